"""Reduced FLUX.1 pipelines with random weights, saved by diffusers' `save_pretrained` in the layout
people download, and what diffusers computes with them, for the Rust parity test
(model/tests/flux_pipeline_parity.rs).

    python gen_flux_pipelines.py OUT_DIR

Writes:
- OUT_DIR/dev: a `FluxPipeline` (guidance-distilled transformer, CLIP with its real BPE vocabulary
  as vocab.json + merges.txt and transformers 4's key names, a SentencePiece T5 tokenizer with
  spiece.model + tokenizer.json, every weight file sharded with an index);
- OUT_DIR/fill: a `FluxFillPipeline` with the same text side (its transformer takes the masked
  image's latents and the packed mask after the latents);
- OUT_DIR/prompts.txt and per pipeline OUT_DIR/<name>/expected/encode_<N>.safetensors:
  `FluxPipeline.encode_prompt` of every line at max_sequence_length N;
- OUT_DIR/latents.safetensors (`latents`, packed), OUT_DIR/image.png, OUT_DIR/mask.png and per
  pipeline OUT_DIR/<name>/expected/image.safetensors: the pipeline's `output_type="pt"` image.
- OUT_DIR/cases.json: the settings used.

The Fill VAE's encoder gives a log-variance of -30 (std 3e-7), so diffusers' posterior sample is its
mean within 3e-7: diffmesh encodes templates to the posterior mean.
"""

import json
import math
import os
import shutil
import sys

import diffusers
import numpy as np
import torch
import transformers
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxFillPipeline, FluxPipeline,
                       FluxTransformer2DModel)
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_tokenizers  # noqa: E402  (the tokenizer files of the tokenizer parity test)

HEIGHT, WIDTH, STEPS, GUIDANCE = 32, 32, 4, 3.5
LENGTHS = [512, 48]
PROMPTS = [
    "a photo of a cat, sitting on a red sofa",
    "",
    "Café au lait — 東京の夜景 🌃!!  Repeated   spaces.",
    " ".join(["a long prompt that runs past seventy-seven CLIP tokens"] * 12),
]


def randomize(model, gen, scale=1.0):
    """Unit-scale random weights (norms near 1), so no layer vanishes or keeps a trivial init."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.02 * noise)
            else:
                fan_in = p[0].numel()
                p.copy_(scale * noise / math.sqrt(fan_in))


def text_side(tok_dir, gen):
    gen_tokenizers.write_clip_vocab_merges(os.path.join(tok_dir, "clip"))
    gen_tokenizers.write_t5(os.path.join(tok_dir, "t5"), os.path.join(tok_dir, "t5_work"))
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(tok_dir, "clip"))
    tokenizer_2 = T5TokenizerFast.from_pretrained(os.path.join(tok_dir, "t5"))
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=0, eos_token_id=2,
        pad_token_id=1)).eval()
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
        relative_attention_max_distance=128)).eval()
    randomize(clip, gen)
    randomize(t5, gen, scale=0.5)
    return tokenizer, tokenizer_2, clip, t5


def vae(gen, fill):
    model = AutoencoderKL(
        block_out_channels=[32, 64], layers_per_block=1, latent_channels=16, norm_num_groups=16,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        sample_size=HEIGHT).eval()
    randomize(model, gen, scale=0.5)
    if fill:
        with torch.no_grad():
            conv = model.encoder.conv_out
            conv.weight[16:] = 0.0
            conv.bias[16:] = -30.0
    return model


def transformer(gen, fill):
    model = FluxTransformer2DModel(
        in_channels=144 if fill else 64, out_channels=64, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=[4, 6, 6]).eval()
    randomize(model, gen, scale=0.5)
    return model


def scheduler():
    return FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, num_train_timesteps=1000,
        shift=3.0, use_dynamic_shifting=True)


def rewrite_clip_as_transformers4(folder):
    """FLUX.1's text_encoder/ was written by transformers 4: `text_model.` keys, position_ids kept."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    files = [os.path.join(folder, "model.safetensors")]
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        files = sorted({os.path.join(folder, v) for v in index["weight_map"].values()})
        index["weight_map"] = {f"text_model.{k}": v for k, v in index["weight_map"].items()}
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
    for path in files:
        tensors = {f"text_model.{k}": v for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})


