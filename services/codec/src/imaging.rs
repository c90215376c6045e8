//! Pure image work of the codec: decode and validate uploads, turn masks into pixel and token
//! masks, resize to and from the model resolution, composite, encode PNG.
//!
//! Resizing stretches (the aspect ratio is not kept): the model sees the whole image at its
//! fixed resolution and the output is stretched back, so every input pixel has an output pixel.
use std::io::Cursor;

use diffmesh_shared::wire::messages::FieldError;
use image::imageops::{self, FilterType};
use image::{DynamicImage, GenericImageView, ImageFormat, ImageReader, RgbImage, RgbaImage};

/// Formats the API accepts.
const ACCEPTED: [ImageFormat; 3] = [ImageFormat::Png, ImageFormat::Jpeg, ImageFormat::WebP];

/// Decode an upload named `field`, refusing non-images and images above `max_pixels`
/// (checked from the header, before any pixel buffer is allocated).
pub fn decode_upload(
    bytes: &[u8],
    field: &str,
    max_pixels: u64,
) -> Result<DynamicImage, FieldError> {
    let not_image = || FieldError::invalid(field, "not a PNG, JPEG or WebP image");
    let format = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|_| not_image())?
        .format()
        .filter(|f| ACCEPTED.contains(f))
        .ok_or_else(not_image)?;
    let mut header = ImageReader::with_format(Cursor::new(bytes), format);
    header.limits(alloc_limit(MAX_SIDE_ALLOC));
    let (w, h) = header
        .into_dimensions()
        .map_err(|e| FieldError::invalid(field, format!("unreadable {format:?} header: {e}")))?;
    check_pixel_count(field, w, h, max_pixels)?;
    if format == ImageFormat::Jpeg {
        check_jpeg_complete(bytes, field)?;
    }
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    // The pixels (at most 8 bytes each: RGBA16) and the decoder's own buffers, nothing more.
    let mut limits = alloc_limit(
        (u64::from(w) * u64::from(h))
            .saturating_mul(8)
            .saturating_add(MAX_SIDE_ALLOC),
    );
    limits.max_image_width = Some(w);
    limits.max_image_height = Some(h);
    reader.limits(limits);
    reader
        .decode()
        .map_err(|e| FieldError::invalid(field, format!("cannot decode {format:?} image: {e}")))
}

/// What a decoder may allocate besides the pixels: its buffers and an embedded ICC profile. The
/// PNG decoder inflates an iCCP chunk while it reads the header, up to its byte limit (512 MiB
/// by default): a 600 KB PNG whose profile inflates to 600 MiB held 830 MB at once before this
/// bound, 53 MB with it (tests/hostile_images.rs).
pub const MAX_SIDE_ALLOC: u64 = 32 << 20;

/// Decoder limits allowing `max_alloc` bytes.
fn alloc_limit(max_alloc: u64) -> image::Limits {
    let mut limits = image::Limits::default();
    limits.max_alloc = Some(max_alloc);
    limits
}

/// A JPEG ends its last scan with an end-of-image marker. The decoder fills a scan that was cut
/// short with grey and reports success: a truncated upload was edited as a half-grey image.
/// (Inside a scan 0xFF is always followed by 0x00 or a restart marker, never by 0xD9.)
fn check_jpeg_complete(bytes: &[u8], field: &str) -> Result<(), FieldError> {
    let last = |marker: u8| bytes.windows(2).rposition(|w| w == [0xFF, marker]);
    match (last(0xDA), last(0xD9)) {
        (Some(scan), Some(end)) if end > scan => Ok(()),
        _ => Err(FieldError::invalid(
            field,
            "the JPEG is cut short: no end-of-image marker after its last scan",
        )),
    }
}

/// Refuses an image with no pixels or more than `max_pixels`.
pub fn check_pixel_count(field: &str, w: u32, h: u32, max_pixels: u64) -> Result<(), FieldError> {
    let pixels = u64::from(w) * u64::from(h);
    if pixels == 0 {
        return Err(FieldError::invalid(field, "image has no pixels"));
    }
    if pixels > max_pixels {
        return Err(FieldError::invalid(
            field,
            format!("image is {w}x{h} = {pixels} pixels, above the limit of {max_pixels}"),
        ));
    }
    Ok(())
}

