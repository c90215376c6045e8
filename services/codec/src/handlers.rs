//! Pre- and post-processing of one job: fetch blobs, do the image work on the blocking pool,
//! store the results, and build the reply message.
use diffmesh_shared::messages::{
    FieldError, JobKind, PostprocessRequest, PreparedInputs, PreprocessRequest,
};
use diffmesh_shared::nats::{blob_key, BlobStore};
use diffmesh_shared::MeshError;
use image::DynamicImage;
use sha2::{Digest, Sha256};
use std::sync::Arc;

use crate::decoded::DecodedImages;
use crate::error::CodecError;
use crate::imaging::{self, PixelMask, TokenGrid};

/// What a codec worker needs to handle requests.
#[derive(Clone)]
pub struct Codec {
    pub blobs: BlobStore,
    pub grid: TokenGrid,
    pub max_pixels: u64,
    pub max_blob_bytes: usize,
    /// Template images decoded once for all their edits.
    pub decoded: DecodedImages,
}

/// Object-store name of the model-resolution template (packed RGB u8).
pub const PREPARED_IMAGE: &str = "prepared-image.rgb";
/// Object-store name of the token mask (one u8 per token).
pub const TOKEN_MASK: &str = "token-mask.u8";

/// Object-store name of the `i`-th final PNG.
pub fn result_name(i: usize) -> String {
    format!("result-{i}.png")
}

struct PreparedEdit {
    model_rgb: Vec<u8>,
    tokens: Vec<u8>,
    masked_tokens: u32,
    width: u32,
    height: u32,
}

impl Codec {
    /// Fetch an upload, turning "too large" into a field error (the gateway caps uploads too,
    /// this guards the codec against anything else that writes the bucket).
    async fn fetch_upload(&self, key: &str, field: &str) -> Result<Vec<u8>, CodecError> {
        match self.blobs.get_limited(key, self.max_blob_bytes).await {
            Err(MeshError::BlobTooLarge { size, limit, .. }) => Err(FieldError::invalid(
                field,
                format!("upload is {size} bytes, above the limit of {limit}"),
            )
            .into()),
            other => Ok(other?),
        }
    }

    async fn fetch_edit_inputs(
        &self,
        image_key: Option<&str>,
        mask_key: Option<&str>,
    ) -> Result<(Vec<u8>, Option<Vec<u8>>), CodecError> {
        let image_key = image_key.ok_or_else(|| CodecError::BadMessage {
            sender: "gateway",
            message: "edit without image_key".into(),
        })?;
        let image = self.fetch_upload(image_key, "image").await?;
        let mask = match mask_key {
            Some(key) => Some(self.fetch_upload(key, "mask").await?),
            None => None,
        };
        Ok((image, mask))
    }

    /// Validate and prepare a job's inputs at the model resolution.
    pub async fn preprocess(&self, req: &PreprocessRequest) -> Result<PreparedInputs, CodecError> {
        let grid = self.grid;
        let base = PreparedInputs {
            image_key: None,
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
        };
        match req.kind {
            JobKind::Generate => return Ok(base),
            JobKind::Capture => return self.prepare_capture(req, base).await,
            JobKind::Edit => {}
        }
        let (image, mask) = self
            .fetch_edit_inputs(req.image_key.as_deref(), req.mask_key.as_deref())
            .await?;
        let (max_pixels, decoded) = (self.max_pixels, self.decoded.clone());
        let prepared = tokio::task::spawn_blocking(move || -> Result<PreparedEdit, FieldError> {
            let image = decoded.decode(&image, "image", max_pixels)?;
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
            Ok(PreparedEdit {
                model_rgb: imaging::to_model_rgb(&image, grid),
                masked_tokens: tokens.iter().map(|&t| u32::from(t)).sum(),
                tokens,
                width: image.width(),
                height: image.height(),
            })
        })
        .await??;

        let image_key = blob_key(&req.job_id, PREPARED_IMAGE);
        let mask_key = blob_key(&req.job_id, TOKEN_MASK);
        self.blobs.put(&image_key, &prepared.model_rgb).await?;
        self.blobs.put(&mask_key, &prepared.tokens).await?;
        Ok(PreparedInputs {
            image_key: Some(image_key),
            token_mask_key: Some(mask_key),
            mask_ratio: prepared.masked_tokens as f32 / grid.tokens() as f32,
            masked_tokens: prepared.masked_tokens,
            input_width: prepared.width,
            input_height: prepared.height,
            template_id: Some(hex_sha256(&prepared.model_rgb)),
            ..base
        })
    }

    /// A template registration: the image alone (no mask, every token computed), stretched to
    /// the model resolution and hashed exactly as an edit of the same image is, so the capture
    /// and the template's edits agree on `template_id`.
    async fn prepare_capture(
        &self,
        req: &PreprocessRequest,
        base: PreparedInputs,
    ) -> Result<PreparedInputs, CodecError> {
        if req.mask_key.is_some() {
            return Err(CodecError::BadMessage {
                sender: "gateway",
                message: "a capture takes no mask".into(),
            });
        }
        let (image, _) = self
            .fetch_edit_inputs(req.image_key.as_deref(), None)
            .await?;
        let (grid, max_pixels, decoded) = (self.grid, self.max_pixels, self.decoded.clone());
        let (model_rgb, width, height) =
            tokio::task::spawn_blocking(move || -> Result<_, FieldError> {
                let image = decoded.decode(&image, "image", max_pixels)?;
                Ok((
                    imaging::to_model_rgb(&image, grid),
                    image.width(),
                    image.height(),
                ))
            })
            .await??;
        let image_key = blob_key(&req.job_id, PREPARED_IMAGE);
        self.blobs.put(&image_key, &model_rgb).await?;
        Ok(PreparedInputs {
            image_key: Some(image_key),
            input_width: width,
            input_height: height,
            template_id: Some(hex_sha256(&model_rgb)),
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
            JobKind::Edit => Some(
                self.fetch_edit_inputs(job.raw_image_key.as_deref(), job.raw_mask_key.as_deref())
                    .await?,
            ),
            JobKind::Generate | JobKind::Capture => None,
        };
        let (mw, mh) = (req.model_width, req.model_height);
        let (w, h) = (job.inputs.input_width, job.inputs.input_height);
        let (max_pixels, decoded) = (self.max_pixels, self.decoded.clone());
        let pngs = tokio::task::spawn_blocking(move || -> Result<Vec<Vec<u8>>, CodecError> {
            let template = match template {
                Some((image, mask)) => Some(decode_template(
                    &decoded,
                    &image,
                    mask.as_deref(),
                    max_pixels,
                )?),
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

fn decode_template(
    decoded: &DecodedImages,
    image: &[u8],
    mask: Option<&[u8]>,
    max_pixels: u64,
) -> Result<(Arc<DynamicImage>, PixelMask), FieldError> {
    let image = decoded.decode(image, "image", max_pixels)?;
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
