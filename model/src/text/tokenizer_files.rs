//! What a tokenizer folder of a diffusers checkpoint holds, read as transformers 5 reads it:
//! `tokenizer_config.json`, `special_tokens_map.json`, `tokenizer.json` (vocabulary, merges,
//! added tokens, SentencePiece's precompiled normaliser) or CLIP's `vocab.json` + `merges.txt`.
//!
//! Only reading lives here; [`super::tokenizer`] builds the pipeline from it.
use crate::error::{read_json, ModelError, Result};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use tokenizers::AddedToken;

/// Named special tokens in the order transformers registers them (`SPECIAL_TOKENS_ATTRIBUTES`).
pub const NAMED_SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// `model_max_length` at or above this is transformers' "no limit" (`VERY_LARGE_INTEGER`, 1e30).
const UNLIMITED_LENGTH: f64 = 1e20;

/// The parsed files of one tokenizer folder.
pub struct TokenizerFiles {
    pub dir: PathBuf,
    /// `tokenizer_config.json`, or empty when absent.
    pub config: Map<String, Value>,
    /// `special_tokens_map.json`, or empty when absent.
    pub special_tokens_map: Map<String, Value>,
    /// `tokenizer.json` when present.
    pub tokenizer_json: Option<Value>,
}

impl TokenizerFiles {
    pub fn read(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::config(
                "tokenizer",
                format!("{} is not a directory", dir.display()),
            ));
        }
        let optional_json = |name: &str| -> Result<Option<Value>> {
            let path = dir.join(name);
            if path.exists() {
                read_json(&path).map(Some)
            } else {
                Ok(None)
            }
        };
        let object = |name: &str, value: Option<Value>| -> Result<Map<String, Value>> {
            match value {
                None => Ok(Map::new()),
                Some(Value::Object(map)) => Ok(map),
                Some(_) => Err(ModelError::config(
                    name,
                    format!("expected a JSON object in {}", dir.join(name).display()),
                )),
            }
        };
        let config = object(
            "tokenizer_config.json",
            optional_json("tokenizer_config.json")?,
        )?;
        let special_tokens_map = object(
            "special_tokens_map.json",
            optional_json("special_tokens_map.json")?,
        )?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            special_tokens_map,
            tokenizer_json: optional_json("tokenizer.json")?,
        })
    }

    /// `tokenizer_class` from `tokenizer_config.json`.
    pub fn class_name(&self) -> Option<&str> {
        self.config.get("tokenizer_class").and_then(Value::as_str)
    }

    /// `model_max_length`, or `None` where the folder sets no limit (absent or transformers' 1e30).
    pub fn model_max_length(&self) -> Result<Option<usize>> {
        match self.config.get("model_max_length") {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let n = v.as_f64().filter(|n| *n >= 1.0).ok_or_else(|| {
                    ModelError::config(
                        "model_max_length",
                        format!("expected a positive number in {}", self.config_path()),
                    )
                })?;
                Ok((n < UNLIMITED_LENGTH).then_some(n as usize))
            }
        }
    }

    /// An integer field of `tokenizer_config.json` (e.g. T5's `extra_ids`).
    pub fn config_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.config.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                ModelError::config(
                    field,
                    format!("expected a non-negative integer in {}", self.config_path()),
                )
            }),
        }
    }

    fn config_path(&self) -> String {
        self.dir.join("tokenizer_config.json").display().to_string()
    }

    fn tokenizer_json_path(&self) -> String {
        self.dir.join("tokenizer.json").display().to_string()
    }

    /// The `model` object of `tokenizer.json`, checked to be of `expected_type`.
    pub fn json_model(&self, expected_type: &str) -> Result<Option<&Map<String, Value>>> {
        let Some(json) = &self.tokenizer_json else {
            return Ok(None);
        };
        let model = json
            .get("model")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                ModelError::config(
                    "model",
                    format!("missing in {}", self.tokenizer_json_path()),
                )
            })?;
        match model.get("type").and_then(Value::as_str) {
            Some(t) if t == expected_type => Ok(Some(model)),
            other => Err(ModelError::config(
                "model.type",
                format!(
                    "{} holds a {} model; this tokenizer class needs {expected_type}",
                    self.tokenizer_json_path(),
                    other.unwrap_or("untyped")
                ),
            )),
        }
    }

    /// The precompiled SentencePiece normaliser in `tokenizer.json` (alone or inside a Sequence),
    /// as transformers extracts it for T5.
    pub fn precompiled_normalizer(&self) -> Option<&Value> {
        let normalizer = self.tokenizer_json.as_ref()?.get("normalizer")?;
        let is_precompiled = |n: &&Value| {
            n.get("type").and_then(Value::as_str) == Some("Precompiled")
                && n.get("precompiled_charsmap").is_some()
        };
        match normalizer.get("type").and_then(Value::as_str) {
            Some("Sequence") => normalizer
                .get("normalizers")?
                .as_array()?
                .iter()
                .find(is_precompiled),
            _ => Some(normalizer).filter(is_precompiled),
        }
    }

    /// A special-token field (`pad_token`, `extra_special_tokens`, ...) as transformers resolves it:
    /// from `tokenizer_config.json`, except that legacy folders (no `added_tokens_decoder`) take
    /// `special_tokens_map.json` first.
    pub fn named(&self, key: &str) -> Option<&Value> {
        let legacy = !self.config.contains_key("added_tokens_decoder");
        let from_map = legacy.then(|| self.special_tokens_map.get(key)).flatten();
        from_map.or_else(|| self.config.get(key))
    }

    /// The content of a named special token (a string or an `AddedToken` object), if set.
    pub fn named_content(&self, key: &str) -> Option<String> {
        match self.named(key)? {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
            _ => None,
        }
    }

    /// The tokens transformers adds to the backend, in its order: the saved added tokens
    /// (`added_tokens_decoder` of the config, else `tokenizer.json`'s `added_tokens`) by id, then
    /// named special tokens and extra special tokens not among them. Strings become special tokens
    /// that are not normalised, as `AddedToken(token, special=True)` does.
    pub fn added_tokens(
        &self,
        class_defaults: &[(&str, &str)],
        class_extras: &[String],
    ) -> Result<Vec<AddedToken>> {
        let mut saved: Vec<(u64, AddedToken)> = Vec::new();
        if let Some(decoder) = self.config.get("added_tokens_decoder") {
            let decoder = decoder.as_object().ok_or_else(|| {
                ModelError::config(
                    "added_tokens_decoder",
                    format!("expected an object in {}", self.config_path()),
                )
            })?;
            for (id, spec) in decoder {
                let id = id.parse::<u64>().map_err(|_| {
                    ModelError::config(
                        format!("added_tokens_decoder.{id}"),
                        format!("the key is not a token id in {}", self.config_path()),
                    )
                })?;
                saved.push((id, added_token(spec, "added_tokens_decoder", false)?));
            }
        } else if let Some(list) = self
            .tokenizer_json
            .as_ref()
            .and_then(|j| j.get("added_tokens"))
        {
            let list = list.as_array().ok_or_else(|| {
                ModelError::config(
                    "added_tokens",
                    format!("expected a list in {}", self.tokenizer_json_path()),
                )
            })?;
            for spec in list {
                let id = spec.get("id").and_then(Value::as_u64).ok_or_else(|| {
                    ModelError::config(
                        "added_tokens.id",
                        format!("missing in {}", self.tokenizer_json_path()),
                    )
                })?;
                saved.push((id, added_token(spec, "added_tokens", false)?));
            }
        }
        saved.sort_by_key(|(id, _)| *id);
        let mut tokens: Vec<AddedToken> = saved.into_iter().map(|(_, t)| t).collect();

        for key in NAMED_SPECIAL_TOKENS {
            let token = match self.named(key) {
                Some(Value::Null) => continue,
                Some(value) => special_token(value, key)?,
                None => match class_defaults.iter().find(|(k, _)| *k == key) {
                    Some((_, content)) => AddedToken::from(*content, true),
                    None => continue,
                },
            };
            push_absent(&mut tokens, token);
        }
        let extras = ["extra_special_tokens", "additional_special_tokens"]
            .iter()
            .find_map(|key| self.named(key).map(|v| (key, v)));
        match extras {
            Some((key, Value::Array(list))) => {
                for value in list {
                    push_absent(&mut tokens, special_token(value, key)?);
                }
            }
            // A dict of model-specific named tokens: their values are special tokens too.
            Some((key, Value::Object(map))) => {
                for value in map.values() {
                    push_absent(&mut tokens, special_token(value, key)?);
                }
            }
            Some((_, Value::Null)) | None => {
                for content in class_extras {
                    push_absent(&mut tokens, AddedToken::from(content.as_str(), true));
                }
            }
            Some((key, _)) => {
                return Err(ModelError::config(
                    *key,
                    format!("expected a list in {}", self.config_path()),
                ))
            }
        }
        Ok(tokens)
    }
}

