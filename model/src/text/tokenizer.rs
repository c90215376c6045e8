//! Prompt tokenizers of real checkpoints (FLUX.1's `tokenizer/` CLIP BPE and `tokenizer_2/` T5
//! unigram), built with the `tokenizers` crate the way transformers 5 builds them.
//!
//! transformers 5 does not run a `tokenizer.json` as saved for these classes: `CLIPTokenizer` and
//! `T5Tokenizer` define their normaliser, pre-tokeniser and post-processor in code and take only the
//! vocabulary (and merges, or T5's precompiled normaliser) from the files. We do the same, so the
//! ids match whichever transformers wrote the folder. Padding and truncation are the library's,
//! set per call as `tokenizer(prompt, padding="max_length", max_length=N, truncation=True)` does.
use super::tokenizer_files::TokenizerFiles;
use crate::error::{ModelError, Result};
use serde_json::Value;
use std::path::Path;
use std::sync::Mutex;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::metaspace::Metaspace as MetaspaceDecoder;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::models::unigram::Unigram;
use tokenizers::normalizers::{Lowercase, NormalizerWrapper, Replace, Sequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::processors::roberta::RobertaProcessing;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    PaddingDirection, PaddingParams, PaddingStrategy, SplitDelimiterBehavior, Tokenizer,
    TruncationDirection, TruncationParams, TruncationStrategy,
};

/// CLIP's pre-tokenisation pattern (transformers' `CLIPTokenizer`, after open_clip).
const CLIP_SPLIT: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";
/// SentencePiece's word-boundary marker.
const METASPACE: char = '\u{2581}';
/// T5's sentinel count when the config does not say (`extra_ids`).
const T5_DEFAULT_EXTRA_IDS: usize = 100;

/// The tokenizer classes diffmesh builds (transformers' names, with or without `Fast`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerClass {
    Clip,
    T5,
}

impl TokenizerClass {
    pub fn from_class_name(name: &str) -> Option<Self> {
        match name.strip_suffix("Fast").unwrap_or(name) {
            "CLIPTokenizer" => Some(Self::Clip),
            "T5Tokenizer" => Some(Self::T5),
            _ => None,
        }
    }

    fn default_of(self, key: &str) -> Option<String> {
        self.default_special_tokens()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_string())
    }

    /// Special tokens the class's constructor defaults to.
    fn default_special_tokens(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::Clip => &[
                ("bos_token", "<|startoftext|>"),
                ("eos_token", "<|endoftext|>"),
                ("unk_token", "<|endoftext|>"),
                ("pad_token", "<|endoftext|>"),
            ],
            Self::T5 => &[
                ("eos_token", "</s>"),
                ("unk_token", "<unk>"),
                ("pad_token", "<pad>"),
            ],
        }
    }
}

/// A loaded prompt tokenizer.
pub struct PromptTokenizer {
    class: TokenizerClass,
    model_max_length: Option<usize>,
    pad_token: String,
    pad_id: u32,
    /// Padding and truncation are settings of the library's tokenizer, set for each call's length.
    inner: Mutex<Tokenizer>,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("class", &self.class)
            .field("model_max_length", &self.model_max_length)
            .field("pad_token", &self.pad_token)
            .finish_non_exhaustive()
    }
}

impl PromptTokenizer {
    /// Load the tokenizer folder `dir`. `class_name` is the class `model_index.json` names; without
    /// it, `tokenizer_class` of `tokenizer_config.json` decides.
    pub fn load(dir: &Path, class_name: Option<&str>) -> Result<Self> {
        let files = TokenizerFiles::read(dir)?;
        let name = class_name.or(files.class_name()).ok_or_else(|| {
            ModelError::config(
                "tokenizer_class",
                format!(
                    "{} names no tokenizer class (tokenizer_config.json)",
                    dir.display()
                ),
            )
        })?;
        let class =
            TokenizerClass::from_class_name(name).ok_or_else(|| ModelError::Unsupported {
                component: dir.display().to_string(),
                class: name.to_string(),
                reason: "diffmesh builds CLIPTokenizer and T5Tokenizer(Fast)".into(),
            })?;
        let (mut tokenizer, extras) = match class {
            TokenizerClass::Clip => (clip_pipeline(&files)?, Vec::new()),
            TokenizerClass::T5 => {
                let extra_ids = files
                    .config_usize("extra_ids")?
                    .unwrap_or(T5_DEFAULT_EXTRA_IDS);
                let extras = (0..extra_ids).map(|i| format!("<extra_id_{i}>")).collect();
                (t5_pipeline(&files)?, extras)
            }
        };
        let added = files.added_tokens(class.default_special_tokens(), &extras)?;
        tokenizer
            .add_tokens(added)
            .map_err(|e| ModelError::config("added_tokens", format!("{}: {e}", dir.display())))?;
        let named = |key: &str| files.named_content(key).or_else(|| class.default_of(key));
        let pad_token = named("pad_token").expect("both classes define a pad token");
        let pad_id = tokenizer.token_to_id(&pad_token).ok_or_else(|| {
            ModelError::config(
                "pad_token",
                format!(
                    "`{pad_token}` is not in the vocabulary of {}",
                    dir.display()
                ),
            )
        })?;
        if class == TokenizerClass::T5 {
            let eos = named("eos_token").expect("T5 defines an eos token");
            let eos_id = tokenizer.token_to_id(&eos).ok_or_else(|| {
                ModelError::config(
                    "eos_token",
                    format!("`{eos}` is not in the vocabulary of {}", dir.display()),
                )
            })?;
            tokenizer.with_post_processor(Some(t5_post_processor(&eos, eos_id)?));
        } else {
            let bos = named("bos_token").expect("CLIP defines a bos token");
            let eos = named("eos_token").expect("CLIP defines an eos token");
            let id = |token: &str, field: &str| {
                tokenizer.token_to_id(token).ok_or_else(|| {
                    ModelError::config(
                        field,
                        format!("`{token}` is not in the vocabulary of {}", dir.display()),
                    )
                })
            };
            let processor = RobertaProcessing::new(
                (eos.clone(), id(&eos, "eos_token")?),
                (bos.clone(), id(&bos, "bos_token")?),
            )
            .trim_offsets(false)
            .add_prefix_space(false);
            tokenizer.with_post_processor(Some(processor));
        }
        Ok(Self {
            class,
            model_max_length: files.model_max_length()?,
            pad_token,
            pad_id,
            inner: Mutex::new(tokenizer),
        })
    }

