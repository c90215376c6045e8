//! The bench's requests: Poisson arrivals of edits (mask ratios drawn from a trace) and
//! generations with varied step counts, seeded so every mode replays the same sequence.
use anyhow::{ensure, Result};
use diffmesh_denoiser::engine::EngineJob;
use diffmesh_denoiser::model::EditInputs;
use diffmesh_model::tiny::data::all_keys;
use diffmesh_shared::wire::messages::{DenoiseJob, JobKind};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// What to generate (the arrival rate is applied later, once the service rate is measured).
#[derive(Debug, Clone)]
pub struct WorkloadSpec {
    pub requests: usize,
    /// Fraction of requests that are edits (the rest are generations).
    pub edit_fraction: f64,
    /// Denoising steps, drawn uniformly in `steps_min..=steps_max`.
    pub steps_min: u32,
    pub steps_max: u32,
    pub seed: u64,
}

impl WorkloadSpec {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.requests > 0, "--requests must be at least 1");
        ensure!(
            (0.0..=1.0).contains(&self.edit_fraction),
            "--edit-fraction must be in [0, 1], got {}",
            self.edit_fraction
        );
        ensure!(
            self.steps_min >= 1 && self.steps_min <= self.steps_max,
            "--steps-min ({}) must be at least 1 and at most --steps-max ({})",
            self.steps_min,
            self.steps_max
        );
        Ok(())
    }

    pub fn mean_steps(&self) -> f64 {
        f64::from(self.steps_min + self.steps_max) / 2.0
    }
}

/// One request of the workload.
#[derive(Debug, Clone)]
pub struct BenchRequest {
    pub id: String,
    /// Arrival time at one request per second; divide by the rate for seconds.
    pub unit_arrival: f64,
    pub steps: u32,
    pub seed: u64,
    pub prompt: String,
    /// An edit repainting this fraction of the image; `None`: a generation.
    pub mask_ratio: Option<f64>,
}

impl BenchRequest {
    pub fn arrival_s(&self, rate: f64) -> f64 {
        self.unit_arrival / rate
    }
}

/// The workload: attributes and unit-rate Poisson arrival times from separate streams, so the
/// rate only rescales the times.
pub fn requests(spec: &WorkloadSpec, mask_ratios: &[f64]) -> Result<Vec<BenchRequest>> {
    spec.validate()?;
    ensure!(
        !mask_ratios.is_empty(),
        "--mask-ratios: the file has no ratios"
    );
    let keys = all_keys();
    let mut attrs = ChaCha8Rng::seed_from_u64(spec.seed);
    let mut gaps = ChaCha8Rng::seed_from_u64(spec.seed ^ 0x0a11_1e55);
    let mut t = 0.0;
    Ok((0..spec.requests)
        .map(|i| {
            t += -(1.0 - gaps.random::<f64>()).ln();
            let edit = attrs.random::<f64>() < spec.edit_fraction;
            BenchRequest {
                id: format!("r{i:05}"),
                unit_arrival: t,
                steps: attrs.random_range(spec.steps_min..=spec.steps_max),
                seed: attrs.random(),
                prompt: keys[attrs.random_range(0..keys.len())].prompt(),
                mask_ratio: edit.then(|| mask_ratios[attrs.random_range(0..mask_ratios.len())]),
            }
        })
        .collect())
}

/// The model's image-token grid (tokens per side) and pixel resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelGrid {
    pub pixels: u32,
    pub tokens_per_side: u32,
}

impl ModelGrid {
    pub fn tokens(&self) -> u32 {
        self.tokens_per_side * self.tokens_per_side
    }
}

/// A rectangle of about `ratio` of a `side x side` grid (at least one cell), placed and shaped
/// by `rng`; row-major, 1 = repaint.
pub fn rect_mask(rng: &mut ChaCha8Rng, side: u32, ratio: f64) -> Vec<u8> {
    let cells = f64::from(side * side);
    let area = (ratio * cells).round().clamp(1.0, cells);
    let aspect: f64 = rng.random_range(0.5..2.0);
    // At least area / side wide, so the height fits the grid.
    let min_w = (area / f64::from(side)).ceil() as u32;
    let w = ((area * aspect).sqrt().round() as u32).clamp(min_w.max(1), side);
    let h = ((area / f64::from(w)).round() as u32).clamp(1, side);
    let (x0, y0) = (
        rng.random_range(0..=side - w),
        rng.random_range(0..=side - h),
    );
    let mut mask = vec![0u8; (side * side) as usize];
    for y in y0..y0 + h {
        let row = (y * side) as usize;
        mask[row + x0 as usize..row + (x0 + w) as usize].fill(1);
    }
    mask
}

