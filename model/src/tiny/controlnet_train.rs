//! Train a ControlNet of the tiny model: the "silhouette" ControlNet, whose control image is the
//! object's silhouette (white on black) at the exact place and size to draw it. The prompt alone
//! leaves the object's size and a few pixels of its position to chance; the silhouette fixes
//! both, so what a ControlNet adds is measurable (the overlap of the drawn object with it).
//!
//! The ControlNet starts as diffusers' `FluxControlNetModel.from_transformer` does: embedders and
//! its first blocks copied from the transformer, `controlnet_x_embedder` and the per-block output
//! linears zero (so it starts as the identity). The transformer and text encoder stay frozen.
//! Written as a diffusers `FluxControlNetModel` folder, so diffusers loads it too.
use super::codec::write_json;
use super::data::{rgb_to_tensor, Generator, Scene, Split};
use super::model::TinyModel;
use super::train::{noised, NoisedBatch, TimeSampling};
use super::IMAGE_SIZE;
use crate::error::{ModelError, Result};
use crate::flux::{FluxConfig, FluxControlNet, FluxTransformer};
use std::path::PathBuf;
use std::time::Instant;
use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};

#[derive(clap::Args, Debug, Clone)]
pub struct ControlNetTrainArgs {
    /// The base model folder.
    #[arg(long, default_value = "weights/tiny")]
    pub model_dir: PathBuf,
    /// The ControlNet folder to write (`config.json` + safetensors).
    #[arg(long, default_value = "weights/tiny-controlnets/silhouette")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 1200)]
    pub steps: usize,
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Double blocks of the ControlNet (copied from the transformer's first ones).
    #[arg(long, default_value_t = 1)]
    pub double_blocks: i64,
    /// Single blocks of the ControlNet.
    #[arg(long, default_value_t = 1)]
    pub single_blocks: i64,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 11)]
    pub seed: u64,
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
}

/// What a training run did.
#[derive(Debug, serde::Serialize)]
pub struct ControlNetTrainSummary {
    pub out: PathBuf,
    pub steps: usize,
    pub parameters: i64,
    pub first_loss: f64,
    pub last_loss: f64,
    pub seconds: f64,
}

/// The silhouette of a scene: white where the object is, black elsewhere.
pub fn render_silhouette(scene: &Scene) -> Vec<u8> {
    let n = IMAGE_SIZE as usize;
    let (ax, ay) = scene.key.position.anchor();
    let (cx, cy) = (ax + scene.jitter.0, ay + scene.jitter.1);
    let mut out = Vec::with_capacity(n * n * 3);
    for y in 0..n {
        for x in 0..n {
            let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
            let v = if scene.key.shape.contains(dx, dy, scene.half_size) {
                255
            } else {
                0
            };
            out.extend_from_slice(&[v, v, v]);
        }
    }
    out
}

/// A ControlNet of `base`'s widths with `double` + `single` blocks, initialised like diffusers'
/// `from_transformer`: shared parts copied, the ControlNet-only linears zero.
pub fn controlnet_from_transformer(
    vs: &nn::VarStore,
    base: &FluxTransformer,
    base_vs: &nn::VarStore,
    double: i64,
    single: i64,
) -> Result<FluxControlNet> {
    if double < 0 || single < 0 || double + single == 0 {
        return Err(ModelError::input(
            "double_blocks/single_blocks",
            "need at least one block, none negative",
        ));
    }
    let cfg = FluxConfig {
        num_layers: double,
        num_single_layers: single,
        out_channels: None,
        ..base.cfg.clone()
    };
    let net = FluxControlNet::new(&vs.root(), cfg)?;
    let base_vars = base_vs.variables();
    tch::no_grad(|| -> Result<()> {
        for (name, mut var) in vs.variables() {
            if name.starts_with("controlnet_") {
                let _ = var.f_zero_()?;
            } else if let Some(src) = base_vars.get(&name) {
                var.f_copy_(src)?;
            }
        }
        Ok(())
    })?;
    Ok(net)
}

