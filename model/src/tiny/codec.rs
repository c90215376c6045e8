//! `DiffmeshPixelCodec`: the tiny model's "VAE". It has no weights: encoding is a pixel
//! unshuffle by `factor` (RGB 64x64 -> 12 channels at 32x32 for factor 2), decoding the inverse
//! shuffle, so the transformer denoises pixels directly and decoding is exact.
use crate::components::LatentCodec;
use crate::error::{read_json, ModelError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tch::{Device, Tensor};

pub const CLASS_NAME: &str = "DiffmeshPixelCodec";

/// `vae/config.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PixelCodecConfig {
    #[serde(rename = "_class_name")]
    pub class_name: String,
    pub in_channels: i64,
    pub factor: i64,
}

impl Default for PixelCodecConfig {
    fn default() -> Self {
        PixelCodecConfig {
            class_name: CLASS_NAME.into(),
            in_channels: 3,
            factor: 2,
        }
    }
}

#[derive(Debug, Clone)]
pub struct DiffmeshPixelCodec {
    config: PixelCodecConfig,
    device: Device,
}

impl DiffmeshPixelCodec {
    pub fn new(config: PixelCodecConfig, device: Device) -> Result<Self> {
        if config.factor < 1 {
            return Err(ModelError::config(
                "factor",
                format!("must be >= 1, got {}", config.factor),
            ));
        }
        if config.in_channels < 1 {
            return Err(ModelError::config(
                "in_channels",
                format!("must be >= 1, got {}", config.in_channels),
            ));
        }
        Ok(DiffmeshPixelCodec { config, device })
    }

    /// Load from `vae/` (only `config.json`; there are no weights).
    pub fn load(dir: &Path, device: Device) -> Result<Self> {
        let config: PixelCodecConfig = read_json(&dir.join("config.json"))?;
        if config.class_name != CLASS_NAME {
            return Err(ModelError::Unsupported {
                component: "vae".into(),
                class: config.class_name.clone(),
                reason: format!("expected {CLASS_NAME}"),
            });
        }
        Self::new(config, device)
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        write_json(&dir.join("config.json"), &self.config)
    }

    fn check(&self, x: &Tensor, field: &str, channels: i64, divisible: i64) -> Result<()> {
        let size = x.size();
        if size.len() != 4
            || size[1] != channels
            || size[2] % divisible != 0
            || size[3] % divisible != 0
        {
            return Err(ModelError::input(
                field,
                format!("expected [B, {channels}, H, W] with H, W divisible by {divisible}, got {size:?}"),
            ));
        }
        Ok(())
    }
}

impl LatentCodec for DiffmeshPixelCodec {
    fn encode(&self, images: &Tensor) -> Result<Tensor> {
        self.check(
            images,
            "images",
            self.config.in_channels,
            self.config.factor,
        )?;
        Ok(images
            .f_to_device(self.device)?
            .f_pixel_unshuffle(self.config.factor)?)
    }

    fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        self.check(latents, "latents", self.latent_channels(), 1)?;
        Ok(latents
            .f_to_device(self.device)?
            .f_pixel_shuffle(self.config.factor)?)
    }

    fn latent_channels(&self) -> i64 {
        self.config.in_channels * self.config.factor * self.config.factor
    }

    fn downscale_factor(&self) -> i64 {
        self.config.factor
    }
}

/// Pretty-print `value` as JSON to `path`, creating parent folders.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|source| ModelError::Io {
            path: parent.to_path_buf(),
            source,
        })?;
    }
    let text = serde_json::to_string_pretty(value).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::write(path, text + "\n").map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let codec = DiffmeshPixelCodec::new(PixelCodecConfig::default(), Device::Cpu).unwrap();
        let x = Tensor::rand([2, 3, 64, 64], (tch::Kind::Float, Device::Cpu)) * 2.0 - 1.0;
        let z = codec.encode(&x).unwrap();
        assert_eq!(z.size(), vec![2, 12, 32, 32]);
        // Channel c*4 + dy*2 + dx holds pixel (2y+dy, 2x+dx) of colour c.
        let px = x.double_value(&[1, 2, 5, 7]);
        assert_eq!(z.double_value(&[1, 2 * 4 + 2 + 1, 2, 3]), px);
        assert!(codec.decode(&z).unwrap().equal(&x));
        assert!(codec
            .encode(&Tensor::zeros(
                [1, 3, 63, 64],
                (tch::Kind::Float, Device::Cpu)
            ))
            .is_err());
        assert!(codec
            .decode(&Tensor::zeros(
                [1, 4, 32, 32],
                (tch::Kind::Float, Device::Cpu)
            ))
            .is_err());
    }

    #[test]
    fn save_load() {
        let dir = std::env::temp_dir().join(format!("diffmesh-codec-{}", std::process::id()));
        let codec = DiffmeshPixelCodec::new(PixelCodecConfig::default(), Device::Cpu).unwrap();
        codec.save(&dir).unwrap();
        let back = DiffmeshPixelCodec::load(&dir, Device::Cpu).unwrap();
        assert_eq!(back.latent_channels(), 12);
        assert_eq!(back.downscale_factor(), 2);
        std::fs::remove_dir_all(&dir).ok();
    }
}
