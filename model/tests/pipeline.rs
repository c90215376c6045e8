//! Pipeline behaviour with random tiny components (CPU, fp32): inpainting keeps unmasked latents on
//! the re-noised template at every step and ends on the template; seeds reproduce; a batch equals
//! its requests run alone; guidance inputs are used; a diffusers-format directory loads by class
//! name and unsupported classes are reported.
use diffmesh_model::components::{LatentCodec, TextEmbeddings, TextEncoder};
use diffmesh_model::flux::{FluxConfig, FluxTransformer};
use diffmesh_model::model_dir::LoadedModel;
use diffmesh_model::noise_scheduler::{
    FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
};
use diffmesh_model::packing::{pack_latents, token_mask};
use diffmesh_model::pipeline::noise::batch_noise;
use diffmesh_model::pipeline::{
    inpaint, text_to_image, FluxPipeline, GenerateOptions, GenerationRequest, InpaintInputs,
    StepEvent,
};
use diffmesh_model::vae::{AutoencoderKL, AutoencoderKLConfig};
use diffmesh_model::{ModelError, Result};
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

/// Tests draw weights and inputs from torch's global generator, re-seeding it: they take
/// turns, so one test's draws never interleave with another thread's.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

/// Deterministic per-prompt embeddings: each prompt's rows depend only on its own bytes.
struct HashTextEncoder {
    tokens: i64,
    dim: i64,
    pooled: i64,
}

impl TextEncoder for HashTextEncoder {
    fn encode(&self, prompts: &[String]) -> Result<TextEmbeddings> {
        let rows = |p: &String, n: i64| -> Tensor {
            let seed = p.bytes().fold(1469598103934665603u64, |h, b| {
                (h ^ b as u64).wrapping_mul(1099511628211)
            });
            let v = diffmesh_model::pipeline::noise::seeded_normal(seed, n as usize);
            Tensor::from_slice(&v)
        };
        let hidden: Vec<Tensor> = prompts
            .iter()
            .map(|p| rows(p, self.tokens * self.dim).view([self.tokens, self.dim]))
            .collect();
        let pooled: Vec<Tensor> = prompts
            .iter()
            .map(|p| rows(p, self.pooled).view([self.pooled]))
            .collect();
        Ok(TextEmbeddings {
            hidden: Tensor::stack(&hidden, 0),
            pooled: Tensor::stack(&pooled, 0),
        })
    }

    fn max_tokens(&self) -> i64 {
        self.tokens
    }
}

fn flux_config(guidance_embeds: bool) -> FluxConfig {
    FluxConfig {
        patch_size: 1,
        in_channels: 16,
        out_channels: None,
        num_layers: 1,
        num_single_layers: 1,
        attention_head_dim: 16,
        num_attention_heads: 2,
        joint_attention_dim: 24,
        pooled_projection_dim: 12,
        guidance_embeds,
        axes_dims_rope: vec![4, 6, 6],
    }
}

fn vae_config() -> AutoencoderKLConfig {
    AutoencoderKLConfig {
        block_out_channels: vec![16, 32],
        down_block_types: vec!["DownEncoderBlock2D".into(); 2],
        up_block_types: vec!["UpDecoderBlock2D".into(); 2],
        norm_num_groups: 8,
        latent_channels: 4,
        scaling_factor: 0.5,
        shift_factor: Some(0.1),
        ..Default::default()
    }
}

fn scheduler() -> FlowMatchEulerDiscreteScheduler {
    let cfg = FlowMatchEulerDiscreteSchedulerConfig {
        shift: 3.0,
        use_dynamic_shifting: true,
        ..Default::default()
    };
    FlowMatchEulerDiscreteScheduler::new(cfg).unwrap()
}

struct Parts {
    _vs: nn::VarStore,
    transformer: FluxTransformer,
    vae: AutoencoderKL,
    text: HashTextEncoder,
    scheduler: FlowMatchEulerDiscreteScheduler,
}

impl Parts {
    fn new(guidance_embeds: bool) -> Self {
        tch::manual_seed(1);
        let vs = nn::VarStore::new(Device::Cpu);
        let transformer =
            FluxTransformer::new(&(vs.root() / "t"), flux_config(guidance_embeds)).unwrap();
        let vae = AutoencoderKL::new(&(vs.root() / "v"), vae_config()).unwrap();
        Parts {
            _vs: vs,
            transformer,
            vae,
            text: HashTextEncoder {
                tokens: 5,
                dim: 24,
                pooled: 12,
            },
            scheduler: scheduler(),
        }
    }