/// The wire job of a request, with the edit's prepared inputs when it has them.
pub fn denoise_job(req: &BenchRequest, grid: ModelGrid, masked_tokens: Option<u32>) -> DenoiseJob {
    // The shared fixture fills every field of a 64x64 generation; adjust what differs.
    let mut job =
        diffmesh_shared::testing::generation_job(&req.id, &req.prompt, req.seed, req.steps);
    let px = grid.pixels;
    (job.params.width, job.params.height) = (px, px);
    let i = &mut job.inputs;
    (i.input_width, i.input_height, i.model_width, i.model_height) = (px, px, px, px);
    (i.token_rows, i.token_cols) = (grid.tokens_per_side, grid.tokens_per_side);
    i.masked_tokens = grid.tokens();
    if let Some(masked) = masked_tokens {
        job.kind = JobKind::Edit;
        i.masked_tokens = masked;
        i.mask_ratio = masked as f32 / grid.tokens() as f32;
    }
    job
}

/// An engine job at the model resolution, no codec work: edits get a synthetic template and a
/// rectangular token mask of the request's ratio.
pub fn engine_job(req: &BenchRequest, grid: ModelGrid) -> EngineJob {
    let Some(ratio) = req.mask_ratio else {
        return EngineJob::new(denoise_job(req, grid, None), None);
    };
    let mut rng = ChaCha8Rng::seed_from_u64(req.seed);
    let token_mask = rect_mask(&mut rng, grid.tokens_per_side, ratio);
    let masked = token_mask.iter().map(|&m| u32::from(m)).sum();
    let pixels = (grid.pixels * grid.pixels) as usize;
    let template_rgb = (0..pixels * 3).map(|_| rng.random::<u8>()).collect();
    EngineJob::new(
        denoise_job(req, grid, Some(masked)),
        Some(EditInputs {
            template_rgb,
            token_mask,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(requests: usize) -> WorkloadSpec {
        WorkloadSpec {
            requests,
            edit_fraction: 0.5,
            steps_min: 4,
            steps_max: 9,
            seed: 3,
        }
    }

    #[test]
    fn seeded_poisson_with_the_requested_mix() {
        let ratios = [0.1, 0.2, 0.3];
        let a = requests(&spec(2000), &ratios).unwrap();
        let b = requests(&spec(2000), &ratios).unwrap();
        assert_eq!(a.len(), 2000);
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.unit_arrival == y.unit_arrival
                && x.steps == y.steps
                && x.mask_ratio == y.mask_ratio));
        assert!(a.windows(2).all(|w| w[0].unit_arrival < w[1].unit_arrival));
        // Unit rate: about 2000 s for 2000 requests.
        let span = a[1999].unit_arrival;
        assert!((1800.0..2200.0).contains(&span), "{span}");
        let edits = a.iter().filter(|r| r.mask_ratio.is_some()).count();
        assert!((900..1100).contains(&edits), "{edits}");
        assert!(a.iter().all(|r| (4..=9).contains(&r.steps)));
        assert!(a.iter().any(|r| r.steps == 4) && a.iter().any(|r| r.steps == 9));
        assert!(a
            .iter()
            .filter_map(|r| r.mask_ratio)
            .all(|m| ratios.contains(&m)));
    }

    #[test]
    fn bad_specs_name_the_flag() {
        let mut s = spec(10);
        s.steps_min = 0;
        assert!(requests(&s, &[0.1])
            .unwrap_err()
            .to_string()
            .contains("--steps-min"));
        let mut s = spec(10);
        s.edit_fraction = 1.5;
        let e = requests(&s, &[0.1]).unwrap_err().to_string();
        assert!(e.contains("--edit-fraction"), "{e}");
        assert!(requests(&spec(10), &[]).is_err());
    }

    #[test]
    fn rect_mask_covers_about_the_ratio() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for ratio in [0.0, 0.05, 0.11, 0.3, 1.0] {
            let m = rect_mask(&mut rng, 16, ratio);
            let n = m.iter().filter(|&&v| v == 1).count() as f64;
            assert!(n >= 1.0);
            assert!((n / 256.0 - ratio).abs() < 0.08, "ratio {ratio}: {n} cells");
        }
    }

    #[test]
    fn edit_jobs_carry_their_mask() {
        let grid = ModelGrid {
            pixels: 64,
            tokens_per_side: 16,
        };
        let reqs = requests(&spec(20), &[0.2]).unwrap();
        for r in &reqs {
            let j = engine_job(r, grid);
            match (r.mask_ratio, &j.edit) {
                (Some(_), Some(e)) => {
                    assert_eq!(j.job.kind, JobKind::Edit);
                    assert_eq!(e.template_rgb.len(), 64 * 64 * 3);
                    let masked: u32 = e.token_mask.iter().map(|&m| u32::from(m)).sum();
                    assert_eq!(j.job.inputs.masked_tokens, masked);
                }
                (None, None) => {
                    assert_eq!(j.job.kind, JobKind::Generate);
                    assert_eq!(j.job.inputs.masked_tokens, 256);
                }
                _ => panic!("edit inputs do not match the request kind"),
            }
            assert_eq!(j.job.params.num_inference_steps, r.steps);
        }
    }
}
