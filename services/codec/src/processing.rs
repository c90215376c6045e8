//! Pre- and post-processing of one job: fetch blobs, do the image work on the image workers,
//! store the results, and build the reply message.
//!
//! A job on a registered template (its capture, or an edit by `template_id`) reads the template's
//! image from the template bucket, through the decoded-image cache keyed by the template's id: the
//! edits of a template neither copy nor re-read its image. The capture keeps the template's
//! model-resolution pixels there too, so its edits skip the resize and the content hash.
use diffmesh_shared::stores::blob_store::{blob_key, BlobStore};
use diffmesh_shared::wire::messages::{
    FieldError, JobKind, PostprocessRequest, PreparedInputs, PreparedTemplate, PreprocessRequest,
};
use diffmesh_shared::wire::templates;
use diffmesh_shared::MeshError;
use image::DynamicImage;
use sha2::{Digest, Sha256};
use std::sync::Arc;

use crate::decoded::DecodedImages;
use crate::error::CodecError;
use crate::image_workers::ImageWorkers;
use crate::imaging::{self, PixelMask, TokenGrid};

/// What a codec worker needs to handle requests.
#[derive(Clone)]
pub struct Codec {
    pub blobs: BlobStore,
    /// Registered templates' images (`subjects::TEMPLATE_BUCKET`).
    pub templates: BlobStore,
    /// The grid of requests whose gateway sent no model geometry (older gateways).
    pub fallback_grid: TokenGrid,
    pub max_pixels: u64,
    pub max_blob_bytes: usize,
    /// Template images decoded once for all their edits.
    pub decoded: DecodedImages,
    /// Where the image work runs.
    pub workers: ImageWorkers,
}

/// Object-store name of the model-resolution template (packed RGB u8).
pub const PREPARED_IMAGE: &str = "prepared-image.rgb";
/// Object-store name of the token mask (one u8 per token).
pub const TOKEN_MASK: &str = "token-mask.u8";
/// Object-store name of a generation's control image at the model resolution (RGB u8).
pub const PREPARED_CONTROL: &str = "prepared-control.rgb";

/// Object-store name of the `i`-th final PNG.
pub fn result_name(i: usize) -> String {
    format!("result-{i}.png")
}

/// An edit's model-resolution image: kept with its template, or made for this job.
enum EditImage {
    Kept(PreparedTemplate),
    Made { rgb: Vec<u8>, content_hash: String },
}

struct PreparedEdit {
    image: EditImage,
    tokens: Vec<u8>,
    masked_tokens: u32,
    width: u32,
    height: u32,
}

impl Codec {
    /// Fetch an upload (or a template's image), turning "too large" into a field error (the
    /// gateway caps uploads too, this guards the codec against anything else that writes the
    /// bucket).
    async fn fetch_upload(
        &self,
        store: &BlobStore,
        key: &str,
        field: &str,
    ) -> Result<Vec<u8>, CodecError> {
        match store.get_limited(key, self.max_blob_bytes).await {
            Err(MeshError::BlobTooLarge { size, limit, .. }) => Err(FieldError::invalid(
                field,
                format!("upload is {size} bytes, above the limit of {limit}"),
            )
            .into()),
            other => Ok(other?),
        }
    }

    async fn fetch_mask(&self, mask_key: Option<&str>) -> Result<Option<Vec<u8>>, CodecError> {
        match mask_key {
            Some(key) => Ok(Some(self.fetch_upload(&self.blobs, key, "mask").await?)),
            None => Ok(None),
        }
    }