    fn pipeline(&self) -> FluxPipeline<'_> {
        FluxPipeline {
            transformer: &self.transformer,
            text_encoder: &self.text,
            codec: &self.vae,
            scheduler: &self.scheduler,
        }
    }
}

fn opts(steps: usize) -> GenerateOptions {
    GenerateOptions {
        height: 16,
        width: 24,
        steps,
        guidance_scale: 3.5,
        ..Default::default()
    }
}

fn req(prompt: &str, seed: u64) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.into(),
        seed,
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn inpaint_blends_unmasked_latents_every_step() {
    let _turn = turn();
    let parts = Parts::new(true);
    let p = parts.pipeline();
    let o = opts(4);
    let requests = [req("a red cube", 11), req("a blue ball", 12)];
    let templates = Tensor::rand([2, 3, 16, 24], CPU) * 2.0 - 1.0;
    // Request 0 repaints a 5x6-pixel box, request 1 a single pixel: token masks by any-pixel rule.
    let masks = Tensor::zeros([2, 1, 16, 24], CPU);
    let _ = masks.get(0).narrow(1, 3, 5).narrow(2, 7, 6).fill_(1.0);
    let _ = masks.get(1).narrow(1, 9, 1).narrow(2, 22, 1).fill_(1.0);

    // What the blend must produce, computed independently from the public pieces.
    let template_latents = tch::no_grad(|| {
        pack_latents(&LatentCodec::encode(&parts.vae, &templates).unwrap()).unwrap()
    });
    let noise =
        pack_latents(&batch_noise(&[11, 12], &[4, 8, 12], Device::Cpu, Kind::Float).unwrap())
            .unwrap();
    let tokens = token_mask(&masks, 4).unwrap();
    assert_eq!(
        tokens.sum(Kind::Int64).int64_value(&[]),
        6 + 1,
        "box covers 2x3 tokens, pixel 1 token"
    );
    let keep = tokens
        .logical_not()
        .unsqueeze(-1)
        .expand([2, 24, 16], false);
    let schedule = parts.scheduler.flux_schedule(4, 24).unwrap();

    let mut seen = Vec::new();
    let mut observer = |e: &StepEvent<'_>| -> Result<()> {
        let want = if e.index + 1 < schedule.len() {
            schedule.scale_noise(&template_latents, e.index + 1, &noise)?
        } else {
            template_latents.shallow_clone()
        };
        let unmasked = max_diff(&e.latents.masked_select(&keep), &want.masked_select(&keep));
        let masked = max_diff(
            &e.latents.masked_select(&keep.logical_not()),
            &want.masked_select(&keep.logical_not()),
        );
        seen.push((e.index, unmasked, masked));
        Ok(())
    };
    let inputs = InpaintInputs {
        requests: &requests,
        templates: &templates,
        masks: &masks,
        strength: 1.0,
    };
    let out = inpaint(&p, &inputs, &o, Some(&mut observer)).unwrap();

    assert_eq!(
        seen.iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    for (i, unmasked, masked) in &seen {
        assert_eq!(
            *unmasked, 0.0,
            "step {i}: unmasked latents differ from the re-noised template"
        );
        assert!(
            *masked > 1e-3,
            "step {i}: masked latents were not denoised ({masked})"
        );
    }
    assert_eq!(
        max_diff(
            &out.latents.masked_select(&keep),
            &template_latents.masked_select(&keep)
        ),
        0.0
    );
    assert_eq!(out.token_mask, tokens);
    // Composited pixels outside the mask are the template's, inside they are the model's.
    let px = masks.ge(0.5).expand([2, 3, 16, 24], false);
    assert_eq!(
        max_diff(
            &out.images.masked_select(&px.logical_not()),
            &templates.masked_select(&px.logical_not())
        ),
        0.0
    );
    assert_eq!(
        max_diff(
            &out.images.masked_select(&px),
            &out.decoded.masked_select(&px)
        ),
        0.0
    );

    // A lower strength starts later in the schedule: fewer steps observed.
    let mut count = 0;
    let mut counter = |_: &StepEvent<'_>| -> Result<()> {
        count += 1;
        Ok(())
    };
    let half = InpaintInputs {
        strength: 0.5,
        ..inputs
    };
    inpaint(&p, &half, &o, Some(&mut counter)).unwrap();
    assert_eq!(count, 2);
}

