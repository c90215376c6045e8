//! Seeded Gaussian noise that depends only on (seed, shape): the same on every device and
//! independent of which other requests share a batch.
//!
//! Values come from ChaCha8 seeded with the request's seed, turned into standard normals by the
//! Box-Muller transform, in row-major order of the unpacked latent `[C, H, W]`. (Neither torch's
//! global RNG, which batching would interleave, nor a per-device generator is used.)
use crate::error::{ModelError, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};

/// `len` standard normal samples for `seed`.
pub fn seeded_normal(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(len + 1);
    while out.len() < len {
        // u1 in (0, 1] so the log is finite; u2 in [0, 1).
        let u1 = 1.0 - rng.random::<f64>();
        let u2 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        out.push((r * theta.cos()) as f32);
        out.push((r * theta.sin()) as f32);
    }
    out.truncate(len);
    out
}

/// One request's noise of `shape` (e.g. the unpacked latent `[C, H, W]`).
pub fn seeded_noise(seed: u64, shape: &[i64], device: Device, kind: Kind) -> Result<Tensor> {
    if shape.iter().any(|&d| d <= 0) {
        return Err(ModelError::input(
            "noise shape",
            format!("{shape:?} must be positive"),
        ));
    }
    let len: i64 = shape.iter().product();
    let values = seeded_normal(seed, len as usize);
    Ok(Tensor::from_slice(&values)
        .f_view(shape)?
        .f_to_kind(kind)?
        .f_to_device(device)?)
}

/// `[B, ...shape]` noise, row `i` drawn from `seeds[i]` alone.
pub fn batch_noise(seeds: &[u64], shape: &[i64], device: Device, kind: Kind) -> Result<Tensor> {
    if seeds.is_empty() {
        return Err(ModelError::input(
            "seeds",
            "at least one request is required",
        ));
    }
    let rows = seeds
        .iter()
        .map(|&s| seeded_noise(s, shape, Device::Cpu, Kind::Float))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::f_stack(&rows, 0)?
        .f_to_kind(kind)?
        .f_to_device(device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_standard() {
        let a = seeded_normal(7, 20001);
        assert_eq!(a, seeded_normal(7, 20001));
        assert_ne!(a[..10], seeded_normal(8, 10)[..]);
        // A prefix of a longer draw equals a shorter draw (shape only sets the length).
        assert_eq!(&a[..101], &seeded_normal(7, 101)[..]);
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
    }

    #[test]
    fn batch_rows_are_independent() {
        let b = batch_noise(&[3, 4], &[2, 3], Device::Cpu, Kind::Float).unwrap();
        let alone = seeded_noise(4, &[2, 3], Device::Cpu, Kind::Float).unwrap();
        assert_eq!(b.get(1), alone);
    }
}
