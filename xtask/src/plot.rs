//! Line plots (PNG: latency CDFs, latency against load) drawn with the `image` crate and a
//! built-in 5x7 bitmap font, so a plot carries its own axis values and legend without a font
//! file or a plotting library.
use image::{Rgb, RgbImage};
use std::path::Path;

const W: u32 = 800;
const H: u32 = 500;
const LEFT: u32 = 70;
const RIGHT: u32 = 20;
const TOP: u32 = 40;
const BOTTOM: u32 = 60;
const SCALE: u32 = 2;

/// Distinct line colours, cycled.
const COLOURS: [[u8; 3]; 8] = [
    [31, 119, 180],
    [214, 39, 40],
    [44, 160, 44],
    [255, 127, 14],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [23, 190, 207],
];

/// One curve: its legend label and its latencies (any order).
pub struct Series {
    pub label: String,
    pub latencies: Vec<f64>,
}

/// Empirical CDFs of every series on one plot, x from 0 to the largest latency.
pub fn latency_cdf(title: &str, series: &[Series], path: &Path) -> anyhow::Result<()> {
    let lines: Vec<Line> = series
        .iter()
        .map(|s| {
            let mut v: Vec<f64> = s
                .latencies
                .iter()
                .copied()
                .filter(|v| v.is_finite())
                .collect();
            v.sort_by(f64::total_cmp);
            let n = v.len().max(1) as f64;
            // A staircase: up by 1/n at every latency.
            let mut points = vec![(0.0, 0.0)];
            for (i, x) in v.iter().enumerate() {
                points.push((*x, i as f64 / n));
                points.push((*x, (i + 1) as f64 / n));
            }
            Line {
                label: s.label.clone(),
                points,
            }
        })
        .collect();
    anyhow::ensure!(
        lines.iter().any(|l| l.points.len() > 1),
        "no latencies to plot"
    );
    line_plot(
        &Axes {
            title,
            x_label: "LATENCY (S)",
            x_min: 0.0,
            y_range: Some((0.0, 1.0)),
            legend_top_left: false,
        },
        &lines,
        path,
    )
}

/// One polyline of a [`line_plot`].
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

pub struct Axes<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub x_min: f64,
    /// Fixed y range; `None`: from 0 to a round value above the largest y.
    pub y_range: Option<(f64, f64)>,
    /// Legend in the top-left corner (for rising curves) instead of the bottom-right one.
    pub legend_top_left: bool,
}

