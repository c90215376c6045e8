//! Shapes and random inputs the benchmarks share (model bench, engine bench, profiler), so every
//! figure in docs/BENCHMARKS.md is measured on the same configuration.
use crate::flux::{FluxConfig, FluxInputs};
use tch::{Device, Kind, Tensor};

/// Medium config: Flux's head layout (head_dim 128, RoPE axes 16/56/56) at 8 heads (hidden 1024),
/// 4 double + 8 single blocks, FLUX.1-dev's input widths (64 latent channels, T5 4096, CLIP 768,
/// guidance embedding); 32x32 = 1024 image tokens, 64 text tokens.
pub fn medium_config() -> FluxConfig {
    FluxConfig {
        num_layers: 4,
        num_single_layers: 8,
        attention_head_dim: 128,
        num_attention_heads: 8,
        guidance_embeds: true,
        ..FluxConfig::default()
    }
}

/// Image tokens per side of the medium config (N = 1024).
pub const MEDIUM_SIDE: i64 = 32;
/// Text tokens of the medium config.
pub const MEDIUM_TXT: i64 = 64;

/// FLUX.1-dev at full size (19 double + 38 single blocks, hidden 3072, guidance embedding), for
/// GPU measurements with random weights.
pub fn flux_dev_config() -> FluxConfig {
    FluxConfig {
        guidance_embeds: true,
        ..FluxConfig::default()
    }
}

/// Image tokens per side at 1024x1024 (N = 4096) and FLUX.1-dev's text length.
pub const FLUX_SIDE: i64 = 64;
pub const FLUX_TXT: i64 = 512;

/// Random full-forward inputs (batch 1, CPU) on a `side x side` token grid with `txt` text tokens.
pub fn random_inputs(cfg: &FluxConfig, side: i64, txt: i64) -> FluxInputs {
    random_inputs_on(cfg, side, txt, 1, Device::Cpu)
}

/// Random full-forward inputs for `batch` requests on `device` (see [`random_inputs`]).
pub fn random_inputs_on(
    cfg: &FluxConfig,
    side: i64,
    txt: i64,
    batch: i64,
    device: Device,
) -> FluxInputs {
    let opts = (Kind::Float, device);
    let n = side * side;
    let rows = Tensor::arange(side, opts)
        .view([side, 1])
        .expand([side, side], false);
    let cols = Tensor::arange(side, opts)
        .view([1, side])
        .expand([side, side], false);
    FluxInputs {
        hidden_states: Tensor::randn([batch, n, cfg.in_channels], opts),
        encoder_hidden_states: Tensor::randn([batch, txt, cfg.joint_attention_dim], opts),
        pooled_projections: Tensor::randn([batch, cfg.pooled_projection_dim], opts),
        timestep: Tensor::full([batch], 0.5, opts),
        img_ids: Tensor::stack(&[Tensor::zeros([side, side], opts), rows, cols], -1).view([n, 3]),
        txt_ids: Tensor::zeros([txt, 3], opts),
        guidance: cfg
            .guidance_embeds
            .then(|| Tensor::full([batch], 3.5, opts)),
    }
}
