//! `T5EncoderModel` as in transformers 5.25 (`models/t5/modeling_t5.py`): the shared token
//! embedding, pre-norm blocks of unscaled self-attention plus a relative position bias that the
//! first block computes and every block adds, RMS layer norms without bias, and T5 v1.1's
//! gated-GELU feed-forward (or the original ReLU one). FLUX.1's `text_encoder_2` is T5-XXL v1.1.
//!
//! As transformers does, fp16 keeps the feed-forward output projections (`wo`) in f32 and clamps
//! infinities after each sub-layer; bf16 and f32 run everything in their own dtype.
use super::activation::Activation;
use crate::error::{read_json, ModelError, Result};
use crate::flux::layers::Linear;
use crate::weights::{self, LoadPlan};
use serde::Deserialize;
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

pub const CLASS_NAME: &str = "T5EncoderModel";

/// Mirrors `text_encoder_2/config.json` (`T5Config`); defaults are transformers'.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default)]
pub struct T5Config {
    pub vocab_size: i64,
    pub d_model: i64,
    pub d_kv: i64,
    pub d_ff: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub relative_attention_num_buckets: i64,
    pub relative_attention_max_distance: i64,
    pub layer_norm_epsilon: f64,
    /// `relu` (T5) or `gated-gelu` (T5 v1.1): `[gated-]ACT`.
    pub feed_forward_proj: String,
}

impl Default for T5Config {
    fn default() -> Self {
        Self {
            vocab_size: 32128,
            d_model: 512,
            d_kv: 64,
            d_ff: 2048,
            num_layers: 6,
            num_heads: 8,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: "relu".into(),
        }
    }
}

impl T5Config {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg: Self = read_json(&dir.join("config.json"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether the feed-forward is gated (`gated-*`), and its activation as transformers derives
    /// it (`gated-gelu` means the tanh GELU, `gelu_new`).
    pub fn feed_forward(&self) -> Result<(bool, Activation)> {
        let parts: Vec<&str> = self.feed_forward_proj.split('-').collect();
        let gated = parts[0] == "gated";
        if (parts.len() > 1 && !gated) || parts.len() > 2 {
            return Err(ModelError::config(
                "feed_forward_proj",
                format!("`{}` is not `gated-ACT` or `ACT`", self.feed_forward_proj),
            ));
        }
        let name = if self.feed_forward_proj == "gated-gelu" {
            "gelu_new"
        } else {
            parts[parts.len() - 1]
        };
        Ok((gated, Activation::parse("feed_forward_proj", name)?))
    }

    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("d_kv", self.d_kv),
            ("d_ff", self.d_ff),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            (
                "relative_attention_num_buckets",
                self.relative_attention_num_buckets,
            ),
        ] {
            if v < 1 {
                return Err(ModelError::config(
                    field,
                    format!("must be positive, got {v}"),
                ));
            }
        }
        // Half the buckets are exact offsets, half logarithmic up to the max distance.
        if self.relative_attention_num_buckets < 4
            || self.relative_attention_max_distance <= self.relative_attention_num_buckets / 4
        {
            return Err(ModelError::config(
                "relative_attention_max_distance",
                format!(
                    "{} buckets up to distance {} leave no logarithmic range",
                    self.relative_attention_num_buckets, self.relative_attention_max_distance
                ),
            ));
        }
        self.feed_forward()?;
        Ok(())
    }
}

/// T5's layer norm: scale only, no mean subtraction, variance in f32.
#[derive(Debug)]
struct T5LayerNorm {
    weight: Tensor,
    eps: f64,
}

impl T5LayerNorm {
    fn new(p: nn::Path, dim: i64, eps: f64) -> Self {
        Self {
            weight: p.ones("weight", &[dim]),
            eps,
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let variance = x
            .f_to_kind(Kind::Float)?
            .f_pow_tensor_scalar(2)?
            .f_mean_dim(-1, true, None::<Kind>)?;
        let mut h = x.f_mul(&variance.f_add_scalar(self.eps)?.f_rsqrt()?)?;
        if matches!(self.weight.kind(), Kind::Half | Kind::BFloat16) {
            h = h.f_to_kind(self.weight.kind())?;
        }
        Ok(self.weight.f_mul(&h)?)
    }
}

#[derive(Debug)]
enum FeedForward {
    Gated {
        wi_0: Linear,
        wi_1: Linear,
        wo: Linear,
    },
    Plain {
        wi: Linear,
        wo: Linear,
    },
}

impl FeedForward {
    fn new(p: nn::Path, cfg: &T5Config, gated: bool) -> Self {
        let (d, ff) = (cfg.d_model, cfg.d_ff);
        if gated {
            Self::Gated {
                wi_0: Linear::new(&p / "wi_0", d, ff, false),
                wi_1: Linear::new(&p / "wi_1", d, ff, false),
                wo: Linear::new(&p / "wo", ff, d, false),
            }
        } else {
            Self::Plain {
                wi: Linear::new(&p / "wi", d, ff, false),
                wo: Linear::new(&p / "wo", ff, d, false),
            }
        }
    }