/// Which input pixels are repainted (true) at the input's size.
#[derive(Debug, Clone, PartialEq)]
pub struct PixelMask {
    pub width: u32,
    pub height: u32,
    /// Row-major, `width * height` entries.
    pub repaint: Vec<bool>,
}

impl PixelMask {
    pub fn masked_pixels(&self) -> usize {
        self.repaint.iter().filter(|&&m| m).count()
    }
}

fn has_transparency(img: &DynamicImage) -> bool {
    img.color().has_alpha() && img.to_rgba8().pixels().any(|p| p.0[3] < 255)
}

/// The repaint mask a mask upload describes.
///
/// A mask with transparent pixels follows the OpenAI convention: transparent (alpha < 128) means
/// repaint. An opaque mask is read by brightness: white (luma >= 128) means repaint.
pub fn mask_from_upload(mask: &DynamicImage) -> PixelMask {
    let (width, height) = (mask.width(), mask.height());
    let repaint = if has_transparency(mask) {
        mask.to_rgba8().pixels().map(|p| p.0[3] < 128).collect()
    } else {
        mask.to_luma8().pixels().map(|p| p.0[0] >= 128).collect()
    };
    PixelMask {
        width,
        height,
        repaint,
    }
}

/// The repaint mask of an edit: the mask upload when given (its size must equal the image's),
/// else the image's own transparent areas (OpenAI behaviour when no mask is sent).
pub fn repaint_mask(
    image: &DynamicImage,
    mask: Option<&DynamicImage>,
) -> Result<PixelMask, FieldError> {
    match mask {
        Some(mask) => {
            if mask.dimensions() != image.dimensions() {
                return Err(FieldError::invalid(
                    "mask",
                    format!(
                        "mask is {}x{} but the image is {}x{}; they must be the same size",
                        mask.width(),
                        mask.height(),
                        image.width(),
                        image.height()
                    ),
                ));
            }
            Ok(mask_from_upload(mask))
        }
        None if has_transparency(image) => Ok(PixelMask {
            width: image.width(),
            height: image.height(),
            repaint: image.to_rgba8().pixels().map(|p| p.0[3] < 128).collect(),
        }),
        None => Err(FieldError::invalid(
            "mask",
            "required: send a mask, or an image whose transparent areas mark the region to edit",
        )),
    }
}

/// The model's image-token grid: `model_width x model_height` pixels, `token_pixels` pixels per
/// token side (VAE downscale factor times the 2x2 patch packing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenGrid {
    pub model_width: u32,
    pub model_height: u32,
    pub token_pixels: u32,
}

impl TokenGrid {
    pub fn cols(&self) -> u32 {
        self.model_width / self.token_pixels
    }
    pub fn rows(&self) -> u32 {
        self.model_height / self.token_pixels
    }
    pub fn tokens(&self) -> u32 {
        self.rows() * self.cols()
    }
}

/// For each input coordinate along one axis, the (first, last) token index its pixel overlaps
/// once the axis is stretched from `input` to `model` pixels and cut into `token_px` tokens.
fn token_spans(input: u32, model: u32, token_px: u32) -> Vec<(usize, usize)> {
    let (input, model, tp) = (u64::from(input), u64::from(model), u64::from(token_px));
    let last = (model / tp).saturating_sub(1) as usize;
    (0..input)
        .map(|x| {
            // The pixel covers [x, x+1) input units = [x*model/input, (x+1)*model/input) model px.
            let first = (x * model) / (input * tp);
            let end = ((x + 1) * model).div_ceil(input * tp);
            (first as usize, (end.saturating_sub(1) as usize).min(last))
        })
        .collect()
}

