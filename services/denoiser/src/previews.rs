//! Previews of a running job (`GenerationParams::preview_steps`: OpenAI's `partial_images`, a
//! job's `preview_every`): after each step a job named, its first image's latents projected to
//! RGB by the model's fitted [`LatentPreview`] (no VAE decode on the step loop), at most
//! [`MAX_PREVIEW_SIDE`] pixels on its long side; the engines send it as an event.
use crate::metrics::DenoiserMetrics;
use diffmesh_model::preview::LatentPreview;
use diffmesh_model::tch::{Device, Tensor};
use diffmesh_model::ModelError;
use diffmesh_shared::wire::messages::DenoiseJob;
use std::time::Instant;

/// Longest side of a preview: it rides on the job's event subject, whose messages must stay
/// well under NATS' payload limit (256 x 256 RGB is 192 KiB).
pub const MAX_PREVIEW_SIDE: u32 = 256;

/// Fit the preview map of a codec, or None (logged) when the fit fails: previews are a nicety.
pub fn fit(
    codec: &dyn diffmesh_model::components::LatentCodec,
    device: Device,
) -> Option<LatentPreview> {
    let started = Instant::now();
    match LatentPreview::fit(codec, device) {
        Ok(p) => {
            tracing::info!(
                fit_rms = p.fit_rms,
                seconds = started.elapsed().as_secs_f64(),
                "latent preview map fitted"
            );
            Some(p)
        }
        Err(error) => {
            tracing::warn!(%error, "no latent preview map: previews are off");
            None
        }
    }
}

/// One job's preview after a step, RGB8.
#[derive(Debug, Clone)]
pub struct Preview {
    pub job_id: String,
    pub step: u32,
    pub total: u32,
    pub width: u32,
    pub height: u32,
    pub rgb: Vec<u8>,
}

/// A preview's size for a `width` x `height` image: the same shape, at most
/// [`MAX_PREVIEW_SIDE`] on its long side.
pub fn preview_size(width: u32, height: u32) -> (u32, u32) {
    let long = width.max(height).max(1);
    if long <= MAX_PREVIEW_SIDE {
        return (width.max(1), height.max(1));
    }
    let scale = |side: u32| {
        ((u64::from(side) * u64::from(MAX_PREVIEW_SIDE)) / u64::from(long)).max(1) as u32
    };
    (scale(width), scale(height))
}

/// The preview of `job` after `step` of `total` if it asked for one then: `latents` gives its
/// first image's latents `[1, C, h, w]`, `(width, height)` its image size. Errors are logged
/// and skipped (a preview never fails a job).
#[allow(clippy::too_many_arguments)]
pub fn preview_event(
    preview: Option<&LatentPreview>,
    job: &DenoiseJob,
    step: u32,
    total: u32,
    (width, height): (u32, u32),
    latents: impl FnOnce() -> Result<Tensor, ModelError>,
    metrics: Option<&DenoiserMetrics>,
) -> Option<Preview> {
    let preview = preview?;
    if step >= total || !job.params.preview_steps.contains(&step) {
        return None;
    }
    let started = Instant::now();
    let (w, h) = preview_size(width, height);
    let rgb = latents()
        .and_then(|l| preview.rgb(&l, i64::from(h), i64::from(w)))
        .and_then(|image| diffmesh_model::tiny::model::images_to_rgb(&image))
        .and_then(|mut images| {
            images
                .pop()
                .ok_or_else(|| ModelError::input("preview", "empty batch"))
        });
    if let Some(m) = metrics {
        m.preview_seconds.observe(started.elapsed().as_secs_f64());
    }
    match rgb {
        Ok(rgb) => Some(Preview {
            job_id: job.job_id.clone(),
            step,
            total,
            width: w,
            height: h,
            rgb,
        }),
        Err(error) => {
            tracing::debug!(%error, "preview skipped");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previews_keep_the_shape_within_the_cap() {
        assert_eq!(preview_size(64, 48), (64, 48));
        assert_eq!(preview_size(1024, 512), (256, 128));
        assert_eq!(preview_size(512, 2048), (64, 256));
    }
}
