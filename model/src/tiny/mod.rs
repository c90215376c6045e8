//! The tiny trained default model: a Flux-architecture transformer over 64x64 RGB pixels
//! (pixel-unshuffled, no VAE), a small word-level text encoder, and the procedural data it learns.
//!
//! Everything here is small enough to train on a 2-core CPU in under an hour
//! (`cargo xtask train-tiny`), so image quality is measurable on any machine.
pub mod check;
pub mod codec;
pub mod controlnet_eval;
pub mod controlnet_train;
pub mod data;
pub mod eval;
pub mod lora_train;
pub mod model;
pub mod plot;
pub mod text_encoder;
pub mod tokenizer;
pub mod train;
pub mod unet_eval;
pub mod unet_train;
pub mod validate;

pub use codec::DiffmeshPixelCodec;
pub use text_encoder::{DiffmeshTinyTextEncoder, TinyTextEncoderConfig};
pub use tokenizer::WordTokenizer;

/// Side length of the square RGB images the tiny model generates.
pub const IMAGE_SIZE: i64 = 64;
