//! The model the engine owns, and the conversion of wire jobs into stepper requests and of
//! decoded images back into RGB bytes.
use crate::templates::GpuCopy;
use diffmesh_model::components::TextEncoder;
use diffmesh_model::flux::step_cache::CacheMethod;
use diffmesh_model::model_dir::{LoadedModel, FILL_PIPELINE};
use diffmesh_model::pipeline::control::ControlInput;
use diffmesh_model::pipeline::stepper::{DenoiseState, EditSpec, StepRequest, TrueCfg};
use diffmesh_model::pipeline::template::{self, TemplateSpec};
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::ModelError;
use diffmesh_shared::wire::messages::{DenoiseJob, JobKind, StepCacheMethod};
use diffmesh_shared::wire::models::{ModelCard, ModelFeatures, ModelGeometry, Resolution};
use std::path::Path;
use std::sync::Arc;

/// A loaded model plus what the engine needs to know about it.
pub struct EngineModel {
    pub model: LoadedModel,
    /// Id reported in heartbeats (router places only compatible jobs).
    pub model_id: String,
    /// What heartbeats announce about the model (`announce`).
    pub card: ModelCard,
    /// The copy stream and pinned-memory allocator of the model's GPU (None on CPU, or where
    /// the CUDA driver could not be opened through cudarc: then caches load synchronously).
    pub gpu_copy: Option<Arc<GpuCopy>>,
    /// Folder of named ControlNets steered generations may name (`--controlnet-dir`).
    pub controlnet_dir: Option<std::path::PathBuf>,
    /// ControlNet workers to run steered steps on (`--controlnet-remote`); None: none.
    pub controlnet_service: Option<crate::controlnet_service::RemoteControlNets>,
    /// Where the engine offers a job's pre-encoded prompts, once the prompt stage owns the text
    /// encoder (`EngineModel::split_text_encoder`); None: the engine encodes them.
    pub pre_encoded: Option<crate::prompt_stage::PreEncodedHandle>,
    /// The node's elastic ranks (`--ranks R`, R > 1): the engine then runs every step as a
    /// task on a group of them ([`crate::ranks`]). None: it steps on this model.
    pub ranks: Option<crate::ranks::ElasticRanks>,
    /// Maps latents to preview pixels (`crate::previews`); None: previews are off.
    pub preview: Option<diffmesh_model::preview::LatentPreview>,
}

impl EngineModel {
    pub fn load(
        dir: &Path,
        device: Device,
        kind: Kind,
        model_id: String,
        default_size: Option<i64>,
    ) -> Result<Self, ModelError> {
        let model = LoadedModel::load(dir, device, kind)?;
        let card = announce(&model, &model_id, default_size);
        let preview = crate::previews::fit(&*model.codec, device);
        let gpu_copy = match device {
            Device::Cuda(ordinal) => match GpuCopy::new(ordinal, GpuCopy::RING) {
                Ok(gpu) => Some(gpu),
                Err(error) => {
                    tracing::warn!(%error, "no CUDA copy stream: template caches load synchronously");
                    None
                }
            },
            _ => None,
        };
        Ok(Self {
            model,
            model_id,
            card,
            gpu_copy,
            controlnet_dir: None,
            controlnet_service: None,
            pre_encoded: None,
            ranks: None,
            preview,
        })
    }

    /// Start `settings.ranks` elastic ranks on this model's transformer (read again from
    /// `dir`, one replica per rank) and measure their step costs. A node with ranks serves
    /// generations, edits (mask-aware on the ranks, template captures on the engine's own
    /// transformer) and fills; LoRAs would need every replica's weights patched, so the card
    /// stops announcing them.
    pub fn start_ranks(
        &mut self,
        dir: &Path,
        settings: &crate::ranks::ElasticSettings,
    ) -> Result<(), String> {
        let (device, kind) = self.model.transformer.device_kind();
        let token_pixels = self.card.geometry.token_pixels;
        let text_tokens = self.model.text_encoder.max_tokens().max(1);
        let ranks = crate::ranks::ElasticRanks::start(
            dir,
            settings,
            device,
            kind,
            token_pixels,
            text_tokens,
        )?;
        let features = &mut self.card.features;
        features.lora = false;
        // Ranks step with velocities they return; a step-caching decision lives on the state.
        features.step_cache = false;
        features.first_block_cache = false;
        self.ranks = Some(ranks);
        Ok(())
    }

