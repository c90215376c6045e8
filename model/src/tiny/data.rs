//! Deterministic procedural data: one coloured shape at a named place on a plain background,
//! with the prompt that describes it.
//!
//! The scene space is the set of tuples (shape, colour, position, background) with the object's
//! colour different from the background's: 3 * 8 * 5 * 7 = 840 tuples. A fixed permutation
//! (seed [`SPLIT_SEED`], independent of the training seed) puts [`HELD_OUT`] of them aside;
//! training draws only from the rest, evaluation uses only the held-out tuples, so every
//! evaluation prompt is a combination the model never saw.
use super::IMAGE_SIZE;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::Tensor;

/// Named colours (sRGB, 0..255): far enough apart that the nearest-colour check is unambiguous.
pub const COLOURS: [(&str, [u8; 3]); 8] = [
    ("red", [220, 40, 40]),
    ("green", [40, 170, 60]),
    ("blue", [40, 70, 220]),
    ("yellow", [240, 220, 40]),
    ("purple", [140, 50, 170]),
    ("orange", [245, 140, 30]),
    ("white", [240, 240, 240]),
    ("black", [20, 20, 20]),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shape {
    Circle,
    Square,
    Triangle,
}

impl Shape {
    pub const ALL: [Shape; 3] = [Shape::Circle, Shape::Square, Shape::Triangle];
    pub fn name(self) -> &'static str {
        match self {
            Shape::Circle => "circle",
            Shape::Square => "square",
            Shape::Triangle => "triangle",
        }
    }
    /// Area of the shape over the area of its bounding box: what the checker's first shape
    /// criterion (`shape_by_fill`) compares.
    pub fn fill_ratio(self) -> f64 {
        match self {
            Shape::Circle => std::f64::consts::PI / 4.0,
            Shape::Square => 1.0,
            Shape::Triangle => 0.5,
        }
    }
    /// Whether the offset `(dx, dy)` from the shape's centre lies inside the shape of
    /// half-size `a` (what `render_rgb` draws; the checker's shape templates use it too).
    pub fn contains(self, dx: f64, dy: f64, a: f64) -> bool {
        match self {
            Shape::Circle => dx * dx + dy * dy <= a * a,
            Shape::Square => dx.abs() <= a && dy.abs() <= a,
            // Apex up at (0, -a), base along dy = a from dx = -a to a.
            Shape::Triangle => dy.abs() <= a && dx.abs() <= (dy + a) / 2.0,
        }
    }
    /// Area of the shape with half-size 1 (scales with the square of the half-size).
    pub fn unit_area(self) -> f64 {
        match self {
            Shape::Circle => std::f64::consts::PI,
            Shape::Square => 4.0,
            Shape::Triangle => 2.0,
        }
    }
    /// How far the centroid of the shape of half-size 1 lies below its centre (the triangle's,
    /// mean of apex -1 and base corners +1, +1: 1/3 towards the base).
    pub fn unit_centroid_dy(self) -> f64 {
        match self {
            Shape::Triangle => 1.0 / 3.0,
            Shape::Circle | Shape::Square => 0.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    Left,
    Right,
    Top,
    Bottom,
    Center,
}

impl Position {
    pub const ALL: [Position; 5] = [
        Position::Left,
        Position::Right,
        Position::Top,
        Position::Bottom,
        Position::Center,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Position::Left => "left",
            Position::Right => "right",
            Position::Top => "top",
            Position::Bottom => "bottom",
            Position::Center => "center",
        }
    }
    /// Nominal centre (x, y) in pixels of an object at this place.
    pub fn anchor(self) -> (f64, f64) {
        let (lo, mid, hi) = (17.0, 32.0, 47.0);
        match self {
            Position::Left => (lo, mid),
            Position::Right => (hi, mid),
            Position::Top => (mid, lo),
            Position::Bottom => (mid, hi),
            Position::Center => (mid, mid),
        }
    }
    /// The prompt phrase: "on the left", "in the center", ...
    pub fn phrase(self) -> String {
        match self {
            Position::Center => "in the center".to_string(),
            p => format!("on the {}", p.name()),
        }
    }
}

/// What a prompt describes (the unit the held-out split works on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SceneKey {
    pub shape: Shape,
    /// Index into [`COLOURS`].
    pub colour: usize,
    pub position: Position,
    /// Index into [`COLOURS`]; never equal to `colour`.
    pub background: usize,
}

impl SceneKey {
    pub fn prompt(&self) -> String {
        format!(
            "a {} {} {} on a {} background",
            COLOURS[self.colour].0,
            self.shape.name(),
            self.position.phrase(),
            COLOURS[self.background].0
        )
    }
}

