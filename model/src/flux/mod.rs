//! Flux DiT (`FluxTransformer2DModel` of diffusers 0.42.1): full forward, strict loading, and the
//! FlashPS mask-aware forward (`masked`).
//!
//! Parameters are created under diffusers' key names so checkpoints load by name. The forward is
//! made of plain fallible tch ops (no `no_grad` inside), so the same code trains a model; callers
//! serving inference wrap it in `tch::no_grad` (or use `load`, which freezes the weights).
pub mod blocks;
pub mod cfg_parallel;
pub mod config;
pub mod controlnet;
pub mod elastic;
pub mod embeddings;
pub mod first_block;
mod full_pass;
pub mod gather;
pub mod kv;
pub mod kv_codec;
pub mod layers;
pub mod masked;
pub mod masked_parallel;
pub mod padded_attention;
pub mod sequence_parallel;
pub mod step_cache;

use crate::error::{ModelError, Result};
use blocks::{DoubleBlock, SingleBlock};
use embeddings::TimeTextEmbed;
use layers::{layer_norm, modulate, Linear};
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

pub use config::FluxConfig;
pub use controlnet::{ControlResiduals, FluxControlNet};
pub use kv::{KvFormat, SharedBlockReads};
pub use masked::{CapturedKv, FnSink, KvCache, KvSink, MaskedRequest};
pub use padded_attention::MaskedAttention;

/// Inputs of one full forward, with diffusers' shapes and units.
#[derive(Debug)]
pub struct FluxInputs {
    /// `[B, N, in_channels]` packed latents (2x2 patches flattened, as the Flux pipeline packs them).
    pub hidden_states: Tensor,
    /// `[B, T, joint_attention_dim]` text sequence (T5 output in FLUX.1).
    pub encoder_hidden_states: Tensor,
    /// `[B, pooled_projection_dim]` (CLIP pooled output in FLUX.1).
    pub pooled_projections: Tensor,
    /// `[B]` in diffusers units (sigma in [0, 1]); the forward multiplies by 1000 like diffusers.
    pub timestep: Tensor,
    /// `[N, 3]` image token position ids.
    pub img_ids: Tensor,
    /// `[T, 3]` text token position ids (zeros in FLUX.1).
    pub txt_ids: Tensor,
    /// `[B]` guidance scale, required iff `guidance_embeds` (also multiplied by 1000).
    pub guidance: Option<Tensor>,
}

/// The Flux transformer.
#[derive(Debug)]
pub struct FluxTransformer {
    pub cfg: FluxConfig,
    pub x_embedder: Linear,
    pub context_embedder: Linear,
    pub time_text_embed: TimeTextEmbed,
    pub transformer_blocks: Vec<DoubleBlock>,
    pub single_transformer_blocks: Vec<SingleBlock>,
    /// `norm_out.linear` of `AdaLayerNormContinuous` (chunks: scale, then shift).
    pub norm_out: Linear,
    pub proj_out: Linear,
    /// How the mask-aware forward runs attention over a batch of several requests.
    pub masked_attention: MaskedAttention,
}

/// Conditioning shared by every block of one forward: `silu(temb)`, one row per batch element
/// (full forward) or per request (mask-aware forward); every AdaLN linear consumes it.
pub(crate) struct Conditioning {
    pub temb_silu: Tensor,
}

impl FluxTransformer {
    /// Create the parameters under `vs` (torch's default init). Validates `cfg`.
    pub fn new(vs: &nn::Path, cfg: FluxConfig) -> Result<Self> {
        cfg.validate()?;
        let dim = cfg.inner_dim();
        let blocks = vs / "transformer_blocks";
        let singles = vs / "single_transformer_blocks";
        Ok(Self {
            x_embedder: Linear::new(vs / "x_embedder", cfg.in_channels, dim, true),
            context_embedder: Linear::new(
                vs / "context_embedder",
                cfg.joint_attention_dim,
                dim,
                true,
            ),
            time_text_embed: TimeTextEmbed::new(vs / "time_text_embed", &cfg),
            transformer_blocks: (0..cfg.num_layers)
                .map(|i| DoubleBlock::new(&blocks / i, &cfg))
                .collect(),
            single_transformer_blocks: (0..cfg.num_single_layers)
                .map(|i| SingleBlock::new(&singles / i, &cfg))
                .collect(),
            norm_out: Linear::new(vs / "norm_out" / "linear", dim, 2 * dim, true),
            proj_out: Linear::new(vs / "proj_out", dim, cfg.proj_out_dim(), true),
            masked_attention: MaskedAttention::default(),
            cfg,
        })
    }

