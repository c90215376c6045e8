//! Inputs of the load generator: template images and masks of a drawn mask ratio, as PNG bytes.
use image::{GrayImage, Luma, Rgb, RgbImage};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::io::Cursor;

fn png_bytes(img: impl Into<image::DynamicImage>) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    img.into()
        .write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png)?;
    Ok(out)
}

/// A template: a two-colour gradient with a disc, different for every `index` (so every
/// template has its own content hash, hence its own template id in the mesh).
pub fn template_png(width: u32, height: u32, index: u32) -> anyhow::Result<Vec<u8>> {
    let hue = |k: u32| ((index * 67 + k * 97) % 256) as u8;
    let (a, b) = ([hue(0), hue(1), 200], [40, hue(2), hue(3)]);
    let (cx, cy) = (
        (width as f64) * (0.3 + 0.1 * (index % 4) as f64),
        (height as f64) * 0.5,
    );
    let r2 = (width.min(height) as f64 * 0.2).powi(2);
    let img = RgbImage::from_fn(width, height, |x, y| {
        let (dx, dy) = (x as f64 - cx, y as f64 - cy);
        if dx * dx + dy * dy < r2 {
            return Rgb([230, 40, 40]);
        }
        let t = y as f64 / height.max(1) as f64;
        let mix = |i: usize| (a[i] as f64 * (1.0 - t) + b[i] as f64 * t) as u8;
        Rgb([mix(0), mix(1), mix(2)])
    });
    png_bytes(img)
}

/// A mask repainting one rectangle of about `ratio` of the image's area (white = repaint, the
/// codec's rule for opaque masks), with a random aspect ratio and position. Never empty.
pub fn mask_png(
    width: u32,
    height: u32,
    ratio: f64,
    rng: &mut ChaCha8Rng,
) -> anyhow::Result<Vec<u8>> {
    let (w, h) = mask_rect(width, height, ratio, rng);
    let x0 = rng.random_range(0..=width - w);
    let y0 = rng.random_range(0..=height - h);
    let img = GrayImage::from_fn(width, height, |x, y| {
        let inside = (x0..x0 + w).contains(&x) && (y0..y0 + h).contains(&y);
        Luma([if inside { 255 } else { 0 }])
    });
    png_bytes(img)
}

/// Rectangle size of about `ratio * width * height` pixels, each side within the image.
fn mask_rect(width: u32, height: u32, ratio: f64, rng: &mut ChaCha8Rng) -> (u32, u32) {
    let area = (ratio.clamp(0.0, 1.0) * width as f64 * height as f64).max(1.0);
    let aspect: f64 = rng.random_range(0.5..2.0);
    let w = ((area * aspect).sqrt().round() as u32).clamp(1, width);
    let h = ((area / w as f64).round() as u32).clamp(1, height);
    (w, h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn mask_area_follows_the_ratio() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for ratio in [0.0, 0.02, 0.11, 0.4, 1.0] {
            let (w, h) = mask_rect(64, 64, ratio, &mut rng);
            let got = (w * h) as f64 / 4096.0;
            // Rounding a side to whole pixels moves the area by at most a row or column.
            assert!(
                (got - ratio).abs() <= 2.0 * 64.0 / 4096.0 + 0.02 || ratio == 0.0,
                "{ratio}: {got}"
            );
            assert!(w >= 1 && h >= 1 && w <= 64 && h <= 64);
        }
    }

    #[test]
    fn pngs_decode_at_the_asked_size() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let m = image::load_from_memory(&mask_png(48, 32, 0.2, &mut rng).unwrap()).unwrap();
        assert_eq!((m.width(), m.height()), (48, 32));
        let t0 = template_png(48, 32, 0).unwrap();
        let t1 = template_png(48, 32, 1).unwrap();
        assert_ne!(t0, t1, "templates must differ to get their own ids");
    }
}