    /// The decoded image of an edit or a capture: the upload under `image_key` if there is one,
    /// else the registered template's. `sender` is whose message named neither.
    async fn job_image(
        &self,
        image_key: Option<&str>,
        template_id: Option<&str>,
        sender: &'static str,
    ) -> Result<Arc<DynamicImage>, CodecError> {
        let (decoded, max_pixels) = (self.decoded.clone(), self.max_pixels);
        if let Some(key) = image_key {
            let bytes = self.fetch_upload(&self.blobs, key, "image").await?;
            return Ok(self
                .workers
                .run(move || decoded.decode(&bytes, "image", max_pixels))
                .await??);
        }
        let Some(template_id) = template_id else {
            return Err(CodecError::BadMessage {
                sender,
                message: "an edit needs an image key or a template".into(),
            });
        };
        let key = DecodedImages::template_key(template_id);
        if let Some(image) = self.decoded.cached(&key, "image", max_pixels)? {
            return Ok(image);
        }
        let bytes = self
            .fetch_upload(&self.templates, &templates::image_key(template_id), "image")
            .await?;
        Ok(self
            .workers
            .run(move || decoded.decode_as(key, &bytes, "image", max_pixels))
            .await??)
    }

    /// The grid a job's inputs are prepared at: its model's geometry (from the gateway) applied
    /// to an input of `width x height`, else the codec's flags.
    fn grid_for(
        &self,
        req: &PreprocessRequest,
        (width, height): (u32, u32),
    ) -> Result<TokenGrid, CodecError> {
        let Some(geometry) = &req.geometry else {
            return Ok(self.fallback_grid);
        };
        let (model_width, model_height) = geometry.model_size(width, height);
        // A geometry is the gateway's word; still, no message makes the codec allocate more
        // than the largest image it accepts.
        if u64::from(model_width) * u64::from(model_height) > self.max_pixels {
            return Err(CodecError::BadMessage {
                sender: "gateway",
                message: format!(
                    "model resolution {model_width}x{model_height} is above the codec's \
                     --max-pixels {}",
                    self.max_pixels
                ),
            });
        }
        Ok(TokenGrid {
            model_width,
            model_height,
            token_pixels: geometry.token_pixels.max(1),
        })
    }

    /// Validate and prepare a job's inputs at the model resolution.
    pub async fn preprocess(&self, req: &PreprocessRequest) -> Result<PreparedInputs, CodecError> {
        match req.kind {
            JobKind::Generate => {
                let grid = self.grid_for(req, (req.params.width, req.params.height))?;
                return self.prepare_generation(req, grid).await;
            }
            JobKind::Capture => return self.prepare_capture(req).await,
            JobKind::Edit => {}
        }
        let template = req.template_image.as_ref();
        let image = self
            .job_image(
                req.image_key.as_deref(),
                template.map(|t| t.template_id.as_str()),
                "gateway",
            )
            .await?;
        let grid = self.grid_for(req, (image.width(), image.height()))?;
        let base = base_inputs(req, grid);
        let mask = self.fetch_mask(req.mask_key.as_deref()).await?;
        let kept = template.and_then(|t| t.prepared.clone());
        let max_pixels = self.max_pixels;
        let prepared = self
            .workers
            .run(move || -> Result<PreparedEdit, FieldError> {
                let mask = match mask {
                    Some(bytes) => Some(imaging::decode_upload(&bytes, "mask", max_pixels)?),
                    None => None,
                };
                let pixel_mask = imaging::repaint_mask(&image, mask.as_ref())?;
                if pixel_mask.masked_pixels() == 0 {
                    return Err(FieldError::invalid(
                        "mask",
                        "the mask marks no pixel to repaint (white or transparent = repaint)",
                    ));
                }
                let tokens = imaging::token_mask(&pixel_mask, grid);
                let image_out = match kept {
                    Some(kept) => EditImage::Kept(kept),
                    None => {
                        let rgb = imaging::to_model_rgb(&image, grid);
                        let content_hash = hex_sha256(&rgb);
                        EditImage::Made { rgb, content_hash }
                    }
                };
                Ok(PreparedEdit {
                    image: image_out,
                    masked_tokens: tokens.iter().map(|&t| u32::from(t)).sum(),
                    tokens,
                    width: image.width(),
                    height: image.height(),
                })
            })
            .await??;

        let mask_key = blob_key(&req.job_id, TOKEN_MASK);
        self.blobs.put(&mask_key, &prepared.tokens).await?;
        let (image_key, template_image_key, content_hash) = match prepared.image {
            EditImage::Kept(kept) => (None, Some(kept.key), kept.content_hash),
            EditImage::Made { rgb, content_hash } => {
                let key = blob_key(&req.job_id, PREPARED_IMAGE);
                self.blobs.put(&key, &rgb).await?;
                (Some(key), None, content_hash)
            }
        };
        Ok(PreparedInputs {
            image_key,
            template_image_key,
            token_mask_key: Some(mask_key),
            mask_ratio: prepared.masked_tokens as f32 / grid.tokens() as f32,
            masked_tokens: prepared.masked_tokens,
            input_width: prepared.width,
            input_height: prepared.height,
            template_id: Some(content_hash),
            ..base
        })
    }

