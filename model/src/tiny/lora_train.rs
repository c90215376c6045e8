//! Train a LoRA of the tiny model: a style the base model never draws, so what an adapter does
//! (and what bounded asynchronous loading costs) is measurable. The style, "outline", draws the
//! named shape hollow: a ring `width` pixels wide in the object's colour, the background inside.
//! Same prompts as the base model; only the picture changes.
//!
//! The base weights stay frozen; every adapted layer computes with `W0 + alpha/r * B @ A`, and
//! only A and B (PEFT's init: A random, B zero) are trained. The file is written in diffusers'
//! PEFT layout with its config as metadata, so `FluxPipeline.load_lora_weights` loads it too.
use super::data::{rgb_to_tensor, Generator, Scene, Split, COLOURS};
use super::model::TinyModel;
use super::train::{flow_matching_loss, TimeSampling};
use super::IMAGE_SIZE;
use crate::error::{ModelError, Result};
use crate::flux::layers::Linear;
use crate::flux::FluxTransformer;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};

#[derive(clap::Args, Debug, Clone)]
pub struct LoraTrainArgs {
    /// The base model folder.
    #[arg(long, default_value = "weights/tiny")]
    pub model_dir: PathBuf,
    /// Where to write the LoRA (`.safetensors`).
    #[arg(long, default_value = "weights/tiny-loras/outline.safetensors")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 1200)]
    pub steps: usize,
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 8)]
    pub rank: i64,
    /// PEFT's `lora_alpha` (scale = alpha / rank).
    #[arg(long, default_value_t = 8.0)]
    pub alpha: f64,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Ring width of the outline style, pixels.
    #[arg(long, default_value_t = 3.0)]
    pub width: f64,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
}

/// What a training run did.
#[derive(Debug, serde::Serialize)]
pub struct LoraTrainSummary {
    pub out: PathBuf,
    pub steps: usize,
    pub modules: usize,
    pub parameters: i64,
    pub first_loss: f64,
    pub last_loss: f64,
    pub seconds: f64,
}

/// The "outline" rendering of a scene: the shape's ring of `width` pixels, background inside.
pub fn render_outline(scene: &Scene, width: f64) -> Vec<u8> {
    let n = IMAGE_SIZE as usize;
    let (ax, ay) = scene.key.position.anchor();
    let (cx, cy) = (ax + scene.jitter.0, ay + scene.jitter.1);
    let a = scene.half_size;
    let inner = (a - width).max(0.0);
    let (bg, fg) = (COLOURS[scene.key.background].1, COLOURS[scene.key.colour].1);
    let mut out = Vec::with_capacity(n * n * 3);
    for y in 0..n {
        for x in 0..n {
            let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
            let ring =
                scene.key.shape.contains(dx, dy, a) && !scene.key.shape.contains(dx, dy, inner);
            out.extend_from_slice(if ring { &fg } else { &bg });
        }
    }
    out
}

/// The layers the LoRA adapts, by their diffusers module path: every attention projection and
/// MLP of both kinds of block.
fn targets(t: &mut FluxTransformer) -> Vec<(String, &mut Linear)> {
    let mut out: Vec<(String, &mut Linear)> = Vec::new();
    for (i, b) in t.transformer_blocks.iter_mut().enumerate() {
        let p = format!("transformer_blocks.{i}");
        out.push((format!("{p}.attn.to_q"), &mut b.img.to_q));
        out.push((format!("{p}.attn.to_k"), &mut b.img.to_k));
        out.push((format!("{p}.attn.to_v"), &mut b.img.to_v));
        out.push((format!("{p}.attn.add_q_proj"), &mut b.txt.to_q));
        out.push((format!("{p}.attn.add_k_proj"), &mut b.txt.to_k));
        out.push((format!("{p}.attn.add_v_proj"), &mut b.txt.to_v));
        out.push((format!("{p}.attn.to_out.0"), &mut b.to_out));
        out.push((format!("{p}.attn.to_add_out"), &mut b.to_add_out));
        out.push((format!("{p}.ff.net.0.proj"), &mut b.ff.proj_in));
        out.push((format!("{p}.ff.net.2"), &mut b.ff.proj_out));
    }
    for (j, b) in t.single_transformer_blocks.iter_mut().enumerate() {
        let p = format!("single_transformer_blocks.{j}");
        out.push((format!("{p}.attn.to_q"), &mut b.attn.to_q));
        out.push((format!("{p}.attn.to_k"), &mut b.attn.to_k));
        out.push((format!("{p}.attn.to_v"), &mut b.attn.to_v));
        out.push((format!("{p}.proj_mlp"), &mut b.proj_mlp));
        out.push((format!("{p}.proj_out"), &mut b.proj_out));
    }
    out
}

/// One adapted layer: its frozen base weight and the trained factors.
struct Adapted {
    name: String,
    base: Tensor,
    down: Tensor,
    up: Tensor,
}

