//! The interfaces pipelines use, so one pipeline serves real checkpoints and the tiny model alike.
use crate::error::Result;
use tch::Tensor;

/// Prompt embeddings as Flux consumes them.
#[derive(Debug)]
pub struct TextEmbeddings {
    /// `[B, T, joint_attention_dim]`: the per-token sequence (T5's role in Flux).
    pub hidden: Tensor,
    /// `[B, pooled_projection_dim]`: one vector per prompt (CLIP's pooled output in Flux).
    pub pooled: Tensor,
}

/// Turns prompts into embeddings.
pub trait TextEncoder: Send {
    fn encode(&self, prompts: &[String]) -> Result<TextEmbeddings>;
    /// Number of text tokens T every prompt is padded/truncated to.
    fn max_tokens(&self) -> i64;
    /// Pad and truncate to `max_tokens` from now on (FLUX.1's `max_sequence_length`); an encoder
    /// with one fixed length accepts only that length.
    fn set_max_tokens(&mut self, max_tokens: i64) -> Result<()> {
        if max_tokens == self.max_tokens() {
            return Ok(());
        }
        Err(crate::error::ModelError::input(
            "max_sequence_length",
            format!(
                "this model's text encoder pads to {} tokens, not {max_tokens}",
                self.max_tokens()
            ),
        ))
    }
}

/// Maps images to the latent space the transformer denoises and back.
/// Images are `[B, 3, H, W]` floats in [-1, 1]; latents are `[B, C, H/f, W/f]`, already scaled
/// (for AutoencoderKL: `(mean - shift_factor) * scaling_factor`).
pub trait LatentCodec: Send {
    fn encode(&self, images: &Tensor) -> Result<Tensor>;
    fn decode(&self, latents: &Tensor) -> Result<Tensor>;
    fn latent_channels(&self) -> i64;
    /// Spatial downscale factor f from pixels to latents.
    fn downscale_factor(&self) -> i64;
    /// Bytes its weights take (0 for a codec without weights).
    fn resident_bytes(&self) -> u64 {
        0
    }
}