    /// Announce at most `max_pixels` of model resolution (a flexible-resolution model only).
    pub fn limit_model_pixels(&mut self, max_pixels: u64) {
        if let Resolution::Scaled { .. } = self.card.geometry.resolution {
            self.card.geometry.resolution = Resolution::Scaled { max_pixels };
        }
    }

    pub fn pipeline(&self) -> FluxPipeline<'_> {
        self.model.pipeline()
    }

    /// Take the text encoder for the prompt stage and leave a stand-in that serves what the
    /// stage encoded ([`crate::prompt_stage::PreEncodedHandle`]).
    pub fn split_text_encoder(&mut self) -> Box<dyn TextEncoder> {
        let max_tokens = self.model.text_encoder.max_tokens();
        let (stand_in, handle) = crate::prompt_stage::PreEncodedHandle::stand_in(max_tokens);
        self.pre_encoded = Some(handle);
        std::mem::replace(&mut self.model.text_encoder, stand_in)
    }
}

/// Largest model resolution (pixels) a model of a flexible resolution runs at by default:
/// 2048x2048, beyond which FLUX.1 was not trained.
pub const DEFAULT_MAX_MODEL_PIXELS: u64 = 2048 * 2048;

/// What the denoiser announces about `model` ([`ModelCard`]): the tiny model runs at the one
/// resolution it was trained at (`default_size`, 64 when unset); FLUX.1 at the input's own
/// size in whole 16-pixel tokens (default 1024x1024, as diffusers'). ControlNets are added per
/// heartbeat, as workers come and go.
pub fn announce(model: &LoadedModel, id: &str, default_size: Option<i64>) -> ModelCard {
    let tiny = model.index.class_of("vae").ok() == Some(diffmesh_model::tiny::codec::CLASS_NAME);
    let size = default_size.unwrap_or(if tiny { 64 } else { 1024 }).max(1) as u32;
    // One token is a 2x2 patch of latent pixels.
    let token_pixels = (model.codec.downscale_factor() * 2).max(1) as u32;
    let resolution = if tiny {
        Resolution::Fixed {
            width: size,
            height: size,
        }
    } else {
        Resolution::Scaled {
            max_pixels: DEFAULT_MAX_MODEL_PIXELS,
        }
    };
    ModelCard {
        id: id.to_string(),
        family: if tiny { "tiny" } else { "flux.1" }.into(),
        pipeline: model.index.pipeline_class.clone(),
        geometry: ModelGeometry {
            token_pixels,
            resolution,
            default_width: size,
            default_height: size,
        },
        features: ModelFeatures {
            edit: true,
            fill: model.index.pipeline_class == FILL_PIPELINE,
            controlnet: false,
            lora: true,
            true_cfg: true,
            guidance_embeds: model.transformer.cfg.guidance_embeds,
            max_sequence_length: model.text_encoder.max_tokens().max(0) as u32,
            multi_controlnet: false,
            step_cache: true,
            first_block_cache: true,
        },
    }
}

/// Model-resolution inputs of an edit, fetched from the object store by the NATS side.
#[derive(Debug, Default, Clone)]
pub struct EditInputs {
    /// RGB u8, `height * width * 3`, row-major.
    pub template_rgb: Vec<u8>,
    /// One u8 per packed image token (1 = repaint), row-major over the token grid.
    pub token_mask: Vec<u8>,
}

/// Resolution a job runs at: what the codec prepared, else the model's announced default.
pub fn job_resolution(job: &DenoiseJob, model: &EngineModel) -> (i64, i64) {
    job_resolution_of(job, &model.card)
}

