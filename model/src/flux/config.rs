//! `FluxConfig`: the `config.json` of a diffusers `FluxTransformer2DModel` component.
use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Mirrors the constructor arguments of diffusers' `FluxTransformer2DModel` (0.42.1), with the same
/// defaults; unknown keys (`_class_name`, `_diffusers_version`, ...) are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FluxConfig {
    pub patch_size: i64,
    pub in_channels: i64,
    /// `None` means "same as `in_channels`" (diffusers' `out_channels or in_channels`).
    pub out_channels: Option<i64>,
    pub num_layers: i64,
    pub num_single_layers: i64,
    pub attention_head_dim: i64,
    pub num_attention_heads: i64,
    pub joint_attention_dim: i64,
    pub pooled_projection_dim: i64,
    pub guidance_embeds: bool,
    pub axes_dims_rope: Vec<i64>,
}

impl Default for FluxConfig {
    /// FLUX.1 sizes (diffusers' defaults).
    fn default() -> Self {
        Self {
            patch_size: 1,
            in_channels: 64,
            out_channels: None,
            num_layers: 19,
            num_single_layers: 38,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            guidance_embeds: false,
            axes_dims_rope: vec![16, 56, 56],
        }
    }
}

impl FluxConfig {
    /// Read and validate `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg: Self = crate::error::read_json(&dir.join("config.json"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Hidden width of every block: heads x head_dim.
    pub fn inner_dim(&self) -> i64 {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Channels of the predicted output per token (before unpatchifying).
    pub fn out_channels(&self) -> i64 {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// Width of `proj_out`'s output: `patch_size^2 * out_channels`, as diffusers builds it.
    pub fn proj_out_dim(&self) -> i64 {
        self.patch_size * self.patch_size * self.out_channels()
    }

    /// Width of the single-block MLP (`mlp_ratio` 4.0, as in diffusers).
    pub fn mlp_hidden_dim(&self) -> i64 {
        self.inner_dim() * 4
    }

    /// Reject configs the model cannot be built from; errors name the field.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("patch_size", self.patch_size),
            ("in_channels", self.in_channels),
            ("attention_head_dim", self.attention_head_dim),
            ("num_attention_heads", self.num_attention_heads),
            ("joint_attention_dim", self.joint_attention_dim),
            ("pooled_projection_dim", self.pooled_projection_dim),
        ];
        for (field, v) in positive {
            if v <= 0 {
                return Err(ModelError::config(field, format!("must be > 0, got {v}")));
            }
        }
        if let Some(o) = self.out_channels {
            if o <= 0 {
                return Err(ModelError::config(
                    "out_channels",
                    format!("must be > 0 or null, got {o}"),
                ));
            }
        }
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("num_single_layers", self.num_single_layers),
        ] {
            if v < 0 {
                return Err(ModelError::config(field, format!("must be >= 0, got {v}")));
            }
        }
        if self.axes_dims_rope.is_empty() {
            return Err(ModelError::config(
                "axes_dims_rope",
                "must list at least one axis",
            ));
        }
        if let Some(d) = self
            .axes_dims_rope
            .iter()
            .find(|d| **d <= 0 || **d % 2 != 0)
        {
            return Err(ModelError::config(
                "axes_dims_rope",
                format!("every axis dim must be even and > 0, got {d}"),
            ));
        }
        let sum: i64 = self.axes_dims_rope.iter().sum();
        if sum != self.attention_head_dim {
            return Err(ModelError::config(
                "axes_dims_rope",
                format!(
                    "sum {sum} must equal attention_head_dim {}",
                    self.attention_head_dim
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_diffusers_json_and_ignores_unknown_keys() {
        let json = r#"{"_class_name":"FluxTransformer2DModel","_diffusers_version":"0.42.1",
            "attention_head_dim":16,"axes_dims_rope":[4,6,6],"guidance_embeds":true,"in_channels":16,
            "joint_attention_dim":32,"num_attention_heads":2,"num_layers":1,"num_single_layers":2,
            "out_channels":null,"patch_size":1,"pooled_projection_dim":8}"#;
        let cfg: FluxConfig = serde_json::from_str(json).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.out_channels(), 16);
        assert_eq!(cfg.inner_dim(), 32);
        assert!(cfg.guidance_embeds);
    }

    #[test]
    fn rejects_rope_axes_not_summing_to_head_dim() {
        let cfg = FluxConfig {
            axes_dims_rope: vec![16, 56, 54],
            ..Default::default()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("axes_dims_rope"), "{err}");
    }

    #[test]
    fn rejects_non_positive_heads() {
        let cfg = FluxConfig {
            num_attention_heads: 0,
            ..Default::default()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("num_attention_heads"), "{err}");
    }
}
