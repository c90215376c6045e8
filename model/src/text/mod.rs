//! The text side of real checkpoints: prompt tokenizers read from a model's tokenizer folders.
pub mod tokenizer;
mod tokenizer_files;

pub use tokenizer::{PromptTokenizer, TokenizerClass};