    fn forward(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        let (h, wo) = match self {
            Self::Gated { wi_0, wi_1, wo } => {
                (act.apply(&wi_0.forward(x)?)?.f_mul(&wi_1.forward(x)?)?, wo)
            }
            Self::Plain { wi, wo } => (act.apply(&wi.forward(x)?)?, wo),
        };
        // `wo` may be kept in f32 (fp16 models): its input follows it.
        wo.forward(&h.f_to_kind(wo.weight.kind())?)
    }
}

#[derive(Debug)]
struct Block {
    attn_norm: T5LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ff_norm: T5LayerNorm,
    ff: FeedForward,
}

impl Block {
    fn new(p: nn::Path, cfg: &T5Config, gated: bool) -> Self {
        let inner = cfg.num_heads * cfg.d_kv;
        let attn_layer = &p / "layer" / 0;
        let attn = &attn_layer / "SelfAttention";
        let ff_layer = &p / "layer" / 1;
        Self {
            attn_norm: T5LayerNorm::new(
                &attn_layer / "layer_norm",
                cfg.d_model,
                cfg.layer_norm_epsilon,
            ),
            q: Linear::new(&attn / "q", cfg.d_model, inner, false),
            k: Linear::new(&attn / "k", cfg.d_model, inner, false),
            v: Linear::new(&attn / "v", cfg.d_model, inner, false),
            o: Linear::new(&attn / "o", inner, cfg.d_model, false),
            ff_norm: T5LayerNorm::new(
                &ff_layer / "layer_norm",
                cfg.d_model,
                cfg.layer_norm_epsilon,
            ),
            ff: FeedForward::new(&ff_layer / "DenseReluDense", cfg, gated),
        }
    }

    fn forward(
        &self,
        x: &Tensor,
        position_bias: &Tensor,
        cfg: &T5Config,
        act: Activation,
    ) -> Result<Tensor> {
        let (b, t, _) = x.size3()?;
        let h = self.attn_norm.forward(x)?;
        let split = |y: Tensor| -> Result<Tensor> {
            Ok(y.f_view([b, t, cfg.num_heads, cfg.d_kv])?
                .f_transpose(1, 2)?)
        };
        let q = split(self.q.forward(&h)?)?;
        let k = split(self.k.forward(&h)?)?;
        let v = split(self.v.forward(&h)?)?;
        // T5 does not scale q·k; the position bias is added to the scores.
        let a = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            Some(position_bias.f_to_kind(q.kind())?),
            0.0,
            false,
            1.0,
            false,
        )?;
        let a = a
            .f_transpose(1, 2)?
            .f_reshape([b, t, cfg.num_heads * cfg.d_kv])?;
        let x = clamp_fp16(x.f_add(&self.o.forward(&a)?)?)?;
        let ff = self.ff.forward(&self.ff_norm.forward(&x)?, act)?;
        clamp_fp16(x.f_add(&ff)?)
    }
}

/// transformers clamps fp16 hidden states so an overflow to infinity stays finite.
fn clamp_fp16(x: Tensor) -> Result<Tensor> {
    if x.kind() != Kind::Half {
        return Ok(x);
    }
    let max = f64::from(half::f16::MAX);
    let any_inf = x.f_isinf()?.f_any()?.f_int64_value(&[])? != 0;
    let limit = if any_inf { max - 1000.0 } else { max };
    Ok(x.f_clamp(-limit, limit)?)
}

/// The T5 encoder stack with its shared embedding.
#[derive(Debug)]
pub struct T5EncoderModel {
    pub config: T5Config,
    shared: nn::Embedding,
    relative_attention_bias: nn::Embedding,
    blocks: Vec<Block>,
    final_layer_norm: T5LayerNorm,
    activation: Activation,
}