    /// Load a diffusers component folder (`config.json` + safetensors) strictly, convert to `kind`,
    /// and freeze the weights (inference). Returns the model and the store owning its variables.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<(Self, nn::VarStore)> {
        let cfg = FluxConfig::from_dir(dir)?;
        let mut vs = crate::weights::new_store(device, kind);
        let model = Self::new(&vs.root(), cfg)?;
        crate::weights::load_frozen(&mut vs, dir, kind, "Flux model")?;
        Ok((model, vs))
    }

    /// Total number of blocks (double then single); block `i` of the KV cache follows this order.
    pub fn num_blocks(&self) -> usize {
        self.transformer_blocks.len() + self.single_transformer_blocks.len()
    }

    /// Width of one cached K or V row (`heads * head_dim`).
    pub fn inner_dim(&self) -> i64 {
        self.cfg.inner_dim()
    }

    /// Device and dtype of the parameters.
    pub fn device_kind(&self) -> (Device, Kind) {
        (self.proj_out.weight.device(), self.proj_out.weight.kind())
    }

    /// `silu(temb)` for timesteps `[R]` and guidance `[R]` (diffusers units) and pooled `[R, P]`.
    pub(crate) fn conditioning(
        &self,
        timestep: &Tensor,
        guidance: Option<&Tensor>,
        pooled: &Tensor,
    ) -> Result<Conditioning> {
        let (_, kind) = self.device_kind();
        let t = timestep
            .f_reshape([-1])?
            .f_to_kind(kind)?
            .f_mul_scalar(1000.0)?;
        let g = guidance
            .map(|g| g.f_reshape([-1])?.f_to_kind(kind)?.f_mul_scalar(1000.0))
            .transpose()?;
        let temb = self.time_text_embed.forward(&t, g.as_ref(), pooled)?;
        Ok(Conditioning {
            temb_silu: temb.f_silu()?,
        })
    }

    /// `proj_out(norm_out(x, temb))` for tokens `x` whose conditioning rows are `rows(chunk)`.
    pub(crate) fn final_layer(
        &self,
        x: &Tensor,
        temb_silu: &Tensor,
        rows: blocks::RowMap,
    ) -> Result<Tensor> {
        let c = self.norm_out.forward(temb_silu)?.f_chunk(2, -1)?;
        let (scale, shift) = (rows(&c[0])?, rows(&c[1])?);
        let x = modulate(
            &layer_norm(x, self.cfg.inner_dim())?,
            &shift,
            &scale.f_add_scalar(1.0)?,
        )?;
        self.proj_out.forward(&x)
    }

    /// diffusers' forward: the predicted velocity `[B, N, patch^2 * out_channels]`.
    pub fn forward(&self, inputs: &FluxInputs) -> Result<Tensor> {
        self.forward_impl(inputs, None, None)
    }

    /// [`Self::forward`] with a ControlNet's residuals added to the image stream after each block
    /// (diffusers' `controlnet_block_samples` / `controlnet_single_block_samples`).
    pub fn forward_controlled(
        &self,
        inputs: &FluxInputs,
        control: &ControlResiduals,
    ) -> Result<Tensor> {
        self.check_control(inputs, control)?;
        self.forward_impl(inputs, None, Some(control))
    }

    /// ControlNet residuals must match the image stream, `[B, N, inner]`.
    pub(crate) fn check_control(
        &self,
        inputs: &FluxInputs,
        control: &ControlResiduals,
    ) -> Result<()> {
        let hs = inputs.hidden_states.size();
        let want = [hs[0], hs.get(1).copied().unwrap_or(0), self.inner_dim()];
        for r in control.tensors() {
            if r.size() != want {
                return Err(ModelError::input(
                    "control",
                    format!("ControlNet residuals must be {want:?}, got {:?}", r.size()),
                ));
            }
        }
        Ok(())
    }

    /// Full forward of ONE request (`B = 1`) that also hands every block's K/V of the image tokens
    /// (`[N, inner]` each) to `sink`, block by block in cache order (double blocks, then single
    /// blocks), in `sink.format()`: raw `to_k`/`to_v` projections (before QK norm and RoPE),
    /// keys after `norm_k` and RoPE (`KvFormat::Prepared`), or the block's input hidden stream
    /// (`KvFormat::Hidden`, given as both `k` and `v`). Text K/V are not captured.
    pub fn forward_capture(&self, inputs: &FluxInputs, sink: &mut dyn KvSink) -> Result<Tensor> {
        let b = inputs.hidden_states.size().first().copied().unwrap_or(0);
        if b != 1 {
            return Err(ModelError::input(
                "hidden_states",
                format!("capture runs one request: batch must be 1, got {b}"),
            ));
        }
        self.forward_impl(inputs, Some(sink), None)
    }

    fn forward_impl(
        &self,
        inputs: &FluxInputs,
        sink: Option<&mut dyn KvSink>,
        control: Option<&ControlResiduals>,
    ) -> Result<Tensor> {
        let run = self.forward_blocks(inputs, sink, control)?;
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        self.final_layer(&run.img_out, &run.cond.temb_silu, &rows)
    }
}

