//! `CLIPTextModel` as in transformers 5.25 (`models/clip/modeling_clip.py`): token + learned
//! position embeddings, pre-norm causal self-attention layers, a final LayerNorm, and the pooled
//! output taken at the end-of-text token. FLUX.1 reads the pooled output of CLIP ViT-L/14.
//!
//! Checkpoints load by transformers' key names, with or without the `text_model.` prefix that
//! checkpoints written before transformers 5 carry (FLUX.1's `text_encoder/`).
use super::activation::Activation;
use crate::error::{read_json, ModelError, Result};
use crate::flux::layers::Linear;
use crate::weights::{self, LoadPlan};
use serde::Deserialize;
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

pub const CLASS_NAME: &str = "CLIPTextModel";

/// Mirrors `text_encoder/config.json` (`CLIPTextConfig`); defaults are transformers'.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default)]
pub struct ClipTextConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub max_position_embeddings: i64,
    pub hidden_act: String,
    pub layer_norm_eps: f64,
    /// 2 in checkpoints from before transformers#24773 (FLUX.1's): the pooled token is then the
    /// highest id of each prompt, which is the end-of-text token.
    pub eos_token_id: i64,
}

impl Default for ClipTextConfig {
    fn default() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 512,
            intermediate_size: 2048,
            num_hidden_layers: 12,
            num_attention_heads: 8,
            max_position_embeddings: 77,
            hidden_act: "quick_gelu".into(),
            layer_norm_eps: 1e-5,
            eos_token_id: 49407,
        }
    }
}

impl ClipTextConfig {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg: Self = read_json(&dir.join("config.json"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v < 1 {
                return Err(ModelError::config(
                    field,
                    format!("must be positive, got {v}"),
                ));
            }
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err(ModelError::config(
                "num_attention_heads",
                format!(
                    "hidden_size {} is not divisible by {} heads",
                    self.hidden_size, self.num_attention_heads
                ),
            ));
        }
        Activation::parse("hidden_act", &self.hidden_act)?;
        Ok(())
    }
}

/// What the text model returns for a batch of token ids.
#[derive(Debug)]
pub struct ClipTextOutput {
    /// `[B, T, hidden_size]` after the final LayerNorm.
    pub last_hidden_state: Tensor,
    /// `[B, hidden_size]`: `last_hidden_state` at each prompt's end-of-text token.
    pub pooler_output: Tensor,
    /// `[B, T, hidden_size]`: transformers' `hidden_states[-2]`, the output of the layer
    /// before the last, without the final LayerNorm (what SDXL's pipelines condition on).
    pub penultimate_hidden_state: Tensor,
}

#[derive(Debug)]
struct EncoderLayer {
    layer_norm1: nn::LayerNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    layer_norm2: nn::LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl EncoderLayer {
    fn new(p: nn::Path, cfg: &ClipTextConfig) -> Self {
        let d = cfg.hidden_size;
        let ln = nn::LayerNormConfig {
            eps: cfg.layer_norm_eps,
            ..Default::default()
        };
        let attn = &p / "self_attn";
        let mlp = &p / "mlp";
        Self {
            layer_norm1: nn::layer_norm(&p / "layer_norm1", vec![d], ln),
            q_proj: Linear::new(&attn / "q_proj", d, d, true),
            k_proj: Linear::new(&attn / "k_proj", d, d, true),
            v_proj: Linear::new(&attn / "v_proj", d, d, true),
            out_proj: Linear::new(&attn / "out_proj", d, d, true),
            layer_norm2: nn::layer_norm(&p / "layer_norm2", vec![d], ln),
            fc1: Linear::new(&mlp / "fc1", d, cfg.intermediate_size, true),
            fc2: Linear::new(&mlp / "fc2", cfg.intermediate_size, d, true),
        }
    }

    fn forward(&self, x: &Tensor, heads: i64, act: Activation) -> Result<Tensor> {
        let (b, t, d) = x.size3()?;
        let h = x.apply(&self.layer_norm1);
        let split = |y: Tensor| -> Result<Tensor> {
            Ok(y.f_view([b, t, heads, d / heads])?.f_transpose(1, 2)?)
        };
        let q = split(self.q_proj.forward(&h)?)?;
        let k = split(self.k_proj.forward(&h)?)?;
        let v = split(self.v_proj.forward(&h)?)?;
        // Causal, scaled by head_dim^-0.5; FluxPipeline passes no padding mask.
        let a = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<&Tensor>,
            0.0,
            true,
            None,
            false,
        )?;
        let a = a.f_transpose(1, 2)?.f_reshape([b, t, d])?;
        let x = x + self.out_proj.forward(&a)?;
        let h = act.apply(&self.fc1.forward(&x.apply(&self.layer_norm2))?)?;
        Ok(x.f_add(&self.fc2.forward(&h)?)?)
    }
}

/// The CLIP text transformer.
#[derive(Debug)]
pub struct ClipTextModel {
    pub config: ClipTextConfig,
    token_embedding: nn::Embedding,
    position_embedding: nn::Embedding,
    layers: Vec<EncoderLayer>,
    final_layer_norm: nn::LayerNorm,
    activation: Activation,
}

