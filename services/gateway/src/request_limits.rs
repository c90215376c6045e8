//! The request limits and defaults the gateway's flags set, and the checks every request
//! field shares (ranges, pixel counts, sizes), each error naming the field.
use diffmesh_shared::wire::messages::FieldError;

/// Request limits, set by gateway flags.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_n: u32,
    pub min_steps: u32,
    pub max_steps: u32,
    pub max_guidance: f32,
    /// Largest image (edits) or requested size (generations) in pixels.
    pub max_pixels: u64,
    pub max_prompt_chars: usize,
}

/// Values used when a request leaves a parameter out.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub steps: u32,
    pub guidance: f32,
    /// `true_cfg_scale` (1: off).
    pub true_cfg: f32,
    pub width: u32,
    pub height: u32,
}

fn invalid(field: &str, message: impl Into<String>) -> FieldError {
    FieldError::invalid(field, message)
}

/// `value`, or `default` when absent, if within `min..=max`.
pub fn in_range(
    field: &str,
    value: Option<i64>,
    default: u32,
    min: u32,
    max: u32,
) -> Result<u32, FieldError> {
    let v = value.unwrap_or(i64::from(default));
    if v < i64::from(min) || v > i64::from(max) {
        return Err(invalid(
            field,
            format!("must be between {min} and {max}, got {v}"),
        ));
    }
    Ok(v as u32)
}

/// Parse `"WxH"` (OpenAI's `size`).
pub fn parse_size(size: &str) -> Result<(u32, u32), FieldError> {
    let bad = || invalid("size", format!("must look like 512x512, got {size:?}"));
    let (w, h) = size.split_once(['x', 'X']).ok_or_else(bad)?;
    let w: u32 = w.trim().parse().map_err(|_| bad())?;
    let h: u32 = h.trim().parse().map_err(|_| bad())?;
    if w == 0 || h == 0 {
        return Err(bad());
    }
    Ok((w, h))
}

pub fn check_pixels(field: &str, w: u32, h: u32, limits: &Limits) -> Result<(), FieldError> {
    let pixels = u64::from(w) * u64::from(h);
    if pixels > limits.max_pixels {
        return Err(invalid(
            field,
            format!(
                "{w}x{h} = {pixels} pixels is above the limit of {}",
                limits.max_pixels
            ),
        ));
    }
    Ok(())
}

/// A seed for requests that give none (time-based; reproducibility needs an explicit seed).
pub fn rand_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    // splitmix64 so nearby timestamps give unrelated seeds.
    let mut z = nanos.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