fn push_absent(tokens: &mut Vec<AddedToken>, token: AddedToken) {
    if !tokens.iter().any(|t| t.content == token.content) {
        tokens.push(token);
    }
}

/// A special token given as a string or as a serialised `AddedToken`.
fn special_token(value: &Value, field: &str) -> Result<AddedToken> {
    match value {
        Value::String(s) => Ok(AddedToken::from(s.as_str(), true)),
        Value::Object(_) => added_token(value, field, true),
        _ => Err(ModelError::config(
            field,
            "expected a token string or an AddedToken object",
        )),
    }
}

/// A serialised `AddedToken` (`content` plus flags; Python's defaults where a flag is absent:
/// special tokens are not normalised). `force_special` marks it special whatever it says.
fn added_token(spec: &Value, field: &str, force_special: bool) -> Result<AddedToken> {
    let content = spec
        .get("content")
        .and_then(Value::as_str)
        .ok_or_else(|| ModelError::config(field, "an added token has no `content`"))?;
    let flag = |name: &str| spec.get(name).and_then(Value::as_bool);
    let special = force_special || flag("special").unwrap_or(false);
    Ok(AddedToken::from(content, special)
        .single_word(flag("single_word").unwrap_or(false))
        .lstrip(flag("lstrip").unwrap_or(false))
        .rstrip(flag("rstrip").unwrap_or(false))
        .normalized(flag("normalized").unwrap_or(!special)))
}