#[test]
fn seeds_reproduce_and_batches_match_single_runs() {
    let _turn = turn();
    let parts = Parts::new(true);
    let p = parts.pipeline();
    let o = opts(3);
    let a = text_to_image(&p, &[req("a red cube", 1)], &o, None).unwrap();
    let a2 = text_to_image(&p, &[req("a red cube", 1)], &o, None).unwrap();
    assert_eq!(
        max_diff(&a.images, &a2.images),
        0.0,
        "same seed must give the same image"
    );
    let b = text_to_image(&p, &[req("a blue ball", 2)], &o, None).unwrap();
    let both = text_to_image(&p, &[req("a red cube", 1), req("a blue ball", 2)], &o, None).unwrap();
    let (d0, d1) = (
        max_diff(&both.images.get(0), &a.images.get(0)),
        max_diff(&both.images.get(1), &b.images.get(0)),
    );
    println!("batch vs single max abs diff: {d0:e}, {d1:e}");
    assert!(
        d0 <= 1e-5 && d1 <= 1e-5,
        "batch rows differ from single runs: {d0}, {d1}"
    );
    let other_seed = text_to_image(&p, &[req("a red cube", 3)], &o, None).unwrap();
    assert!(max_diff(&other_seed.images, &a.images) > 1e-3);
    assert_eq!(a.images.size(), vec![1, 3, 16, 24]);
    assert_eq!(a.latents.size(), vec![1, 24, 16]);
}

#[test]
fn guidance_and_true_cfg_change_the_output() {
    let _turn = turn();
    let parts = Parts::new(true);
    let p = parts.pipeline();
    let r = [req("a red cube", 5)];
    let base = text_to_image(&p, &r, &opts(2), None).unwrap();
    let g = GenerateOptions {
        guidance_scale: 7.0,
        ..opts(2)
    };
    assert!(
        max_diff(
            &text_to_image(&p, &r, &g, None).unwrap().latents,
            &base.latents
        ) > 1e-4
    );
    let neg = GenerateOptions {
        negative_prompt: Some("blurry".into()),
        true_cfg_scale: 1.0,
        ..opts(2)
    };
    // true_cfg_scale 1 disables true CFG: identical to no negative prompt.
    assert_eq!(
        max_diff(
            &text_to_image(&p, &r, &neg, None).unwrap().latents,
            &base.latents
        ),
        0.0
    );
    let cfg = GenerateOptions {
        true_cfg_scale: 4.0,
        ..neg
    };
    assert!(
        max_diff(
            &text_to_image(&p, &r, &cfg, None).unwrap().latents,
            &base.latents
        ) > 1e-4
    );

    // Without guidance embeddings the guidance scale is ignored.
    let plain = Parts::new(false);
    let pp = plain.pipeline();
    let x = text_to_image(&pp, &r, &opts(2), None).unwrap();
    let y = text_to_image(&pp, &r, &g, None).unwrap();
    assert_eq!(max_diff(&x.latents, &y.latents), 0.0);
}

#[test]
fn bad_requests_name_the_field() {
    let _turn = turn();
    let parts = Parts::new(false);
    let p = parts.pipeline();
    let err = |o: GenerateOptions| {
        text_to_image(&p, &[req("x", 1)], &o, None)
            .unwrap_err()
            .to_string()
    };
    assert!(err(GenerateOptions {
        height: 18,
        ..opts(2)
    })
    .contains("height"));
    assert!(err(GenerateOptions {
        width: 0,
        ..opts(2)
    })
    .contains("width"));
    assert!(err(GenerateOptions {
        steps: 0,
        ..opts(2)
    })
    .contains("steps"));
    let t = Tensor::zeros([1, 3, 16, 24], CPU);
    let m = Tensor::zeros([1, 1, 16, 16], CPU);
    let requests = [req("x", 1)];
    let inputs = InpaintInputs {
        requests: &requests,
        templates: &t,
        masks: &m,
        strength: 1.0,
    };
    assert!(inpaint(&p, &inputs, &opts(2), None)
        .unwrap_err()
        .to_string()
        .contains("masks"));
}

