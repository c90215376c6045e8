//! `UNet2DConditionModel`'s `config.json`, as diffusers 0.42.1 writes it, and the subset of it
//! that SD1.x/SD2.x and SDXL checkpoints use. Anything outside that subset is refused by
//! [`UNetConfig::validate`], naming the field, rather than run wrongly.
use crate::error::{ModelError, Result};
use serde::Deserialize;

/// A setting diffusers takes either once for every level or per level.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PerLevel<T> {
    One(T),
    Each(Vec<T>),
}

impl<T: Clone> PerLevel<T> {
    /// The value at each of `levels` levels; None when a list has another length.
    pub fn levels(&self, levels: usize) -> Option<Vec<T>> {
        match self {
            Self::One(v) => Some(vec![v.clone(); levels]),
            Self::Each(v) if v.len() == levels => Some(v.clone()),
            Self::Each(_) => None,
        }
    }
}

/// Mirrors the UNet's `config.json`; defaults are diffusers' constructor defaults.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default)]
pub struct UNetConfig {
    pub in_channels: i64,
    pub out_channels: i64,
    pub center_input_sample: bool,
    pub flip_sin_to_cos: bool,
    pub freq_shift: f64,
    pub down_block_types: Vec<String>,
    pub mid_block_type: Option<String>,
    pub up_block_types: Vec<String>,
    pub only_cross_attention: PerLevel<bool>,
    pub block_out_channels: Vec<i64>,
    pub layers_per_block: PerLevel<i64>,
    pub downsample_padding: i64,
    pub mid_block_scale_factor: f64,
    pub act_fn: String,
    pub norm_num_groups: Option<i64>,
    pub norm_eps: f64,
    pub cross_attention_dim: PerLevel<i64>,
    pub transformer_layers_per_block: PerLevel<i64>,
    pub reverse_transformer_layers_per_block: Option<serde_json::Value>,
    pub encoder_hid_dim: Option<i64>,
    pub encoder_hid_dim_type: Option<String>,
    /// Heads per level (diffusers' misnomer: `num_attention_heads` falls back to it).
    pub attention_head_dim: PerLevel<i64>,
    pub num_attention_heads: Option<PerLevel<i64>>,
    pub dual_cross_attention: bool,
    pub use_linear_projection: bool,
    pub class_embed_type: Option<String>,
    pub addition_embed_type: Option<String>,
    pub addition_time_embed_dim: Option<i64>,
    pub num_class_embeds: Option<i64>,
    /// Softmax in fp32 (SD2.x): only changes low-precision rounding; attention here runs
    /// through SDPA, which accumulates in fp32 anyway.
    pub upcast_attention: bool,
    pub resnet_time_scale_shift: String,
    pub resnet_skip_time_act: bool,
    pub resnet_out_scale_factor: f64,
    pub time_embedding_type: String,
    pub time_embedding_dim: Option<i64>,
    pub time_embedding_act_fn: Option<String>,
    pub timestep_post_act: Option<String>,
    pub time_cond_proj_dim: Option<i64>,
    pub conv_in_kernel: i64,
    pub conv_out_kernel: i64,
    pub projection_class_embeddings_input_dim: Option<i64>,
    pub attention_type: String,
    pub class_embeddings_concat: bool,
    pub mid_block_only_cross_attention: Option<bool>,
    pub cross_attention_norm: Option<String>,
    pub dropout: f64,
    /// Only read by pipelines (the default latent side).
    pub sample_size: Option<serde_json::Value>,
}

