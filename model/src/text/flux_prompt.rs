//! FLUX.1's prompt encoding (diffusers' `FluxPipeline.encode_prompt`): CLIP-L's pooled output of
//! the prompt padded to the CLIP tokenizer's `model_max_length` (77), and T5's last hidden states
//! of the prompt padded to `max_sequence_length`. Neither encoder gets an attention mask, as in
//! diffusers: padding tokens are encoded like any other.
use super::{ClipTextModel, PromptTokenizer, T5EncoderModel};
use crate::components::{TextEmbeddings, TextEncoder};
use crate::error::{ModelError, Result};
use tch::Tensor;

/// diffusers' limit on `max_sequence_length` (`FluxPipeline.check_inputs`).
pub const MAX_SEQUENCE_LENGTH_LIMIT: i64 = 512;

/// What `FluxPipeline.__call__` pads T5 prompts to unless told otherwise.
pub const DEFAULT_MAX_SEQUENCE_LENGTH: i64 = 512;

/// CLIP's length when its tokenizer folder sets no `model_max_length` (diffusers' fallback).
const CLIP_FALLBACK_LENGTH: usize = 77;

/// The two tokenizers and two encoders of a FLUX.1 directory, as one [`TextEncoder`].
pub struct FluxPromptEncoder {
    clip_tokenizer: PromptTokenizer,
    clip: ClipTextModel,
    t5_tokenizer: PromptTokenizer,
    t5: T5EncoderModel,
    clip_length: usize,
    max_sequence_length: i64,
}

impl FluxPromptEncoder {
    /// Pair the components; CLIP's length comes from its tokenizer (`tokenizer_max_length`).
    pub fn new(
        clip_tokenizer: PromptTokenizer,
        clip: ClipTextModel,
        t5_tokenizer: PromptTokenizer,
        t5: T5EncoderModel,
    ) -> Result<Self> {
        let clip_length = clip_tokenizer
            .model_max_length()
            .unwrap_or(CLIP_FALLBACK_LENGTH);
        if clip_length as i64 > clip.config.max_position_embeddings {
            return Err(ModelError::config(
                "tokenizer.model_max_length",
                format!(
                    "{clip_length} exceeds the CLIP text encoder's max_position_embeddings {}",
                    clip.config.max_position_embeddings
                ),
            ));
        }
        Ok(Self {
            clip_tokenizer,
            clip,
            t5_tokenizer,
            t5,
            clip_length,
            max_sequence_length: DEFAULT_MAX_SEQUENCE_LENGTH,
        })
    }

    /// Token ids `[B, length]` of `prompts`, padded and truncated as the pipeline asks.
    fn ids(tokenizer: &PromptTokenizer, prompts: &[String], length: usize) -> Result<Tensor> {
        let mut ids = Vec::with_capacity(prompts.len() * length);
        for prompt in prompts {
            ids.extend(
                tokenizer
                    .encode_padded(prompt, length)?
                    .into_iter()
                    .map(i64::from),
            );
        }
        Ok(Tensor::from_slice(&ids).f_view([prompts.len() as i64, length as i64])?)
    }

    /// `encode_prompt` with T5 padded to `max_sequence_length` (1..=512).
    pub fn encode_with_length(
        &self,
        prompts: &[String],
        max_sequence_length: i64,
    ) -> Result<TextEmbeddings> {
        check_max_sequence_length(max_sequence_length)?;
        if prompts.is_empty() {
            return Err(ModelError::input(
                "prompts",
                "at least one prompt is required",
            ));
        }
        tch::no_grad(|| {
            let clip_ids = Self::ids(&self.clip_tokenizer, prompts, self.clip_length)?;
            let pooled = self.clip.forward(&clip_ids)?.pooler_output;
            let t5_ids = Self::ids(&self.t5_tokenizer, prompts, max_sequence_length as usize)?;
            let hidden = self.t5.forward(&t5_ids)?;
            // diffusers casts each output to its encoder's dtype (T5 in f16 keeps some f32).
            let (_, t5_kind) = self.t5.device_kind();
            let (_, clip_kind) = self.clip.device_kind();
            Ok(TextEmbeddings {
                hidden: hidden.f_to_kind(t5_kind)?,
                pooled: pooled.f_to_kind(clip_kind)?,
            })
        })
    }
}

fn check_max_sequence_length(n: i64) -> Result<()> {
    if !(1..=MAX_SEQUENCE_LENGTH_LIMIT).contains(&n) {
        return Err(ModelError::input(
            "max_sequence_length",
            format!("{n} is not in 1..={MAX_SEQUENCE_LENGTH_LIMIT}"),
        ));
    }
    Ok(())
}

impl TextEncoder for FluxPromptEncoder {
    fn encode(&self, prompts: &[String]) -> Result<TextEmbeddings> {
        self.encode_with_length(prompts, self.max_sequence_length)
    }

    fn max_tokens(&self) -> i64 {
        self.max_sequence_length
    }

    fn set_max_tokens(&mut self, max_tokens: i64) -> Result<()> {
        check_max_sequence_length(max_tokens)?;
        self.max_sequence_length = max_tokens;
        Ok(())
    }
}