def save(pipe, folder, tok_dir):
    pipe.save_pretrained(folder, max_shard_size="300KB")
    # The tokenizer folders as FLUX.1 ships them: tokenizer/ with vocab.json + merges.txt (no
    # tokenizer.json), tokenizer_2/ with spiece.model + tokenizer.json.
    for name, source in [("tokenizer", "clip"), ("tokenizer_2", "t5")]:
        shutil.rmtree(os.path.join(folder, name))
        shutil.copytree(os.path.join(tok_dir, source), os.path.join(folder, name))
    assert not os.path.exists(os.path.join(folder, "tokenizer", "tokenizer.json"))
    assert os.path.exists(os.path.join(folder, "tokenizer_2", "spiece.model"))
    rewrite_clip_as_transformers4(os.path.join(folder, "text_encoder"))
    assert os.path.exists(os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors.index.json"))


def write_inputs(out, gen):
    latents = torch.randn(1, (HEIGHT // 4) * (WIDTH // 4), 64, generator=gen)
    save_file({"latents": latents}, os.path.join(out, "latents.safetensors"))
    pixels = (torch.rand(HEIGHT, WIDTH, 3, generator=gen) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels, "RGB").save(os.path.join(out, "image.png"))
    mask = np.zeros((HEIGHT, WIDTH), dtype=np.uint8)
    mask[4:20, 10:30] = 255
    mask[24:28, 2:6] = 200  # binarised: repainted
    mask[28:30, 20:24] = 100  # binarised: kept
    Image.fromarray(mask, "L").save(os.path.join(out, "mask.png"))
    return latents


def expected(pipe, folder, latents, out, fill):
    exp = os.path.join(folder, "expected")
    os.makedirs(exp)
    with torch.no_grad():
        for n in LENGTHS:
            embeds, pooled, _ = pipe.encode_prompt(PROMPTS, PROMPTS, max_sequence_length=n)
            save_file({"prompt_embeds": embeds.contiguous(), "pooled_prompt_embeds": pooled.contiguous()},
                      os.path.join(exp, f"encode_{n}.safetensors"))
        kwargs = dict(prompt=PROMPTS[0], height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                      guidance_scale=GUIDANCE, max_sequence_length=LENGTHS[1], latents=latents.clone(),
                      output_type="pt")
        if fill:
            kwargs["image"] = Image.open(os.path.join(out, "image.png"))
            kwargs["mask_image"] = Image.open(os.path.join(out, "mask.png"))
        image = pipe(**kwargs).images
    save_file({"image": image.float().contiguous()}, os.path.join(exp, "image.safetensors"))


def main():
    out = sys.argv[1]
    # The truncation warnings print every padded prompt in full.
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    gen = torch.Generator().manual_seed(0)
    tok_dir = os.path.join(out, "work", "tokenizers")
    tokenizer, tokenizer_2, clip, t5 = text_side(tok_dir, gen)
    latents = write_inputs(out, gen)
    with open(os.path.join(out, "prompts.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(PROMPTS) + "\n")
    for name, cls, fill in [("dev", FluxPipeline, False), ("fill", FluxFillPipeline, True)]:
        pipe = cls(scheduler=scheduler(), vae=vae(gen, fill), text_encoder=clip, tokenizer=tokenizer,
                   text_encoder_2=t5, tokenizer_2=tokenizer_2, transformer=transformer(gen, fill))
        folder = os.path.join(out, name)
        save(pipe, folder, tok_dir)
        # The reference runs the pipeline as a user loads it from the saved directory.
        loaded = cls.from_pretrained(folder, torch_dtype=torch.float32)
        expected(loaded, folder, latents, out, fill)
    shutil.rmtree(os.path.join(out, "work"))
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"height": HEIGHT, "width": WIDTH, "steps": STEPS, "guidance_scale": GUIDANCE,
                   "lengths": LENGTHS, "prompt": PROMPTS[0], "pipelines": ["dev", "fill"]}, f, indent=2)


if __name__ == "__main__":
    main()