/// A fully specified scene: the key plus the free parameters the prompt does not name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scene {
    pub key: SceneKey,
    /// Half the object's width (= half its height), pixels.
    pub half_size: f64,
    /// Offset of the object's centre from the position's anchor, pixels.
    pub jitter: (f64, f64),
}

/// Seed of the held-out permutation; changing it changes which tuples evaluation uses.
pub const SPLIT_SEED: u64 = 0x5eed_d1ff;
/// Number of held-out tuples (= evaluation prompts).
pub const HELD_OUT: usize = 100;
pub const MIN_HALF_SIZE: f64 = 9.0;
pub const MAX_HALF_SIZE: f64 = 13.0;
pub const MAX_JITTER: f64 = 2.0;

/// Every valid tuple, in a fixed enumeration order.
pub fn all_keys() -> Vec<SceneKey> {
    let mut keys = Vec::new();
    for shape in Shape::ALL {
        for colour in 0..COLOURS.len() {
            for position in Position::ALL {
                for background in 0..COLOURS.len() {
                    if background != colour {
                        keys.push(SceneKey {
                            shape,
                            colour,
                            position,
                            background,
                        });
                    }
                }
            }
        }
    }
    keys
}

/// The train / held-out partition of the scene space.
#[derive(Debug, Clone)]
pub struct Split {
    pub train: Vec<SceneKey>,
    pub held_out: Vec<SceneKey>,
}

impl Split {
    pub fn new() -> Self {
        let mut keys = all_keys();
        keys.shuffle(&mut ChaCha8Rng::seed_from_u64(SPLIT_SEED));
        let train = keys.split_off(HELD_OUT);
        Split {
            train,
            held_out: keys,
        }
    }
}

impl Default for Split {
    fn default() -> Self {
        Self::new()
    }
}

/// Seeded stream of training scenes drawn uniformly from the training tuples.
pub struct Generator {
    rng: ChaCha8Rng,
    keys: Vec<SceneKey>,
}

impl Generator {
    pub fn new(keys: Vec<SceneKey>, seed: u64) -> Self {
        Generator {
            rng: ChaCha8Rng::seed_from_u64(seed),
            keys,
        }
    }

    pub fn next_scene(&mut self) -> Scene {
        let key = self.keys[self.rng.random_range(0..self.keys.len())];
        scene_for(key, &mut self.rng)
    }
}

/// Draw the unnamed parameters (size, jitter) of a scene for `key`.
pub fn scene_for(key: SceneKey, rng: &mut impl Rng) -> Scene {
    Scene {
        key,
        half_size: rng.random_range(MIN_HALF_SIZE..=MAX_HALF_SIZE),
        jitter: (
            rng.random_range(-MAX_JITTER..=MAX_JITTER),
            rng.random_range(-MAX_JITTER..=MAX_JITTER),
        ),
    }
}

/// Render a scene as 8-bit RGB, row-major `[y][x][c]`.
pub fn render_rgb(scene: &Scene) -> Vec<u8> {
    let n = IMAGE_SIZE as usize;
    let (ax, ay) = scene.key.position.anchor();
    let (cx, cy) = (ax + scene.jitter.0, ay + scene.jitter.1);
    let a = scene.half_size;
    let bg = COLOURS[scene.key.background].1;
    let fg = COLOURS[scene.key.colour].1;
    let mut out = Vec::with_capacity(n * n * 3);
    for y in 0..n {
        for x in 0..n {
            // Sample at pixel centres.
            let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
            let inside = scene.key.shape.contains(dx, dy, a);
            out.extend_from_slice(if inside { &fg } else { &bg });
        }
    }
    out
}

/// Pixels (row-major, `IMAGE_SIZE`^2) inside the object's bounding box grown by `margin` pixels:
/// 1.0 there, 0.0 elsewhere. The box is where the shapes differ from each other (a square fills
/// its corners, a circle and a triangle do not), so training can weight the loss there.
pub fn object_box_mask(scene: &Scene, margin: f64) -> Vec<f32> {
    let n = IMAGE_SIZE as usize;
    let (ax, ay) = scene.key.position.anchor();
    let (cx, cy) = (ax + scene.jitter.0, ay + scene.jitter.1);
    let reach = scene.half_size + margin;
    let mut out = Vec::with_capacity(n * n);
    for y in 0..n {
        for x in 0..n {
            let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
            out.push(if dx.abs() <= reach && dy.abs() <= reach {
                1.0
            } else {
                0.0
            });
        }
    }
    out
}

