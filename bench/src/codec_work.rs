//! The codec work of one request, done with the codec service's own functions
//! (`diffmesh_codec::imaging`) exactly as its handlers chain them: pre-processing decodes the
//! uploaded template and mask PNGs, derives the token mask and stretches the template to the
//! model resolution; post-processing decodes the uploads again (the codec re-reads them),
//! stretches the output back, composites it over the template and encodes the PNG.
use crate::workload::{denoise_job, rect_mask, BenchRequest, ModelGrid};
use anyhow::{anyhow, ensure, Result};
use diffmesh_codec::imaging::{self, TokenGrid};
use diffmesh_denoiser::engine::EngineJob;
use diffmesh_denoiser::model::EditInputs;
use diffmesh_shared::wire::messages::DenoiseJob;
use image::{DynamicImage, GrayImage, RgbImage};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

/// Largest upload accepted (the codec's default limit is of this order).
const MAX_PIXELS: u64 = 4096 * 4096;

/// What a client uploaded for one request.
#[derive(Debug, Clone)]
pub struct Uploads {
    /// PNG of the template (edits) ; `None` for a generation.
    pub image_png: Option<Arc<Vec<u8>>>,
    pub mask_png: Option<Vec<u8>>,
    /// Output size of a generation (edits keep the template's size).
    pub size: u32,
}

/// A photo-like RGB template: smooth gradients, a few discs and sensor-like noise, so the PNG
/// compresses like a photograph rather than like a flat test card.
pub fn synthetic_template(rng: &mut ChaCha8Rng, size: u32) -> DynamicImage {
    let base: [f32; 6] = std::array::from_fn(|_| rng.random_range(0.0..255.0));
    let discs: Vec<(f32, f32, f32, [f32; 3])> = (0..6)
        .map(|_| {
            let s = size as f32;
            (
                rng.random_range(0.0..s),
                rng.random_range(0.0..s),
                rng.random_range(s * 0.05..s * 0.25),
                std::array::from_fn(|_| rng.random_range(0.0..255.0)),
            )
        })
        .collect();
    let mut noise = ChaCha8Rng::seed_from_u64(rng.random());
    let img = RgbImage::from_fn(size, size, |x, y| {
        let (u, v) = (x as f32 / size as f32, y as f32 / size as f32);
        let mut px: [f32; 3] = std::array::from_fn(|c| base[c] * (1.0 - u) + base[c + 3] * v);
        for (cx, cy, r, col) in &discs {
            let (dx, dy) = (x as f32 - cx, y as f32 - cy);
            if dx * dx + dy * dy < r * r {
                px = *col;
            }
        }
        image::Rgb(std::array::from_fn(|c| {
            (px[c] + noise.random_range(-6.0..6.0)).clamp(0.0, 255.0) as u8
        }))
    });
    DynamicImage::ImageRgb8(img)
}

/// A grayscale mask PNG (white = repaint) with a rectangle of about `ratio` of the pixels.
pub fn mask_png(rng: &mut ChaCha8Rng, size: u32, ratio: f64) -> Result<Vec<u8>> {
    let cells: Vec<u8> = rect_mask(rng, size, ratio)
        .iter()
        .map(|&m| m * 255)
        .collect();
    let img = GrayImage::from_raw(size, size, cells).ok_or_else(|| anyhow!("mask size"))?;
    Ok(imaging::encode_png(&DynamicImage::ImageLuma8(img))?)
}

/// Uploads for every request: edits share `templates` template PNGs and get their own mask.
pub fn uploads(
    reqs: &[BenchRequest],
    size: u32,
    templates: usize,
    seed: u64,
) -> Result<Vec<Uploads>> {
    ensure!(templates >= 1, "--templates must be at least 1");
    ensure!(size >= 16, "--image-size must be at least 16, got {size}");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let pngs: Vec<Arc<Vec<u8>>> = (0..templates)
        .map(|_| {
            Ok(Arc::new(imaging::encode_png(&synthetic_template(
                &mut rng, size,
            ))?))
        })
        .collect::<Result<_>>()?;
    reqs.iter()
        .enumerate()
        .map(|(i, r)| {
            Ok(match r.mask_ratio {
                Some(ratio) => Uploads {
                    image_png: Some(pngs[i % templates].clone()),
                    mask_png: Some(mask_png(&mut rng, size, ratio)?),
                    size,
                },
                None => Uploads {
                    image_png: None,
                    mask_png: None,
                    size,
                },
            })
        })
        .collect()
}

