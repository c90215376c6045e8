//! `DiffmeshTinyTextEncoder`: word embeddings + learned positions + a few pre-norm transformer
//! layers, trained jointly with the tiny Flux transformer.
//!
//! It plays both of Flux's text roles: the per-token sequence (T5's) and a pooled vector (CLIP's),
//! the mean of the non-pad token states passed through a linear projection.
use super::tokenizer::WordTokenizer;
use crate::components::{TextEmbeddings, TextEncoder};
use crate::error::{read_json, ModelError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tch::{nn, nn::Module, Device, Kind, Tensor};

pub const CLASS_NAME: &str = "DiffmeshTinyTextEncoder";

/// `text_encoder/config.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TinyTextEncoderConfig {
    #[serde(rename = "_class_name")]
    pub class_name: String,
    pub vocab_size: i64,
    pub max_tokens: i64,
    /// Width of the token states; equals the transformer's `joint_attention_dim`.
    pub hidden_size: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub pooled_projection_dim: i64,
}

impl TinyTextEncoderConfig {
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("max_tokens", self.max_tokens),
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("pooled_projection_dim", self.pooled_projection_dim),
        ];
        for (field, v) in positive {
            if v <= 0 {
                return Err(ModelError::config(
                    field,
                    format!("must be positive, got {v}"),
                ));
            }
        }
        if self.hidden_size % self.num_heads != 0 {
            return Err(ModelError::config(
                "num_heads",
                format!(
                    "{} does not divide hidden_size {}",
                    self.num_heads, self.hidden_size
                ),
            ));
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Layer {
    norm1: nn::LayerNorm,
    qkv: nn::Linear,
    out: nn::Linear,
    norm2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
    heads: i64,
}

impl Layer {
    fn new(p: &nn::Path, dim: i64, heads: i64) -> Self {
        let ln = nn::LayerNormConfig::default();
        Layer {
            norm1: nn::layer_norm(p / "norm1", vec![dim], ln),
            qkv: nn::linear(p / "attn" / "qkv", dim, 3 * dim, Default::default()),
            out: nn::linear(p / "attn" / "out", dim, dim, Default::default()),
            norm2: nn::layer_norm(p / "norm2", vec![dim], ln),
            fc1: nn::linear(p / "mlp" / "fc1", dim, 4 * dim, Default::default()),
            fc2: nn::linear(p / "mlp" / "fc2", 4 * dim, dim, Default::default()),
            heads,
        }
    }

    /// `x`: [B, T, D]; `key_mask`: bool [B, 1, 1, T], true where a key may be attended.
    fn forward(&self, x: &Tensor, key_mask: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.size3()?;
        let qkv = self.qkv.forward(&self.norm1.forward(x));
        let qkv = qkv
            .f_view([b, t, 3, self.heads, d / self.heads])?
            .f_permute([2, 0, 3, 1, 4])?;
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let a = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            Some(key_mask),
            0.0,
            false,
            None,
            false,
        )?;
        let a = a.f_transpose(1, 2)?.f_reshape([b, t, d])?;
        let x = x + self.out.forward(&a);
        let h = self
            .fc2
            .forward(&self.fc1.forward(&self.norm2.forward(&x)).f_gelu("tanh")?);
        Ok(x + h)
    }
}

/// The tiny text encoder. Parameters live in the `VarStore` the caller passes in (so training can
/// optimise them), with the key names written to `text_encoder/model.safetensors`.
#[derive(Debug)]
pub struct DiffmeshTinyTextEncoder {
    config: TinyTextEncoderConfig,
    tokenizer: WordTokenizer,
    embed_tokens: nn::Embedding,
    embed_positions: nn::Embedding,
    layers: Vec<Layer>,
    final_norm: nn::LayerNorm,
    pooled_proj: nn::Linear,
    device: Device,
}