pub fn train_lora(args: &LoraTrainArgs) -> Result<LoraTrainSummary> {
    if args.steps == 0 || args.batch_size == 0 || args.rank <= 0 {
        return Err(ModelError::input(
            "steps/batch_size/rank",
            "must all be at least 1",
        ));
    }
    tch::set_num_threads(args.threads);
    tch::manual_seed(args.seed as i64);
    let mut model = TinyModel::load(&args.model_dir, Device::Cpu)?;
    model.transformer_vs.freeze();
    model.text_vs.freeze();
    let scale = args.alpha / args.rank as f64;
    let lora_vs = nn::VarStore::new(Device::Cpu);
    let root = lora_vs.root();
    let mut adapted = Vec::new();
    for (name, lin) in targets(&mut model.transformer) {
        let (out_f, in_f) = (lin.weight.size()[0], lin.weight.size()[1]);
        let p = &root / name.replace('.', "_");
        // PEFT's init: A Kaiming-uniform, B zero (the adapter starts as the identity).
        let bound = 1.0 / (in_f as f64).sqrt();
        let down = p.var(
            "down",
            &[args.rank, in_f],
            nn::Init::Uniform {
                lo: -bound,
                up: bound,
            },
        );
        let up = p.var("up", &[out_f, args.rank], nn::Init::Const(0.0));
        adapted.push(Adapted {
            base: lin.weight.detach().copy(),
            name,
            down,
            up,
        });
    }
    let mut opt = nn::adamw(0.9, 0.99, 0.0).build(&lora_vs, args.lr)?;
    let split = Split::new();
    let mut gen = Generator::new(split.train.clone(), args.seed);
    let time = TimeSampling::default();
    let start = Instant::now();
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 1..=args.steps {
        {
            let by_name: HashMap<&str, &Adapted> =
                adapted.iter().map(|a| (a.name.as_str(), a)).collect();
            for (name, lin) in targets(&mut model.transformer) {
                let a = by_name[name.as_str()];
                lin.weight = a
                    .base
                    .f_add(&a.up.f_matmul(&a.down)?.f_mul_scalar(scale)?)?;
            }
        }
        let mut images = Vec::with_capacity(args.batch_size);
        let mut prompts = Vec::with_capacity(args.batch_size);
        for _ in 0..args.batch_size {
            let scene = gen.next_scene();
            images.push(rgb_to_tensor(
                &render_outline(&scene, args.width),
                IMAGE_SIZE,
            ));
            prompts.push(scene.key.prompt());
        }
        let images = Tensor::f_stack(&images, 0)?;
        let loss = flow_matching_loss(&model, &images, &prompts, time, None)?;
        opt.backward_step(&loss);
        let l = f64::try_from(&loss)?;
        if step == 1 {
            first = l;
        }
        last = l;
        if step % 100 == 0 || step == args.steps {
            eprintln!(
                "step {step}/{}: loss {l:.4} ({:.0} s)",
                args.steps,
                start.elapsed().as_secs_f64()
            );
        }
    }
    write_lora(args, &adapted)?;
    Ok(LoraTrainSummary {
        out: args.out.clone(),
        steps: args.steps,
        modules: adapted.len(),
        parameters: adapted
            .iter()
            .map(|a| a.down.numel() as i64 + a.up.numel() as i64)
            .sum(),
        first_loss: first,
        last_loss: last,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Write the factors as diffusers does (`transformer.<module>.lora_A/B.weight`, PEFT config in
/// the `lora_adapter_metadata` entry).
fn write_lora(args: &LoraTrainArgs, adapted: &[Adapted]) -> Result<()> {
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for a in adapted {
        for (suffix, t) in [("lora_A", &a.down), ("lora_B", &a.up)] {
            let t = t.detach().f_to_kind(Kind::Float)?.f_contiguous()?;
            let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
            let values: Vec<f32> = Vec::<f32>::try_from(t.f_flatten(0, -1)?)?;
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            data.push((
                format!("transformer.{}.{suffix}.weight", a.name),
                shape,
                bytes,
            ));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(k, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::tensor::Dtype::F32, s.clone(), b)
                .map(|v| (k.clone(), v))
                .map_err(|e| ModelError::input("lora", e.to_string()))
        })
        .collect::<Result<_>>()?;
    // PEFT's target_modules: the layer names within a block (`attn.to_q`, `proj_mlp`, ...).
    let modules: std::collections::BTreeSet<&str> = adapted
        .iter()
        .filter_map(|a| a.name.splitn(3, '.').nth(2))
        .collect();
    let metadata = serde_json::json!({
        "transformer.r": args.rank,
        "transformer.lora_alpha": args.alpha,
        "transformer.target_modules": modules,
        "transformer.use_dora": false,
        "transformer.use_rslora": false,
        "transformer.lora_bias": false,
    });
    let info = HashMap::from([("lora_adapter_metadata".to_string(), metadata.to_string())]);
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let bytes = safetensors::serialize(views, Some(info))
        .map_err(|e| ModelError::input("lora", e.to_string()))?;
    std::fs::write(&args.out, bytes).map_err(|source| ModelError::Io {
        path: args.out.clone(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::data::scene_for;
    use rand::SeedableRng;

    #[test]
    fn the_outline_keeps_the_ring_and_clears_the_inside() {
        let split = Split::new();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let scene = scene_for(split.train[0], &mut rng);
        let full = super::super::data::render_rgb(&scene);
        let ring = render_outline(&scene, 3.0);
        let bg = COLOURS[scene.key.background].1;
        let count = |img: &[u8]| img.chunks(3).filter(|p| *p != bg).count();
        assert!(count(&ring) > 0 && count(&ring) < count(&full) * 3 / 4);
        // Every ring pixel is an object pixel of the full rendering.
        assert!(ring
            .chunks(3)
            .zip(full.chunks(3))
            .all(|(r, f)| r == bg || r == f));
    }
}
