//! What a denoiser announces about the model it holds ([`ModelCard`], in every heartbeat): its
//! id, family, the resolutions it runs at and how pixels map to image tokens, and the features
//! it serves. The gateway validates requests against it and hands its geometry to the codec
//! with each job, so no flag on the codec has to match the model by hand.
use serde::{Deserialize, Serialize};

/// A model a denoiser holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// The id requests name (`model`): `--model-id`, else the model folder's name.
    pub id: String,
    /// `flux.1` for the FLUX.1 family in the diffusers layout, `tiny` for diffmesh's own, `sd`
    /// (SD 1.x/2.x) and `sdxl` for the UNet family.
    pub family: String,
    /// The diffusers pipeline class in `model_index.json` (`FluxPipeline`, `FluxFillPipeline`).
    pub pipeline: String,
    pub geometry: ModelGeometry,
    pub features: ModelFeatures,
}

/// How a model's pixels map to image tokens, and the resolutions it runs at.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelGeometry {
    /// Side of one image token in pixels: the VAE's downscale times the 2x2 packing (16 for
    /// FLUX.1, 4 for the tiny model).
    pub token_pixels: u32,
    pub resolution: Resolution,
    /// Output size of a generation that names none.
    pub default_width: u32,
    pub default_height: u32,
}

/// The resolutions a model runs at.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Resolution {
    /// One resolution (the one it was trained at): every input is stretched to it and the
    /// output stretched back.
    Fixed { width: u32, height: u32 },
    /// The input's own size, scaled down to at most `max_pixels` when larger and each side
    /// rounded down to whole tokens (as diffusers' FLUX pipelines round).
    Scaled { max_pixels: u64 },
}

/// What a model serves beyond text-to-image.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFeatures {
    /// Mask-aware edits of uploads and registered templates.
    pub edit: bool,
    /// A Fill model: the masked image and the mask are the transformer's extra inputs.
    pub fill: bool,
    /// ControlNets served beside it (`--controlnet-dir`, `--controlnet-remote`).
    pub controlnet: bool,
    /// Registered LoRAs.
    pub lora: bool,
    /// True classifier-free guidance against a negative prompt.
    pub true_cfg: bool,
    /// Guidance-distilled (FLUX.1-dev's `guidance_embeds`): `guidance_scale` steers it;
    /// without it (schnell) `guidance_scale` changes nothing.
    pub guidance_embeds: bool,
    /// Longest prompt in text-encoder tokens (T5's `max_sequence_length`).
    pub max_sequence_length: u32,
    /// Several ControlNets per request (`controlnets`), their residuals summed. False from
    /// older senders.
    #[serde(default)]
    pub multi_controlnet: bool,
    /// Step caching per request (`cache_threshold`). False from older senders.
    #[serde(default)]
    pub step_cache: bool,
    /// First-block step caching (`cache_method: first_block`). False from older senders,
    /// which would read the request's threshold as TeaCache's.
    #[serde(default)]
    pub first_block_cache: bool,
}

impl ModelGeometry {
    /// The model resolution `(width, height)` an input of `width x height` pixels runs at:
    /// whole tokens, at least one token a side.
    pub fn model_size(&self, width: u32, height: u32) -> (u32, u32) {
        let tp = self.token_pixels.max(1);
        let (w, h) = match self.resolution {
            Resolution::Fixed { width, height } => (width, height),
            Resolution::Scaled { max_pixels } => {
                let pixels = u64::from(width) * u64::from(height);
                if max_pixels > 0 && pixels > max_pixels {
                    let scale = (max_pixels as f64 / pixels as f64).sqrt();
                    (
                        (f64::from(width) * scale).floor() as u32,
                        (f64::from(height) * scale).floor() as u32,
                    )
                } else {
                    (width, height)
                }
            }
        };
        ((w / tp).max(1) * tp, (h / tp).max(1) * tp)
    }

    /// The image-token grid `(rows, cols)` at a model resolution.
    pub fn tokens(&self, model_width: u32, model_height: u32) -> (u32, u32) {
        let tp = self.token_pixels.max(1);
        (model_height / tp, model_width / tp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaled(max_pixels: u64) -> ModelGeometry {
        ModelGeometry {
            token_pixels: 16,
            resolution: Resolution::Scaled { max_pixels },
            default_width: 1024,
            default_height: 1024,
        }
    }

    #[test]
    fn a_fixed_model_runs_every_input_at_its_resolution() {
        let g = ModelGeometry {
            token_pixels: 4,
            resolution: Resolution::Fixed {
                width: 64,
                height: 64,
            },
            default_width: 64,
            default_height: 64,
        };
        assert_eq!(g.model_size(1000, 37), (64, 64));
        assert_eq!(g.tokens(64, 64), (16, 16));
    }

    #[test]
    fn a_scaled_model_rounds_down_to_whole_tokens_and_caps_the_pixels() {
        let g = scaled(1024 * 1024);
        assert_eq!(g.model_size(1024, 768), (1024, 768));
        // diffusers: 2 * (1000 // 16) * 8 = 992.
        assert_eq!(g.model_size(1000, 520), (992, 512));
        // 2048x2048 is 4x the cap: halved each side.
        assert_eq!(g.model_size(2048, 2048), (1024, 1024));
        let (w, h) = g.model_size(4000, 1000);
        assert!(u64::from(w) * u64::from(h) <= 1024 * 1024);
        assert_eq!((w % 16, h % 16), (0, 0));
        // Never below one token.
        assert_eq!(g.model_size(3, 5), (16, 16));
        assert_eq!(g.tokens(992, 512), (32, 62));
    }

    #[test]
    fn a_card_survives_messagepack() {
        let card = ModelCard {
            id: "flux-dev".into(),
            family: "flux.1".into(),
            pipeline: "FluxPipeline".into(),
            geometry: scaled(4 << 20),
            features: ModelFeatures {
                edit: true,
                guidance_embeds: true,
                max_sequence_length: 512,
                multi_controlnet: false,
                step_cache: true,
                first_block_cache: true,
                ..ModelFeatures::default()
            },
        };
        let bytes = rmp_serde::to_vec_named(&card).unwrap();
        assert_eq!(rmp_serde::from_slice::<ModelCard>(&bytes).unwrap(), card);
    }
}