impl DiffmeshTinyTextEncoder {
    pub fn new(
        p: &nn::Path,
        config: TinyTextEncoderConfig,
        tokenizer: WordTokenizer,
    ) -> Result<Self> {
        config.validate()?;
        if tokenizer.vocab_size() > config.vocab_size {
            return Err(ModelError::config(
                "vocab_size",
                format!(
                    "{} is smaller than the tokenizer's {}",
                    config.vocab_size,
                    tokenizer.vocab_size()
                ),
            ));
        }
        if tokenizer.max_tokens() != config.max_tokens {
            return Err(ModelError::config(
                "max_tokens",
                "differs from the tokenizer's",
            ));
        }
        let d = config.hidden_size;
        let emb = nn::EmbeddingConfig {
            ws_init: nn::Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
            ..Default::default()
        };
        Ok(DiffmeshTinyTextEncoder {
            embed_tokens: nn::embedding(p / "embed_tokens", config.vocab_size, d, emb),
            embed_positions: nn::embedding(p / "embed_positions", config.max_tokens, d, emb),
            layers: (0..config.num_layers)
                .map(|i| Layer::new(&(p / "layers" / i), d, config.num_heads))
                .collect(),
            final_norm: nn::layer_norm(p / "final_norm", vec![d], Default::default()),
            pooled_proj: nn::linear(
                p / "pooled_proj",
                d,
                config.pooled_projection_dim,
                Default::default(),
            ),
            device: p.device(),
            config,
            tokenizer,
        })
    }

    /// Load from a diffusers-style folder: `text_encoder_dir` holds `config.json` and
    /// `model.safetensors`; the vocabulary is read from the sibling `tokenizer/` folder.
    /// Returns the encoder with the `VarStore` that owns its weights.
    pub fn load(text_encoder_dir: &Path, device: Device) -> Result<(Self, nn::VarStore)> {
        let tokenizer_dir = text_encoder_dir
            .parent()
            .map(|p| p.join("tokenizer"))
            .ok_or_else(|| {
                ModelError::config("text_encoder", "folder has no parent to find tokenizer/ in")
            })?;
        let config: TinyTextEncoderConfig = read_json(&text_encoder_dir.join("config.json"))?;
        if config.class_name != CLASS_NAME {
            return Err(ModelError::Unsupported {
                component: "text_encoder".into(),
                class: config.class_name.clone(),
                reason: format!("expected {CLASS_NAME}"),
            });
        }
        let tokenizer = WordTokenizer::load(&tokenizer_dir, config.max_tokens)?;
        let mut vs = nn::VarStore::new(device);
        let encoder = Self::new(&vs.root(), config, tokenizer)?;
        crate::weights::load_strict(&mut vs, text_encoder_dir)?;
        Ok((encoder, vs))
    }

    pub fn config(&self) -> &TinyTextEncoderConfig {
        &self.config
    }

    pub fn tokenizer(&self) -> &WordTokenizer {
        &self.tokenizer
    }

    /// Encode token ids `[B, T]` (int64) into embeddings; the forward pass training differentiates.
    pub fn forward_ids(&self, ids: &Tensor) -> Result<TextEmbeddings> {
        let (_, t) = ids.size2()?;
        if t != self.config.max_tokens {
            return Err(ModelError::input(
                "ids",
                format!("expected {} tokens, got {t}", self.config.max_tokens),
            ));
        }
        let valid = ids.f_ne(self.tokenizer.pad_id())?; // [B, T]
        let key_mask = valid.f_unsqueeze(1)?.f_unsqueeze(1)?;
        let positions = Tensor::f_arange(t, (Kind::Int64, ids.device()))?;
        let mut x = self.embed_tokens.forward(ids)
            + self.embed_positions.forward(&positions).f_unsqueeze(0)?;
        for layer in &self.layers {
            x = layer.forward(&x, &key_mask)?;
        }
        let hidden = self.final_norm.forward(&x);
        let w = valid.f_to_kind(hidden.kind())?.f_unsqueeze(-1)?; // [B, T, 1]
        let count = w
            .f_sum_dim_intlist(1, false, hidden.kind())?
            .f_clamp_min(1.0)?;
        let mean = (&hidden * &w)
            .f_sum_dim_intlist(1, false, hidden.kind())?
            .f_div(&count)?;
        let pooled = self.pooled_proj.forward(&mean);
        Ok(TextEmbeddings { hidden, pooled })
    }

    /// Token ids `[B, T]` for `prompts`, on this encoder's device.
    pub fn tokenize(&self, prompts: &[String]) -> Result<Tensor> {
        let t = self.config.max_tokens;
        let ids: Vec<i64> = prompts
            .iter()
            .flat_map(|p| self.tokenizer.encode(p))
            .collect();
        Ok(Tensor::from_slice(&ids)
            .f_view([prompts.len() as i64, t])?
            .f_to_device(self.device)?)
    }
}