/// Validate a forward's shapes against `cfg` (the transformer's or a ControlNet's); errors
/// name the field.
pub(crate) fn check_inputs(cfg: &FluxConfig, x: &FluxInputs) -> Result<InputShapes> {
    let hs = x.hidden_states.size();
    if hs.len() != 3 || hs[2] != cfg.in_channels {
        return Err(ModelError::input(
            "hidden_states",
            format!("expected [B, N, {}], got {hs:?}", cfg.in_channels),
        ));
    }
    let (b, n) = (hs[0], hs[1]);
    let es = x.encoder_hidden_states.size();
    if es.len() != 3 || es[0] != b || es[2] != cfg.joint_attention_dim {
        return Err(ModelError::input(
            "encoder_hidden_states",
            format!("expected [{b}, T, {}], got {es:?}", cfg.joint_attention_dim),
        ));
    }
    let t = es[1];
    let ps = x.pooled_projections.size();
    if ps != [b, cfg.pooled_projection_dim] {
        return Err(ModelError::input(
            "pooled_projections",
            format!("expected [{b}, {}], got {ps:?}", cfg.pooled_projection_dim),
        ));
    }
    check_batch_vector("timestep", &x.timestep, b)?;
    if let Some(g) = &x.guidance {
        check_batch_vector("guidance", g, b)?;
    }
    let axes = cfg.axes_dims_rope.len() as i64;
    let img_ids = ids_2d("img_ids", &x.img_ids, n, axes)?;
    let txt_ids = ids_2d("txt_ids", &x.txt_ids, t, axes)?;
    Ok(InputShapes {
        img_tokens: n,
        txt_tokens: t,
        img_ids,
        txt_ids,
    })
}

pub(crate) struct InputShapes {
    pub img_tokens: i64,
    pub txt_tokens: i64,
    pub img_ids: Tensor,
    pub txt_ids: Tensor,
}

/// `[B]` (a 0-d scalar is accepted when B = 1, like a Python float broadcast).
pub(crate) fn check_batch_vector(field: &str, t: &Tensor, b: i64) -> Result<()> {
    let s = t.size();
    if s != [b] && !(s.is_empty() && b == 1) {
        return Err(ModelError::input(
            field,
            format!("expected [{b}], got {s:?}"),
        ));
    }
    Ok(())
}

/// Position ids as `[len, axes]`; a leading batch dim is dropped like diffusers does (deprecated there).
pub(crate) fn ids_2d(field: &str, ids: &Tensor, len: i64, axes: i64) -> Result<Tensor> {
    let ids = if ids.dim() == 3 {
        ids.f_select(0, 0)?
    } else {
        ids.shallow_clone()
    };
    let s = ids.size();
    if s != [len, axes] {
        return Err(ModelError::input(
            field,
            format!("expected [{len}, {axes}], got {s:?}"),
        ));
    }
    Ok(ids)
}

/// `diffmesh-forward --component transformer`: reads the `FluxInputs` tensors by field name
/// (`guidance` optional) from `inputs`, writes `sample` (fp32 CPU forward) to `out`. `model_dir`
/// is a `transformer/` folder or a model directory containing one.
pub fn cli_forward_transformer(model_dir: &Path, inputs: &Path, out: &Path) -> Result<()> {
    let (model, _vs) = FluxTransformer::load(&component_dir(model_dir), Device::Cpu, Kind::Float)?;
    let x = cli_inputs(inputs)?;
    let sample = tch::no_grad(|| model.forward(&x))?;
    Tensor::write_safetensors(&[("sample", sample.f_contiguous()?)], out)?;
    Ok(())
}

/// The transformer's folder: `model_dir/transformer` when there is one, else `model_dir`.
pub fn component_dir(model_dir: &Path) -> std::path::PathBuf {
    if model_dir.join("transformer").join("config.json").is_file() {
        model_dir.join("transformer")
    } else {
        model_dir.into()
    }
}

/// [`FluxInputs`] from a safetensors file holding the forward's argument names.
pub(crate) fn cli_inputs(inputs: &Path) -> Result<FluxInputs> {
    let mut named: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(inputs)?.into_iter().collect();
    let mut take = |name: &str| {
        named.remove(name).ok_or_else(|| {
            ModelError::input(name, format!("no tensor `{name}` in {}", inputs.display()))
        })
    };
    Ok(FluxInputs {
        hidden_states: take("hidden_states")?,
        encoder_hidden_states: take("encoder_hidden_states")?,
        pooled_projections: take("pooled_projections")?,
        timestep: take("timestep")?,
        img_ids: take("img_ids")?,
        txt_ids: take("txt_ids")?,
        guidance: take("guidance").ok(),
    })
}
