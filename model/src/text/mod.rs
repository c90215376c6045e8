//! The text side of real checkpoints: prompt tokenizers read from a model's tokenizer folders,
//! and the text encoders FLUX.1 pairs them with (CLIP-L's pooled output, T5-XXL's hidden states).
mod activation;
pub mod clip;
pub mod clip_lora;
pub mod flux_prompt;
pub mod t5;
pub mod tokenizer;
mod tokenizer_files;

pub use activation::Activation;
pub use clip::{
    ClipProjectedOutput, ClipTextConfig, ClipTextModel, ClipTextModelWithProjection, ClipTextOutput,
};
pub use flux_prompt::FluxPromptEncoder;
pub use t5::{T5Config, T5EncoderModel};
pub use tokenizer::{PromptTokenizer, TokenizerClass};