impl T5EncoderModel {
    /// Parameters under `p` with transformers' key names (`shared`, `encoder.block.N...`).
    pub fn new(p: &nn::Path, config: T5Config) -> Result<Self> {
        config.validate()?;
        let (gated, activation) = config.feed_forward()?;
        let encoder = p / "encoder";
        let blocks_path = &encoder / "block";
        let blocks: Vec<Block> = (0..config.num_layers)
            .map(|i| Block::new(&blocks_path / i, &config, gated))
            .collect();
        Ok(Self {
            shared: nn::embedding(
                p / "shared",
                config.vocab_size,
                config.d_model,
                Default::default(),
            ),
            relative_attention_bias: nn::embedding(
                &blocks_path / 0 / "layer" / 0 / "SelfAttention" / "relative_attention_bias",
                config.relative_attention_num_buckets,
                config.num_heads,
                Default::default(),
            ),
            blocks,
            final_layer_norm: T5LayerNorm::new(
                &encoder / "final_layer_norm",
                config.d_model,
                config.layer_norm_epsilon,
            ),
            activation,
            config,
        })
    }

    /// Load a transformers `T5EncoderModel` folder (`config.json` + safetensors, sharded or not).
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<(Self, nn::VarStore)> {
        let config = T5Config::from_dir(dir)?;
        let mut vs = crate::weights::new_store(device, kind);
        let model = Self::new(&vs.root(), config)?;
        let plan = LoadPlan {
            kind,
            // The embedding is tied: some checkpoints hold it as the encoder's own.
            rename: &|key| (key == "encoder.embed_tokens.weight").then(|| "shared.weight".into()),
            keep_f32: &|name| kind == Kind::Half && name.ends_with("DenseReluDense.wo.weight"),
        };
        weights::load_frozen_planned(&mut vs, dir, &plan, "T5 encoder")?;
        Ok((model, vs))
    }

    pub fn device_kind(&self) -> (Device, Kind) {
        let w = &self.shared.ws;
        (w.device(), w.kind())
    }

    /// The relative position bias `[1, heads, T, T]` of a bidirectional encoder.
    fn position_bias(&self, t: i64, device: Device) -> Result<Tensor> {
        let positions = Tensor::f_arange(t, (Kind::Int64, device))?;
        let relative = positions
            .f_unsqueeze(0)?
            .f_sub(&positions.f_unsqueeze(1)?)?;
        let buckets = relative_position_bucket(
            &relative,
            self.config.relative_attention_num_buckets,
            self.config.relative_attention_max_distance,
        )?;
        Ok(buckets
            .apply(&self.relative_attention_bias)
            .f_permute([2, 0, 1])?
            .f_unsqueeze(0)?)
    }

    /// `input_ids` `[B, T]` (int64) to the last hidden state `[B, T, d_model]`.
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, t) = input_ids.size2()?;
        let (device, _) = self.device_kind();
        let mut x = input_ids.f_to_device(device)?.apply(&self.shared);
        let bias = self.position_bias(t, device)?;
        for block in &self.blocks {
            x = block.forward(&x, &bias, &self.config, self.activation)?;
        }
        self.final_layer_norm.forward(&x)
    }
}

/// Mesh TensorFlow's bucketing of `key - query` offsets, bidirectional: half the buckets for
/// each sign; in each half, exact offsets below `num_buckets / 4`, logarithmic bins up to
/// `max_distance`, and one bucket for everything beyond.
fn relative_position_bucket(
    relative: &Tensor,
    num_buckets: i64,
    max_distance: i64,
) -> Result<Tensor> {
    let half = num_buckets / 2;
    let sign_offset = relative
        .f_gt(0)?
        .f_to_kind(Kind::Int64)?
        .f_mul_scalar(half)?;
    let distance = relative.f_abs()?;
    let max_exact = half / 2;
    let is_small = distance.f_lt(max_exact)?;
    let log_ratio = distance
        .f_to_kind(Kind::Float)?
        .f_div_scalar(max_exact as f64)?
        .f_log()?
        .f_div_scalar((max_distance as f64 / max_exact as f64).ln())?
        .f_mul_scalar((half - max_exact) as f64)?;
    let large = log_ratio
        .f_to_kind(Kind::Int64)?
        .f_add_scalar(max_exact)?
        .f_clamp_max(half - 1)?;
    Ok(sign_offset.f_add(&distance.f_where_self(&is_small, &large)?)?)
}
