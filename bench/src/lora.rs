//! `cargo xtask bench lora`: what LoRA serving costs and what bounded asynchronous loading (BAL)
//! gives up (Katz §6, §9.2).
//!
//! - [`switch_costs`]: one in-place switch of the weights (base -> LoRA, LoRA -> LoRA, LoRA ->
//!   base) for a random rank-r LoRA over every attention and MLP layer, against one denoising
//!   step of the same model, on the tiny model and the medium config.
//! - [`bal_quality`]: generations with a trained LoRA whose first K steps ran on the base model
//!   (what BAL does when the adapter arrives at the bound), against the LoRA from the first step:
//!   SSIM, how much of the LoRA's change to the image survives, and Katz's Fig. 12 measure, the
//!   cosine similarity of the latents with and without the LoRA at every step.
use anyhow::{ensure, Context, Result};
use diffmesh_denoiser::lora::LoraBlob;
use diffmesh_denoiser::model::{step_requests, EngineModel};
use diffmesh_model::flux::FluxTransformer;
use diffmesh_model::lora::{LoraAdapter, LoraDelta, LoraPatcher, OriginalsOn, WeightedLora};
use diffmesh_model::pipeline::stepper::DenoiseState;
use diffmesh_model::quality::ssim;
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use diffmesh_model::tiny::data::Split;
use diffmesh_shared::testing::generation_job;
use std::time::Instant;

