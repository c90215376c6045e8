//! Test images and response decoding helpers.
use std::io::Cursor;

use anyhow::{Context, Result};
use base64::Engine;
use image::{DynamicImage, GrayImage, ImageFormat, Luma, Rgb, RgbImage};

/// A deterministic, textured RGB image (every pixel differs from its neighbours, so an exact
/// comparison catches any resampling of unmasked pixels).
pub fn template(width: u32, height: u32) -> DynamicImage {
    DynamicImage::ImageRgb8(RgbImage::from_fn(width, height, |x, y| {
        Rgb([
            (x * 7 + y * 3) as u8,
            ((x * 13) ^ (y * 5)) as u8,
            (x.wrapping_mul(y) * 11 + 17) as u8,
        ])
    }))
}

/// A mask that repaints the rectangle `[x0, x1) x [y0, y1)` (white = repaint).
pub fn rect_mask(width: u32, height: u32, x0: u32, y0: u32, x1: u32, y1: u32) -> DynamicImage {
    DynamicImage::ImageLuma8(GrayImage::from_fn(width, height, |x, y| {
        let inside = (x0..x1).contains(&x) && (y0..y1).contains(&y);
        Luma([if inside { 255 } else { 0 }])
    }))
}

pub fn png_bytes(img: &DynamicImage) -> Vec<u8> {
    let mut buf = Cursor::new(Vec::new());
    img.write_to(&mut buf, ImageFormat::Png)
        .expect("encoding a PNG in memory cannot fail");
    buf.into_inner()
}

/// `img` as a base64 PNG, as JSON requests carry images.
pub fn png_b64(img: &DynamicImage) -> String {
    base64::engine::general_purpose::STANDARD.encode(png_bytes(img))
}

/// The pixels of `edited` that differ from `original` inside the rectangle `[x0, x1) x [y0, y1)`;
/// panics, naming the pixel and `what`, where one outside it differs (an edit keeps them).
pub fn changed_inside_only(
    edited: &RgbImage,
    original: &RgbImage,
    (x0, y0, x1, y1): (u32, u32, u32, u32),
    what: &str,
) -> usize {
    let mut changed = 0;
    for (x, y, p) in edited.enumerate_pixels() {
        if (x0..x1).contains(&x) && (y0..y1).contains(&y) {
            changed += usize::from(p != original.get_pixel(x, y));
        } else {
            assert_eq!(
                p,
                original.get_pixel(x, y),
                "{what}unmasked pixel ({x},{y}) differs"
            );
        }
    }
    changed
}

/// Decode the `b64_json` images of an OpenAI-style response.
pub fn decode_b64_images(body: &serde_json::Value) -> Result<Vec<DynamicImage>> {
    let data = body["data"]
        .as_array()
        .context("response has no data array")?;
    data.iter()
        .map(|item| {
            let b64 = item["b64_json"].as_str().context("item has no b64_json")?;
            let png = base64::engine::general_purpose::STANDARD.decode(b64)?;
            Ok(image::load_from_memory_with_format(&png, ImageFormat::Png)?)
        })
        .collect()
}
