//! What the quality figures of edits share: the trained tiny model's template and its captured
//! cache, the edits drawn from the mask-ratio trace, the codec's composite, and SSIM/PSNR of
//! an edit against its full-compute reference over the whole image, over the mask's box grown
//! by [`BOX_MARGIN`] and over the masked pixels (issue 50: the rest of a composite is the
//! template's by construction, so whole-image figures flatter every cache).
use crate::mask_aware::MaskAwareOptions;
use anyhow::Result;
use diffmesh_denoiser::cached_step::CaptureSink;
use diffmesh_denoiser::templates::{CacheLayout, TemplateEntry};
use diffmesh_model::flux::kv_codec::CacheDtype;
use diffmesh_model::flux::step_cache::CacheMethod;
use diffmesh_model::flux::KvFormat;
use diffmesh_model::pipeline::stepper::{DenoiseState, EditSpec, StepRequest};
use diffmesh_model::pipeline::template::{capture_state, TemplateSpec};
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::quality::{mask_box, psnr, psnr_masked, ssim, ssim_masked};
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::tiny::data::{all_keys, render_rgb, rgb_to_tensor, scene_for};
use diffmesh_model::tiny::IMAGE_SIZE;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::sync::Arc;

/// Pixels the mask's box is grown by each side for the box figures (issue 50).
pub(crate) const BOX_MARGIN: i64 = 8;

/// The seed a quality template is captured with (its edits follow that noise outside the mask).
const TEMPLATE_SEED: u64 = 4242;

/// A rendered template of the held-in scenes and the edits drawn against it.
pub(crate) struct QualityEdits {
    pub template: Tensor,
    prompt: String,
    /// Token grid side.
    side: i64,
    steps: usize,
    /// `(token mask, prompt)` per edit.
    pub edits: Vec<(Tensor, String)>,
}

impl QualityEdits {
    /// The template and edits of `opts` (the same ones for every figure of one run).
    pub fn draw(opts: &MaskAwareOptions, p: &FluxPipeline<'_>) -> Self {
        let keys = all_keys();
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
        let scene = scene_for(keys[rng.random_range(0..keys.len())], &mut rng);
        let template = rgb_to_tensor(&render_rgb(&scene), IMAGE_SIZE).unsqueeze(0);
        let side = IMAGE_SIZE / (2 * p.codec.downscale_factor());
        let mut edit_rng = ChaCha8Rng::seed_from_u64(opts.seed + 1);
        let edits = (0..opts.quality_edits)
            .map(|_| {
                let ratio = opts.mask_ratios[edit_rng.random_range(0..opts.mask_ratios.len())];
                let mask = rect_mask(&mut edit_rng, side, ratio);
                (mask, keys[edit_rng.random_range(0..keys.len())].prompt())
            })
            .collect();
        Self {
            template,
            prompt: scene.key.prompt(),
            side,
            steps: opts.quality_steps,
            edits,
        }
    }

    /// The template's cache in `format` and `dtype`, captured as the engine does.
    pub fn capture(
        &self,
        p: &FluxPipeline<'_>,
        format: KvFormat,
        dtype: CacheDtype,
    ) -> Result<Arc<TemplateEntry>> {
        let spec = TemplateSpec {
            template: self.template.shallow_clone(),
            prompt: self.prompt.clone(),
            seed: TEMPLATE_SEED,
            steps: self.steps,
            guidance_scale: 1.0,
        };
        let mut state = capture_state(p, &spec)?;
        let mut sink = CaptureSink::new(CacheLayout::One(format), dtype);
        while !state.is_done() {
            state.capture_step(p, &mut sink)?;
            sink.end_step();
        }
        Ok(Arc::new(
            sink.finish("quality".into(), p.transformer.num_blocks())
                .map_err(anyhow::Error::msg)?,
        ))
    }

    /// Edit `e` as a step request (caching steps by `step_cache`'s method at its threshold
    /// where given).
    pub fn request(&self, e: usize, step_cache: Option<(CacheMethod, f64)>) -> StepRequest {
        let (mask, prompt) = &self.edits[e];
        StepRequest {
            true_cfg: None,
            cache_threshold: step_cache.map(|(_, t)| t),
            cache_method: step_cache.map(|(m, _)| m).unwrap_or_default(),
            control: None,
            prompt: prompt.clone(),
            seed: 100 + e as u64,
            height: IMAGE_SIZE,
            width: IMAGE_SIZE,
            steps: self.steps,
            guidance_scale: 1.0,
            edit: Some(EditSpec {
                template: self.template.shallow_clone(),
                token_mask: mask.shallow_clone(),
                strength: 1.0,
                template_seed: Some(TEMPLATE_SEED),
            }),
        }
    }

    /// Edit `e`'s mask in pixels, `[1, 1, H, W]`.
    pub fn pixel_mask(&self, e: usize) -> Tensor {
        let unit = IMAGE_SIZE / self.side;
        self.edits[e]
            .0
            .view([self.side, self.side])
            .to_kind(Kind::Float)
            .repeat_interleave_self_int(unit, Some(0), None)
            .repeat_interleave_self_int(unit, Some(1), None)
            .view([1, 1, IMAGE_SIZE, IMAGE_SIZE])
    }