    /// A generation: nothing to prepare but its ControlNets' control images, each stretched to
    /// the model resolution like an edit's image.
    async fn prepare_generation(
        &self,
        req: &PreprocessRequest,
        grid: TokenGrid,
    ) -> Result<PreparedInputs, CodecError> {
        let base = base_inputs(req, grid);
        let uploads: Vec<&str> = req
            .control_image_key
            .iter()
            .chain(&req.extra_control_image_keys)
            .map(String::as_str)
            .collect();
        if uploads.is_empty() {
            return Ok(base);
        }
        let listed = req.controlnets_listed || !req.extra_control_image_keys.is_empty();
        let mut prepared = Vec::with_capacity(uploads.len());
        for (i, upload) in uploads.into_iter().enumerate() {
            // Named as the request named it: `controlnet`, or the list `controlnets`.
            let field = match listed {
                false => "controlnet.image".to_string(),
                true => format!("controlnets[{i}].image"),
            };
            let bytes = self.fetch_upload(&self.blobs, upload, &field).await?;
            let max_pixels = self.max_pixels;
            let rgb = self
                .workers
                .run(move || -> Result<Vec<u8>, FieldError> {
                    let image = imaging::decode_upload(&bytes, &field, max_pixels)?;
                    Ok(imaging::to_model_rgb(&image, grid))
                })
                .await??;
            let name = match i {
                0 => PREPARED_CONTROL.to_string(),
                i => format!("{PREPARED_CONTROL}.{i}"),
            };
            let key = blob_key(&req.job_id, &name);
            self.blobs.put(&key, &rgb).await?;
            prepared.push(key);
        }
        let mut prepared = prepared.into_iter();
        Ok(PreparedInputs {
            control_image_key: prepared.next(),
            extra_control_image_keys: prepared.collect(),
            ..base
        })
    }

    /// A template registration: the image alone (no mask, every token computed), stretched to
    /// the model resolution and hashed exactly as an edit of the same image is, so the capture
    /// and the template's edits agree on `template_id`. A registered template's pixels are kept
    /// with it (template bucket) for its edits; without `template_image` (an older gateway) they
    /// go with the job.
    async fn prepare_capture(&self, req: &PreprocessRequest) -> Result<PreparedInputs, CodecError> {
        if req.mask_key.is_some() {
            return Err(CodecError::BadMessage {
                sender: "gateway",
                message: "a capture takes no mask".into(),
            });
        }
        let template_id = req.template_image.as_ref().map(|t| t.template_id.as_str());
        let image = self
            .job_image(req.image_key.as_deref(), template_id, "gateway")
            .await?;
        let (width, height) = (image.width(), image.height());
        let grid = self.grid_for(req, (width, height))?;
        let base = base_inputs(req, grid);
        let (model_rgb, content_hash) = self
            .workers
            .run(move || {
                let rgb = imaging::to_model_rgb(&image, grid);
                let hash = hex_sha256(&rgb);
                (rgb, hash)
            })
            .await?;
        let (image_key, template_image_key) = match template_id {
            Some(id) => {
                let key = templates::prepared_image_key(id);
                self.templates.put(&key, &model_rgb).await?;
                (None, Some(key))
            }
            None => {
                let key = blob_key(&req.job_id, PREPARED_IMAGE);
                self.blobs.put(&key, &model_rgb).await?;
                (Some(key), None)
            }
        };
        Ok(PreparedInputs {
            image_key,
            template_image_key,
            input_width: width,
            input_height: height,
            template_id: Some(content_hash),
            ..base
        })
    }

