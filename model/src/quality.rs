//! Image quality metrics for comparing a mask-aware result with the full-compute one: SSIM
//! (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03, "valid" windows,
//! averaged over channels and positions) and PSNR, over whole images, over the box around a
//! mask's pixels ([`mask_box`], grown by a margin: where an edit changes the image, without the
//! unmasked pixels that are equal by construction), and over the masked pixels alone
//! ([`ssim_masked`], [`psnr_masked`]). Inputs are `[1, C, H, W]` or `[C, H, W]` in [0, 1]
//! (convert from [-1, 1] first).
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
    Ok(ssim_map(a, b)?.f_mean(Kind::Double)?.double_value(&[]))
}

/// SSIM at every valid window position, `[1, C, H - 10, W - 10]` (the window's centre at
/// `(y + 5, x + 5)`).
fn ssim_map(a: &Tensor, b: &Tensor) -> Result<Tensor> {
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
    Ok(num.f_div(&den)?)
}

/// A rectangle of pixels: rows `top..top + height`, columns `left..left + width`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PixelBox {
    pub top: i64,
    pub left: i64,
    pub height: i64,
    pub width: i64,
}

impl PixelBox {
    /// The box's pixels of `image` (`[.., H, W]`).
    pub fn crop(&self, image: &Tensor) -> Result<Tensor> {
        let d = image.dim() as i64;
        Ok(image
            .f_narrow(d - 2, self.top, self.height)?
            .f_narrow(d - 1, self.left, self.width)?)
    }
}

/// The box around the pixels `mask` repaints (`[.., H, W]`, at least 0.5), grown by `grow`
/// pixels each side within the image, and to the SSIM window where the image allows; `None`
/// for a mask that repaints nothing.
pub fn mask_box(mask: &Tensor, grow: i64) -> Result<Option<PixelBox>> {
    let s = mask.size();
    let (h, w) = match s.as_slice() {
        [.., h, w] => (*h, *w),
        _ => return Err(ModelError::input("mask", "expected [.., H, W]")),
    };
    let on = mask
        .f_ge(0.5)?
        .f_reshape([-1, h, w])?
        .f_any_dims(&[0i64][..], false)?;
    let rows: Vec<bool> = Vec::<bool>::try_from(on.f_any_dims(&[1i64][..], false)?)?;
    let cols: Vec<bool> = Vec::<bool>::try_from(on.f_any_dims(&[0i64][..], false)?)?;
    let span = |v: &[bool], n: i64| -> Option<(i64, i64)> {
        let first = v.iter().position(|&x| x)? as i64;
        let last = v.iter().rposition(|&x| x)? as i64;
        // Grown, then widened to the window (centred as far as the image allows).
        let (mut lo, mut hi) = ((first - grow).max(0), (last + 1 + grow).min(n));
        let short = (WINDOW.min(n) - (hi - lo)).max(0);
        lo = (lo - short / 2 - short % 2).max(0);
        hi = (lo + (hi - lo).max(WINDOW.min(n))).min(n);
        lo = lo.min(hi - WINDOW.min(n)).max(0);
        Some((lo, hi))
    };
    let (Some((top, bottom)), Some((left, right))) = (span(&rows, h), span(&cols, w)) else {
        return Ok(None);
    };
    Ok(Some(PixelBox {
        top,
        left,
        height: bottom - top,
        width: right - left,
    }))
}

/// SSIM of two images in [0, 1] averaged over the windows centred on a pixel `mask`
/// repaints (`[.., H, W]`, at least 0.5); `None` when no window centre is masked (a mask only
/// at the borders).
pub fn ssim_masked(a: &Tensor, b: &Tensor, mask: &Tensor) -> Result<Option<f64>> {
    let map = ssim_map(a, b)?;
    let s = map.size();
    let (hv, wv) = (s[2], s[3]);
    let half = WINDOW / 2;
    let m = mask.f_ge(0.5)?.f_to_kind(Kind::Double)?;
    let d = m.dim() as i64;
    let centres = m
        .f_narrow(d - 2, half, hv)?
        .f_narrow(d - 1, half, wv)?
        .f_reshape([1, 1, hv, wv])?
        .f_to_device(map.device())?;
    let weight = centres.f_sum(Kind::Double)?.double_value(&[]) * s[1] as f64;
    if weight == 0.0 {
        return Ok(None);
    }
    let total = map.f_mul(&centres)?.f_sum(Kind::Double)?.double_value(&[]);
    Ok(Some(total / weight))
}