/// Wait for the device's queued work (GPU ops return before they run).
fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Median seconds of `f` over `rounds` runs on `device`.
fn median_s(device: Device, rounds: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut t = Vec::with_capacity(rounds);
    for _ in 0..rounds.max(1) {
        sync(device);
        let start = Instant::now();
        f()?;
        sync(device);
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// A random rank-`rank` adapter over every attention and MLP linear of the blocks in `vs`.
pub fn random_adapter(vs: &nn::VarStore, id: &str, rank: i64) -> LoraAdapter {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let deltas = vars
        .into_iter()
        .filter(|(name, t)| {
            t.dim() == 2
                && name.contains("blocks.")
                && (name.contains(".attn.") || name.contains(".ff") || name.contains(".proj_"))
        })
        .filter_map(|(name, t)| {
            let module = name.strip_suffix(".weight")?.to_string();
            let (out, inp) = (t.size()[0], t.size()[1]);
            let opts = (Kind::Float, Device::Cpu);
            Some(LoraDelta {
                module,
                down: Tensor::randn([rank, inp], opts) / (inp as f64).sqrt(),
                up: Tensor::randn([out, rank], opts) * 0.01,
                scale: 1.0,
            })
        })
        .collect();
    LoraAdapter {
        id: id.into(),
        deltas,
    }
}

/// An adapter as a LoRA file (diffusers' keys, f32, no metadata: scale 1).
fn adapter_file(a: &LoraAdapter) -> Result<Vec<u8>> {
    let mut tensors = Vec::new();
    for d in &a.deltas {
        for (suffix, t) in [("lora_A", &d.down), ("lora_B", &d.up)] {
            let shape = t.size().iter().map(|&x| x as usize).collect();
            let values = Vec::<f32>::try_from(t.flatten(0, -1))?;
            tensors.push((
                format!("transformer.{}.{suffix}.weight", d.module),
                shape,
                values,
            ));
        }
    }
    Ok(diffmesh_shared::wire::lora::write_f32_safetensors(
        &tensors, None,
    )?)
}

/// One model's switch costs (seconds, medians).
#[derive(Debug, Clone, serde::Serialize)]
pub struct SwitchCosts {
    pub model: String,
    pub device: String,
    pub dtype: String,
    /// Where the patcher kept the base copies (`--originals`).
    pub originals: String,
    pub layers: usize,
    pub lora_bytes: u64,
    pub base_to_lora_s: f64,
    pub lora_to_lora_s: f64,
    pub lora_to_base_s: f64,
    /// Reading the adapter's tensors from its file bytes, which the engine does at each switch.
    pub read_s: f64,
    /// One full-compute denoising step at batch 1, for scale.
    pub step_s: f64,
}

/// Switch costs of a random rank-`rank` LoRA on `model` (its weights in `vs`); `step` runs one
/// forward of the model.
pub fn switch_costs(
    name: &str,
    vs: &nn::VarStore,
    originals: OriginalsOn,
    rank: i64,
    rounds: usize,
    mut step: impl FnMut() -> Result<()>,
) -> Result<SwitchCosts> {
    let device = vs.device();
    let a = random_adapter(vs, "a", rank);
    let b = random_adapter(vs, "b", rank);
    ensure!(
        !a.deltas.is_empty(),
        "{name}: no attention or MLP layers found"
    );
    let mut p = LoraPatcher::with_originals_on(vs, originals);
    let (wa, wb) = (
        [WeightedLora {
            adapter: &a,
            weight: 1.0,
        }],
        [WeightedLora {
            adapter: &b,
            weight: 1.0,
        }],
    );
    // The first patch copies the base layers once; time the switches after it.
    p.apply(&wa)?;
    p.restore()?;
    let mut time_switch = |from: &[WeightedLora], to: &[WeightedLora]| -> Result<f64> {
        let mut t = Vec::new();
        for _ in 0..rounds.max(1) {
            p.apply(from)?;
            sync(device);
            let start = Instant::now();
            p.apply(to)?;
            sync(device);
            t.push(start.elapsed().as_secs_f64());
        }
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    };
    let base_to_lora_s = time_switch(&[], &wa)?;
    let lora_to_lora_s = time_switch(&wa, &wb)?;
    let lora_to_base_s = time_switch(&wa, &[])?;
    p.restore()?;
    let blob = LoraBlob::new("a", adapter_file(&a)?.into())?;
    let read_s = median_s(Device::Cpu, rounds, || {
        std::hint::black_box(blob.adapter()?);
        Ok(())
    })?;
    let step_s = median_s(device, rounds, &mut step)?;
    let dtype = vs
        .variables()
        .values()
        .next()
        .map_or("-".into(), |t| format!("{:?}", t.kind()));
    Ok(SwitchCosts {
        model: name.into(),
        device: format!("{device:?}"),
        dtype,
        originals: format!("{originals:?}"),
        layers: a.deltas.len(),
        lora_bytes: a.bytes(),
        base_to_lora_s,
        lora_to_lora_s,
        lora_to_base_s,
        read_s,
        step_s,
    })
}

/// Where and how a random-weights config runs for its switch costs.
#[derive(Debug, Clone, Copy)]
pub struct SwitchTarget {
    /// FLUX.1-dev at full size instead of the medium config.
    pub flux_dev: bool,
    pub device: Device,
    pub kind: Kind,
    pub originals: OriginalsOn,
}

/// The medium config (or FLUX.1-dev) with random weights, and its switch costs.
pub fn config_switch_costs(target: SwitchTarget, rank: i64, rounds: usize) -> Result<SwitchCosts> {
    use diffmesh_model::bench_inputs as b;
    let (cfg, side, txt, name) = if target.flux_dev {
        (b::flux_dev_config(), b::FLUX_SIDE, b::FLUX_TXT, "flux-dev")
    } else {
        (b::medium_config(), b::MEDIUM_SIDE, b::MEDIUM_TXT, "medium")
    };
    let mut vs = nn::VarStore::new(target.device);
    let model = FluxTransformer::new(&vs.root(), cfg.clone())?;
    vs.set_kind(target.kind);
    let inputs = crate::mask_aware::inputs_as(
        b::random_inputs_on(&cfg, side, txt, 1, target.device),
        target.kind,
    );
    switch_costs(name, &vs, target.originals, rank, rounds, || {
        let _out = tch::no_grad(|| model.forward(&inputs))?;
        Ok(())
    })
}

/// The tiny model's switch costs (a generation step at batch 1 for scale).
pub fn tiny_switch_costs(model: &EngineModel, rank: i64, rounds: usize) -> Result<SwitchCosts> {
    let job = generation_job(
        "bench",
        "a red circle on the left on a blue background",
        1,
        1000,
    );
    let req = step_requests(&job, None, model)?.remove(0);
    let pipeline = model.pipeline();
    let mut state = DenoiseState::new(&pipeline, &req)?;
    let store = &model.model.transformer_store;
    switch_costs("tiny", store, OriginalsOn::Device, rank, rounds, || {
        tch::no_grad(|| state.step(&pipeline))?;
        Ok(())
    })
}

/// BAL quality at one bound.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BalQuality {
    /// Steps run on the base model before the LoRA.
    pub base_steps: usize,
    /// Mean SSIM against the LoRA from the first step.
    pub ssim_vs_sync: f64,
    pub min_ssim_vs_sync: f64,
    /// Mean share of the LoRA's change to the image that is kept: 1 - |img_K - img_sync| /
    /// |img_base - img_sync| (L1 over pixels; 1 = as synchronous loading, 0 = no LoRA).
    pub lora_effect_kept: f64,
}

/// The BAL study over `prompts` held-out prompts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BalStudy {
    pub steps: usize,
    pub prompts: usize,
    /// Mean SSIM of the base model's images against the LoRA's (how far the LoRA moves them).
    pub ssim_base_vs_sync: f64,
    /// Per step: mean cosine similarity of the latents with and without the LoRA (Katz Fig. 12).
    pub latent_cosine: Vec<f64>,
    pub bounds: Vec<BalQuality>,
}

