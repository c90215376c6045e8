//! A UNet-family model as the engine holds it, what its heartbeats announce, and the
//! conversions of wire jobs into Stable Diffusion states, of captures into template caches of
//! the tiers' block codec and back.
use crate::model::{job_resolution_of, rgb_to_tensor, rgb_to_unit_tensor, EditInputs};
use crate::templates::TemplateEntry;
use diffmesh_model::components::LatentCodec;
use diffmesh_model::flux::kv_codec::CacheDtype;
use diffmesh_model::pipeline::noise::seeded_noise;
use diffmesh_model::stable_diffusion::control::SdControl;
use diffmesh_model::stable_diffusion::inpaint::InpaintInputs;
use diffmesh_model::stable_diffusion::stepper::SdState;
use diffmesh_model::stable_diffusion::template::{SdTemplate, TemplateSteps};
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::unet::cache_codec::encode_step;
use diffmesh_model::ModelError;
use diffmesh_shared::wire::messages::{DenoiseJob, JobKind, TemplateRef};
use diffmesh_shared::wire::models::{ModelCard, ModelFeatures, ModelGeometry, Resolution};
use diffmesh_shared::wire::templates::{pack_step, CacheMeta};
use std::path::Path;
use std::sync::Arc;

/// A loaded UNet pipeline plus what the engine announces about it.
pub struct UnetModel {
    pub pipeline: SdPipeline,
    pub model_id: String,
    pub card: ModelCard,
    /// Maps latents to preview pixels (`crate::previews`); None: previews are off.
    pub preview: Option<diffmesh_model::preview::LatentPreview>,
    /// Folder of named ControlNets (`ControlNetModel`) generations may name (`--controlnet-dir`).
    pub controlnet_dir: Option<std::path::PathBuf>,
    /// ControlNet workers serving UNet ControlNets (`--controlnet-remote sync`).
    pub controlnet_service: Option<crate::controlnet_service::RemoteControlNets>,
}

impl UnetModel {
    pub fn load(
        dir: &Path,
        device: Device,
        kind: Kind,
        model_id: String,
        default_size: Option<i64>,
    ) -> Result<Self, ModelError> {
        let pipeline = SdPipeline::load(dir, device, kind)?;
        let card = announce(&pipeline, &model_id, default_size);
        let preview = crate::previews::fit(&pipeline.vae, device);
        Ok(Self {
            pipeline,
            model_id,
            card,
            preview,
            controlnet_dir: None,
            controlnet_service: None,
        })
    }
}

/// What the denoiser announces about a UNet pipeline: any size up to `max_pixels` in whole
/// tokens, a token being the pixels one latent pixel of the UNet's coarsest level covers (so a
/// token mask is exact at every level, and every size the codec rounds to runs); the default
/// size is diffusers' (`unet.sample_size` latents), or `default_size`. Template edits and
/// plain inpainting run, LoRAs are patched in (diffusers' and kohya's UNet files), generations
/// are steered by the ControlNets of `--controlnet-dir` (the heartbeat sets `controlnet` from
/// what it serves); fills are not served for this family.
pub fn announce(pipeline: &SdPipeline, id: &str, default_size: Option<i64>) -> ModelCard {
    let factor = pipeline.vae.downscale_factor().max(1);
    let token_pixels = u32::try_from(pipeline.token_pixels()).unwrap_or(u32::MAX);
    let sample = pipeline
        .unet
        .config
        .sample_size
        .as_ref()
        .and_then(|v| v.as_i64().or_else(|| v.get(0).and_then(|s| s.as_i64())))
        .unwrap_or(64);
    let size = default_size.unwrap_or(sample * factor).max(1) as u32;
    ModelCard {
        id: id.to_string(),
        family: if pipeline.is_xl() { "sdxl" } else { "sd" }.into(),
        pipeline: pipeline.class.clone(),
        geometry: ModelGeometry {
            token_pixels,
            resolution: Resolution::Scaled {
                max_pixels: crate::model::DEFAULT_MAX_MODEL_PIXELS,
            },
            default_width: size,
            default_height: size,
        },
        features: ModelFeatures {
            edit: true,
            fill: false,
            controlnet: false,
            lora: true,
            true_cfg: false,
            guidance_embeds: false,
            max_sequence_length: u32::try_from(pipeline.max_tokens()).unwrap_or(u32::MAX),
            multi_controlnet: true,
            step_cache: false,
            first_block_cache: false,
        },
    }
}