/// Every line on one plot; x from `x_min` to a round value above the largest x.
pub fn line_plot(axes: &Axes, lines: &[Line], path: &Path) -> anyhow::Result<()> {
    let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let xmax = lines
        .iter()
        .flat_map(|l| l.points.iter().filter(finite).map(|p| p.0))
        .fold(f64::MIN, f64::max);
    anyhow::ensure!(xmax > axes.x_min, "nothing to plot");
    let xmax = axes.x_min + nice_ceiling(xmax - axes.x_min);
    let (ymin, ymax) = match axes.y_range {
        Some(r) => r,
        None => {
            let y = lines
                .iter()
                .flat_map(|l| l.points.iter().filter(finite).map(|p| p.1))
                .fold(0.0f64, f64::max);
            (0.0, nice_ceiling(y.max(f64::MIN_POSITIVE)))
        }
    };
    let mut img = RgbImage::from_pixel(W, H, Rgb([255, 255, 255]));
    let (pw, ph) = ((W - LEFT - RIGHT) as f64, (H - TOP - BOTTOM) as f64);
    let px = |x: f64| LEFT as f64 + (x - axes.x_min) / (xmax - axes.x_min) * pw;
    let py = |y: f64| TOP as f64 + (1.0 - (y - ymin) / (ymax - ymin)) * ph;
    let grid = Rgb([220, 220, 220]);
    let ink = Rgb([0, 0, 0]);
    for i in 0..=4 {
        let y = ymin + (ymax - ymin) * i as f64 / 4.0;
        line(&mut img, (px(axes.x_min), py(y)), (px(xmax), py(y)), grid);
        text(&mut img, 4, py(y) as i64 - 7, &trim_number(y), ink);
    }
    for i in 0..=10 {
        let x = axes.x_min + (xmax - axes.x_min) * i as f64 / 10.0;
        line(&mut img, (px(x), py(ymin)), (px(x), py(ymax)), grid);
        let label = trim_number(x);
        let w = text_width(&label) as i64;
        text(
            &mut img,
            px(x) as i64 - w / 2,
            (H - BOTTOM + 8) as i64,
            &label,
            ink,
        );
    }
    line(
        &mut img,
        (px(axes.x_min), py(ymin)),
        (px(xmax), py(ymin)),
        ink,
    );
    line(
        &mut img,
        (px(axes.x_min), py(ymin)),
        (px(axes.x_min), py(ymax)),
        ink,
    );
    let xl = axes.x_label;
    text(
        &mut img,
        (W / 2) as i64 - text_width(xl) as i64 / 2,
        (H - 24) as i64,
        xl,
        ink,
    );
    text(&mut img, LEFT as i64, 10, axes.title, ink);
    for (k, l) in lines.iter().enumerate() {
        let colour = Rgb(COLOURS[k % COLOURS.len()]);
        let pts: Vec<&(f64, f64)> = l.points.iter().filter(finite).collect();
        for w in pts.windows(2) {
            thick_line(
                &mut img,
                (px(w[0].0), py(w[0].1)),
                (px(w[1].0), py(w[1].1)),
                colour,
            );
        }
        // The legend box fits the longest label (swatch, gap, text).
        let legend_w = 40
            + lines
                .iter()
                .map(|l| text_width(&l.label))
                .max()
                .unwrap_or(0) as i64;
        let (lx, ly) = if axes.legend_top_left {
            ((LEFT + 12) as i64, (TOP + 10) as i64 + 22 * k as i64)
        } else {
            (
                (W - RIGHT) as i64 - legend_w,
                (H - BOTTOM) as i64 - 22 * (lines.len() - k) as i64 - 6,
            )
        };
        for dy in 0..4 {
            line(
                &mut img,
                (lx as f64, (ly + 6 + dy) as f64),
                ((lx + 24) as f64, (ly + 6 + dy) as f64),
                colour,
            );
        }
        text(&mut img, lx + 32, ly, &l.label, ink);
    }
    img.save(path)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

/// The smallest of 1, 2, 2.5, 5 x a power of ten at or above `x`.
fn nice_ceiling(x: f64) -> f64 {
    let p = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|v| *v >= x)
        .unwrap_or(10.0 * p)
}

fn trim_number(x: f64) -> String {
    if x.abs() >= 100.0 {
        return format!("{x:.0}");
    }
    let s = format!("{x:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s.is_empty() || s == "-" {
        "0".into()
    } else {
        s.to_string()
    }
}

fn put(img: &mut RgbImage, x: i64, y: i64, c: Rgb<u8>) {
    if x >= 0 && y >= 0 && (x as u32) < img.width() && (y as u32) < img.height() {
        img.put_pixel(x as u32, y as u32, c);
    }
}

fn line(img: &mut RgbImage, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: Rgb<u8>) {
    let steps = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
    for s in 0..=steps {
        let f = s as f64 / steps as f64;
        put(
            img,
            (x0 + (x1 - x0) * f) as i64,
            (y0 + (y1 - y0) * f) as i64,
            c,
        );
    }
}

fn thick_line(img: &mut RgbImage, a: (f64, f64), b: (f64, f64), c: Rgb<u8>) {
    for (dx, dy) in [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)] {
        line(img, (a.0 + dx, a.1 + dy), (b.0 + dx, b.1 + dy), c);
    }
}

fn text_width(s: &str) -> u32 {
    s.chars().count() as u32 * 6 * SCALE
}

