//! Flux's 2x2 latent packing, image position ids, and pixel-mask -> token-mask conversion.
//!
//! Flux turns a `[B, C, H, W]` latent into `H/2 * W/2` tokens of `4C` features (diffusers
//! `_pack_latents`). Token `k` covers latent rows `2i..2i+2` and columns `2j..2j+2` with
//! `k = i * (W/2) + j`, so it covers a `2f x 2f` pixel square for a codec with downscale factor `f`.
//! A token counts as masked when ANY pixel under it is masked (max pooling): mask-aware editing
//! recomputes every token whose pixels may change, so none is ever served stale from the cache.
use crate::error::{ModelError, Result};
use tch::{Kind, Tensor};

/// Threshold above which a pixel mask value means "repaint" (diffusers keeps pixels `< 0.5`).
pub const MASK_THRESHOLD: f32 = 0.5;

fn dims4(t: &Tensor, field: &str) -> Result<[i64; 4]> {
    let s = t.size();
    <[i64; 4]>::try_from(s.as_slice())
        .map_err(|_| ModelError::input(field, format!("expected 4 dims, got {s:?}")))
}

/// Latent height/width diffusers uses for an image: `2 * (pixels / (2f))`, so tokens tile it.
pub fn latent_size(height: i64, width: i64, vae_scale_factor: i64) -> (i64, i64) {
    let unit = vae_scale_factor * 2;
    (2 * (height / unit), 2 * (width / unit))
}

/// `[B, C, H, W]` -> `[B, (H/2)(W/2), 4C]` (diffusers `_pack_latents`).
pub fn pack_latents(latents: &Tensor) -> Result<Tensor> {
    let [b, c, h, w] = dims4(latents, "latents")?;
    if h % 2 != 0 || w % 2 != 0 {
        return Err(ModelError::input(
            "latents",
            format!("height {h} and width {w} must be even to pack 2x2"),
        ));
    }
    Ok(latents
        .f_view([b, c, h / 2, 2, w / 2, 2])?
        .f_permute([0, 2, 4, 1, 3, 5])?
        .f_reshape([b, (h / 2) * (w / 2), c * 4])?)
}

/// `[B, (H/2)(W/2), 4C]` -> `[B, C, H, W]` for latent size `H x W` (diffusers `_unpack_latents`,
/// which takes pixel sizes; use [`latent_size`] to convert).
pub fn unpack_latents(packed: &Tensor, latent_height: i64, latent_width: i64) -> Result<Tensor> {
    let s = packed.size();
    let [b, n, ch] = <[i64; 3]>::try_from(s.as_slice()).map_err(|_| {
        ModelError::input(
            "latents",
            format!("expected [B, N, C] packed latents, got {s:?}"),
        )
    })?;
    let (h, w) = (latent_height, latent_width);
    if h <= 0 || w <= 0 || h % 2 != 0 || w % 2 != 0 || n != (h / 2) * (w / 2) || ch % 4 != 0 {
        return Err(ModelError::input(
            "latents",
            format!("packed shape {s:?} does not match latent size {h}x{w} (even sizes, N = H/2*W/2, C % 4 == 0)"),
        ));
    }
    Ok(packed
        .f_view([b, h / 2, w / 2, ch / 4, 2, 2])?
        .f_permute([0, 3, 1, 4, 2, 5])?
        .f_reshape([b, ch / 4, h, w])?)
}

/// `[rows*cols, 3]` position ids `(0, row, col)` of the packed tokens (diffusers
/// `_prepare_latent_image_ids` with `height = rows`, `width = cols`), in `kind`.
pub fn latent_image_ids(rows: i64, cols: i64, kind: Kind) -> Result<Tensor> {
    if rows <= 0 || cols <= 0 {
        return Err(ModelError::input(
            "latent_image_ids",
            format!("token grid {rows}x{cols} must be positive"),
        ));
    }
    let mut ids = Vec::with_capacity((rows * cols * 3) as usize);
    for r in 0..rows {
        for c in 0..cols {
            ids.extend_from_slice(&[0f32, r as f32, c as f32]);
        }
    }
    Ok(Tensor::from_slice(&ids)
        .f_view([rows * cols, 3])?
        .f_to_kind(kind)?)
}

/// Token mask of one pixel mask given as a row-major `height x width` slice: `true` where any
/// pixel of the token's `token_px x token_px` square is `>= MASK_THRESHOLD`.
#[allow(clippy::manual_is_multiple_of)] // usize::is_multiple_of needs Rust 1.87; MSRV is 1.85.
pub fn token_mask_from_pixels(
    mask: &[f32],
    height: usize,
    width: usize,
    token_px: usize,
) -> Result<Vec<bool>> {
    if token_px == 0 {
        return Err(ModelError::input("token_px", "must be positive"));
    }
    if mask.len() != height * width {
        return Err(ModelError::input(
            "mask",
            format!("{} values for {height}x{width}", mask.len()),
        ));
    }
    if height % token_px != 0 || width % token_px != 0 || height == 0 || width == 0 {
        return Err(ModelError::input(
            "mask",
            format!(
                "size {height}x{width} must be a positive multiple of the token size {token_px}"
            ),
        ));
    }
    let cols = width / token_px;
    let mut out = vec![false; (height / token_px) * cols];
    for (y, row) in mask.chunks_exact(width).enumerate() {
        for (x, &v) in row.iter().enumerate() {
            if v >= MASK_THRESHOLD {
                out[(y / token_px) * cols + x / token_px] = true;
            }
        }
    }
    Ok(out)
}

