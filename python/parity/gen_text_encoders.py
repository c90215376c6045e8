"""Reference outputs of transformers' CLIPTextModel and T5EncoderModel on reduced configs with random
weights, for the Rust parity test (model/tests/text_encoder_parity.rs).

    python gen_text_encoders.py OUT_DIR

Writes OUT_DIR/cases.json and per case OUT_DIR/<case>/ (config.json and safetensors as
`save_pretrained` writes them; one case rewritten to transformers 4's key names, one sharded) plus
OUT_DIR/<case>/io.safetensors: `input_ids` [B, T] (int64) and, per dtype (f32, bf16, f16), the
last hidden state (and CLIP's pooled output, its `hidden_states[-2]` and, with a projection,
`text_embeds`) transformers computes, stored as f32.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config,
                          T5EncoderModel)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

CLIP_CASES = {
    # FLUX.1's CLIP-L shape in miniature: quick_gelu and the legacy eos id 2 (pooled = highest id).
    "clip_quick_gelu_legacy_eos": dict(
        config=dict(hidden_act="quick_gelu", eos_token_id=2, num_hidden_layers=2, num_attention_heads=4),
        lengths=[77, 16],
        legacy_keys=True,
    ),
    # A newer config: exact GELU, the pooled token is the first eos id.
    "clip_gelu_eos_id": dict(
        config=dict(hidden_act="gelu", eos_token_id=999, num_hidden_layers=3, num_attention_heads=2),
        lengths=[20],
        legacy_keys=False,
    ),
    # SDXL's text_encoder_2 (OpenCLIP-bigG) in miniature: CLIPTextModelWithProjection, exact
    # GELU, the projected pooled output and the penultimate hidden states.
    "clip_with_projection": dict(
        config=dict(hidden_act="gelu", eos_token_id=999, num_hidden_layers=3, num_attention_heads=4,
                    projection_dim=24),
        lengths=[77, 9],
        legacy_keys=False,
        projection=True,
    ),
}

T5_CASES = {
    # T5 v1.1 (FLUX.1's text_encoder_2) in miniature; long enough for the logarithmic buckets.
    "t5_gated_gelu": dict(
        config=dict(feed_forward_proj="gated-gelu", num_layers=2, num_heads=4, d_kv=8),
        lengths=[40, 7],
        shard=True,
    ),
    # Original T5: ReLU feed-forward; a short max distance so offsets past it share a bucket.
    "t5_relu_short_distance": dict(
        config=dict(feed_forward_proj="relu", num_layers=3, num_heads=2, d_kv=16, relative_attention_max_distance=20),
        lengths=[64],
        shard=False,
    ),
}


def clip_ids(generator, batch, length, vocab, bos, eos):
    """[BOS, words..., EOS, EOS padding] with prompts of different lengths, as the tokenizer gives."""
    rows = []
    for b in range(batch):
        words = max(1, (length - 2) * (b + 1) // (batch + 1))
        body = torch.randint(0, bos, (words,), generator=generator)
        row = torch.cat([torch.tensor([bos]), body, torch.tensor([eos])])
        row = torch.cat([row, torch.full((length - row.numel(),), eos)])
        rows.append(row)
    return torch.stack(rows).long()


def t5_ids(generator, batch, length, vocab):
    """Words, then </s> (1), then <pad> (0), as T5's tokenizer gives."""
    rows = []
    for b in range(batch):
        words = max(1, (length - 1) * (b + 1) // (batch + 1))
        body = torch.randint(3, vocab, (words,), generator=generator)
        row = torch.cat([body, torch.tensor([1]), torch.zeros(length - words - 1, dtype=torch.long)])
        rows.append(row)
    return torch.stack(rows).long()


def rewrite_as_transformers4(folder):
    """Checkpoints written before transformers 5 prefix CLIP's keys with `text_model.` and keep
    the position_ids buffer (FLUX.1's text_encoder/ is such a checkpoint)."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    renamed = {f"text_model.{k}": v for k, v in tensors.items()}
    n = renamed["text_model.embeddings.position_embedding.weight"].shape[0]
    renamed["text_model.embeddings.position_ids"] = torch.arange(n).unsqueeze(0)
    save_file(renamed, path, metadata={"format": "pt"})


def run_clip(out, name, spec, generator):
    base = dict(vocab_size=1000, hidden_size=32, intermediate_size=64, max_position_embeddings=77,
                bos_token_id=998, pad_token_id=999)
    config = CLIPTextConfig(**{**base, **spec["config"]})
    cls = CLIPTextModelWithProjection if spec.get("projection") else CLIPTextModel
    model = cls(config).eval()
    folder = os.path.join(out, name)
    model.save_pretrained(folder)
    if spec["legacy_keys"]:
        rewrite_as_transformers4(folder)
    io = {}
    for length in spec["lengths"]:
        ids = clip_ids(generator, 3, length, config.vocab_size, bos=998, eos=999)
        io[f"input_ids_{length}"] = ids
        for tag, dtype in DTYPES.items():
            m = cls.from_pretrained(folder, dtype=dtype).eval()
            with torch.no_grad():
                o = m(ids, output_hidden_states=True)
            io[f"last_hidden_state_{length}_{tag}"] = o.last_hidden_state.float()
            io[f"penultimate_hidden_state_{length}_{tag}"] = o.hidden_states[-2].float()
            if spec.get("projection"):
                io[f"text_embeds_{length}_{tag}"] = o.text_embeds.float()
            else:
                io[f"pooler_output_{length}_{tag}"] = o.pooler_output.float()
    save_file(io, os.path.join(folder, "io.safetensors"))
    family = "clip_projection" if spec.get("projection") else "clip"
    return {"name": name, "family": family, "lengths": spec["lengths"]}


def run_t5(out, name, spec, generator):
    base = dict(vocab_size=300, d_model=32, d_ff=64)
    config = T5Config(**{**base, **spec["config"]})
    model = T5EncoderModel(config).eval()
    # Random weights of a unit scale, so the deep layers do not vanish into the norms.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    folder = os.path.join(out, name)
    model.save_pretrained(folder, max_shard_size="20KB" if spec["shard"] else "10GB")
    io = {}
    for length in spec["lengths"]:
        ids = t5_ids(generator, 3, length, config.vocab_size)
        io[f"input_ids_{length}"] = ids
        for tag, dtype in DTYPES.items():
            m = T5EncoderModel.from_pretrained(folder, dtype=dtype).eval()
            with torch.no_grad():
                io[f"last_hidden_state_{length}_{tag}"] = m(ids).last_hidden_state.float()
    save_file(io, os.path.join(folder, "io.safetensors"))
    return {"name": name, "family": "t5", "lengths": spec["lengths"], "sharded": spec["shard"]}


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    cases = [run_clip(out, n, s, generator) for n, s in CLIP_CASES.items()]
    cases += [run_t5(out, n, s, generator) for n, s in T5_CASES.items()]
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()