    /// A finished state decoded and composited as the codec does: edit `e`'s pixels inside its
    /// mask, the template's outside, in [0, 1].
    pub fn composite(&self, e: usize, s: &DenoiseState, p: &FluxPipeline<'_>) -> Result<Tensor> {
        let x = s.decode(p)?.to_kind(Kind::Float);
        let mask = self.pixel_mask(e);
        let img = (x.clamp(-1.0, 1.0) + 1.0) / 2.0;
        let tpl = (&self.template + 1.0) / 2.0;
        Ok(&mask * img + (1.0 - &mask) * tpl)
    }
}

/// SSIM and PSNR of edits against their references, accumulated.
#[derive(Default)]
pub(crate) struct EditScores {
    ssim: Vec<f64>,
    psnr: Vec<f64>,
    box_ssim: Vec<f64>,
    box_psnr: Vec<f64>,
    masked_ssim: Vec<f64>,
    masked_psnr: Vec<f64>,
}

impl EditScores {
    /// Score `b` against the reference `a` (composites, `[1, 3, H, W]`), with the edit's
    /// pixel mask.
    pub fn add(&mut self, a: &Tensor, b: &Tensor, pixel_mask: &Tensor) -> Result<()> {
        self.ssim.push(ssim(a, b)?);
        self.psnr.push(psnr(a, b)?.min(100.0));
        if let Some(area) = mask_box(pixel_mask, BOX_MARGIN)? {
            let (ca, cb) = (area.crop(a)?, area.crop(b)?);
            self.box_ssim.push(ssim(&ca, &cb)?);
            self.box_psnr.push(psnr(&ca, &cb)?.min(100.0));
        }
        if let Some(s) = ssim_masked(a, b, pixel_mask)? {
            self.masked_ssim.push(s);
        }
        if let Some(q) = psnr_masked(a, b, pixel_mask)? {
            self.masked_psnr.push(q.min(100.0));
        }
        Ok(())
    }

    /// Whole-image SSIM (mean, min) and PSNR mean.
    pub fn whole(&self) -> (f64, f64, f64) {
        let (s, min_s) = mean_min(&self.ssim);
        (s, min_s, mean_min(&self.psnr).0)
    }

    /// One line of the figures, for the report's log.
    pub fn summary(&self) -> String {
        let (s, min_s, q) = self.whole();
        let ((bs, min_bs), (bq, _)) = (mean_min(&self.box_ssim), mean_min(&self.box_psnr));
        let ((ms, _), (mq, _)) = (mean_min(&self.masked_ssim), mean_min(&self.masked_psnr));
        format!(
            "SSIM mean {s:.4} (min {min_s:.4}), PSNR mean {q:.2} dB; over the mask's box \
             (+{BOX_MARGIN} px) SSIM {bs:.4} (min {min_bs:.4}), PSNR {bq:.2} dB; over the masked \
             pixels SSIM {ms:.4}, PSNR {mq:.2} dB"
        )
    }

    /// The figures as report values, under the names the issue uses.
    pub fn figures(&self) -> Value {
        let (s, min_s, q) = self.whole();
        json!({"ssim_mean": s, "ssim_min": min_s, "psnr_mean": q,
            "ssim_box_mean": mean_or_null(&self.box_ssim),
            "ssim_box_min": mean_min(&self.box_ssim).1,
            "psnr_box_mean": mean_or_null(&self.box_psnr),
            "ssim_masked_mean": mean_or_null(&self.masked_ssim),
            "psnr_masked_mean": mean_or_null(&self.masked_psnr)})
    }
}

/// A token mask (`side x side` grid) repainting a rectangle of about `ratio` of the tokens.
pub(crate) fn rect_mask(rng: &mut ChaCha8Rng, side: i64, ratio: f64) -> Tensor {
    let area = (ratio * (side * side) as f64)
        .round()
        .clamp(1.0, (side * side - 1) as f64);
    let aspect: f64 = rng.random_range(0.5..2.0);
    let w = ((area * aspect).sqrt().round() as i64).clamp(1, side);
    let h = ((area / w as f64).round() as i64).clamp(1, side);
    let (x0, y0) = (
        rng.random_range(0..=side - w),
        rng.random_range(0..=side - h),
    );
    let mask = Tensor::zeros([side, side], (Kind::Bool, Device::Cpu));
    let _ = mask.narrow(0, y0, h).narrow(1, x0, w).fill_(1);
    mask.view([-1])
}

/// The mean of `v` as a report value: null when nothing was measured (every mask at the border,
/// say), not a zero that reads as a score.
pub(crate) fn mean_or_null(v: &[f64]) -> Value {
    match v.is_empty() {
        true => Value::Null,
        false => json!(mean_min(v).0),
    }
}

/// Mean and minimum of per-edit scores.
pub(crate) fn mean_min(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    (mean, v.iter().copied().fold(f64::INFINITY, f64::min))
}
