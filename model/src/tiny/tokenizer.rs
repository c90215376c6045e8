//! Word-level tokenizer over the generator's closed vocabulary.
//!
//! Every sequence starts with `<s>` (never padded), so an empty prompt, which classifier-free
//! guidance uses as the unconditional input, still has one token attention can look at.
use super::data::{Position, Shape, COLOURS};
use crate::error::{read_json, ModelError, Result};
use std::collections::BTreeMap;
use std::path::Path;

pub const PAD: &str = "<pad>";
pub const UNK: &str = "<unk>";
pub const BOS: &str = "<s>";

#[derive(Debug, Clone)]
pub struct WordTokenizer {
    vocab: BTreeMap<String, i64>,
    max_tokens: i64,
    pad_id: i64,
    unk_id: i64,
    bos_id: i64,
}

impl WordTokenizer {
    /// The vocabulary of the procedural data: specials, glue words, colours, shapes, positions.
    pub fn for_generator(max_tokens: i64) -> Self {
        let mut words: Vec<String> = [PAD, UNK, BOS, "a", "on", "the", "in", "background"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        words.extend(COLOURS.iter().map(|c| c.0.to_string()));
        words.extend(Shape::ALL.iter().map(|s| s.name().to_string()));
        words.extend(Position::ALL.iter().map(|p| p.name().to_string()));
        let vocab = words
            .into_iter()
            .enumerate()
            .map(|(i, w)| (w, i as i64))
            .collect();
        Self::from_vocab(vocab, max_tokens).expect("built-in vocabulary has the special tokens")
    }

    pub fn from_vocab(vocab: BTreeMap<String, i64>, max_tokens: i64) -> Result<Self> {
        let id = |w: &str| {
            vocab.get(w).copied().ok_or_else(|| {
                ModelError::config("tokenizer.vocab", format!("missing special token {w}"))
            })
        };
        if max_tokens < 2 {
            return Err(ModelError::config(
                "tokenizer.max_tokens",
                format!("must be >= 2, got {max_tokens}"),
            ));
        }
        Ok(WordTokenizer {
            pad_id: id(PAD)?,
            unk_id: id(UNK)?,
            bos_id: id(BOS)?,
            vocab,
            max_tokens,
        })
    }

    /// Read `tokenizer/vocab.json` (a word -> id map).
    pub fn load(dir: &Path, max_tokens: i64) -> Result<Self> {
        let vocab: BTreeMap<String, i64> = read_json(&dir.join("vocab.json"))?;
        Self::from_vocab(vocab, max_tokens)
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join("vocab.json");
        let text =
            serde_json::to_string_pretty(&self.vocab).map_err(|source| ModelError::Json {
                path: path.clone(),
                source,
            })?;
        std::fs::write(&path, text).map_err(|source| ModelError::Io { path, source })
    }

    pub fn vocab_size(&self) -> i64 {
        self.vocab.values().copied().max().map_or(0, |m| m + 1)
    }

    pub fn max_tokens(&self) -> i64 {
        self.max_tokens
    }

    pub fn pad_id(&self) -> i64 {
        self.pad_id
    }

    /// Lower-case, split on whitespace and punctuation, map unknown words to `<unk>`, prepend
    /// `<s>`, truncate and pad to `max_tokens`.
    pub fn encode(&self, prompt: &str) -> Vec<i64> {
        let mut ids = vec![self.bos_id];
        let lower = prompt.to_lowercase();
        for word in lower
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
        {
            ids.push(self.vocab.get(word).copied().unwrap_or(self.unk_id));
        }
        ids.truncate(self.max_tokens as usize);
        ids.resize(self.max_tokens as usize, self.pad_id);
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_pads_and_marks_unknown() {
        let tok = WordTokenizer::for_generator(16);
        let ids = tok.encode("A red circle, on the LEFT; zebra");
        assert_eq!(ids.len(), 16);
        assert_eq!(ids[0], tok.bos_id);
        assert_eq!(ids[1], tok.vocab["a"]);
        assert_eq!(ids[2], tok.vocab["red"]);
        assert_eq!(ids[6], tok.vocab["left"]);
        assert_eq!(ids[7], tok.unk_id);
        assert!(ids[8..].iter().all(|&i| i == tok.pad_id));
        let empty = tok.encode("");
        assert_eq!(empty[0], tok.bos_id);
        assert!(empty[1..].iter().all(|&i| i == tok.pad_id));
    }

    #[test]
    fn save_load_round_trip() {
        let dir = std::env::temp_dir().join(format!("diffmesh-tok-{}", std::process::id()));
        let tok = WordTokenizer::for_generator(16);
        tok.save(&dir).unwrap();
        let back = WordTokenizer::load(&dir, 16).unwrap();
        assert_eq!(
            back.encode("a blue square in the center"),
            tok.encode("a blue square in the center")
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