/// Token mask (one byte per token, 1 = repaint, row-major): a token is repainted if ANY input
/// pixel that overlaps it is repainted, so the model covers every repainted pixel.
pub fn token_mask(mask: &PixelMask, grid: TokenGrid) -> Vec<u8> {
    let cols = grid.cols() as usize;
    let mut tokens = vec![0u8; grid.tokens() as usize];
    let xs = token_spans(mask.width, grid.model_width, grid.token_pixels);
    let ys = token_spans(mask.height, grid.model_height, grid.token_pixels);
    for (y, &(r0, r1)) in ys.iter().enumerate() {
        let row = &mask.repaint[y * mask.width as usize..(y + 1) * mask.width as usize];
        for (x, _) in row.iter().enumerate().filter(|(_, &m)| m) {
            let (c0, c1) = xs[x];
            for r in r0..=r1 {
                tokens[r * cols + c0..=r * cols + c1].fill(1);
            }
        }
    }
    tokens
}

/// The template stretched to the model resolution, as packed RGB bytes.
pub fn to_model_rgb(image: &DynamicImage, grid: TokenGrid) -> Vec<u8> {
    imageops::resize(
        &image.to_rgb8(),
        grid.model_width,
        grid.model_height,
        FilterType::Triangle,
    )
    .into_raw()
}

/// A model-resolution RGB output from raw bytes, checking the length.
pub fn model_output(bytes: Vec<u8>, width: u32, height: u32) -> Result<RgbImage, String> {
    let expected = width as usize * height as usize * 3;
    let got = bytes.len();
    RgbImage::from_raw(width, height, bytes).ok_or_else(|| {
        format!("model output is {got} bytes, expected {expected} for {width}x{height} RGB")
    })
}

/// Stretch a model output to `width x height`.
pub fn to_output_size(output: &RgbImage, width: u32, height: u32) -> RgbImage {
    if output.dimensions() == (width, height) {
        return output.clone();
    }
    imageops::resize(output, width, height, FilterType::Triangle)
}

/// The final edit: generated pixels where the mask repaints, the template's own pixels
/// (exactly its decoded bytes, alpha included) everywhere else.
pub fn composite(template: &DynamicImage, mask: &PixelMask, generated: &RgbImage) -> DynamicImage {
    debug_assert_eq!(
        (template.width(), template.height()),
        generated.dimensions()
    );
    if template.color().has_alpha() {
        let mut out: RgbaImage = template.to_rgba8();
        for ((px, &m), g) in out.pixels_mut().zip(&mask.repaint).zip(generated.pixels()) {
            if m {
                *px = image::Rgba([g.0[0], g.0[1], g.0[2], 255]);
            }
        }
        DynamicImage::ImageRgba8(out)
    } else {
        let mut out: RgbImage = template.to_rgb8();
        for ((px, &m), g) in out.pixels_mut().zip(&mask.repaint).zip(generated.pixels()) {
            if m {
                *px = *g;
            }
        }
        DynamicImage::ImageRgb8(out)
    }
}