    pub fn class(&self) -> TokenizerClass {
        self.class
    }

    /// `model_max_length` of the folder; `None` where it sets no limit.
    pub fn model_max_length(&self) -> Option<usize> {
        self.model_max_length
    }

    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The ids of `tokenizer(prompt, padding="max_length", max_length, truncation=True)`: special
    /// tokens added, cut to `max_length` (keeping the closing token), padded with the pad token.
    pub fn encode_padded(&self, prompt: &str, max_length: usize) -> Result<Vec<u32>> {
        if max_length == 0 {
            return Err(ModelError::input("max_length", "must be at least 1"));
        }
        let mut tokenizer = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        tokenizer
            .with_truncation(Some(TruncationParams {
                direction: TruncationDirection::Right,
                max_length,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }))
            .map_err(|e| ModelError::input("max_length", e.to_string()))?;
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::Fixed(max_length),
            direction: PaddingDirection::Right,
            pad_to_multiple_of: None,
            pad_id: self.pad_id,
            pad_type_id: 0,
            pad_token: self.pad_token.clone(),
        }));
        let encoding = tokenizer
            .encode(prompt, true)
            .map_err(|e| ModelError::input("prompt", format!("cannot be tokenized: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The library's serialisation of the pipeline without padding or truncation (what
    /// transformers' `backend_tokenizer.to_str()` gives): tests compare the two.
    pub fn pipeline_json(&self) -> Result<String> {
        let mut tokenizer = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        tokenizer
            .with_truncation(None)
            .map_err(|e| ModelError::config("truncation", e.to_string()))?;
        tokenizer.with_padding(None);
        tokenizer
            .to_string(false)
            .map_err(|e| ModelError::config("tokenizer", e.to_string()))
    }
}

/// `CLIPTokenizer`: byte-level BPE with `</w>` word ends, NFC + whitespace folding + lower case,
/// CLIP's split pattern, and `<|startoftext|> ... <|endoftext|>` around each prompt.
fn clip_pipeline(files: &TokenizerFiles) -> Result<Tokenizer> {
    let (vocab, merges) = clip_vocab_and_merges(files)?;
    let unk = files
        .named_content("unk_token")
        .unwrap_or_else(|| "<|endoftext|>".into());
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix("</w>".into())
        .fuse_unk(false)
        .unk_token(unk)
        .build()
        .map_err(|e| ModelError::config("vocab", format!("{}: {e}", files.dir.display())))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let whitespace = Replace::new(
        tokenizers::normalizers::replace::ReplacePattern::Regex(r"\s+".into()),
        " ",
    )
    .map_err(|e| ModelError::config("normalizer", e.to_string()))?;
    let normalizer = Sequence::new(vec![
        NormalizerWrapper::NFC(NFC),
        NormalizerWrapper::Replace(whitespace),
        NormalizerWrapper::Lowercase(Lowercase),
    ]);
    tokenizer
        .with_normalizer(Some(normalizer))
        .map_err(|e| ModelError::config("normalizer", e.to_string()))?;
    let split = Split::new(
        SplitPattern::Regex(CLIP_SPLIT.into()),
        SplitDelimiterBehavior::Removed,
        true,
    )
    .map_err(|e| ModelError::config("pre_tokenizer", e.to_string()))?;
    tokenizer.with_pre_tokenizer(Some(PreSequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, true).into(),
    ])));
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(true, true, true)));
    Ok(tokenizer)
}

