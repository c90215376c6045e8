//! Image quality metrics for comparing a mask-aware result with the full-compute one: SSIM
//! (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03, "valid" windows,
//! averaged over channels and positions) and PSNR. Inputs are `[1, C, H, W]` or `[C, H, W]` in
//! [0, 1] (convert from [-1, 1] first).
use crate::error::{ModelError, Result};
use tch::{Kind, Tensor};

const WINDOW: i64 = 11;
const SIGMA: f64 = 1.5;

fn as_batch(x: &Tensor, field: &str) -> Result<Tensor> {
    let x = match x.dim() {
        3 => x.f_unsqueeze(0)?,
        4 => x.shallow_clone(),
        d => {
            return Err(ModelError::input(
                field,
                format!("expected [C, H, W] or [1, C, H, W], got {d} dims"),
            ))
        }
    };
    Ok(x.f_to_kind(Kind::Double)?)
}

fn check_pair(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let (a, b) = (as_batch(a, "a")?, as_batch(b, "b")?);
    if a.size() != b.size() {
        return Err(ModelError::input(
            "b",
            format!("shape {:?} differs from a's {:?}", b.size(), a.size()),
        ));
    }
    Ok((a, b))
}

/// Mean SSIM of two images in [0, 1].
pub fn ssim(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = check_pair(a, b)?;
    let s = a.size();
    let (c, h, w) = (s[1], s[2], s[3]);
    if h < WINDOW || w < WINDOW {
        return Err(ModelError::input(
            "a",
            format!("SSIM needs at least {WINDOW}x{WINDOW} pixels, got {h}x{w}"),
        ));
    }
    let opts = (Kind::Double, a.device());
    let x = Tensor::f_arange(WINDOW, opts)?.f_sub_scalar((WINDOW - 1) as f64 / 2.0)?;
    let g = x.f_square()?.f_div_scalar(-2.0 * SIGMA * SIGMA)?.f_exp()?;
    let g = g.f_div(&g.f_sum(Kind::Double)?)?;
    let kernel = g
        .f_unsqueeze(1)?
        .f_matmul(&g.f_unsqueeze(0)?)?
        .f_expand([c, 1, WINDOW, WINDOW], false)?
        .f_contiguous()?;
    let blur = |t: &Tensor| -> Result<Tensor> {
        Ok(t.f_conv2d::<Tensor>(&kernel, None, [1, 1], [0, 0], [1, 1], c)?)
    };
    let (mu_a, mu_b) = (blur(&a)?, blur(&b)?);
    let (mu_aa, mu_bb, mu_ab) = (mu_a.f_square()?, mu_b.f_square()?, mu_a.f_mul(&mu_b)?);
    let var_a = blur(&a.f_square()?)?.f_sub(&mu_aa)?;
    let var_b = blur(&b.f_square()?)?.f_sub(&mu_bb)?;
    let cov = blur(&a.f_mul(&b)?)?.f_sub(&mu_ab)?;
    let (c1, c2) = (0.01f64.powi(2), 0.03f64.powi(2));
    let num = mu_ab
        .f_mul_scalar(2.0)?
        .f_add_scalar(c1)?
        .f_mul(&cov.f_mul_scalar(2.0)?.f_add_scalar(c2)?)?;
    let den = mu_aa
        .f_add(&mu_bb)?
        .f_add_scalar(c1)?
        .f_mul(&var_a.f_add(&var_b)?.f_add_scalar(c2)?)?;
    Ok(num.f_div(&den)?.f_mean(Kind::Double)?.double_value(&[]))
}

/// PSNR in dB of two images in [0, 1]; `f64::INFINITY` when they are equal.
pub fn psnr(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = check_pair(a, b)?;
    let mse = a
        .f_sub(&b)?
        .f_square()?
        .f_mean(Kind::Double)?
        .double_value(&[]);
    Ok(if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (1.0 / mse).log10()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn img(seed: i64) -> Tensor {
        tch::manual_seed(seed);
        Tensor::rand([1, 3, 32, 32], (Kind::Float, Device::Cpu))
    }

    #[test]
    fn identical_images_score_one_and_infinite_psnr() {
        let a = img(1);
        assert!((ssim(&a, &a).unwrap() - 1.0).abs() < 1e-9);
        assert!(psnr(&a, &a).unwrap().is_infinite());
    }

    #[test]
    fn more_noise_scores_lower() {
        let a = img(1);
        let noise = img(2) - 0.5;
        let slight = (&a + &noise * 0.05).clamp(0.0, 1.0);
        let heavy = (&a + &noise * 0.5).clamp(0.0, 1.0);
        let (s1, s2) = (ssim(&a, &slight).unwrap(), ssim(&a, &heavy).unwrap());
        assert!(s1 > s2 && s1 < 1.0, "{s1} {s2}");
        let (p1, p2) = (psnr(&a, &slight).unwrap(), psnr(&a, &heavy).unwrap());
        assert!(p1 > p2, "{p1} {p2}");
        // PSNR of a constant offset is exact: mse = 0.1^2 -> 20 dB.
        let shifted = &a * 0.0 + 0.5;
        let p = psnr(&(&shifted + 0.1), &shifted).unwrap();
        assert!((p - 20.0).abs() < 1e-4, "{p}");
    }

    #[test]
    fn mismatched_or_tiny_inputs_name_the_field() {
        let a = img(1);
        let b = Tensor::rand([1, 3, 16, 32], (Kind::Float, Device::Cpu));
        assert!(ssim(&a, &b).unwrap_err().to_string().contains('b'));
        let small = Tensor::rand([3, 8, 8], (Kind::Float, Device::Cpu));
        assert!(ssim(&small, &small)
            .unwrap_err()
            .to_string()
            .contains("11x11"));
    }
}