/// Draw `s` (upper-cased; unknown characters as blanks) with its top-left corner at (x, y).
fn text(img: &mut RgbImage, x: i64, y: i64, s: &str, c: Rgb<u8>) {
    for (i, ch) in s.to_uppercase().chars().enumerate() {
        let rows = glyph(ch);
        let ox = x + (i as u32 * 6 * SCALE) as i64;
        for (r, bits) in rows.iter().enumerate() {
            for col in 0..5 {
                if bits >> (4 - col) & 1 == 1 {
                    for sy in 0..SCALE {
                        for sx in 0..SCALE {
                            put(
                                img,
                                ox + (col * SCALE + sx) as i64,
                                y + (r as u32 * SCALE + sy) as i64,
                                c,
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Rows (5 bits each, most significant bit on the left) of a 5x7 glyph.
fn glyph(c: char) -> [u8; 7] {
    match c {
        'A' => [14, 17, 17, 31, 17, 17, 17],
        'B' => [30, 17, 17, 30, 17, 17, 30],
        'C' => [14, 17, 16, 16, 16, 17, 14],
        'D' => [28, 18, 17, 17, 17, 18, 28],
        'E' => [31, 16, 16, 30, 16, 16, 31],
        'F' => [31, 16, 16, 30, 16, 16, 16],
        'G' => [14, 17, 16, 23, 17, 17, 15],
        'H' => [17, 17, 17, 31, 17, 17, 17],
        'I' => [14, 4, 4, 4, 4, 4, 14],
        'J' => [7, 2, 2, 2, 2, 18, 12],
        'K' => [17, 18, 20, 24, 20, 18, 17],
        'L' => [16, 16, 16, 16, 16, 16, 31],
        'M' => [17, 27, 21, 21, 17, 17, 17],
        'N' => [17, 17, 25, 21, 19, 17, 17],
        'O' => [14, 17, 17, 17, 17, 17, 14],
        'P' => [30, 17, 17, 30, 16, 16, 16],
        'Q' => [14, 17, 17, 17, 21, 18, 13],
        'R' => [30, 17, 17, 30, 20, 18, 17],
        'S' => [15, 16, 16, 14, 1, 1, 30],
        'T' => [31, 4, 4, 4, 4, 4, 4],
        'U' => [17, 17, 17, 17, 17, 17, 14],
        'V' => [17, 17, 17, 17, 17, 10, 4],
        'W' => [17, 17, 17, 21, 21, 21, 10],
        'X' => [17, 17, 10, 4, 10, 17, 17],
        'Y' => [17, 17, 17, 10, 4, 4, 4],
        'Z' => [31, 1, 2, 4, 8, 16, 31],
        '0' => [14, 17, 19, 21, 25, 17, 14],
        '1' => [4, 12, 4, 4, 4, 4, 14],
        '2' => [14, 17, 1, 2, 4, 8, 31],
        '3' => [31, 2, 4, 2, 1, 17, 14],
        '4' => [2, 6, 10, 18, 31, 2, 2],
        '5' => [31, 16, 30, 1, 1, 17, 14],
        '6' => [6, 8, 16, 30, 17, 17, 14],
        '7' => [31, 1, 2, 4, 8, 8, 8],
        '8' => [14, 17, 17, 14, 17, 17, 14],
        '9' => [14, 17, 17, 15, 1, 2, 12],
        '.' => [0, 0, 0, 0, 0, 12, 12],
        ',' => [0, 0, 0, 0, 12, 4, 8],
        '-' => [0, 0, 0, 31, 0, 0, 0],
        '_' => [0, 0, 0, 0, 0, 0, 31],
        ':' => [0, 12, 12, 0, 12, 12, 0],
        '/' => [0, 1, 2, 4, 8, 16, 0],
        '(' => [2, 4, 8, 8, 8, 4, 2],
        ')' => [8, 4, 2, 2, 2, 4, 8],
        '%' => [24, 25, 2, 4, 8, 19, 3],
        '=' => [0, 0, 31, 0, 31, 0, 0],
        '+' => [0, 4, 4, 31, 4, 4, 0],
        _ => [0; 7],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(0.7), 1.0);
        assert_eq!(nice_ceiling(1.3), 2.0);
        assert_eq!(nice_ceiling(2.1), 2.5);
        assert_eq!(nice_ceiling(37.0), 50.0);
        assert_eq!(trim_number(2.5), "2.5");
        assert_eq!(trim_number(0.0), "0");
        assert_eq!(trim_number(250.0), "250");
        assert_eq!(trim_number(10.0), "10");
    }

    #[test]
    fn plot_is_written_and_curves_are_drawn() {
        let dir = std::env::temp_dir().join(format!("xtask-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cdf.png");
        let series = vec![
            Series {
                label: "mask-aware".into(),
                latencies: vec![1.0, 2.0, 3.0],
            },
            Series {
                label: "round-robin".into(),
                latencies: vec![1.5, 2.5, 6.0],
            },
        ];
        latency_cdf("test", &series, &path).unwrap();
        let img = image::open(&path).unwrap().to_rgb8();
        assert_eq!((img.width(), img.height()), (W, H));
        let has = |c: [u8; 3]| img.pixels().any(|p| p.0 == c);
        assert!(has(COLOURS[0]) && has(COLOURS[1]));
        assert!(latency_cdf("x", &[], &path).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
