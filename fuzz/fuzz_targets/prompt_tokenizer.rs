//! A prompt through the FLUX.1 prompt tokenizers (CLIP BPE and T5 unigram), padded and cut to a
//! fuzzed length as the text encoders ask (`PromptTokenizer::encode_padded`).
//!
//! The tokenizer lives in the model crate, which links libtorch; the fuzz build links none, so it
//! compiles the model crate's two tokenizer files themselves (`#[path]`) beside a copy of the
//! crate's error type without its libtorch variant. The vocabularies are tiny folders written at
//! start-up in the layout transformers saves.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: diffmesh_fuzz::CappedAlloc = diffmesh_fuzz::CappedAlloc;

/// `model/src/error.rs` without `Torch` (the one variant that names a tch type). The tokenizer
/// files use only these.
#[allow(dead_code)]
mod error {
    use std::path::PathBuf;

    #[derive(Debug, thiserror::Error)]
    pub enum ModelError {
        #[error("io error on {path}: {source}")]
        Io {
            path: PathBuf,
            #[source]
            source: std::io::Error,
        },
        #[error("invalid json in {path}: {source}")]
        Json {
            path: PathBuf,
            #[source]
            source: serde_json::Error,
        },
        #[error("unsupported component `{component}` of class `{class}`: {reason}")]
        Unsupported {
            component: String,
            class: String,
            reason: String,
        },
        #[error("invalid input `{field}`: {reason}")]
        Input { field: String, reason: String },
        #[error("invalid config `{field}`: {reason}")]
        Config { field: String, reason: String },
    }

    impl ModelError {
        pub fn input(field: impl Into<String>, reason: impl Into<String>) -> Self {
            Self::Input {
                field: field.into(),
                reason: reason.into(),
            }
        }
        pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
            Self::Config {
                field: field.into(),
                reason: reason.into(),
            }
        }
    }

    pub type Result<T, E = ModelError> = std::result::Result<T, E>;

    pub fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })
    }
}

// At the crate root, so that the tokenizer's `super::tokenizer_files` is its sibling.
#[allow(dead_code)]
#[path = "../../model/src/text/tokenizer.rs"]
mod tokenizer;
#[allow(dead_code)]
#[path = "../../model/src/text/tokenizer_files.rs"]
mod tokenizer_files;

use tokenizer::PromptTokenizer;

fn write(dir: &Path, files: &[(&str, &str)]) {
    std::fs::create_dir_all(dir).expect("tokenizer folder");
    for (name, text) in files {
        std::fs::write(dir.join(name), text).expect("tokenizer file");
    }
}

/// A CLIP folder (`vocab.json` + `merges.txt`) and a T5 one (`tokenizer.json`), loaded once.
fn tokenizers() -> &'static [PromptTokenizer; 2] {
    static LOADED: OnceLock<[PromptTokenizer; 2]> = OnceLock::new();
    LOADED.get_or_init(|| {
        let root: PathBuf =
            std::env::temp_dir().join(format!("diffmesh-fuzz-tokenizers-{}", std::process::id()));
        let (clip, t5) = (root.join("clip"), root.join("t5"));
        write(
            &clip,
            &[
                (
                    "tokenizer_config.json",
                    r#"{"tokenizer_class": "CLIPTokenizer", "model_max_length": 77}"#,
                ),
                (
                    "vocab.json",
                    r#"{"<|startoftext|>": 0, "<|endoftext|>": 1, "a": 2, "a</w>": 3, "b": 4,
                        "b</w>": 5, "ab</w>": 6, "!": 7, "!</w>": 8}"#,
                ),
                ("merges.txt", "#version: 0.2\na b</w>\n"),
            ],
        );
        write(
            &t5,
            &[
                (
                    "tokenizer_config.json",
                    r#"{"tokenizer_class": "T5TokenizerFast", "extra_ids": 3, "model_max_length": 512}"#,
                ),
                (
                    "tokenizer.json",
                    r#"{"model": {"type": "Unigram", "unk_id": 2, "vocab": [["<pad>", 0.0],
                        ["</s>", 0.0], ["<unk>", 0.0], ["\u2581", -2.0], ["\u2581a", -3.0],
                        ["a", -3.2], ["b", -3.4], ["\u2581ab", -2.5]]}}"#,
                ),
            ],
        );
        let loaded = [
            PromptTokenizer::load(&clip, None).expect("the CLIP folder loads"),
            PromptTokenizer::load(&t5, None).expect("the T5 folder loads"),
        ];
        let _ = std::fs::remove_dir_all(&root);
        loaded
    })
}

fuzz_target!(
    init: diffmesh_fuzz::write_seeds_if_asked(diffmesh_fuzz::seeds::prompts),
    |data: &[u8]| {
        let Some((&length, prompt)) = data.split_first() else {
            return;
        };
        // Both special tokens fit from 2 on; the pipeline pads CLIP to 77 and T5 to 1..=512.
        let max_length = 2 + usize::from(length);
        let prompt = String::from_utf8_lossy(prompt);
        for tokenizer in tokenizers() {
            let ids = tokenizer
                .encode_padded(&prompt, max_length)
                .expect("any prompt tokenizes");
            // The text encoder views the ids as [prompts, max_length].
            assert_eq!(ids.len(), max_length, "{:?}", tokenizer.class());
        }
    }
);
