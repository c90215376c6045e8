"""Tokenizer files in FLUX.1's layout and the ids transformers gives for them, for the Rust parity
test of the prompt tokenizers (model/tests/tokenizer_parity.rs).

    python gen_tokenizers.py OUT_DIR

Writes five tokenizer folders, three as a user's download would have them:
- OUT_DIR/clip_vocab_merges: CLIP ViT-L/14's real BPE (vocab.json + merges.txt, built from the merges
  open_clip ships) with the tokenizer_config.json FLUX.1's `tokenizer/` carries; no tokenizer.json.
- OUT_DIR/clip_tokenizer_json: the same tokenizer after `CLIPTokenizer.save_pretrained` (tokenizer.json).
- OUT_DIR/t5: a T5-style SentencePiece unigram model trained here (pad 0, </s> 1, <unk> 2, nmt_nfkc,
  100 sentinels), saved by `T5Tokenizer.save_pretrained` as FLUX.1's `tokenizer_2/` (spiece.model +
  tokenizer.json);
and two with the vocabulary alone (OUT_DIR/clip_bare: vocab.json + merges.txt; OUT_DIR/t5_bare:
tokenizer.json). OUT_DIR/expected.json holds the prompts, per folder the class, model_max_length and
the backend pipeline transformers built (`backend_tokenizer.to_str()`), and per folder and max_length
the input ids of `tokenizer(prompt, padding="max_length", max_length=N, truncation=True)`, the call
FluxPipeline makes.
"""

import gzip
import importlib.util
import json
import os
import random
import shutil
import sys

import sentencepiece as spm
import transformers
from transformers import CLIPTokenizer, T5Tokenizer, T5TokenizerFast

SPECIAL_CASES = [
    "",
    " ",
    "a photo of a cat",
    "A Photo Of A CAT",
    "A PHOTO OF A CAT!!!",
    "a   photo\tof  a\n\ncat",
    "  leading and trailing spaces  ",
    "punctuation: commas, periods. semicolons; (parens) [brackets] {braces} 'quotes' \"double\"",
    "it's a dog's life, isn't it? we'll see, they've gone, I'm here, you'd know",
    "IT'S LOUD, DON'T SHOUT",
    "hyphen-ated words and under_scores and slashes/between/them",
    "numbers 1234567890 and 3.14159 and 1,000,000 and 2nd 3rd 4th",
    "café naïve résumé façade jalapeño Zürich São Paulo Ærøskøbing",
    "CAFÉ NAÏVE RÉSUMÉ",
    "cafe\u0301 (combining accent) vs café (precomposed)",
    "emoji 🐱🐶🚀 and a family 👨‍👩‍👧 and flags 🇯🇵🇫🇷",
    "東京の夜景、ネオンと雨",
    "一只猫坐在窗台上看着雨",
    "한국어 프롬프트: 산 위의 일출",
    "mixed 東京 tokyo ТОКИО Τόκιο طوكيو",
    "Ελληνικά και русский текст",
    "full-width ＡＢＣ１２３ and ligature ﬁ and ™ ½ ²",
    "<|startoftext|> literal special tokens <|endoftext|>",
    "<|ENDOFTEXT|> upper-case special",
    "</s> <pad> <unk> <extra_id_0> <extra_id_99> t5 specials",
    "tabs\tand\u00a0non-breaking\u2003spaces\u200bzero-width",
    "!!!???...,,,;;;:::",
    "$100 & 50% off @ #sale ~ ^ * + = | \\ `",
    "a" * 300,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "x",
    "X",
    "1",
    ".",
    "👍",
]

WORDS = (
    "a photo of the cat dog astronaut riding horse on moon castle mountain lake sunset forest city "
    "street neon rain painting oil watercolor portrait landscape highly detailed 4k 8k cinematic "
    "lighting bokeh studio golden hour dramatic soft shadow vibrant colorful minimalist surreal "
    "futuristic ancient ruins ocean waves beach tree flower garden robot dragon wizard knight "
    "steampunk cyberpunk anime style trending artstation unreal engine octane render"
).split()
ACCENTED = "café naïve Zürich São Ærø façade crème brûlée piñata jalapeño Øresund".split()
CJK = "東京 夜景 猫 雨 桜 富士山 龍 城 한국 서울".split()
EMOJI = ["🐱", "🚀", "🌅", "🎨", "✨", "🔥", "👨‍👩‍👧", "🇯🇵"]
PUNCT = [",", ".", "!", "?", ";", ":", "-", "(", ")", "'s", "'", '"', "...", "&"]


def generated_prompts(count, seed):
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        # Lengths from a few tokens to well past 77 (CLIP) and 512 (T5's longest max_sequence_length).
        n = rng.choice([3, 8, 15, 30, 60, 90, 150]) if i % 10 else rng.choice([400, 700])
        parts = []
        for _ in range(n):
            r = rng.random()
            if r < 0.70:
                w = rng.choice(WORDS)
            elif r < 0.78:
                w = rng.choice(ACCENTED)
            elif r < 0.84:
                w = rng.choice(CJK)
            elif r < 0.88:
                w = rng.choice(EMOJI)
            else:
                w = rng.choice(PUNCT)
            case = rng.random()
            if case < 0.1:
                w = w.upper()
            elif case < 0.25:
                w = w.capitalize()
            parts.append(w)
        sep = rng.choice([" ", " ", " ", "  ", ", "])
        prompts.append(sep.join(parts))
    return prompts


