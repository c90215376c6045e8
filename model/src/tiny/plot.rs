//! Pictures for the model card: a loss curve and a grid of samples, drawn with the `image` crate
//! (no fonts: axes carry tick marks, the card's text gives their values).
use crate::error::{ModelError, Result};
use image::{Rgb, RgbImage};
use std::path::Path;

const W: u32 = 640;
const H: u32 = 360;
const MARGIN: u32 = 30;

fn save(img: &RgbImage, path: &Path) -> Result<()> {
    img.save(path).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })
}

fn line(img: &mut RgbImage, (x0, y0): (f64, f64), (x1, y1): (f64, f64), colour: Rgb<u8>) {
    let steps = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
    for s in 0..=steps {
        let f = s as f64 / steps as f64;
        let (x, y) = (x0 + (x1 - x0) * f, y0 + (y1 - y0) * f);
        if x >= 0.0 && y >= 0.0 && (x as u32) < img.width() && (y as u32) < img.height() {
            img.put_pixel(x as u32, y as u32, colour);
        }
    }
}

/// One curve: its colour and its (x, y) points.
pub type Series = (Rgb<u8>, Vec<(f64, f64)>);

/// Plot `series` (each a colour and (x, y) points) on a log10 y axis. Horizontal grid lines mark
/// every power of ten and (fainter) 2x and 5x; vertical ticks mark every tenth of the x range.
pub fn loss_curve(series: &[Series], path: &Path) -> Result<()> {
    let mut img = RgbImage::from_pixel(W, H, Rgb([255, 255, 255]));
    let points = series.iter().flat_map(|s| s.1.iter()).filter(|p| p.1 > 0.0);
    let (mut xmax, mut ymin, mut ymax) = (1.0f64, f64::MAX, f64::MIN);
    for &(x, y) in points {
        xmax = xmax.max(x);
        ymin = ymin.min(y.log10());
        ymax = ymax.max(y.log10());
    }
    if ymin > ymax {
        return Err(ModelError::input("series", "no positive values to plot"));
    }
    let (ymin, ymax) = (ymin.floor(), ymax.ceil().max(ymin.floor() + 1.0));
    let (pw, ph) = ((W - 2 * MARGIN) as f64, (H - 2 * MARGIN) as f64);
    let px = |x: f64| MARGIN as f64 + x / xmax * pw;
    let py = |ly: f64| MARGIN as f64 + (ymax - ly) / (ymax - ymin) * ph;
    let mut decade = ymin;
    while decade <= ymax {
        for (m, shade) in [(1.0f64, 180u8), (2.0, 225), (5.0, 225)] {
            let ly = decade + m.log10();
            if ly <= ymax {
                line(
                    &mut img,
                    (px(0.0), py(ly)),
                    (px(xmax), py(ly)),
                    Rgb([shade, shade, shade]),
                );
            }
        }
        decade += 1.0;
    }
    for i in 0..=10 {
        let x = px(xmax * i as f64 / 10.0);
        line(&mut img, (x, py(ymin)), (x, py(ymin) + 6.0), Rgb([0, 0, 0]));
    }
    line(
        &mut img,
        (px(0.0), py(ymin)),
        (px(xmax), py(ymin)),
        Rgb([0, 0, 0]),
    );
    line(
        &mut img,
        (px(0.0), py(ymin)),
        (px(0.0), py(ymax)),
        Rgb([0, 0, 0]),
    );
    for (colour, pts) in series {
        let pts: Vec<(f64, f64)> = pts
            .iter()
            .filter(|p| p.1 > 0.0)
            .map(|&(x, y)| (px(x), py(y.log10())))
            .collect();
        for w in pts.windows(2) {
            line(&mut img, w[0], w[1], *colour);
        }
    }
    save(&img, path)
}

/// Lay out RGB tiles (each `size`x`size`, row-major `[y][x][c]`) in a grid with `cols` columns
/// and a 2-pixel grey gutter.
pub fn grid(tiles: &[Vec<u8>], size: u32, cols: u32, path: &Path) -> Result<()> {
    if tiles.is_empty() || cols == 0 {
        return Err(ModelError::input(
            "tiles",
            "need at least one tile and one column",
        ));
    }
    let gap = 2;
    let rows = (tiles.len() as u32).div_ceil(cols);
    let mut img = RgbImage::from_pixel(
        cols * (size + gap) + gap,
        rows * (size + gap) + gap,
        Rgb([128, 128, 128]),
    );
    for (i, tile) in tiles.iter().enumerate() {
        if tile.len() != (size * size * 3) as usize {
            return Err(ModelError::input(
                "tiles",
                format!(
                    "tile {i} has {} bytes, expected {size}x{size}x3",
                    tile.len()
                ),
            ));
        }
        let (ox, oy) = (
            gap + (i as u32 % cols) * (size + gap),
            gap + (i as u32 / cols) * (size + gap),
        );
        for (j, p) in tile.chunks(3).enumerate() {
            let (x, y) = (j as u32 % size, j as u32 / size);
            img.put_pixel(ox + x, oy + y, Rgb([p[0], p[1], p[2]]));
        }
    }
    save(&img, path)
}