/// Convert 8-bit RGB (`[H][W][3]`) to a `[3, H, W]` float tensor in [-1, 1].
pub fn rgb_to_tensor(rgb: &[u8], size: i64) -> Tensor {
    let floats: Vec<f32> = rgb.iter().map(|&v| v as f32 / 127.5 - 1.0).collect();
    Tensor::from_slice(&floats)
        .view([size, size, 3])
        .permute([2, 0, 1])
        .contiguous()
}

/// One training batch: images `[B, 3, 64, 64]` in [-1, 1] and their prompts.
pub fn batch(gen: &mut Generator, size: usize) -> (Tensor, Vec<String>) {
    let b = batch_with_boxes(gen, size, 0.0);
    (b.images, b.prompts)
}

/// A training batch with the object-box mask of every image.
pub struct Batch {
    /// `[B, 3, 64, 64]` in [-1, 1].
    pub images: Tensor,
    pub prompts: Vec<String>,
    /// `[B, 3, 64, 64]`: 1 inside each object's bounding box grown by the margin, else 0.
    pub boxes: Tensor,
}

/// Draw `size` scenes; `margin` grows the object boxes (see [`object_box_mask`]).
pub fn batch_with_boxes(gen: &mut Generator, size: usize, margin: f64) -> Batch {
    let mut images = Vec::with_capacity(size);
    let mut prompts = Vec::with_capacity(size);
    let mut boxes = Vec::with_capacity(size);
    for _ in 0..size {
        let scene = gen.next_scene();
        images.push(rgb_to_tensor(&render_rgb(&scene), IMAGE_SIZE));
        prompts.push(scene.key.prompt());
        let mask = Tensor::from_slice(&object_box_mask(&scene, margin));
        boxes.push(mask.view([1, IMAGE_SIZE, IMAGE_SIZE]).repeat([3, 1, 1]));
    }
    Batch {
        images: Tensor::stack(&images, 0),
        prompts,
        boxes: Tensor::stack(&boxes, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn split_is_disjoint_and_complete() {
        let split = Split::new();
        assert_eq!(split.held_out.len(), HELD_OUT);
        assert_eq!(split.train.len() + split.held_out.len(), 840);
        let train: HashSet<_> = split.train.iter().collect();
        assert!(split.held_out.iter().all(|k| !train.contains(k)));
        // Every single attribute value still appears in training.
        for s in Shape::ALL {
            assert!(split.train.iter().any(|k| k.shape == s));
        }
        for c in 0..COLOURS.len() {
            assert!(split.train.iter().any(|k| k.colour == c));
            assert!(split.train.iter().any(|k| k.background == c));
        }
    }

    #[test]
    fn generator_is_deterministic_and_never_emits_held_out() {
        let split = Split::new();
        let held: HashSet<_> = split.held_out.iter().copied().collect();
        let mut a = Generator::new(split.train.clone(), 7);
        let mut b = Generator::new(split.train.clone(), 7);
        for _ in 0..500 {
            let (sa, sb) = (a.next_scene(), b.next_scene());
            assert_eq!(sa, sb);
            assert!(!held.contains(&sa.key));
        }
    }

    #[test]
    fn object_box_covers_the_object_and_margin_only() {
        let key = SceneKey {
            shape: Shape::Square,
            colour: 0,
            position: Position::Left,
            background: 2,
        };
        let scene = Scene {
            key,
            half_size: 10.0,
            jitter: (1.0, -1.0),
        };
        let rgb = render_rgb(&scene);
        let mask = object_box_mask(&scene, 2.0);
        // Every object pixel is inside the box; the box is the square's 20 px side plus 2 px a side.
        for (i, p) in rgb.chunks(3).enumerate() {
            if p == COLOURS[0].1 {
                assert_eq!(mask[i], 1.0, "object pixel {i} outside the box");
            }
        }
        assert_eq!(mask.iter().filter(|&&m| m == 1.0).count(), 24 * 24);
    }

    #[test]
    fn render_fill_ratio_matches_shape() {
        let key = SceneKey {
            shape: Shape::Triangle,
            colour: 0,
            position: Position::Center,
            background: 2,
        };
        let scene = Scene {
            key,
            half_size: 12.0,
            jitter: (0.0, 0.0),
        };
        let rgb = render_rgb(&scene);
        let fg = rgb.chunks(3).filter(|p| p == &COLOURS[0].1).count() as f64;
        let ratio = fg / (24.0 * 24.0);
        assert!((ratio - 0.5).abs() < 0.06, "triangle fill ratio {ratio}");
    }
}