pub fn train_controlnet(args: &ControlNetTrainArgs) -> Result<ControlNetTrainSummary> {
    if args.steps == 0 || args.batch_size == 0 {
        return Err(ModelError::input(
            "steps/batch_size",
            "must both be at least 1",
        ));
    }
    tch::set_num_threads(args.threads);
    tch::manual_seed(args.seed as i64);
    let mut model = TinyModel::load(&args.model_dir, Device::Cpu)?;
    model.transformer_vs.freeze();
    model.text_vs.freeze();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = controlnet_from_transformer(
        &vs,
        &model.transformer,
        &model.transformer_vs,
        args.double_blocks,
        args.single_blocks,
    )?;
    let mut opt = nn::adamw(0.9, 0.99, 0.0).build(&vs, args.lr)?;
    let split = Split::new();
    let mut gen = Generator::new(split.train.clone(), args.seed);
    let time = TimeSampling::default();
    let start = Instant::now();
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 1..=args.steps {
        let (mut images, mut controls, mut prompts) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..args.batch_size {
            let scene = gen.next_scene();
            images.push(rgb_to_tensor(&super::data::render_rgb(&scene), IMAGE_SIZE));
            controls.push(rgb_to_tensor(&render_silhouette(&scene), IMAGE_SIZE));
            prompts.push(scene.key.prompt());
        }
        let images = Tensor::f_stack(&images, 0)?;
        let controls = Tensor::f_stack(&controls, 0)?;
        let loss = controlled_loss(&model, &net, &images, &controls, &prompts, time)?;
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
    save_controlnet(&net, &vs, &args.out)?;
    Ok(ControlNetTrainSummary {
        out: args.out.clone(),
        steps: args.steps,
        parameters: vs
            .trainable_variables()
            .iter()
            .map(|t| t.numel() as i64)
            .sum(),
        first_loss: first,
        last_loss: last,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The flow-matching loss of the frozen transformer steered by `net` with `controls`.
fn controlled_loss(
    model: &TinyModel,
    net: &FluxControlNet,
    images: &Tensor,
    controls: &Tensor,
    prompts: &[String],
    time: TimeSampling,
) -> Result<Tensor> {
    let x0 = model.images_to_tokens(images)?;
    let control = model.images_to_tokens(controls)?;
    let NoisedBatch { xt, t, target } = noised(&x0, time)?;
    let ids = model.text_encoder.tokenize(prompts)?;
    let text = model.text_encoder.forward_ids(&ids)?;
    let inputs = model.flux_inputs(&xt, &text, &t);
    let residuals = net.forward(&inputs, &control, 1.0)?;
    let v = model.transformer.forward_controlled(&inputs, &residuals)?;
    Ok(v.f_sub(&target)?.f_square()?.f_mean(Kind::Float)?)
}

/// For tests of the serving code: a random tiny model (`TinyModel::random_for_tests`, seed 11)
/// saved in `dir`, and a random ControlNet of it (one double and one single block, small
/// random control weights) in `dir/controlnets/<name>`.
pub fn save_random_model_and_controlnet(dir: &std::path::Path, name: &str) -> Result<()> {
    let m = TinyModel::random_for_tests(11, Device::Cpu)?;
    m.save(dir, None)?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = controlnet_from_transformer(&vs, &m.transformer, &m.transformer_vs, 1, 1)?;
    tch::manual_seed(3);
    tch::no_grad(|| {
        for (name, mut v) in vs.variables() {
            if name.starts_with("controlnet_") {
                v.copy_(&(Tensor::randn(v.size(), (Kind::Float, Device::Cpu)) * 0.05));
            }
        }
    });
    save_controlnet(&net, &vs, &dir.join("controlnets").join(name))
}

/// Write `net` as a diffusers `FluxControlNetModel` folder.
pub fn save_controlnet(
    net: &FluxControlNet,
    vs: &nn::VarStore,
    dir: &std::path::Path,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut cfg = serde_json::to_value(&net.cfg).map_err(|source| ModelError::Json {
        path: dir.join("config.json"),
        source,
    })?;
    // `FluxControlNetModel` has no output projection, so no `out_channels` argument.
    if let Some(map) = cfg.as_object_mut() {
        map.remove("out_channels");
    }
    cfg["_class_name"] = "FluxControlNetModel".into();
    cfg["_diffusers_version"] = "0.42.1".into();
    write_json(&dir.join("config.json"), &cfg)?;
    crate::weights::save(vs, &dir.join("diffusion_pytorch_model.safetensors"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::data::scene_for;
    use rand::SeedableRng;

    #[test]
    fn the_silhouette_covers_exactly_the_object() {
        let split = Split::new();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let scene = scene_for(split.train[5], &mut rng);
        let full = super::super::data::render_rgb(&scene);
        let sil = render_silhouette(&scene);
        let bg = super::super::data::COLOURS[scene.key.background].1;
        let object = full.chunks(3).map(|p| p != bg);
        let white = sil.chunks(3).map(|p| p == [255, 255, 255]);
        assert!(object.zip(white).all(|(o, w)| o == w));
        assert!(sil.chunks(3).any(|p| p == [255, 255, 255]));
    }

    #[test]
    fn a_fresh_controlnet_changes_nothing() {
        tch::manual_seed(0);
        let model = TinyModel::random_for_tests(5, Device::Cpu).unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = controlnet_from_transformer(&vs, &model.transformer, &model.transformer_vs, 1, 1)
            .unwrap();
        let x = Tensor::randn([2, 256, 48], (Kind::Float, Device::Cpu));
        let ids = model
            .text_encoder
            .tokenize(&["a red circle".into(), "".into()])
            .unwrap();
        let text = model.text_encoder.forward_ids(&ids).unwrap();
        let t = Tensor::from_slice(&[0.3f32, 0.8]);
        let inputs = model.flux_inputs(&x, &text, &t);
        let control = Tensor::randn([2, 256, 48], (Kind::Float, Device::Cpu));
        let r = net.forward(&inputs, &control, 1.0).unwrap();
        let with = model.transformer.forward_controlled(&inputs, &r).unwrap();
        let without = model.transformer.forward(&inputs).unwrap();
        assert_eq!(f64::try_from((with - without).abs().max()).unwrap(), 0.0);
    }
}