impl Default for UNetConfig {
    fn default() -> Self {
        Self {
            in_channels: 4,
            out_channels: 4,
            center_input_sample: false,
            flip_sin_to_cos: true,
            freq_shift: 0.0,
            down_block_types: [
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "DownBlock2D",
            ]
            .map(String::from)
            .to_vec(),
            mid_block_type: Some(MID_CROSS_ATTN.into()),
            up_block_types: [
                "UpBlock2D",
                "CrossAttnUpBlock2D",
                "CrossAttnUpBlock2D",
                "CrossAttnUpBlock2D",
            ]
            .map(String::from)
            .to_vec(),
            only_cross_attention: PerLevel::One(false),
            block_out_channels: vec![320, 640, 1280, 1280],
            layers_per_block: PerLevel::One(2),
            downsample_padding: 1,
            mid_block_scale_factor: 1.0,
            act_fn: "silu".into(),
            norm_num_groups: Some(32),
            norm_eps: 1e-5,
            cross_attention_dim: PerLevel::One(1280),
            transformer_layers_per_block: PerLevel::One(1),
            reverse_transformer_layers_per_block: None,
            encoder_hid_dim: None,
            encoder_hid_dim_type: None,
            attention_head_dim: PerLevel::One(8),
            num_attention_heads: None,
            dual_cross_attention: false,
            use_linear_projection: false,
            class_embed_type: None,
            addition_embed_type: None,
            addition_time_embed_dim: None,
            num_class_embeds: None,
            upcast_attention: false,
            resnet_time_scale_shift: "default".into(),
            resnet_skip_time_act: false,
            resnet_out_scale_factor: 1.0,
            time_embedding_type: "positional".into(),
            time_embedding_dim: None,
            time_embedding_act_fn: None,
            timestep_post_act: None,
            time_cond_proj_dim: None,
            conv_in_kernel: 3,
            conv_out_kernel: 3,
            projection_class_embeddings_input_dim: None,
            attention_type: "default".into(),
            class_embeddings_concat: false,
            mid_block_only_cross_attention: None,
            cross_attention_norm: None,
            dropout: 0.0,
            sample_size: None,
        }
    }
}

pub const MID_CROSS_ATTN: &str = "UNetMidBlock2DCrossAttn";
pub const CROSS_ATTN_DOWN: &str = "CrossAttnDownBlock2D";
pub const DOWN: &str = "DownBlock2D";
pub const CROSS_ATTN_UP: &str = "CrossAttnUpBlock2D";
pub const UP: &str = "UpBlock2D";

/// One resolution level, as the blocks are built from it.
#[derive(Debug, Clone, PartialEq)]
pub struct Level {
    pub channels: i64,
    pub layers: i64,
    /// Transformer layers of each attention of the level (0: no attention).
    pub transformer_layers: i64,
    pub heads: i64,
    pub cross_attention_dim: i64,
}