fn to_unit(img: &Tensor) -> Result<Tensor> {
    Ok(img
        .f_add_scalar(1.0)?
        .f_mul_scalar(0.5)?
        .f_clamp(0.0, 1.0)?)
}

/// Generate each prompt with the LoRA from step 0 (sync), without it, and with it from each
/// bound in `bounds`, stepping all variants of a prompt in lockstep (weights switched per step).
/// `grid` collects the first prompts' images (base, each bound, sync) as 8-bit RGB rows for a
/// picture.
pub fn bal_quality(
    model: &EngineModel,
    blob: &LoraBlob,
    prompts: usize,
    steps: usize,
    bounds: &[usize],
    mut grid: Option<&mut Vec<Vec<Vec<u8>>>>,
) -> Result<BalStudy> {
    let adapter = blob.adapter().context("reading the LoRA")?;
    let set = [WeightedLora {
        adapter: &adapter,
        weight: 1.0,
    }];
    let mut patcher = LoraPatcher::new(&model.model.transformer_store);
    patcher.check(&adapter)?;
    let pipeline = model.pipeline();
    let keys = Split::new().held_out;
    let mut cosine = vec![0.0; steps];
    let mut ssim_base = 0.0;
    let mut per_bound: Vec<Vec<(f64, f64)>> = vec![Vec::new(); bounds.len()];
    for (i, key) in keys.iter().take(prompts).enumerate() {
        let job = generation_job("bal", &key.prompt(), 1000 + i as u64, steps as u32);
        let req = step_requests(&job, None, model)?.remove(0);
        // 0: sync, 1: base, 2..: one per bound.
        let mut states: Vec<DenoiseState> = (0..2 + bounds.len())
            .map(|_| DenoiseState::new(&pipeline, &req))
            .collect::<std::result::Result<_, _>>()?;
        let uses_lora = |variant: usize, step: usize| match variant {
            0 => true,
            1 => false,
            v => step >= bounds[v - 2],
        };
        for (step, cos) in cosine.iter_mut().enumerate() {
            for lora in [true, false] {
                patcher.apply(if lora { &set } else { &[] })?;
                for (v, s) in states.iter_mut().enumerate() {
                    if uses_lora(v, step) == lora {
                        tch::no_grad(|| s.step(&pipeline))?;
                    }
                }
            }
            let (a, b) = (
                states[0].latents().flatten(0, -1),
                states[1].latents().flatten(0, -1),
            );
            *cos += f64::try_from(Tensor::cosine_similarity(&a, &b, 0, 1e-8))?;
        }
        patcher.restore()?;
        let images: Vec<Tensor> = states
            .iter()
            .map(|s| to_unit(&s.decode(&pipeline)?))
            .collect::<std::result::Result<_, _>>()?;
        let l1 = |a: &Tensor, b: &Tensor| -> Result<f64> {
            Ok(f64::try_from((a - b).abs().mean(Kind::Double))?)
        };
        if let Some(rows) = grid.as_deref_mut() {
            let mut row = vec![diffmesh_denoiser::model::tensor_to_rgb(
                &states[1].decode(&pipeline)?,
            )?];
            for s in states.iter().skip(2).chain(states.iter().take(1)) {
                row.push(diffmesh_denoiser::model::tensor_to_rgb(
                    &s.decode(&pipeline)?,
                )?);
            }
            rows.push(row);
        }
        ssim_base += ssim(&images[1], &images[0])?;
        let moved = l1(&images[1], &images[0])?.max(1e-12);
        for (b, out) in per_bound.iter_mut().enumerate() {
            let img = &images[2 + b];
            out.push((ssim(img, &images[0])?, 1.0 - l1(img, &images[0])? / moved));
        }
    }
    let n = prompts.min(keys.len()).max(1) as f64;
    let bounds = bounds
        .iter()
        .zip(per_bound)
        .map(|(&k, v)| BalQuality {
            base_steps: k,
            ssim_vs_sync: v.iter().map(|x| x.0).sum::<f64>() / n,
            min_ssim_vs_sync: v.iter().map(|x| x.0).fold(f64::INFINITY, f64::min),
            lora_effect_kept: v.iter().map(|x| x.1).sum::<f64>() / n,
        })
        .collect();
    Ok(BalStudy {
        steps,
        prompts: n as usize,
        ssim_base_vs_sync: ssim_base / n,
        latent_cosine: cosine.into_iter().map(|c| c / n).collect(),
        bounds,
    })
}
