//! The capture's quality guard (`--cache-quality-floor`): what a template's cache would do to
//! an edit, measured while the cache is captured. A typical edit of the template (a centred box
//! of about a fifth of the image repainted under another seed, toward other content than the
//! template's caption: the empty prompt, the one conditioning every model has) runs twice
//! in lockstep with the capture: in full compute, and mask-aware from the step the capture has
//! just stored (decoded from its encoded form, so the storage dtype counts). At the end both
//! are composited over the template as the codec does, and their SSIM over the mask's box
//! (grown by 8 pixels, where the edit changes the image) is the template's figure. Below the
//! floor the capture stores a cache of no steps: every edit of the template computes in full,
//! and the capture reports why.
use crate::model::{job_resolution, rgb_to_tensor, EditInputs, EngineModel};
use diffmesh_model::flux::kv_codec::decode_block;
use diffmesh_model::flux::{CapturedKv, ControlResiduals, KvFormat};
use diffmesh_model::pipeline::stepper::{
    step_batch_controlled, DenoiseState, EditSpec, StepMode, StepRequest,
};
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::quality::{mask_box, ssim};
use diffmesh_model::tch::{Kind, Tensor};
use diffmesh_model::{ModelError, Result};
use diffmesh_shared::wire::messages::DenoiseJob;
use diffmesh_shared::wire::templates::{step_block_ranges, CacheQuality};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The typical edit's prompt. An edit under the template's own caption would change little
/// and flatter the cache; the empty prompt departs from it as users' edits do.
pub const QUALITY_PROBE_PROMPT: &str = "";

/// Share of the image tokens the typical edit repaints (FlashPS's production masks: a median
/// near 0.11, most below 0.3).
const TYPICAL_MASK: f64 = 0.2;

/// Pixels the mask's box grows by each side (as the bench's box figures).
const BOX_MARGIN: i64 = 8;

/// The two runs of the typical edit, stepped beside the capture.
pub(super) struct QualityProbe {
    full: DenoiseState,
    masked: DenoiseState,
    /// `[1, 1, H, W]`, 1 where the edit repaints.
    pixel_mask: Tensor,
    /// `[1, 3, H, W]` in [-1, 1].
    template: Tensor,
}

impl QualityProbe {
    /// The typical edit of the capture job's template.
    pub(super) fn new(
        job: &DenoiseJob,
        edit: Option<&EditInputs>,
        model: &EngineModel,
    ) -> Result<Self> {
        let (t, e) = match (job.template.as_ref(), edit) {
            (Some(t), Some(e)) => (t, e),
            _ => {
                return Err(ModelError::input(
                    "template",
                    "a capture names its template",
                ))
            }
        };
        let (height, width) = job_resolution(job, model);
        let p = model.pipeline();
        let template = rgb_to_tensor(&e.template_rgb, height, width, "inputs.image_key")?;
        let unit = 2 * p.codec.downscale_factor();
        let (rows, cols) = (height / unit, width / unit);
        let side = TYPICAL_MASK.sqrt();
        let (box_rows, box_cols) = (
            ((rows as f64 * side).round() as i64).clamp(1, rows),
            ((cols as f64 * side).round() as i64).clamp(1, cols),
        );
        let (top, left) = ((rows - box_rows) / 2, (cols - box_cols) / 2);
        let tokens: Vec<u8> = (0..rows * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                u8::from((top..top + box_rows).contains(&r) && (left..left + box_cols).contains(&c))
            })
            .collect();
        let pixel_mask = Tensor::f_from_slice(&tokens)?
            .f_to_kind(Kind::Float)?
            .f_view([rows, cols])?
            .f_repeat_interleave_self_int(unit, Some(0), None)?
            .f_repeat_interleave_self_int(unit, Some(1), None)?
            .f_view([1, 1, rows * unit, cols * unit])?;
        let request = StepRequest {
            true_cfg: None,
            cache_threshold: None,
            cache_method: Default::default(),
            control: None,
            prompt: QUALITY_PROBE_PROMPT.into(),
            // Another trajectory inside the mask than the template's own.
            seed: t.seed.wrapping_add(1),
            height,
            width,
            steps: t.steps as usize,
            guidance_scale: t.guidance_scale as f64,
            edit: Some(EditSpec {
                template: template.shallow_clone(),
                token_mask: Tensor::f_from_slice(&tokens)?,
                strength: 1.0,
                template_seed: Some(t.seed),
            }),
        };
        Ok(Self {
            full: DenoiseState::new(&p, &request)?,
            masked: DenoiseState::new(&p, &request)?,
            pixel_mask,
            template,
        })
    }

    /// Step both runs once: the mask-aware one reads `cache`, the step just captured.
    pub(super) fn step(&mut self, p: &FluxPipeline<'_>, cache: &CapturedKv) -> Result<()> {
        let none: [Option<ControlResiduals>; 2] = [None, None];
        step_batch_controlled(
            p,
            &mut [&mut self.full, &mut self.masked],
            &[StepMode::Full, StepMode::Cached(cache)],
            0,
            &none,
        )
    }

    /// SSIM of the mask-aware run against the full one over the mask's box, both composited
    /// over the template.
    pub(super) fn box_ssim(&self, p: &FluxPipeline<'_>) -> Result<f64> {
        let tpl = (&self.template.f_to_kind(Kind::Float)? + 1.0) / 2.0;
        let composite = |s: &DenoiseState| -> Result<Tensor> {
            let x = s
                .decode(p)?
                .f_to_kind(Kind::Float)?
                .f_to_device(tpl.device())?;
            let img = (x.f_clamp(-1.0, 1.0)? + 1.0) / 2.0;
            Ok(&self.pixel_mask * img + (1.0 - &self.pixel_mask) * &tpl)
        };
        let (full, masked) = (composite(&self.full)?, composite(&self.masked)?);
        let area = mask_box(&self.pixel_mask, BOX_MARGIN)?
            .ok_or_else(|| ModelError::input("mask", "the typical mask repaints nothing"))?;
        ssim(&area.crop(&full)?, &area.crop(&masked)?)
    }
}