impl UNetConfig {
    /// Check the configuration is one this UNet runs; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let levels = self.block_out_channels.len();
        if levels == 0 {
            return Err(ModelError::config(
                "block_out_channels",
                "must not be empty",
            ));
        }
        for (field, types) in [
            ("down_block_types", &self.down_block_types),
            ("up_block_types", &self.up_block_types),
        ] {
            if types.len() != levels {
                return Err(ModelError::config(
                    field,
                    format!("{} blocks for {levels} block_out_channels", types.len()),
                ));
            }
        }
        for t in &self.down_block_types {
            if t != CROSS_ATTN_DOWN && t != DOWN {
                return Err(ModelError::config(
                    "down_block_types",
                    format!("{t} is not supported ({CROSS_ATTN_DOWN} or {DOWN})"),
                ));
            }
        }
        for (i, t) in self.up_block_types.iter().enumerate() {
            if t != CROSS_ATTN_UP && t != UP {
                return Err(ModelError::config(
                    "up_block_types",
                    format!("{t} is not supported ({CROSS_ATTN_UP} or {UP})"),
                ));
            }
            // The up blocks mirror the down blocks: attention where the mirrored level has it.
            let mirrored = &self.down_block_types[levels - 1 - i];
            if (t == CROSS_ATTN_UP) != (mirrored == CROSS_ATTN_DOWN) {
                return Err(ModelError::config(
                    "up_block_types",
                    format!("{t} at up level {i} does not mirror {mirrored}"),
                ));
            }
        }
        if self.mid_block_type.as_deref() != Some(MID_CROSS_ATTN) {
            return Err(ModelError::config(
                "mid_block_type",
                format!(
                    "{:?} is not supported ({MID_CROSS_ATTN})",
                    self.mid_block_type
                ),
            ));
        }
        let unsupported = |field: &str, what: String| Err(ModelError::config(field, what));
        if self.act_fn != "silu" && self.act_fn != "swish" {
            return unsupported("act_fn", format!("{} is not supported (silu)", self.act_fn));
        }
        if self.only_cross_attention.levels(levels) != Some(vec![false; levels])
            || self.mid_block_only_cross_attention == Some(true)
        {
            return unsupported("only_cross_attention", "must be false".into());
        }
        for (field, set) in [
            (
                "reverse_transformer_layers_per_block",
                self.reverse_transformer_layers_per_block.is_some(),
            ),
            ("encoder_hid_dim_type", self.encoder_hid_dim_type.is_some()),
            ("class_embed_type", self.class_embed_type.is_some()),
            ("num_class_embeds", self.num_class_embeds.is_some()),
            (
                "time_embedding_act_fn",
                self.time_embedding_act_fn.is_some(),
            ),
            ("timestep_post_act", self.timestep_post_act.is_some()),
            ("time_cond_proj_dim", self.time_cond_proj_dim.is_some()),
            ("cross_attention_norm", self.cross_attention_norm.is_some()),
            ("dual_cross_attention", self.dual_cross_attention),
            ("center_input_sample", self.center_input_sample),
            ("resnet_skip_time_act", self.resnet_skip_time_act),
            ("class_embeddings_concat", self.class_embeddings_concat),
        ] {
            if set {
                return unsupported(field, "is not supported by this UNet".into());
            }
        }
        for (field, value, want) in [
            (
                "time_embedding_type",
                &self.time_embedding_type,
                "positional",
            ),
            (
                "resnet_time_scale_shift",
                &self.resnet_time_scale_shift,
                "default",
            ),
            ("attention_type", &self.attention_type, "default"),
        ] {
            if value != want {
                return unsupported(field, format!("{value} is not supported ({want})"));
            }
        }
        if self.resnet_out_scale_factor != 1.0 || self.mid_block_scale_factor != 1.0 {
            return unsupported("resnet_out_scale_factor", "only 1.0 is supported".into());
        }
        match self.addition_embed_type.as_deref() {
            None => {}
            Some("text_time") => {
                for (field, v) in [
                    ("addition_time_embed_dim", self.addition_time_embed_dim),
                    (
                        "projection_class_embeddings_input_dim",
                        self.projection_class_embeddings_input_dim,
                    ),
                ] {
                    if v.is_none_or(|v| v < 1) {
                        return unsupported(field, "text_time conditioning needs it".into());
                    }
                }
            }
            Some(other) => {
                return unsupported(
                    "addition_embed_type",
                    format!("{other} is not supported (text_time, as SDXL)"),
                )
            }
        }
        let groups = self.norm_num_groups.ok_or_else(|| {
            ModelError::config(
                "norm_num_groups",
                "a UNet without group norms is not supported",
            )
        })?;
        for (field, k) in [
            ("conv_in_kernel", self.conv_in_kernel),
            ("conv_out_kernel", self.conv_out_kernel),
        ] {
            if k < 1 || k % 2 == 0 {
                return unsupported(field, format!("{k} is not an odd positive size"));
            }
        }
        if self.downsample_padding < 0 {
            return unsupported("downsample_padding", "must not be negative".into());
        }
        let each = self.levels()?;
        if each
            .iter()
            .any(|l| l.cross_attention_dim != each[0].cross_attention_dim)
        {
            return unsupported(
                "cross_attention_dim",
                "one text width for every level (one encoder_hidden_states feeds them all)".into(),
            );
        }
        for l in &each {
            if l.channels < 1 || l.channels % groups != 0 {
                return unsupported(
                    "block_out_channels",
                    format!(
                        "{} is not a positive multiple of norm_num_groups {groups}",
                        l.channels
                    ),
                );
            }
            if l.layers < 1 {
                return unsupported("layers_per_block", "must be at least 1".into());
            }
            if l.heads < 1 || l.channels % l.heads != 0 {
                return unsupported(
                    "attention_head_dim",
                    format!("{} heads do not divide {} channels", l.heads, l.channels),
                );
            }
            if l.cross_attention_dim < 1 {
                return unsupported("cross_attention_dim", "must be positive".into());
            }
        }
        Ok(())
    }

    /// Each level's settings, down the UNet (the mid block uses the last).
    pub fn levels(&self) -> Result<Vec<Level>> {
        let n = self.block_out_channels.len();
        let per = |field: &str, v: &PerLevel<i64>| -> Result<Vec<i64>> {
            v.levels(n)
                .ok_or_else(|| ModelError::config(field, format!("needs one value or {n}")))
        };
        let layers = per("layers_per_block", &self.layers_per_block)?;
        let transformer_layers = per(
            "transformer_layers_per_block",
            &self.transformer_layers_per_block,
        )?;
        let heads = match &self.num_attention_heads {
            Some(h) => per("num_attention_heads", h)?,
            None => per("attention_head_dim", &self.attention_head_dim)?,
        };
        let cross = per("cross_attention_dim", &self.cross_attention_dim)?;
        Ok((0..n)
            .map(|i| Level {
                channels: self.block_out_channels[i],
                layers: layers[i],
                transformer_layers: if self.down_block_types[i] == CROSS_ATTN_DOWN {
                    transformer_layers[i]
                } else {
                    0
                },
                heads: heads[i],
                cross_attention_dim: cross[i],
            })
            .collect())
    }

    /// The shapes of a ControlNet's residuals for `rows` samples of latent side `[h, w]`: one
    /// per skip of the down path (`conv_in`'s, each resnet's, each downsampler's: every level
    /// but the last halves the side, rounding up as its stride-2 convolution does), and the mid
    /// block's.
    pub fn control_residual_shapes(
        &self,
        rows: i64,
        [h, w]: [i64; 2],
    ) -> Result<(Vec<[i64; 4]>, [i64; 4])> {
        let levels = self.levels()?;
        let mut side = [h, w];
        let mut down = vec![[rows, self.block_out_channels[0], h, w]];
        for (i, l) in levels.iter().enumerate() {
            for _ in 0..l.layers {
                down.push([rows, l.channels, side[0], side[1]]);
            }
            if i + 1 < levels.len() {
                side = [(side[0] + 1) / 2, (side[1] + 1) / 2];
                down.push([rows, l.channels, side[0], side[1]]);
            }
        }
        let last = levels.last().map_or(0, |l| l.channels);
        Ok((down, [rows, last, side[0], side[1]]))
    }

    /// The mid block's transformer layers (the last level's setting, whatever its block type).
    pub fn mid_transformer_layers(&self) -> i64 {
        let n = self.block_out_channels.len();
        self.transformer_layers_per_block
            .levels(n)
            .and_then(|l| l.last().copied())
            .unwrap_or(1)
    }

    /// The text width the cross-attention reads (every level's: [`UNetConfig::validate`]).
    pub fn context_dim(&self) -> i64 {
        match &self.cross_attention_dim {
            PerLevel::One(d) => *d,
            PerLevel::Each(d) => d.first().copied().unwrap_or(0),
        }
    }

    /// `block_out_channels[0] * 4`, the time embedding's width.
    pub fn time_embed_dim(&self) -> i64 {
        self.block_out_channels.first().copied().unwrap_or(0) * 4
    }

    /// SDXL's added conditioning: (time id projection width, embedding input width).
    pub fn text_time(&self) -> Option<(i64, i64)> {
        match self.addition_embed_type.as_deref() {
            Some("text_time") => Some((
                self.addition_time_embed_dim?,
                self.projection_class_embeddings_input_dim?,
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_sd15s_and_valid() {
        let c = UNetConfig::default();
        c.validate().unwrap();
        let l = c.levels().unwrap();
        assert_eq!(l[0].transformer_layers, 1);
        assert_eq!(l[3].transformer_layers, 0, "DownBlock2D has no attention");
        assert_eq!(c.time_embed_dim(), 1280);
    }

    #[test]
    fn refusals_name_the_field() {
        let cases: Vec<(&str, serde_json::Value)> = vec![
            (
                "class_embed_type",
                serde_json::json!({"class_embed_type": "timestep"}),
            ),
            ("act_fn", serde_json::json!({"act_fn": "gelu"})),
            (
                "layers_per_block",
                serde_json::json!({"layers_per_block": [1, 2]}),
            ),
            (
                "addition_time_embed_dim",
                serde_json::json!({"addition_embed_type": "text_time"}),
            ),
            (
                "attention_head_dim",
                serde_json::json!({"attention_head_dim": 7}),
            ),
            (
                "up_block_types",
                serde_json::json!({"up_block_types": ["UpBlock2D", "UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]}),
            ),
        ];
        for (field, json) in cases {
            let c: UNetConfig = serde_json::from_value(json).unwrap();
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }
}
