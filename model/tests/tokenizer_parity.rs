//! Prompt tokenizers against transformers 5.25 (python/parity/gen_tokenizers.py): CLIP's real BPE
//! vocabulary and a SentencePiece T5 model trained here, in FLUX.1's folder layouts and bare ones.
//! For each folder the pipeline we build serialises like transformers' backend, and the ids of
//! every prompt (punctuation, capitals, repeated spaces, accents, emoji, CJK, the empty prompt,
//! prompts past 77 and past 512 tokens) are identical at each padded length.
mod py_fixture;

use diffmesh_model::text::{PromptTokenizer, TokenizerClass};
use py_fixture::generate;
use serde_json::Value;

/// The fixture, generated into `name` (each test its own: they run in parallel).
fn expected(name: &str) -> (std::path::PathBuf, Value) {
    let dir = generate("gen_tokenizers.py", &[], name);
    let text = std::fs::read_to_string(dir.join("expected.json")).expect("expected.json");
    (dir, serde_json::from_str(&text).expect("json"))
}

/// The pipeline parts that decide the ids (the library version string aside).
fn pipeline_parts(mut json: Value) -> Value {
    let object = json.as_object_mut().expect("tokenizer json is an object");
    for volatile in ["version", "truncation", "padding"] {
        object.remove(volatile);
    }
    json
}

#[test]
fn tokenizers_match_transformers() {
    let (dir, expected) = expected("parity-tokenizers");
    let prompts: Vec<&str> = expected["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| p.as_str().expect("prompt"))
        .collect();
    assert!(prompts.len() >= 200, "{} prompts", prompts.len());
    let specs = expected["tokenizers"].as_object().expect("tokenizers");
    let mut loaded = std::collections::HashMap::new();
    for (folder, spec) in specs {
        let class = spec["class"].as_str().expect("class");
        let tokenizer = PromptTokenizer::load(&dir.join(folder), Some(class))
            .unwrap_or_else(|e| panic!("{folder}: {e}"));
        let want_class = if class.starts_with("CLIP") {
            TokenizerClass::Clip
        } else {
            TokenizerClass::T5
        };
        assert_eq!(tokenizer.class(), want_class, "{folder}");
        assert_eq!(
            tokenizer.model_max_length(),
            spec["model_max_length"].as_u64().map(|n| n as usize),
            "{folder}: model_max_length"
        );
        assert_eq!(
            Some(tokenizer.pad_id() as u64),
            spec["pad_token_id"].as_u64(),
            "{folder}: pad id"
        );
        let ours: Value =
            serde_json::from_str(&tokenizer.pipeline_json().expect("serialise")).expect("json");
        let theirs = pipeline_parts(spec["backend"].clone());
        let ours = pipeline_parts(ours);
        for part in [
            "added_tokens",
            "normalizer",
            "pre_tokenizer",
            "post_processor",
            "decoder",
            "model",
        ] {
            assert!(
                ours[part] == theirs[part],
                "{folder}: `{part}` differs from transformers'\nours:   {:.600}\ntheirs: {:.600}",
                ours[part].to_string(),
                theirs[part].to_string()
            );
        }
        loaded.insert(folder.clone(), tokenizer);
    }

    let mut compared = 0;
    for case in expected["cases"].as_array().expect("cases") {
        let folder = case["folder"].as_str().expect("folder");
        let max_length = case["max_length"].as_u64().expect("max_length") as usize;
        let tokenizer = &loaded[folder];
        let rows = case["ids"].as_array().expect("ids");
        assert_eq!(rows.len(), prompts.len());
        for (prompt, row) in prompts.iter().zip(rows) {
            let want: Vec<u32> = row
                .as_array()
                .expect("row")
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect();
            let got = tokenizer
                .encode_padded(prompt, max_length)
                .unwrap_or_else(|e| panic!("{folder}: {prompt:?}: {e}"));
            assert_eq!(
                got, want,
                "{folder} max_length {max_length}: ids differ for {prompt:?}"
            );
            compared += 1;
        }
    }
    println!("{compared} prompt encodings identical to transformers'");
}

#[test]
fn tokenizer_folders_that_cannot_load_name_the_problem() {
    let (dir, _) = expected("parity-tokenizers-errors");
    let scratch = tempfile::tempdir().expect("tempdir");

    // T5 with the SentencePiece model alone.
    let spiece_only = scratch.path().join("spiece_only");
    std::fs::create_dir(&spiece_only).unwrap();
    std::fs::copy(
        dir.join("t5/spiece.model"),
        spiece_only.join("spiece.model"),
    )
    .unwrap();
    let err = PromptTokenizer::load(&spiece_only, Some("T5TokenizerFast"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("spiece.model"),
        "{err}"
    );

    // CLIP without merges.
    let no_merges = scratch.path().join("no_merges");
    std::fs::create_dir(&no_merges).unwrap();
    std::fs::copy(
        dir.join("clip_vocab_merges/vocab.json"),
        no_merges.join("vocab.json"),
    )
    .unwrap();
    let err = PromptTokenizer::load(&no_merges, Some("CLIPTokenizer"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("merges.txt"), "{err}");

    // A class diffmesh does not build, and a folder that names none.
    let err = PromptTokenizer::load(&dir.join("t5"), Some("LlamaTokenizerFast"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("LlamaTokenizerFast"), "{err}");
    let err = PromptTokenizer::load(&dir.join("clip_bare"), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer_class"), "{err}");

    // A CLIP class over T5's files: the model type is named.
    let err = PromptTokenizer::load(&dir.join("t5"), Some("CLIPTokenizer"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("Unigram") && err.contains("BPE"), "{err}");

    // A malformed config names the field.
    let bad = scratch.path().join("bad_config");
    std::fs::create_dir(&bad).unwrap();
    for name in ["vocab.json", "merges.txt"] {
        std::fs::copy(dir.join("clip_vocab_merges").join(name), bad.join(name)).unwrap();
    }
    std::fs::write(
        bad.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "CLIPTokenizer", "model_max_length": "77"}"#,
    )
    .unwrap();
    let err = PromptTokenizer::load(&bad, None).unwrap_err().to_string();
    assert!(err.contains("model_max_length"), "{err}");

    // Zero length is refused, not a panic.
    let clip = PromptTokenizer::load(&dir.join("clip_vocab_merges"), None).expect("load");
    let err = clip.encode_padded("a cat", 0).unwrap_err().to_string();
    assert!(err.contains("max_length"), "{err}");
}