/// The BPE vocabulary and merges from `tokenizer.json`, else `vocab.json` + `merges.txt`.
fn clip_vocab_and_merges(files: &TokenizerFiles) -> Result<(Vocab, Merges)> {
    if let Some(model) = files.json_model("BPE")? {
        let where_ = || files.dir.join("tokenizer.json").display().to_string();
        let vocab: Vocab = serde_json::from_value(model.get("vocab").cloned().unwrap_or_default())
            .map_err(|e| ModelError::config("model.vocab", format!("{}: {e}", where_())))?;
        let raw = model
            .get("merges")
            .and_then(Value::as_array)
            .ok_or_else(|| {
                ModelError::config("model.merges", format!("missing in {}", where_()))
            })?;
        let merges = raw
            .iter()
            .map(|m| match m {
                Value::String(s) => s
                    .split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string())),
                Value::Array(pair) if pair.len() == 2 => {
                    Some((pair[0].as_str()?.to_string(), pair[1].as_str()?.to_string()))
                }
                _ => None,
            })
            .collect::<Option<Merges>>()
            .ok_or_else(|| {
                ModelError::config(
                    "model.merges",
                    format!("a merge is not a pair in {}", where_()),
                )
            })?;
        return Ok((vocab, merges));
    }
    let vocab = files.dir.join("vocab.json");
    let merges = files.dir.join("merges.txt");
    for path in [&vocab, &merges] {
        if !path.exists() {
            return Err(ModelError::config(
                "tokenizer",
                format!(
                    "{} has neither tokenizer.json nor {}",
                    files.dir.display(),
                    path.file_name().unwrap_or_default().to_string_lossy()
                ),
            ));
        }
    }
    BPE::read_file(&vocab.to_string_lossy(), &merges.to_string_lossy()).map_err(|e| {
        ModelError::config(
            "vocab",
            format!("{} / {}: {e}", vocab.display(), merges.display()),
        )
    })
}

/// `T5Tokenizer`: SentencePiece unigram with `<unk>` at id 2, the precompiled normaliser of the
/// model, whitespace split with `▁` prepended to each word, and `</s>` closing each prompt.
fn t5_pipeline(files: &TokenizerFiles) -> Result<Tokenizer> {
    let Some(model) = files.json_model("Unigram")? else {
        let reason = if files.dir.join("spiece.model").exists() {
            "has spiece.model but no tokenizer.json; diffmesh reads T5's vocabulary from \
             tokenizer.json (save the tokenizer with transformers' save_pretrained to write it)"
        } else {
            "has no tokenizer.json"
        };
        return Err(ModelError::config(
            "tokenizer.json",
            format!("{} {reason}", files.dir.display()),
        ));
    };
    let where_ = || files.dir.join("tokenizer.json").display().to_string();
    let vocab: Vec<(String, f64)> =
        serde_json::from_value(model.get("vocab").cloned().unwrap_or_default())
            .map_err(|e| ModelError::config("model.vocab", format!("{}: {e}", where_())))?;
    // transformers' T5Tokenizer fixes the unknown token at id 2 (SentencePiece's T5 layout).
    let unigram = Unigram::from(vocab, Some(2), false)
        .map_err(|e| ModelError::config("model.vocab", format!("{}: {e}", where_())))?;
    let mut tokenizer = Tokenizer::new(unigram);
    if let Some(precompiled) = files.precompiled_normalizer() {
        let normalizer: NormalizerWrapper =
            serde_json::from_value(precompiled.clone()).map_err(|e| {
                ModelError::config(
                    "normalizer.precompiled_charsmap",
                    format!("{}: {e}", where_()),
                )
            })?;
        tokenizer
            .with_normalizer(Some(normalizer))
            .map_err(|e| ModelError::config("normalizer", e.to_string()))?;
    }
    tokenizer.with_pre_tokenizer(Some(PreSequence::new(vec![
        WhitespaceSplit.into(),
        Metaspace::new(METASPACE, PrependScheme::Always, true).into(),
    ])));
    tokenizer.with_decoder(Some(MetaspaceDecoder::new(
        METASPACE,
        PrependScheme::Always,
        true,
    )));
    Ok(tokenizer)
}

fn t5_post_processor(eos: &str, eos_id: u32) -> Result<TemplateProcessing> {
    let single = format!("$A {eos}");
    let pair = format!("$A {eos} $B {eos}");
    TemplateProcessing::builder()
        .try_single(single.as_str())
        .and_then(|b| b.try_pair(pair.as_str()))
        .map_err(|e| ModelError::config("post_processor", e.to_string()))?
        .special_tokens(vec![(eos.to_string(), eos_id)])
        .build()
        .map_err(|e| ModelError::config("post_processor", e.to_string()))
}