/// PSNR in dB of two images in [0, 1] over the pixels `mask` repaints (`[.., H, W]`, at least
/// 0.5; every channel); `None` for an empty mask, `f64::INFINITY` when they agree there.
pub fn psnr_masked(a: &Tensor, b: &Tensor, mask: &Tensor) -> Result<Option<f64>> {
    let (a, b) = check_pair(a, b)?;
    let s = a.size();
    let m = mask
        .f_ge(0.5)?
        .f_to_kind(Kind::Double)?
        .f_reshape([1, 1, s[2], s[3]])?
        .f_to_device(a.device())?;
    let pixels = m.f_sum(Kind::Double)?.double_value(&[]) * s[1] as f64;
    if pixels == 0.0 {
        return Ok(None);
    }
    let sse = a
        .f_sub(&b)?
        .f_square()?
        .f_mul(&m)?
        .f_sum(Kind::Double)?
        .double_value(&[]);
    let mse = sse / pixels;
    Ok(Some(if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (1.0 / mse).log10()
    }))
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

    #[test]
    fn boxes_and_masks_see_only_where_the_images_differ() {
        let a = img(1);
        let mask = Tensor::zeros([1, 1, 32, 32], (Kind::Float, Device::Cpu));
        let _ = mask.narrow(2, 10, 6).narrow(3, 4, 8).fill_(1.0);
        // Grown by 2: rows 8..18 (widened to the 11-pixel window: 7..18), columns 2..14.
        let b = mask_box(&mask, 2).unwrap().unwrap();
        assert_eq!((b.top, b.left, b.height, b.width), (7, 2, 11, 12));
        let tight = mask_box(&mask, 0).unwrap().unwrap();
        assert_eq!((tight.height, tight.width), (11, 11));
        assert!(
            tight.top <= 10 && tight.top + 11 >= 16 && tight.left <= 4 && tight.left + 11 >= 12
        );
        let near_edge = Tensor::zeros([32, 32], (Kind::Float, Device::Cpu));
        let _ = near_edge.narrow(0, 30, 2).narrow(1, 0, 1).fill_(1.0);
        let e = mask_box(&near_edge, 0).unwrap().unwrap();
        assert_eq!((e.top, e.left, e.height, e.width), (21, 0, 11, 11));
        assert_eq!(mask_box(&(&mask * 0.0), 8).unwrap(), None);

        // Changed only under the mask: the whole image (mostly equal pixels) scores better than
        // the box and the masked windows.
        let noise = (img(2) - 0.5) * 0.4;
        let changed = (&a + noise * &mask).clamp(0.0, 1.0);
        let whole = ssim(&a, &changed).unwrap();
        let boxed = ssim(&b.crop(&a).unwrap(), &b.crop(&changed).unwrap()).unwrap();
        let masked = ssim_masked(&a, &changed, &mask).unwrap().unwrap();
        assert!(
            whole > boxed + 0.02 && whole > masked + 0.02,
            "{whole} {boxed} {masked}"
        );
        let p_whole = psnr(&a, &changed).unwrap();
        let p_masked = psnr_masked(&a, &changed, &mask).unwrap().unwrap();
        assert!(p_whole > p_masked, "{p_whole} {p_masked}");
        assert!(psnr_masked(&a, &a, &mask).unwrap().unwrap().is_infinite());
        assert!((ssim_masked(&a, &a, &mask).unwrap().unwrap() - 1.0).abs() < 1e-9);
    }
}
