//! Gather/scatter of token subsets along the token (first) dim, and packing bookkeeping.
//!
//! Kept as plain functions over `index_select` / `index_copy` so a CUDA kernel can replace any of
//! them later without touching the model code. Indices are int64 tensors on the data's device.
use crate::error::{ModelError, Result};
use tch::{Device, Kind, Tensor};

/// Rows `index` of `x` (`x[index]` along dim 0).
pub fn gather_rows(x: &Tensor, index: &Tensor) -> Result<Tensor> {
    Ok(x.f_index_select(0, index)?)
}

/// A copy of `base` with rows `index` replaced by the rows of `src` (out of place, so autograd
/// and the caller's cached tensor are both left intact).
pub fn scatter_rows(base: &Tensor, index: &Tensor, src: &Tensor) -> Result<Tensor> {
    Ok(base.f_index_copy(0, index, src)?)
}

/// In place: rows `index` of `dst` become the rows of `src`. For buffers the caller just built
/// (never a cached tensor that other requests share).
pub fn scatter_rows_(dst: &mut Tensor, index: &Tensor, src: &Tensor) -> Result<()> {
    let _ = dst.f_index_copy_(0, index, src)?;
    Ok(())
}

/// In place: `dst[offset .. offset + N] = base` (`base` is `[N, ...]`), then rows `index` of `dst`
/// become the rows of `src`. Builds a joint key/value sequence from cached rows plus fresh rows
/// without concatenating: one copy of the cached rows, one indexed write of the fresh ones.
pub fn merge_rows_(
    dst: &mut Tensor,
    offset: i64,
    base: &Tensor,
    index: &Tensor,
    src: &Tensor,
) -> Result<()> {
    let n = base.size().first().copied().unwrap_or(0);
    dst.f_narrow(0, offset, n)?.f_copy_(base)?;
    scatter_rows_(dst, index, src)
}

/// `rows[0]` when there is one part (a view, no copy), else the parts concatenated along dim 0.
pub fn cat_rows(rows: &[Tensor]) -> Result<Tensor> {
    match rows {
        [one] => Ok(one.shallow_clone()),
        _ => Ok(Tensor::f_cat(rows, 0)?),
    }
}

/// Per-token request index for a packed sequence: `[0; lens[0]] ++ [1; lens[1]] ++ ...`.
/// Used to gather each request's AdaLN rows for its own tokens.
pub fn request_ids(lens: &[i64], device: Device) -> Result<Tensor> {
    let ids: Vec<i64> = lens
        .iter()
        .enumerate()
        .flat_map(|(r, &n)| std::iter::repeat_n(r as i64, n.max(0) as usize))
        .collect();
    Ok(Tensor::f_from_slice(&ids)?.f_to_device(device)?)
}

/// Start offset of every segment of a packed sequence (exclusive prefix sum of `lens`).
pub fn offsets(lens: &[i64]) -> Vec<i64> {
    lens.iter()
        .scan(0i64, |acc, &n| {
            let start = *acc;
            *acc += n;
            Some(start)
        })
        .collect()
}

/// Check a token index vector: 1-D int64, unique, each in `0..n`; returns it on `device`.
/// Uniqueness matters: `index_copy` with duplicates is nondeterministic.
pub fn check_token_index(field: &str, index: &Tensor, n: i64, device: Device) -> Result<Tensor> {
    if index.dim() != 1 {
        return Err(ModelError::input(
            field,
            format!("must be 1-D, got shape {:?}", index.size()),
        ));
    }
    if !matches!(
        index.kind(),
        Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8
    ) {
        return Err(ModelError::input(
            field,
            format!("must be an integer tensor, got {:?}", index.kind()),
        ));
    }
    let index = index.f_to_kind(Kind::Int64)?;
    let m = index.size()[0];
    if m == 0 {
        return Err(ModelError::input(field, "must select at least one token"));
    }
    let host: Vec<i64> = Vec::<i64>::try_from(&index.f_to_device(Device::Cpu)?)?;
    let mut seen = vec![false; n.max(0) as usize];
    for &i in &host {
        if i < 0 || i >= n {
            return Err(ModelError::input(
                field,
                format!("token index {i} out of range 0..{n}"),
            ));
        }
        if std::mem::replace(&mut seen[i as usize], true) {
            return Err(ModelError::input(
                field,
                format!("token index {i} appears twice"),
            ));
        }
    }
    Ok(index.f_to_device(device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_and_offsets() {
        let ids = request_ids(&[2, 0, 3], Device::Cpu).unwrap();
        assert_eq!(Vec::<i64>::try_from(&ids).unwrap(), vec![0, 0, 2, 2, 2]);
        assert_eq!(offsets(&[2, 0, 3]), vec![0, 2, 2]);
    }

    #[test]
    fn scatter_then_gather_round_trips_and_leaves_base_intact() {
        let base = Tensor::zeros([5, 2], (Kind::Float, Device::Cpu));
        let idx = Tensor::from_slice(&[3i64, 1]);
        let src = Tensor::from_slice(&[1f32, 2., 3., 4.]).view([2, 2]);
        let out = scatter_rows(&base, &idx, &src).unwrap();
        assert_eq!(gather_rows(&out, &idx).unwrap(), src);
        assert_eq!(f64::try_from(base.abs().sum(Kind::Float)).unwrap(), 0.0);
    }

    #[test]
    fn merge_rows_places_base_after_offset_then_overwrites_index() {
        let mut dst = Tensor::full([4, 1], -1.0, (Kind::Float, Device::Cpu));
        let base = Tensor::from_slice(&[10f32, 11., 12.]).view([3, 1]);
        let idx = Tensor::from_slice(&[0i64, 2]);
        let src = Tensor::from_slice(&[7f32, 8.]).view([2, 1]);
        merge_rows_(&mut dst, 1, &base, &idx, &src).unwrap();
        let got = Vec::<f32>::try_from(&dst.view([-1])).unwrap();
        assert_eq!(got, vec![7., 10., 8., 12.]);
    }

    #[test]
    fn token_index_rejects_duplicates_and_out_of_range() {
        let dup = Tensor::from_slice(&[1i64, 1]);
        assert!(check_token_index("idx", &dup, 4, Device::Cpu)
            .unwrap_err()
            .to_string()
            .contains("twice"));
        let oob = Tensor::from_slice(&[4i64]);
        assert!(check_token_index("idx", &oob, 4, Device::Cpu)
            .unwrap_err()
            .to_string()
            .contains("out of range"));
    }
}