fn token_grid(grid: ModelGrid) -> TokenGrid {
    TokenGrid {
        model_width: grid.pixels,
        model_height: grid.pixels,
        token_pixels: grid.pixels / grid.tokens_per_side,
    }
}

fn decode(up: &Uploads) -> Result<Option<(DynamicImage, imaging::PixelMask)>> {
    let Some(png) = &up.image_png else {
        return Ok(None);
    };
    let field =
        |e: diffmesh_shared::wire::messages::FieldError| anyhow!("{}: {}", e.field, e.message);
    let image = imaging::decode_upload(png, "image", MAX_PIXELS).map_err(field)?;
    let mask = match &up.mask_png {
        Some(m) => Some(imaging::decode_upload(m, "mask", MAX_PIXELS).map_err(field)?),
        None => None,
    };
    let pixel_mask = imaging::repaint_mask(&image, mask.as_ref()).map_err(field)?;
    Ok(Some((image, pixel_mask)))
}

/// Pre-processing: the engine job of a request from its uploads.
pub fn preprocess(req: &BenchRequest, up: &Uploads, grid: ModelGrid) -> Result<EngineJob> {
    let Some((image, pixel_mask)) = decode(up)? else {
        return Ok(EngineJob::new(denoise_job(req, grid, None), None));
    };
    let tg = token_grid(grid);
    let token_mask = imaging::token_mask(&pixel_mask, tg);
    let masked: u32 = token_mask.iter().map(|&t| u32::from(t)).sum();
    ensure!(masked > 0, "mask: {} marks no pixel to repaint", req.id);
    let mut job = denoise_job(req, grid, Some(masked));
    (job.inputs.input_width, job.inputs.input_height) = (image.width(), image.height());
    Ok(EngineJob::new(
        job,
        Some(EditInputs {
            template_rgb: imaging::to_model_rgb(&image, tg),
            token_mask,
        }),
    ))
}

/// Post-processing: the final PNG of a finished job from its model-resolution RGB output.
pub fn postprocess(job: &DenoiseJob, up: &Uploads, output: Vec<u8>) -> Result<Vec<u8>> {
    let (mw, mh) = (job.inputs.model_width, job.inputs.model_height);
    let generated = imaging::model_output(output, mw, mh).map_err(|e| anyhow!(e))?;
    let image = match decode(up)? {
        Some((template, mask)) => {
            let resized = imaging::to_output_size(&generated, template.width(), template.height());
            imaging::composite(&template, &mask, &resized)
        }
        None => DynamicImage::ImageRgb8(imaging::to_output_size(&generated, up.size, up.size)),
    };
    Ok(imaging::encode_png(&image)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{requests, WorkloadSpec};

    #[test]
    fn pre_and_post_round_trip_keeps_unmasked_pixels() {
        let spec = WorkloadSpec {
            requests: 6,
            edit_fraction: 0.5,
            steps_min: 2,
            steps_max: 3,
            seed: 5,
        };
        let reqs = requests(&spec, &[0.1, 0.3]).unwrap();
        let ups = uploads(&reqs, 96, 2, 1).unwrap();
        let grid = ModelGrid {
            pixels: 64,
            tokens_per_side: 16,
        };
        for (r, up) in reqs.iter().zip(&ups) {
            let job = preprocess(r, up, grid).unwrap();
            assert_eq!(job.edit.is_some(), r.mask_ratio.is_some());
            let png = postprocess(&job.job, up, vec![7u8; 64 * 64 * 3]).unwrap();
            let out = image::load_from_memory(&png).unwrap().to_rgb8();
            assert_eq!(out.dimensions(), (96, 96));
            if let (Some(tpl), Some(mask)) = (&up.image_png, &up.mask_png) {
                let tpl = image::load_from_memory(tpl).unwrap().to_rgb8();
                let mask = image::load_from_memory(mask).unwrap().to_luma8();
                let masked = job.job.inputs.masked_tokens;
                assert!(masked > 0 && masked < 256, "{masked}");
                for ((o, t), m) in out.pixels().zip(tpl.pixels()).zip(mask.pixels()) {
                    if m.0[0] == 0 {
                        assert_eq!(o, t);
                    } else {
                        assert_eq!(o.0, [7, 7, 7]);
                    }
                }
            }
        }
    }
}