/// Resolution a job runs at on a model announced as `card`.
pub fn job_resolution_of(job: &DenoiseJob, card: &ModelCard) -> (i64, i64) {
    let g = &card.geometry;
    let or_default =
        |prepared: u32, default: u32| i64::from(if prepared > 0 { prepared } else { default });
    (
        or_default(job.inputs.model_height, g.default_height),
        or_default(job.inputs.model_width, g.default_width),
    )
}

/// The stepper requests of a job: one per image, image `i` seeded with `seed + i`.
pub fn step_requests(
    job: &DenoiseJob,
    edit: Option<&EditInputs>,
    model: &EngineModel,
) -> Result<Vec<StepRequest>, ModelError> {
    let p = &job.params;
    if p.n == 0 {
        return Err(ModelError::input("params.n", "must be at least 1"));
    }
    let (height, width) = job_resolution(job, model);
    let mut out = Vec::with_capacity(p.n as usize);
    for i in 0..p.n {
        let edit = match job.kind {
            JobKind::Generate => None,
            JobKind::Capture => {
                return Err(ModelError::input(
                    "kind",
                    "a capture job is not a denoising request",
                ))
            }
            JobKind::Edit => {
                let e = edit.ok_or_else(|| {
                    ModelError::input(
                        "inputs.image_key",
                        "an edit needs the prepared template and token mask",
                    )
                })?;
                Some(EditSpec {
                    template: rgb_to_tensor(&e.template_rgb, height, width, "inputs.image_key")?,
                    token_mask: Tensor::from_slice(&e.token_mask),
                    strength: p.strength.map_or(1.0, f64::from),
                    // Edits of a registered template follow its noise outside the mask (what
                    // its cache recorded), with or without the cache.
                    template_seed: job.template.as_ref().map(|t| t.seed),
                })
            }
        };
        out.push(StepRequest {
            true_cfg: p.true_cfg.as_ref().map(|c| TrueCfg {
                negative_prompt: c.negative_prompt.clone(),
                scale: f64::from(c.scale),
            }),
            control: None,
            prompt: p.prompt.clone(),
            seed: p.seed.wrapping_add(i as u64),
            height,
            width,
            steps: p.num_inference_steps as usize,
            guidance_scale: p.guidance_scale as f64,
            edit,
            cache_threshold: p.cache_threshold.map(f64::from),
            cache_method: step_cache_method(p.cache_method),
        });
    }
    Ok(out)
}

/// The model's step cache for a job's `cache_method` (absent: TeaCache).
fn step_cache_method(method: Option<StepCacheMethod>) -> CacheMethod {
    match method {
        None | Some(StepCacheMethod::Teacache) => CacheMethod::TeaCache,
        Some(StepCacheMethod::FirstBlock) => CacheMethod::FirstBlock,
    }
}

/// Give each request of a steered generation its control image (`params.controlnet`, with the
/// codec's model-resolution pixels `control_rgb`). A Flux model is steered by one ControlNet.
pub fn apply_control(
    requests: &mut [StepRequest],
    job: &DenoiseJob,
    control_rgb: &[Vec<u8>],
    model: &EngineModel,
) -> Result<(), ModelError> {
    if !job.params.extra_controlnets.is_empty() {
        return Err(ModelError::input(
            "params.extra_controlnets",
            "a Flux model is steered by one ControlNet per request",
        ));
    }
    let Some(control) = &job.params.controlnet else {
        return Ok(());
    };
    if job.kind != JobKind::Generate {
        return Err(ModelError::input(
            "params.controlnet",
            "only generations take a ControlNet",
        ));
    }
    let rgb = control_rgb.first().ok_or_else(|| {
        ModelError::input(
            "inputs.control_image_key",
            "a ControlNet needs its control image",
        )
    })?;
    let (height, width) = job_resolution(job, model);
    for r in requests {
        r.control = Some(ControlInput {
            image: rgb_to_tensor(rgb, height, width, "inputs.control_image_key")?,
            scale: f64::from(control.scale),
        });
    }
    Ok(())
}

/// Row-major RGB bytes -> `[1, 3, H, W]` in [-1, 1].
pub fn rgb_to_tensor(
    rgb: &[u8],
    height: i64,
    width: i64,
    field: &str,
) -> Result<Tensor, ModelError> {
    Ok(rgb_planes(rgb, height, width, field)?
        .f_div_scalar(127.5)?
        .f_sub_scalar(1.0)?
        .f_unsqueeze(0)?)
}