/// Template UNet rows of a capture with `guidance_scale` (both branches when guided).
pub(super) fn template_rows(t: &TemplateRef) -> i64 {
    if t.guidance_scale > 1.0 {
        2
    } else {
        1
    }
}

/// The pixel mask `[1, 1, H, W]` (1 = repaint) of a token mask over the model resolution.
fn pixel_mask(
    token_mask: &[u8],
    job: &DenoiseJob,
    card: &ModelCard,
    height: i64,
    width: i64,
) -> Result<Tensor, ModelError> {
    let t = i64::from(card.geometry.token_pixels.max(1));
    let (rows, cols) = (height / t, width / t);
    if token_mask.len() as i64 != rows * cols || rows * t != height || cols * t != width {
        return Err(ModelError::input(
            "inputs.token_mask_key",
            format!(
                "{} tokens for {height}x{width} pixels in {t}-pixel tokens (job {})",
                token_mask.len(),
                job.job_id
            ),
        ));
    }
    Ok(Tensor::from_slice(token_mask)
        .f_to_kind(Kind::Float)?
        .f_view([1, 1, rows, cols])?
        .f_upsample_nearest2d([height, width], None, None)?)
}

/// The prompt and negative prompt a job's states condition on: a capture's (`capture`: the
/// engine runs it as one, as it does recaptures of edits) are its template's, with no negative;
/// any other job's are its own.
pub fn conditioning_prompts(job: &DenoiseJob, capture: bool) -> (String, Option<String>) {
    match (capture, &job.template) {
        (true, Some(t)) => (t.prompt.clone(), None),
        _ => (
            job.params.prompt.clone(),
            job.params
                .true_cfg
                .as_ref()
                .map(|c| c.negative_prompt.clone()),
        ),
    }
}