/// Batched token mask: pixel masks `[B, 1, H, W]` (or `[B, H, W]`) -> bool `[B, (H/t)(W/t)]` with
/// `t = token_px`, by max pooling the thresholded mask.
pub fn token_mask(mask: &Tensor, token_px: i64) -> Result<Tensor> {
    let mask = if mask.dim() == 3 {
        mask.f_unsqueeze(1)?
    } else {
        mask.shallow_clone()
    };
    let [b, c, h, w] = dims4(&mask, "mask")?;
    if c != 1 {
        return Err(ModelError::input(
            "mask",
            format!("expected 1 channel, got {c}"),
        ));
    }
    if token_px <= 0 || h % token_px != 0 || w % token_px != 0 || h == 0 || w == 0 {
        return Err(ModelError::input(
            "mask",
            format!("size {h}x{w} must be a positive multiple of the token size {token_px}"),
        ));
    }
    let hit = mask.f_ge(MASK_THRESHOLD as f64)?.f_to_kind(Kind::Float)?;
    let pooled = hit.f_max_pool2d(
        [token_px, token_px],
        [token_px, token_px],
        [0, 0],
        [1, 1],
        false,
    )?;
    Ok(pooled
        .f_reshape([b, (h / token_px) * (w / token_px)])?
        .f_gt(0.5)?)
}

/// Indices of the masked tokens of one token mask.
pub fn masked_token_indices(token_mask: &[bool]) -> Vec<i64> {
    token_mask
        .iter()
        .enumerate()
        .filter(|(_, &m)| m)
        .map(|(i, _)| i as i64)
        .collect()
}

/// Fraction of tokens that are masked (0 for an empty mask).
pub fn mask_ratio(token_mask: &[bool]) -> f64 {
    if token_mask.is_empty() {
        return 0.0;
    }
    token_mask.iter().filter(|&&m| m).count() as f64 / token_mask.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_unpack_roundtrip_and_layout() {
        let x = Tensor::arange(2 * 3 * 4 * 6, (Kind::Float, tch::Device::Cpu)).view([2, 3, 4, 6]);
        let p = pack_latents(&x).unwrap();
        assert_eq!(p.size(), vec![2, 6, 12]);
        // token 1 = latent rows 0..2, cols 2..4; feature 0 = channel 0, (0, 0) of the 2x2 patch.
        assert_eq!(p.double_value(&[0, 1, 0]), x.double_value(&[0, 0, 0, 2]));
        // feature 4*c + 2*dy + dx.
        assert_eq!(
            p.double_value(&[1, 4, 4 * 2 + 2 + 1]),
            x.double_value(&[1, 2, 3, 3])
        );
        let u = unpack_latents(&p, 4, 6).unwrap();
        assert_eq!(u, x);
        assert!(unpack_latents(&p, 4, 8).is_err());
        assert!(pack_latents(&x.narrow(2, 0, 3)).is_err());
    }

    #[test]
    fn image_ids() {
        let ids = latent_image_ids(2, 3, Kind::Float).unwrap();
        assert_eq!(ids.size(), vec![6, 3]);
        let v: Vec<f32> = Vec::try_from(ids.view([-1])).unwrap();
        assert_eq!(&v[9..12], &[0.0, 1.0, 0.0]);
        assert_eq!(&v[15..18], &[0.0, 1.0, 2.0]);
    }

    #[test]
    fn token_mask_is_any_pixel() {
        // 4x8 pixels, tokens of 2x2 -> 2x4 tokens; one masked pixel in the bottom-right token.
        let mut m = vec![0f32; 32];
        m[3 * 8 + 7] = 1.0;
        m[0] = 0.49; // below threshold
        let t = token_mask_from_pixels(&m, 4, 8, 2).unwrap();
        assert_eq!(
            t,
            vec![false, false, false, false, false, false, false, true]
        );
        assert_eq!(masked_token_indices(&t), vec![7]);
        assert_eq!(mask_ratio(&t), 1.0 / 8.0);
        let tt = token_mask(&Tensor::from_slice(&m).view([1, 1, 4, 8]), 2).unwrap();
        let v: Vec<bool> = Vec::try_from(tt.view([-1])).unwrap();
        assert_eq!(v, t);
        assert!(token_mask_from_pixels(&m, 4, 8, 3).is_err());
    }
}