/// Encode as PNG.
pub fn encode_png(image: &DynamicImage) -> Result<Vec<u8>, image::ImageError> {
    let mut buf = Cursor::new(Vec::new());
    image.write_to(&mut buf, ImageFormat::Png)?;
    Ok(buf.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{GrayImage, Luma, Rgb, Rgba};

    fn png(img: &DynamicImage) -> Vec<u8> {
        encode_png(img).unwrap()
    }

    const GRID: TokenGrid = TokenGrid {
        model_width: 64,
        model_height: 64,
        token_pixels: 4,
    };

    #[test]
    fn rejects_non_images_and_oversized() {
        let err = decode_upload(b"hello, not an image", "image", 1 << 20).unwrap_err();
        assert_eq!(err.field, "image");
        let big = DynamicImage::ImageRgb8(RgbImage::new(100, 50));
        let err = decode_upload(&png(&big), "image", 4999).unwrap_err();
        assert_eq!(err.field, "image");
        assert!(err.message.contains("5000 pixels"), "{}", err.message);
        assert!(decode_upload(&png(&big), "image", 5000).is_ok());
        // Truncated PNG: the header parses, the pixels do not.
        let bytes = png(&big);
        assert!(decode_upload(&bytes[..bytes.len() / 2], "mask", 5000).is_err());
    }

    #[test]
    fn mask_conventions() {
        // Opaque grayscale: white repaints.
        let mut g = GrayImage::new(2, 1);
        g.put_pixel(1, 0, Luma([255]));
        let m = mask_from_upload(&DynamicImage::ImageLuma8(g));
        assert_eq!(m.repaint, vec![false, true]);
        // RGBA with transparency: transparent repaints, whatever the colour.
        let mut a = RgbaImage::from_pixel(2, 1, Rgba([255, 255, 255, 255]));
        a.put_pixel(0, 0, Rgba([0, 0, 0, 0]));
        let m = mask_from_upload(&DynamicImage::ImageRgba8(a));
        assert_eq!(m.repaint, vec![true, false]);
    }

    #[test]
    fn mask_size_must_match() {
        let img = DynamicImage::ImageRgb8(RgbImage::new(8, 8));
        let mask = DynamicImage::ImageLuma8(GrayImage::new(8, 4));
        assert_eq!(repaint_mask(&img, Some(&mask)).unwrap_err().field, "mask");
        assert_eq!(repaint_mask(&img, None).unwrap_err().field, "mask");
    }

    #[test]
    fn token_mask_marks_any_overlap() {
        // 128x128 input -> 64x64 model -> 16x16 tokens: 8 input px per token side.
        let mut mask = PixelMask {
            width: 128,
            height: 128,
            repaint: vec![false; 128 * 128],
        };
        // One pixel at (8, 0) -> token (0, 1) only.
        mask.repaint[8] = true;
        let t = token_mask(&mask, GRID);
        assert_eq!(t.iter().filter(|&&v| v == 1).count(), 1);
        assert_eq!(t[1], 1);
        // Upscaling: a 3x3 input stretched to 64x64; pixel (1,1) covers model px 21.3..42.7,
        // i.e. tokens 5..=10 on both axes.
        let mut small = PixelMask {
            width: 3,
            height: 3,
            repaint: vec![false; 9],
        };
        small.repaint[4] = true;
        let t = token_mask(&small, GRID);
        for r in 0..16 {
            for c in 0..16 {
                let inside = (5..=10).contains(&r) && (5..=10).contains(&c);
                assert_eq!(t[r * 16 + c] == 1, inside, "token ({r},{c})");
            }
        }
    }

    #[test]
    fn composite_keeps_template_bytes_exactly() {
        let template = DynamicImage::ImageRgba8(RgbaImage::from_fn(5, 4, |x, y| {
            Rgba([x as u8 * 40, y as u8 * 50, 7, 200])
        }));
        let mask = PixelMask {
            width: 5,
            height: 4,
            repaint: (0..20).map(|i| i % 3 == 0).collect(),
        };
        let generated = RgbImage::from_pixel(5, 4, Rgb([1, 2, 3]));
        let out = composite(&template, &mask, &generated);
        let decoded = image::load_from_memory(&png(&out)).unwrap().to_rgba8();
        let tmpl = template.to_rgba8();
        for (i, (o, t)) in decoded.pixels().zip(tmpl.pixels()).enumerate() {
            if mask.repaint[i] {
                assert_eq!(o.0, [1, 2, 3, 255]);
            } else {
                assert_eq!(o, t);
            }
        }
    }

    #[test]
    fn model_output_checks_length() {
        assert!(model_output(vec![0; 64 * 64 * 3], 64, 64).is_ok());
        assert!(model_output(vec![0; 10], 64, 64).is_err());
        let out = to_output_size(&RgbImage::new(64, 64), 100, 30);
        assert_eq!(out.dimensions(), (100, 30));
        assert_eq!(
            to_model_rgb(&DynamicImage::ImageRgb8(RgbImage::new(9, 7)), GRID).len(),
            64 * 64 * 3
        );
    }
}
