//! What an SD pipeline folder's text side and VAE can be: the CLIP encoders and AutoencoderKL
//! of real checkpoints, or diffmesh's tiny text encoder and pixel codec (the tiny UNet's), which
//! `model_index.json` names by class.
use super::SdPrompt;
use crate::components::{LatentCodec, TextEncoder};
use crate::error::{read_json, ModelError, Result};
use crate::text::{ClipTextModel, ClipTextModelWithProjection, PromptTokenizer};
use crate::tiny::{DiffmeshPixelCodec, DiffmeshTinyTextEncoder};
use crate::vae::AutoencoderKL;
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

/// `model_index.json`'s `[library, class]` of `component`, if it names one.
pub(super) fn component_class(dir: &Path, component: &str) -> Option<String> {
    let index: serde_json::Value = read_json(&dir.join("model_index.json")).ok()?;
    index.get(component)?.get(1)?.as_str().map(str::to_owned)
}

/// The text encoders of the family: SD 1.x/2.x's one CLIP encoder (its last hidden states),
/// SDXL's CLIP-L and OpenCLIP-bigG (their penultimate hidden states concatenated), or the tiny
/// model's word-level encoder (its token states).
pub(super) enum TextSide {
    Clip(Box<ClipSide>),
    Tiny(Box<DiffmeshTinyTextEncoder>),
}

pub(super) struct ClipSide {
    tokenizer: PromptTokenizer,
    encoder: ClipTextModel,
    /// SDXL's second encoder.
    second: Option<SecondEncoder>,
}

pub(super) struct SecondEncoder {
    tokenizer: PromptTokenizer,
    encoder: ClipTextModelWithProjection,
}

impl TextSide {
    /// Load the folder's text side; `xl` loads SDXL's second encoder. The weights' stores are
    /// pushed on `stores`.
    pub(super) fn load(
        dir: &Path,
        xl: bool,
        device: Device,
        kind: Kind,
        stores: &mut Vec<nn::VarStore>,
    ) -> Result<Self> {
        if component_class(dir, "text_encoder").as_deref()
            == Some(crate::tiny::text_encoder::CLASS_NAME)
        {
            if xl {
                return Err(ModelError::config(
                    "text_encoder",
                    "an SDXL pipeline needs its two CLIP encoders, not the tiny text encoder",
                ));
            }
            let (encoder, vs) = DiffmeshTinyTextEncoder::load(&dir.join("text_encoder"), device)?;
            stores.push(vs);
            return Ok(TextSide::Tiny(Box::new(encoder)));
        }
        let tokenizer = PromptTokenizer::load(&dir.join("tokenizer"), Some("CLIPTokenizer"))?;
        let (encoder, vs1) = ClipTextModel::load(&dir.join("text_encoder"), device, kind)?;
        stores.push(vs1);
        let second = if xl {
            let tokenizer_2 =
                PromptTokenizer::load(&dir.join("tokenizer_2"), Some("CLIPTokenizer"))?;
            let (encoder_2, vs2) =
                ClipTextModelWithProjection::load(&dir.join("text_encoder_2"), device, kind)?;
            stores.push(vs2);
            Some(SecondEncoder {
                tokenizer: tokenizer_2,
                encoder: encoder_2,
            })
        } else {
            None
        };
        Ok(TextSide::Clip(Box::new(ClipSide {
            tokenizer,
            encoder,
            second,
        })))
    }

    /// Tokens every prompt is padded or cut to (the first tokenizer's `model_max_length`, 77
    /// where it sets none; the tiny encoder's fixed length).
    pub(super) fn max_tokens(&self) -> i64 {
        match self {
            TextSide::Clip(clip) => clip.tokenizer.model_max_length().unwrap_or(77) as i64,
            TextSide::Tiny(encoder) => encoder.max_tokens(),
        }
    }

    pub(super) fn is_xl(&self) -> bool {
        matches!(self, TextSide::Clip(clip) if clip.second.is_some())
    }

    /// `encode_prompt` of one prompt padded to each tokenizer's length.
    pub(super) fn encode(&self, prompt: &str) -> Result<SdPrompt> {
        let (tokenizer, encoder, second) = match self {
            TextSide::Tiny(encoder) => {
                return Ok(SdPrompt {
                    embeds: encoder.encode(&[prompt.to_owned()])?.hidden,
                    pooled: None,
                })
            }
            TextSide::Clip(clip) => (&clip.tokenizer, &clip.encoder, &clip.second),
        };
        let ids = |t: &PromptTokenizer| -> Result<Tensor> {
            let length = t.model_max_length().unwrap_or(77);
            let ids: Vec<i64> = t
                .encode_padded(prompt, length)?
                .into_iter()
                .map(i64::from)
                .collect();
            Ok(Tensor::from_slice(&ids).f_unsqueeze(0)?)
        };
        let first = encoder.forward(&ids(tokenizer)?)?;
        match second {
            None => Ok(SdPrompt {
                embeds: first.last_hidden_state,
                pooled: None,
            }),
            Some(second) => {
                let second = second.encoder.forward(&ids(&second.tokenizer)?)?;
                Ok(SdPrompt {
                    embeds: Tensor::f_cat(
                        &[
                            &first.penultimate_hidden_state,
                            &second.text.penultimate_hidden_state,
                        ],
                        -1,
                    )?,
                    pooled: Some(second.text_embeds),
                })
            }
        }
    }
}

/// The pipeline's VAE: a real checkpoint's AutoencoderKL, or the tiny model's pixel codec.
pub enum SdVae {
    Kl(Box<AutoencoderKL>),
    Pixel(DiffmeshPixelCodec),
}

impl SdVae {
    pub(super) fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let folder = dir.join("vae");
        if component_class(dir, "vae").as_deref() == Some(crate::tiny::codec::CLASS_NAME) {
            return Ok(SdVae::Pixel(DiffmeshPixelCodec::load(&folder, device)?));
        }
        Ok(SdVae::Kl(Box::new(AutoencoderKL::load(
            &folder, device, kind,
        )?)))
    }

    fn codec(&self) -> &dyn LatentCodec {
        match self {
            SdVae::Kl(vae) => vae.as_ref(),
            SdVae::Pixel(codec) => codec,
        }
    }

    /// The dtype latents are decoded in (the pixel codec's is f32).
    pub fn kind(&self) -> Kind {
        match self {
            SdVae::Kl(vae) => vae.device_kind().1,
            SdVae::Pixel(_) => Kind::Float,
        }
    }
}

impl LatentCodec for SdVae {
    fn encode(&self, images: &Tensor) -> Result<Tensor> {
        self.codec().encode(images)
    }

    fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        self.codec().decode(latents)
    }

    fn latent_channels(&self) -> i64 {
        self.codec().latent_channels()
    }

    fn downscale_factor(&self) -> i64 {
        self.codec().downscale_factor()
    }

    fn resident_bytes(&self) -> u64 {
        self.codec().resident_bytes()
    }
}