/// The K/V blocks of an encoded step entry (the layout's first `blocks` blobs, all in one
/// K/V or hidden format), decoded as `kind`. A `prepared+hidden` cache is judged by its K/V
/// layer: its Y blocks rebuild the same K/V under the edit's conditioning.
pub(super) fn decode_step(entry: &[u8], blocks: usize, kind: Kind) -> Result<CapturedKv> {
    let ranges = step_block_ranges(entry).map_err(|e| ModelError::input("cache", e.0))?;
    let mut cache = CapturedKv::new(KvFormat::default());
    for (b, range) in ranges.into_iter().take(blocks).enumerate() {
        let (k, v, format) = decode_block(&entry[range], kind)?;
        if b == 0 {
            cache.format = format;
        }
        cache.blocks.push((k, v));
    }
    Ok(cache)
}

impl super::Engine {
    /// The quality probe of a capture job, or `None` (logged) where it cannot be built: the
    /// capture then runs unguarded.
    pub(super) fn quality_probe(
        &self,
        job: &super::EngineJob,
        span: &tracing::Span,
    ) -> Option<QualityProbe> {
        let _e = span.enter();
        let built = catch_unwind(AssertUnwindSafe(|| {
            QualityProbe::new(&job.job, job.edit.as_ref(), &self.model)
        }));
        match built {
            Ok(Ok(probe)) => Some(probe),
            Ok(Err(error)) => {
                tracing::warn!(%error, "capture quality guard not run");
                None
            }
            Err(_) => {
                tracing::warn!("capture quality guard not run: its probe panicked");
                None
            }
        }
    }

    /// The guard's verdict on a finished capture, where its probe ran to the end.
    pub(super) fn judge_capture(
        &self,
        probe: Option<QualityProbe>,
        span: &tracing::Span,
    ) -> Option<CacheQuality> {
        let (probe, floor) = (probe?, self.config.cache_quality_floor?);
        let _e = span.enter();
        let judged = catch_unwind(AssertUnwindSafe(|| probe.box_ssim(&self.model.pipeline())));
        match judged {
            // A probe that diverged says nothing of the cache (and NaN has no JSON form on
            // the records the verdict goes to).
            Ok(Ok(box_ssim)) if !box_ssim.is_finite() => {
                tracing::warn!(
                    box_ssim,
                    "capture quality guard diverged; the cache is kept"
                );
                None
            }
            Ok(Ok(box_ssim)) => {
                let full_compute = box_ssim < floor;
                if full_compute {
                    tracing::warn!(
                        box_ssim,
                        floor,
                        "template cache below the quality floor: its edits compute in full"
                    );
                } else {
                    tracing::info!(box_ssim, floor, "template cache passed the quality guard");
                }
                Some(CacheQuality {
                    box_ssim,
                    floor,
                    full_compute,
                })
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "capture quality guard failed; the cache is kept");
                None
            }
            Err(_) => {
                tracing::warn!("capture quality guard panicked; the cache is kept");
                None
            }
        }
    }

    /// One step of every running capture's probe, from the step its capture just stored. A
    /// probe that fails is dropped (its capture goes on unguarded).
    pub(super) fn step_probes(&mut self) {
        let pipeline = self.model.pipeline();
        let (_, kind) = pipeline.transformer.device_kind();
        let blocks = pipeline.transformer.num_blocks();
        for a in self.active.iter_mut().filter(|a| a.failed.is_none()) {
            let (Some((sink, _, _)), Some(probe)) = (a.capture.as_ref(), a.probe.as_mut()) else {
                continue;
            };
            let _e = a.span.enter();
            let stepped = sink
                .last_step()
                .ok_or_else(|| ModelError::input("cache", "no step captured yet"))
                .and_then(|entry| decode_step(entry, blocks, kind))
                .and_then(|cache| probe.step(&pipeline, &cache));
            if let Err(error) = stepped {
                tracing::warn!(%error, "capture quality guard dropped");
                a.probe = None;
            }
        }
    }
}