    /// Turn model-resolution outputs into PNGs at the input size; returns their keys.
    pub async fn postprocess(&self, req: &PostprocessRequest) -> Result<Vec<String>, CodecError> {
        let job = &req.job;
        if req.output_keys.is_empty() {
            return Err(CodecError::BadMessage {
                sender: "denoiser",
                message: "postprocess request without outputs".into(),
            });
        }
        let mut outputs = Vec::with_capacity(req.output_keys.len());
        for key in &req.output_keys {
            outputs.push(self.blobs.get(key).await?);
        }
        let template = match job.kind {
            JobKind::Edit => {
                let template_id = job.template.as_ref().map(|t| t.template_id.as_str());
                let image = self
                    .job_image(job.raw_image_key.as_deref(), template_id, "denoiser")
                    .await?;
                Some((image, self.fetch_mask(job.raw_mask_key.as_deref()).await?))
            }
            JobKind::Generate | JobKind::Capture => None,
        };
        let (mw, mh) = (req.model_width, req.model_height);
        let (w, h) = (job.inputs.input_width, job.inputs.input_height);
        let max_pixels = self.max_pixels;
        let pngs = self
            .workers
            .run(move || -> Result<Vec<Vec<u8>>, CodecError> {
                let template = match template {
                    Some((image, mask)) => {
                        Some(with_repaint_mask(image, mask.as_deref(), max_pixels)?)
                    }
                    None => None,
                };
                let mut pngs = Vec::with_capacity(outputs.len());
                for bytes in outputs {
                    let generated = imaging::model_output(bytes, mw, mh).map_err(|message| {
                        CodecError::BadMessage {
                            sender: "denoiser",
                            message,
                        }
                    })?;
                    let image = match &template {
                        Some((image, mask)) => {
                            let resized =
                                imaging::to_output_size(&generated, image.width(), image.height());
                            imaging::composite(image, mask, &resized)
                        }
                        None => DynamicImage::ImageRgb8(imaging::to_output_size(&generated, w, h)),
                    };
                    pngs.push(imaging::encode_png(&image)?);
                }
                Ok(pngs)
            })
            .await??;

        let mut keys = Vec::with_capacity(pngs.len());
        for (i, png) in pngs.iter().enumerate() {
            let key = blob_key(&job.job_id, &result_name(i));
            self.blobs.put(&key, png).await?;
            keys.push(key);
        }
        Ok(keys)
    }
}

/// What every job's prepared inputs hold before its kind adds to them: the whole grid repainted.
fn base_inputs(req: &PreprocessRequest, grid: TokenGrid) -> PreparedInputs {
    PreparedInputs {
        image_key: None,
        template_image_key: None,
        token_mask_key: None,
        mask_ratio: 1.0,
        masked_tokens: grid.tokens(),
        input_width: req.params.width,
        input_height: req.params.height,
        model_width: grid.model_width,
        model_height: grid.model_height,
        token_rows: grid.rows(),
        token_cols: grid.cols(),
        template_id: None,
        control_image_key: None,
        extra_control_image_keys: Vec::new(),
    }
}

/// The template image with the pixels its edit repainted (from the mask, or the image's alpha).
fn with_repaint_mask(
    image: Arc<DynamicImage>,
    mask: Option<&[u8]>,
    max_pixels: u64,
) -> Result<(Arc<DynamicImage>, PixelMask), FieldError> {
    let mask = match mask {
        Some(bytes) => Some(imaging::decode_upload(bytes, "mask", max_pixels)?),
        None => None,
    };
    let pixel_mask = imaging::repaint_mask(&image, mask.as_ref())?;
    Ok((image, pixel_mask))
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