impl ClipTextModel {
    /// Parameters under `p` with transformers 5's key names (no `text_model.` prefix).
    pub fn new(p: &nn::Path, config: ClipTextConfig) -> Result<Self> {
        config.validate()?;
        let d = config.hidden_size;
        let embeddings = p / "embeddings";
        let layers_path = p / "encoder" / "layers";
        let layers = (0..config.num_hidden_layers)
            .map(|i| EncoderLayer::new(&layers_path / i, &config))
            .collect();
        Ok(Self {
            token_embedding: nn::embedding(
                &embeddings / "token_embedding",
                config.vocab_size,
                d,
                Default::default(),
            ),
            position_embedding: nn::embedding(
                &embeddings / "position_embedding",
                config.max_position_embeddings,
                d,
                Default::default(),
            ),
            layers,
            final_layer_norm: nn::layer_norm(
                p / "final_layer_norm",
                vec![d],
                nn::LayerNormConfig {
                    eps: config.layer_norm_eps,
                    ..Default::default()
                },
            ),
            activation: Activation::parse("hidden_act", &config.hidden_act)?,
            config,
        })
    }

    /// Load a transformers `CLIPTextModel` folder (`config.json` + safetensors) as `kind`.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<(Self, nn::VarStore)> {
        let config = ClipTextConfig::from_dir(dir)?;
        let mut vs = crate::weights::new_store(device, kind);
        let model = Self::new(&vs.root(), config)?;
        let plan = LoadPlan {
            kind,
            rename: &|key| key.strip_prefix("text_model.").map(str::to_string),
            keep_f32: &|_| false,
        };
        weights::load_frozen_planned(&mut vs, dir, &plan, "CLIP text model")?;
        Ok((model, vs))
    }

    pub fn device_kind(&self) -> (Device, Kind) {
        let w = &self.token_embedding.ws;
        (w.device(), w.kind())
    }

    /// `input_ids` `[B, T]` (int64, T ≤ max_position_embeddings).
    pub fn forward(&self, input_ids: &Tensor) -> Result<ClipTextOutput> {
        let (b, t) = input_ids.size2()?;
        if t > self.config.max_position_embeddings {
            return Err(ModelError::input(
                "input_ids",
                format!(
                    "{t} tokens exceed max_position_embeddings {}",
                    self.config.max_position_embeddings
                ),
            ));
        }
        let (device, _) = self.device_kind();
        let ids = input_ids.f_to_device(device)?;
        let positions = Tensor::f_arange(t, (Kind::Int64, device))?;
        let mut x = ids
            .apply(&self.token_embedding)
            .f_add(&positions.apply(&self.position_embedding))?;
        let heads = self.config.num_attention_heads;
        let mut penultimate = x.shallow_clone();
        for layer in &self.layers {
            penultimate = x.shallow_clone();
            x = layer.forward(&x, heads, self.activation)?;
        }
        let last = x.apply(&self.final_layer_norm);
        // transformers' choice of the pooled token: the highest id under the legacy eos id 2,
        // else the first end-of-text token.
        let eos_at = if self.config.eos_token_id == 2 {
            ids.f_argmax(-1, false)?
        } else {
            ids.f_eq(self.config.eos_token_id)?
                .f_to_kind(Kind::Int)?
                .f_argmax(-1, false)?
        };
        let rows = Tensor::f_arange(b, (Kind::Int64, device))?;
        let pooled = last.f_index(&[Some(rows), Some(eos_at)])?;
        Ok(ClipTextOutput {
            last_hidden_state: last,
            pooler_output: pooled,
            penultimate_hidden_state: penultimate,
        })
    }
}

pub const WITH_PROJECTION_CLASS_NAME: &str = "CLIPTextModelWithProjection";

/// `CLIPTextModelWithProjection` (SDXL's second text encoder, OpenCLIP-bigG): the text model
/// and `text_projection` (no bias) of its pooled output.
#[derive(Debug)]
pub struct ClipTextModelWithProjection {
    pub text_model: ClipTextModel,
    text_projection: Linear,
}

/// What the projecting text model returns.
#[derive(Debug)]
pub struct ClipProjectedOutput {
    /// `[B, projection_dim]`: the projected pooled output (SDXL's pooled `text_embeds`).
    pub text_embeds: Tensor,
    pub text: ClipTextOutput,
}

impl ClipTextModelWithProjection {
    /// Parameters under `p`: the text model's (transformers 5's names without `text_model.`)
    /// and `text_projection`.
    pub fn new(p: &nn::Path, config: ClipTextConfig, projection_dim: i64) -> Result<Self> {
        if projection_dim < 1 {
            return Err(ModelError::config(
                "projection_dim",
                format!("must be positive, got {projection_dim}"),
            ));
        }
        let d = config.hidden_size;
        Ok(Self {
            text_model: ClipTextModel::new(p, config)?,
            text_projection: Linear::new(p / "text_projection", d, projection_dim, false),
        })
    }

    /// Load a transformers `CLIPTextModelWithProjection` folder as `kind`.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<(Self, nn::VarStore)> {
        #[derive(Deserialize)]
        struct Projection {
            projection_dim: Option<i64>,
        }
        let config = ClipTextConfig::from_dir(dir)?;
        let projection: Projection = read_json(&dir.join("config.json"))?;
        let projection_dim = projection.projection_dim.unwrap_or(512);
        let mut vs = crate::weights::new_store(device, kind);
        let model = Self::new(&vs.root(), config, projection_dim)?;
        let plan = LoadPlan {
            kind,
            rename: &|key| key.strip_prefix("text_model.").map(str::to_string),
            keep_f32: &|_| false,
        };
        weights::load_frozen_planned(&mut vs, dir, &plan, "CLIP text model with projection")?;
        Ok((model, vs))
    }

    /// `input_ids` `[B, T]` (int64).
    pub fn forward(&self, input_ids: &Tensor) -> Result<ClipProjectedOutput> {
        let text = self.text_model.forward(input_ids)?;
        Ok(ClipProjectedOutput {
            text_embeds: self.text_projection.forward(&text.pooler_output)?,
            text,
        })
    }
}