fn write_json(path: &Path, v: serde_json::Value) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn model_dir_loads_by_class_and_reports_unsupported() {
    let _turn = turn();
    use diffmesh_model::tiny::{
        text_encoder, DiffmeshTinyTextEncoder, TinyTextEncoderConfig, WordTokenizer,
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pipeline-model-dir");
    let _ = std::fs::remove_dir_all(&dir);
    tch::manual_seed(2);

    let fc = flux_config(false);
    let vs = nn::VarStore::new(Device::Cpu);
    FluxTransformer::new(&vs.root(), fc.clone()).unwrap();
    let mut tj = serde_json::to_value(&fc).unwrap();
    tj["_class_name"] = "FluxTransformer2DModel".into();
    write_json(&dir.join("transformer/config.json"), tj);
    diffmesh_model::weights::save(
        &vs,
        &dir.join("transformer/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();

    let vs = nn::VarStore::new(Device::Cpu);
    AutoencoderKL::new(&vs.root(), vae_config()).unwrap();
    write_json(
        &dir.join("vae/config.json"),
        serde_json::json!({"_class_name": "AutoencoderKL", "block_out_channels": [16, 32],
            "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
            "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"], "norm_num_groups": 8,
            "latent_channels": 4, "scaling_factor": 0.5, "shift_factor": 0.1}),
    );
    diffmesh_model::weights::save(&vs, &dir.join("vae/diffusion_pytorch_model.safetensors"))
        .unwrap();

    let tok = WordTokenizer::for_generator(8);
    let tc = TinyTextEncoderConfig {
        class_name: text_encoder::CLASS_NAME.into(),
        vocab_size: tok.vocab_size(),
        max_tokens: 8,
        hidden_size: 24,
        num_layers: 1,
        num_heads: 2,
        pooled_projection_dim: 12,
    };
    let vs = nn::VarStore::new(Device::Cpu);
    DiffmeshTinyTextEncoder::new(&vs.root(), tc.clone(), tok.clone()).unwrap();
    text_encoder::save_configs(&dir, &tc, &tok).unwrap();
    diffmesh_model::weights::save(&vs, &dir.join("text_encoder/model.safetensors")).unwrap();

    write_json(
        &dir.join("scheduler/scheduler_config.json"),
        serde_json::json!({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
            "use_dynamic_shifting": true}),
    );
    let mut index = serde_json::json!({
        "_class_name": "FluxPipeline", "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["diffmesh", text_encoder::CLASS_NAME],
        "tokenizer": ["diffmesh", "DiffmeshWordTokenizer"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "image_encoder": [null, null]
    });
    write_json(&dir.join("model_index.json"), index.clone());

    let model = LoadedModel::load(&dir, Device::Cpu, Kind::Float).unwrap();
    assert_eq!(model.index.pipeline_class, "FluxPipeline");
    assert_eq!(model.codec.latent_channels(), 4);
    assert_eq!(model.scheduler.config.shift, 3.0);
    let out = text_to_image(&model.pipeline(), &[req("red circle", 3)], &opts(2), None).unwrap();
    assert_eq!(out.images.size(), vec![1, 3, 16, 24]);

    // Classes diffmesh does not implement (SD3's projected CLIP, an IP-Adapter's image encoder)
    // are all named before any weight is read.
    index["text_encoder"] = serde_json::json!(["transformers", "CLIPTextModelWithProjection"]);
    index["image_encoder"] = serde_json::json!(["transformers", "CLIPVisionModelWithProjection"]);
    write_json(&dir.join("model_index.json"), index);
    match LoadedModel::load(&dir, Device::Cpu, Kind::Float) {
        Err(ModelError::Unsupported {
            component,
            class,
            reason,
        }) => {
            assert_eq!(
                (component.as_str(), class.as_str()),
                ("image_encoder", "CLIPVisionModelWithProjection")
            );
            assert!(
                reason.contains("text_encoder (CLIPTextModelWithProjection)"),
                "{reason}"
            );
        }
        other => panic!(
            "expected Unsupported, got {other:?}",
            other = other.map(|_| ())
        ),
    }
}
