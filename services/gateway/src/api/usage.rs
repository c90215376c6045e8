//! `usage` of the Images API's answers, as OpenAI reports it for its image models: tokens in
//! and out. The gateway runs no tokenizer, so `text_tokens` counts the prompt's words; image
//! tokens are the model's own (one per `token_pixels` square of its resolution: what a
//! mask-aware step computes per token), for an edit's input image and for every output image.
use serde::Serialize;
use utoipa::ToSchema;

use crate::job_driver::ImageRequest;
use diffmesh_shared::wire::messages::JobKind;

/// Token counts of one request.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ImageUsage {
    /// `text_tokens + image_tokens`.
    pub input_tokens: u64,
    pub input_tokens_details: InputTokens,
    /// The output images' model tokens, all images together.
    pub output_tokens: u64,
    pub total_tokens: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct InputTokens {
    /// Words of the prompt.
    pub text_tokens: u64,
    /// Model tokens of an edit's input image (0 for generations).
    pub image_tokens: u64,
}

impl ImageUsage {
    pub fn new(prompt: &str, input_image_tokens: u64, output_tokens: u64) -> Self {
        let text = prompt.split_whitespace().count() as u64;
        Self {
            input_tokens: text + input_image_tokens,
            input_tokens_details: InputTokens {
                text_tokens: text,
                image_tokens: input_image_tokens,
            },
            output_tokens,
            total_tokens: text + input_image_tokens + output_tokens,
        }
    }

    /// The usage of `request`: its model's token size from the card it was checked against
    /// (16 pixels when the model announced none).
    pub fn of(request: &ImageRequest) -> Self {
        let input = &request.input;
        let p = &input.valid.params;
        let token = input
            .geometry
            .as_ref()
            .map_or(16, |g| g.token_pixels.max(1));
        let per_image = u64::from(p.width / token) * u64::from(p.height / token);
        let input_image_tokens = match input.kind {
            JobKind::Edit => per_image,
            _ => 0,
        };
        Self::new(
            &p.prompt,
            input_image_tokens,
            per_image * u64::from(p.n.max(1)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_up() {
        let u = ImageUsage::new("a red  circle", 12, 24);
        assert_eq!(u.input_tokens_details.text_tokens, 3);
        assert_eq!(u.input_tokens, 15);
        assert_eq!(u.total_tokens, 39);
    }
}