/// Row-major RGB bytes -> `[1, 3, H, W]` in [0, 1] (a UNet ControlNet's control image: diffusers'
/// control image processor does not normalise).
pub fn rgb_to_unit_tensor(
    rgb: &[u8],
    height: i64,
    width: i64,
    field: &str,
) -> Result<Tensor, ModelError> {
    Ok(rgb_planes(rgb, height, width, field)?
        .f_div_scalar(255.0)?
        .f_unsqueeze(0)?)
}

/// `[3, H, W]` float bytes; an error names `field` when the length is not `H * W * 3`.
fn rgb_planes(rgb: &[u8], height: i64, width: i64, field: &str) -> Result<Tensor, ModelError> {
    let expect = (height * width * 3) as usize;
    if rgb.len() != expect {
        return Err(ModelError::input(
            field,
            format!(
                "{} bytes, expected {height}x{width}x3 = {expect}",
                rgb.len()
            ),
        ));
    }
    Ok(Tensor::from_slice(rgb)
        .f_view([height, width, 3])?
        .f_permute([2, 0, 1])?
        .f_to_kind(Kind::Float)?)
}

/// `[1, 3, H, W]` in [-1, 1] (clamped) -> row-major RGB bytes.
pub fn tensor_to_rgb(image: &Tensor) -> Result<Vec<u8>, ModelError> {
    let rgb = diffmesh_model::tiny::model::images_to_rgb(image)?;
    rgb.into_iter()
        .next()
        .ok_or_else(|| ModelError::input("image", "empty batch"))
}

/// The prompts preparing `job` encodes (what the prompt stage encodes ahead): the template's
/// for a capture, else the job's and, with true CFG, its negative prompt.
pub fn job_prompts(job: &DenoiseJob) -> Vec<String> {
    if job.kind == JobKind::Capture {
        // The quality guard's typical edit asks for other content than the template's
        // caption (cheap to encode; the guard may be off).
        let probe = std::iter::once(crate::engine::QUALITY_PROBE_PROMPT.to_string());
        return job
            .template
            .iter()
            .map(|t| t.prompt.clone())
            .chain(probe)
            .collect();
    }
    let mut prompts = vec![job.params.prompt.clone()];
    if let Some(cfg) = &job.params.true_cfg {
        prompts.push(cfg.negative_prompt.clone());
    }
    prompts
}

/// The capture pass of a `Capture` job: its template (the prepared image) under the template's
/// prompt, seed, steps and guidance.
pub fn capture_state(
    job: &DenoiseJob,
    edit: Option<&EditInputs>,
    model: &EngineModel,
) -> Result<DenoiseState, ModelError> {
    let t = job
        .template
        .as_ref()
        .ok_or_else(|| ModelError::input("template", "a capture job names its template"))?;
    let e = edit.ok_or_else(|| {
        ModelError::input(
            "inputs.image_key",
            "a capture job needs the prepared template",
        )
    })?;
    let (height, width) = job_resolution(job, model);
    let spec = TemplateSpec {
        template: rgb_to_tensor(&e.template_rgb, height, width, "inputs.image_key")?,
        prompt: t.prompt.clone(),
        seed: t.seed,
        steps: t.steps as usize,
        guidance_scale: t.guidance_scale as f64,
    };
    template::capture_state(&model.pipeline(), &spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rgb_round_trip() {
        let rgb: Vec<u8> = (0..4 * 2 * 3).map(|i| (i * 10) as u8).collect();
        let t = rgb_to_tensor(&rgb, 4, 2, "image").unwrap();
        assert_eq!(t.size(), vec![1, 3, 4, 2]);
        assert_eq!(tensor_to_rgb(&t).unwrap(), rgb);
        let err = rgb_to_tensor(&rgb, 4, 4, "inputs.image_key")
            .unwrap_err()
            .to_string();
        assert!(err.contains("inputs.image_key"), "{err}");
    }
}
