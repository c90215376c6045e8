//! Programmatic checker: reads back what a generated image shows, attribute by attribute.
//!
//! Criterion (stated in the model card):
//! - every pixel gets the label of its nearest named colour (Euclidean RGB);
//! - **background** = majority label of the 2-pixel frame along the image border;
//! - **object** = largest 4-connected component of pixels whose label differs from the
//!   background's, if it has at least [`MIN_OBJECT_AREA`] pixels;
//! - **colour** = majority label inside the object; **position** = the named anchor nearest the
//!   object's centroid; **shape** = nearest of the fill ratios (object area / bounding-box area)
//!   triangle 0.5, circle 0.785, square 1.0;
//! - an image is **all correct** when background, colour, position and shape all match the prompt.
use super::data::{Position, SceneKey, Shape, COLOURS};
use super::IMAGE_SIZE;
use crate::error::{ModelError, Result};
use serde::Serialize;

/// Smallest object (pixels) that counts; the smallest rendered object (triangle, half size 9) has ~160.
pub const MIN_OBJECT_AREA: usize = 60;
const FRAME: usize = 2;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DetectedObject {
    pub colour: usize,
    pub position: Position,
    pub shape: Shape,
    pub area: usize,
    pub fill_ratio: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Detection {
    pub background: usize,
    pub object: Option<DetectedObject>,
}

/// Per-attribute verdict of one image against its prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Verdict {
    pub background: bool,
    pub colour: bool,
    pub position: bool,
    pub shape: bool,
}

impl Verdict {
    pub fn all(&self) -> bool {
        self.background && self.colour && self.position && self.shape
    }
}

impl serde::Serialize for Position {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl serde::Serialize for Shape {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

fn nearest_colour(p: &[u8]) -> usize {
    let dist = |c: &[u8; 3]| -> i32 { (0..3).map(|i| (p[i] as i32 - c[i] as i32).pow(2)).sum() };
    (0..COLOURS.len())
        .min_by_key(|&i| dist(&COLOURS[i].1))
        .unwrap_or(0)
}

fn majority(labels: impl Iterator<Item = usize>) -> usize {
    let mut counts = [0usize; COLOURS.len()];
    for l in labels {
        counts[l] += 1;
    }
    (0..COLOURS.len())
        .max_by_key(|&i| (counts[i], std::cmp::Reverse(i)))
        .unwrap_or(0)
}

/// Analyse an `IMAGE_SIZE`x`IMAGE_SIZE` RGB image (row-major `[y][x][c]`).
pub fn detect(rgb: &[u8]) -> Result<Detection> {
    let n = IMAGE_SIZE as usize;
    if rgb.len() != n * n * 3 {
        return Err(ModelError::input(
            "rgb",
            format!(
                "expected a {n}x{n} RGB image ({} bytes), got {}",
                n * n * 3,
                rgb.len()
            ),
        ));
    }
    let labels: Vec<usize> = rgb.chunks(3).map(nearest_colour).collect();
    let in_frame = |y: usize, x: usize| y < FRAME || x < FRAME || y >= n - FRAME || x >= n - FRAME;
    let background = majority(
        (0..n * n)
            .filter(|&i| in_frame(i / n, i % n))
            .map(|i| labels[i]),
    );

    // Largest 4-connected component of non-background pixels.
    let mut seen = vec![false; n * n];
    let mut best: Vec<usize> = Vec::new();
    for start in 0..n * n {
        if seen[start] || labels[start] == background {
            continue;
        }
        let mut component = vec![start];
        seen[start] = true;
        let mut head = 0;
        while head < component.len() {
            let i = component[head];
            head += 1;
            let (y, x) = (i / n, i % n);
            let mut visit = |j: usize| {
                if !seen[j] && labels[j] != background {
                    seen[j] = true;
                    component.push(j);
                }
            };
            if y > 0 {
                visit(i - n);
            }
            if y + 1 < n {
                visit(i + n);
            }
            if x > 0 {
                visit(i - 1);
            }
            if x + 1 < n {
                visit(i + 1);
            }
        }
        if component.len() > best.len() {
            best = component;
        }
    }
    if best.len() < MIN_OBJECT_AREA {
        return Ok(Detection {
            background,
            object: None,
        });
    }
    let colour = majority(best.iter().map(|&i| labels[i]));
    let (mut x0, mut x1, mut y0, mut y1) = (n, 0, n, 0);
    let (mut sx, mut sy) = (0.0, 0.0);
    for &i in &best {
        let (y, x) = (i / n, i % n);
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
        sx += x as f64 + 0.5;
        sy += y as f64 + 0.5;
    }
    let area = best.len();
    let (cx, cy) = (sx / area as f64, sy / area as f64);
    let position = *Position::ALL
        .iter()
        .min_by(|a, b| {
            let d = |p: &Position| {
                let (ax, ay) = p.anchor();
                (ax - cx).powi(2) + (ay - cy).powi(2)
            };
            d(a).total_cmp(&d(b))
        })
        .unwrap_or(&Position::Center);
    let fill_ratio = area as f64 / ((x1 - x0 + 1) * (y1 - y0 + 1)) as f64;
    let shape = *Shape::ALL
        .iter()
        .min_by(|a, b| {
            (a.fill_ratio() - fill_ratio)
                .abs()
                .total_cmp(&(b.fill_ratio() - fill_ratio).abs())
        })
        .unwrap_or(&Shape::Square);
    Ok(Detection {
        background,
        object: Some(DetectedObject {
            colour,
            position,
            shape,
            area,
            fill_ratio,
        }),
    })
}

/// Compare a detection with what the prompt asked for.
pub fn judge(detection: &Detection, key: &SceneKey) -> Verdict {
    let background = detection.background == key.background;
    match &detection.object {
        None => Verdict {
            background,
            ..Default::default()
        },
        Some(o) => Verdict {
            background,
            colour: o.colour == key.colour,
            position: o.position == key.position,
            shape: o.shape == key.shape,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::data::{all_keys, render_rgb, scene_for};
    use rand::SeedableRng;

    #[test]
    fn ground_truth_renders_pass_every_check() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for key in all_keys() {
            let scene = scene_for(key, &mut rng);
            let d = detect(&render_rgb(&scene)).unwrap();
            let v = judge(&d, &key);
            assert!(v.all(), "{} detected as {d:?}", key.prompt());
        }
    }

    #[test]
    fn wrong_images_fail() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let key = SceneKey {
            shape: Shape::Circle,
            colour: 0,
            position: Position::Left,
            background: 2,
        };
        // A plain background has no object.
        let plain = vec![COLOURS[2].1; 64 * 64].concat();
        assert_eq!(
            judge(&detect(&plain).unwrap(), &key),
            Verdict {
                background: true,
                ..Default::default()
            }
        );
        // A square on the right is judged wrong on shape and position, right on colours.
        let other = SceneKey {
            shape: Shape::Square,
            position: Position::Right,
            ..key
        };
        let v = judge(
            &detect(&render_rgb(&scene_for(other, &mut rng))).unwrap(),
            &key,
        );
        assert_eq!(
            v,
            Verdict {
                background: true,
                colour: true,
                position: false,
                shape: false
            }
        );
    }
}
