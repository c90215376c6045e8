//! A synthetic profile with the shape of FlashPS's Flux-on-H800 cost models, for use until the
//! denoiser's profiler has measured a real one. Everything built from it says "synthetic".
//!
//! Assumptions (hardware figures, not fitted to any scheduling outcome):
//! - Flux at 1024x1024: 57 blocks (19 double + 38 single), H = 3072, 4096 image + 512 text
//!   tokens, 28 steps; the cache holds the attention output Y in bf16 (2*H bytes per token per
//!   block), as FlashPS does.
//! - Compute: 45% of the H800's 989 TFLOP/s dense bf16, plus 0.25 ms per block of fixed cost
//!   (launches, small-batch under-use of the SMs that FlashPS observes at batch 1).
//! - Load: 40 GB/s host-to-device from pinned memory (PCIe Gen5 x16), plus 20 us per transfer.
//! - 3% multiplicative Gaussian noise on every sample, so the fit and R^2 are exercised.
use crate::cost_model::{BatchTotals, ComputeSample, CostModels, LoadSample, ModelShape, Profile};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const FLOPS_PER_S: f64 = 0.45 * 989e12;
pub const BLOCK_OVERHEAD_S: f64 = 0.25e-3;
pub const LOAD_BYTES_PER_S: f64 = 40e9;
pub const LOAD_OVERHEAD_S: f64 = 20e-6;
pub const NOISE: f64 = 0.03;

pub fn flux_shape() -> ModelShape {
    ModelShape {
        blocks: 57,
        hidden: 3072,
        image_tokens: 4096,
        text_tokens: 512,
        // FlashPS's own cache (bf16 Y), priced as the default K/V layout prices its bytes.
        cache_bytes_per_token: 2 * 3072,
        steps: 28,
        cache_layout: Default::default(),
    }
}

fn gaussian(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// The synthetic profile; `seed` only changes the noise.
pub fn profile(seed: u64) -> Profile {
    let shape = flux_shape();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut compute = Vec::new();
    let mut load = Vec::new();
    for i in 0..240 {
        let batch = 1 + (i % 8) as u32;
        let full = i % 6 == 0;
        let mut t = BatchTotals::default();
        let mut tokens = 0;
        for _ in 0..batch {
            let masked = shape.masked_tokens(rng.random_range(0.0..1.0));
            t.add(&shape, masked);
            tokens += if full {
                shape.total_tokens()
            } else {
                shape.computed_tokens(masked)
            };
        }
        let flops = if full { t.flops_full } else { t.flops_cached };
        let exact = flops / FLOPS_PER_S + BLOCK_OVERHEAD_S;
        compute.push(ComputeSample {
            tokens,
            batch,
            attended: batch as u64 * shape.total_tokens(),
            flops,
            latency_s: exact * (1.0 + NOISE * gaussian(&mut rng)),
        });
        let bytes = t.bytes as u64;
        let exact = bytes as f64 / LOAD_BYTES_PER_S + LOAD_OVERHEAD_S;
        load.push(LoadSample {
            bytes,
            latency_s: exact * (1.0 + NOISE * gaussian(&mut rng)),
        });
    }
    Profile {
        label: "synthetic profile: FlashPS Flux/H800 shape (45% of 989 TFLOP/s + 0.25 ms/block, \
                40 GB/s + 20 us loads, 3% noise); not measured"
            .into(),
        synthetic: true,
        shape,
        compute,
        load,
        disk_load: Vec::new(),
        engine_steps: Vec::new(),
        engine_label: String::new(),
        engine_jobs: None,
    }
}

/// Models fitted on the synthetic profile with seed 0.
pub fn default_models() -> CostModels {
    // The generated profile is well-formed by construction (validated shape, varied x values).
    CostModels::fit(&profile(0)).expect("synthetic profile fits")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_fit_recovers_the_generating_line() {
        let m = default_models();
        assert!(m.synthetic && m.label.contains("synthetic profile"));
        assert!(m.compute.r2 > 0.98, "{:?}", m.compute);
        assert!(m.load.r2 > 0.98, "{:?}", m.load);
        assert!(
            (m.compute.slope * FLOPS_PER_S - 1.0).abs() < 0.05,
            "{:?}",
            m.compute
        );
        assert!(
            (m.load.slope * LOAD_BYTES_PER_S - 1.0).abs() < 0.05,
            "{:?}",
            m.load
        );
    }
}