def open_clip_bpe_path():
    # The data file only; importing open_clip would need timm and torchvision.
    spec = importlib.util.find_spec("open_clip")
    if spec is None:
        raise SystemExit("open_clip_torch is not installed (cargo xtask setup installs it)")
    return os.path.join(spec.submodule_search_locations[0], "bpe_simple_vocab_16e6.txt.gz")


def bytes_to_unicode():
    # GPT-2's byte-to-printable map, which CLIP's vocabulary is written in.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_clip_vocab_merges(folder):
    """CLIP ViT-L/14's vocabulary as openai/clip-vit-large-patch14 (and FLUX.1's tokenizer/) ship it."""
    os.makedirs(folder)
    with gzip.open(open_clip_bpe_path(), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    byte_chars = bytes_to_unicode()
    vocab = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == 49408
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({tok: i for i, tok in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        f.write("\n".join(" ".join(m) for m in merges) + "\n")
    special = {"content": None, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False, "special": True}
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            "49406": {**special, "content": "<|startoftext|>"},
            "49407": {**special, "content": "<|endoftext|>"},
        },
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": True,
        "do_lower_case": True,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 77,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": "<|endoftext|>",
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump({k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}, f, indent=2)


def t5_corpus(path):
    import pydoc_data.topics as topics

    rng = random.Random(7)
    with open(path, "w", encoding="utf-8") as f:
        for text in topics.topics.values():
            for line in text.split("\n"):
                if line.strip():
                    f.write(line.strip() + "\n")
        for prompt in generated_prompts(3000, seed=11):
            f.write(prompt + "\n")
        for _ in range(200):
            f.write(" ".join(rng.choice(ACCENTED + CJK) for _ in range(8)) + "\n")


def write_t5(folder, work):
    """A T5 v1.1-style SentencePiece model (FLUX.1's tokenizer_2/), trained on local text."""
    os.makedirs(work)
    corpus = os.path.join(work, "corpus.txt")
    t5_corpus(corpus)
    prefix = os.path.join(work, "spiece")
    spm.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=prefix,
        model_type="unigram",
        vocab_size=4000,
        character_coverage=0.9995,
        normalization_rule_name="nmt_nfkc",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        num_threads=2,
        minloglevel=2,
    )
    plain = os.path.join(work, "plain")
    os.makedirs(plain)
    shutil.copy(prefix + ".model", os.path.join(plain, "spiece.model"))
    tok = T5Tokenizer.from_pretrained(plain, extra_ids=100, model_max_length=512, legacy=True)
    tok.save_pretrained(folder)
    if not os.path.exists(os.path.join(folder, "spiece.model")):
        # FLUX.1's tokenizer_2/ carries both files; transformers reads tokenizer.json.
        shutil.copy(prefix + ".model", os.path.join(folder, "spiece.model"))


def ids(tok, prompts, max_length):
    out = tok(prompts, padding="max_length", max_length=max_length, truncation=True)
    return out["input_ids"]


def main():
    out = sys.argv[1]
    path = lambda name: os.path.join(out, name)  # noqa: E731
    write_clip_vocab_merges(path("clip_vocab_merges"))
    CLIPTokenizer.from_pretrained(path("clip_vocab_merges")).save_pretrained(path("clip_tokenizer_json"))
    assert os.path.exists(path("clip_tokenizer_json/tokenizer.json"))
    write_t5(path("t5"), path("t5_work"))
    assert os.path.exists(path("t5/tokenizer.json"))
    # Folders with the vocabulary alone: the class comes from model_index.json, the special tokens
    # from the class's defaults, and there is no model_max_length.
    os.makedirs(path("clip_bare"))
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(path(f"clip_vocab_merges/{name}"), path(f"clip_bare/{name}"))
    os.makedirs(path("t5_bare"))
    shutil.copy(path("t5/tokenizer.json"), path("t5_bare/tokenizer.json"))

    prompts = SPECIAL_CASES + generated_prompts(220, seed=3)
    # Each folder loaded as diffusers loads a pipeline's tokenizers (the class from model_index.json).
    folders = [
        ("clip_vocab_merges", "CLIPTokenizer", CLIPTokenizer, [77, 16]),
        ("clip_tokenizer_json", "CLIPTokenizer", CLIPTokenizer, [77]),
        ("clip_bare", "CLIPTokenizer", CLIPTokenizer, [77]),
        ("t5", "T5TokenizerFast", T5TokenizerFast, [512, 256, 16]),
        ("t5_bare", "T5TokenizerFast", T5TokenizerFast, [512]),
    ]
    cases, tokenizers = [], {}
    for folder, class_name, cls, lengths in folders:
        tok = cls.from_pretrained(path(folder))
        limit = tok.model_max_length if tok.model_max_length < 1e20 else None
        tokenizers[folder] = {
            "class": class_name,
            "model_max_length": limit,
            "pad_token_id": tok.pad_token_id,
            "backend": json.loads(tok.backend_tokenizer.to_str()),
        }
        for n in lengths:
            cases.append({"folder": folder, "max_length": n, "ids": ids(tok, prompts, n)})
    expected = {
        "transformers": transformers.__version__,
        "prompts": prompts,
        "tokenizers": tokenizers,
        "cases": cases,
    }
    with open(path("expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False)
    first = cases[0]["ids"]
    full = sum(1 for row in first if row[-1] == 49407 and row[-2] != 49407)
    print(f"{len(prompts)} prompts, {len(cases)} cases, {full} fill CLIP's 77 tokens")


if __name__ == "__main__":
    main()