impl TextEncoder for DiffmeshTinyTextEncoder {
    fn encode(&self, prompts: &[String]) -> Result<TextEmbeddings> {
        if prompts.is_empty() {
            return Err(ModelError::input(
                "prompts",
                "at least one prompt is required",
            ));
        }
        let ids = self.tokenize(prompts)?;
        tch::no_grad(|| self.forward_ids(&ids))
    }

    fn max_tokens(&self) -> i64 {
        self.config.max_tokens
    }
}

/// Write `text_encoder/config.json` plus `tokenizer/vocab.json` and `tokenizer/tokenizer_config.json`.
pub fn save_configs(
    root: &Path,
    config: &TinyTextEncoderConfig,
    tokenizer: &WordTokenizer,
) -> Result<()> {
    let te = root.join("text_encoder");
    let tok = root.join("tokenizer");
    super::codec::write_json(&te.join("config.json"), config)?;
    tokenizer.save(&tok)?;
    let tok_config = serde_json::json!({
        "_class_name": "DiffmeshWordTokenizer",
        "model_max_length": tokenizer.max_tokens(),
        "pad_token": super::tokenizer::PAD,
        "unk_token": super::tokenizer::UNK,
        "bos_token": super::tokenizer::BOS,
    });
    super::codec::write_json(&tok.join("tokenizer_config.json"), &tok_config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> (nn::VarStore, DiffmeshTinyTextEncoder) {
        tch::manual_seed(0);
        let tok = WordTokenizer::for_generator(16);
        let config = TinyTextEncoderConfig {
            class_name: CLASS_NAME.into(),
            vocab_size: tok.vocab_size(),
            max_tokens: 16,
            hidden_size: 32,
            num_layers: 1,
            num_heads: 2,
            pooled_projection_dim: 24,
        };
        let vs = nn::VarStore::new(Device::Cpu);
        let enc = DiffmeshTinyTextEncoder::new(&vs.root(), config, tok).unwrap();
        (vs, enc)
    }

    #[test]
    fn shapes_and_padding_invariance() {
        let (vs, enc) = small();
        let out = enc
            .encode(&["a red circle on the left".into(), "".into()])
            .unwrap();
        assert_eq!(out.hidden.size(), vec![2, 16, 32]);
        assert_eq!(out.pooled.size(), vec![2, 24]);
        assert!(
            out.hidden.isfinite().all().int64_value(&[]) == 1,
            "empty prompt must not give NaN"
        );
        // Pad tokens are masked out: changing the pad embedding leaves the pooled vector alone.
        let ids = enc.tokenize(&["a red circle".into()]).unwrap();
        let base = tch::no_grad(|| enc.forward_ids(&ids)).unwrap();
        let table = vs.variables()["embed_tokens.weight"].shallow_clone();
        tch::no_grad(|| {
            let _ = table
                .get(enc.tokenizer().pad_id())
                .f_add_scalar_(3.0)
                .unwrap();
        });
        let again = tch::no_grad(|| enc.forward_ids(&ids)).unwrap();
        assert!(base.pooled.allclose(&again.pooled, 1e-5, 1e-5, false));
        // Different prompts give different embeddings.
        let other = enc.encode(&["a blue square".into()]).unwrap();
        assert!(!base.pooled.allclose(&other.pooled, 1e-4, 1e-4, false));
    }

    #[test]
    fn save_and_load_strict() {
        let (vs, enc) = small();
        let root = std::env::temp_dir().join(format!("diffmesh-te-{}", std::process::id()));
        save_configs(&root, enc.config(), enc.tokenizer()).unwrap();
        crate::weights::save(&vs, &root.join("text_encoder").join("model.safetensors")).unwrap();
        let (back, _vs2) =
            DiffmeshTinyTextEncoder::load(&root.join("text_encoder"), Device::Cpu).unwrap();
        let p = vec!["a green triangle in the center on a black background".to_string()];
        let (a, b) = (enc.encode(&p).unwrap(), back.encode(&p).unwrap());
        assert!(a.hidden.allclose(&b.hidden, 1e-6, 1e-6, false));
        std::fs::remove_dir_all(&root).ok();
    }
}