/// The states of a job's images (image `i` seeded with `seed + i`): a generation, steered by
/// its ControlNets when it names any (`control_rgb`: their control images at the model
/// resolution, in `params.controlnets()` order); an edit, as SD inpainting at the job's strength (1 but for variations) whose latents carry the template's
/// noise outside the mask when it edits a registered template; mask-aware on `template` (its
/// decoded cache) when given.
pub fn job_states(
    job: &DenoiseJob,
    edit: Option<&EditInputs>,
    template: Option<&Arc<dyn TemplateSteps>>,
    control_rgb: &[Vec<u8>],
    model: &UnetModel,
) -> Result<Vec<SdState>, ModelError> {
    let p = &job.params;
    if p.n == 0 {
        return Err(ModelError::input("params.n", "must be at least 1"));
    }
    if p.cache_threshold.is_some() {
        // Refused rather than ignored: the request asked for a trade it would not get.
        return Err(ModelError::input(
            "params.cache_threshold",
            "step caching runs on Flux models; this UNet model computes every step",
        ));
    }
    let (height, width) = job_resolution_of(job, &model.card);
    let names = p.controlnets().count();
    if names > 0 && job.kind != JobKind::Generate {
        return Err(ModelError::input(
            "params.controlnet",
            "only generations are steered by a ControlNet",
        ));
    }
    if control_rgb.len() != names {
        return Err(ModelError::input(
            "inputs.control_image_key",
            format!(
                "{names} ControlNets and {} control images",
                control_rgb.len()
            ),
        ));
    }
    let controls = p
        .controlnets()
        .zip(control_rgb)
        .map(|(c, rgb)| {
            let image = rgb_to_unit_tensor(rgb, height, width, "inputs.control_image_key")?;
            Ok((image, f64::from(c.scale)))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let (prompt, negative_prompt) = conditioning_prompts(job, false);
    let request = SdRequest {
        prompt,
        negative_prompt,
        height,
        width,
        steps: p.num_inference_steps as usize,
        guidance_scale: f64::from(p.guidance_scale),
        scheduler: None,
    };
    let pipe = &model.pipeline;
    let shape = latent_shape(pipe, height, width);
    let inpaint = match job.kind {
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
            let image = rgb_to_tensor(&e.template_rgb, height, width, "inputs.image_key")?;
            let mask = pixel_mask(&e.token_mask, job, &model.card, height, width)?;
            Some((image, mask))
        }
    };
    let (device, _) = pipe.unet.device_kind();
    let template_noise = match (&inpaint, &job.template) {
        (Some(_), Some(t)) => Some(seeded_noise(t.seed, &shape, device, Kind::Float)?),
        _ => None,
    };
    let mut states = Vec::with_capacity(p.n as usize);
    for i in 0..p.n {
        let own = seeded_noise(
            p.seed.wrapping_add(u64::from(i)),
            &shape,
            device,
            Kind::Float,
        )?;
        let state = match &inpaint {
            None => {
                let mut state = pipe.prepare(&request, &own, None)?;
                if !controls.is_empty() {
                    let steer = controls
                        .iter()
                        .map(|(image, scale)| SdControl {
                            image: image.shallow_clone(),
                            scale: *scale,
                        })
                        .collect();
                    pipe.steer(&mut state, steer)?;
                }
                state
            }
            Some((image, mask)) => {
                let inputs = InpaintInputs {
                    image,
                    mask,
                    // Below 1 for variations (the whole image, noised part of the way).
                    strength: p.strength.map_or(1.0, f64::from),
                };
                // Outside the mask the template's noise, so the latents there follow its
                // capture's exactly (cache or not).
                let latents = match &template_noise {
                    Some(noise) => {
                        let m = mask.f_to_device(device)?.f_upsample_nearest2d(
                            [shape[2], shape[3]],
                            None,
                            None,
                        )?;
                        noise.f_add(&own.f_sub(noise)?.f_mul(&m)?)?
                    }
                    None => own,
                };
                match template {
                    Some(t) => pipe.prepare_edit(&request, &latents, &inputs, t.clone())?,
                    None => pipe.prepare(&request, &latents, Some(&inputs))?,
                }
            }
        };
        states.push(state);
    }
    Ok(states)
}

fn latent_shape(pipe: &SdPipeline, height: i64, width: i64) -> [i64; 4] {
    let f = pipe.vae.downscale_factor().max(1);
    [1, pipe.vae.latent_channels(), height / f, width / f]
}

/// The capture of a `Capture` job: its template image under the template's prompt, seed,
/// steps and guidance, run as inpainting at strength 1 that repaints nothing.
pub fn capture_state(
    job: &DenoiseJob,
    edit: Option<&EditInputs>,
    model: &UnetModel,
) -> Result<SdState, ModelError> {
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
    let (height, width) = job_resolution_of(job, &model.card);
    let pipe = &model.pipeline;
    let (prompt, negative_prompt) = conditioning_prompts(job, true);
    let request = SdRequest {
        prompt,
        negative_prompt,
        height,
        width,
        steps: t.steps as usize,
        guidance_scale: f64::from(t.guidance_scale),
        scheduler: None,
    };
    let (device, _) = pipe.unet.device_kind();
    let noise = seeded_noise(
        t.seed,
        &latent_shape(pipe, height, width),
        device,
        Kind::Float,
    )?;
    let image = rgb_to_tensor(&e.template_rgb, height, width, "inputs.image_key")?;
    pipe.prepare_capture(&request, &noise, &image, 1.0)
}

/// A finished capture as a cache of the tiers: one step entry per step, each the UNet blocks
/// of `encode_step` in `dtype`.
pub fn capture_entry(
    template: &SdTemplate,
    cache_key: String,
    dtype: CacheDtype,
) -> Result<TemplateEntry, String> {
    let mut steps = Vec::with_capacity(template.steps.len());
    let mut blocks = 0;
    for (s, cache) in template.steps.iter().enumerate() {
        let cache = cache
            .as_ref()
            .ok_or_else(|| format!("the capture recorded nothing at step {s}"))?;
        let encoded = encode_step(cache, dtype).map_err(|e| e.to_string())?;
        blocks = encoded.len();
        steps.push(bytes::Bytes::from(pack_step(&encoded)));
    }
    let meta = CacheMeta {
        cache_key,
        steps: steps.len() as u32,
        blocks: blocks as u32,
        bytes: steps.iter().map(|s| s.len() as u64).sum(),
        format: "raw".into(),
        dtype: dtype.as_str().into(),
    };
    TemplateEntry::new(meta, steps)
}
