//! `POST /v1/images/variations` (OpenAI's `images.create_variation`): new images like an
//! uploaded one. Run as an edit of the whole image at a `strength` below 1 (diffusers'
//! image-to-image, SDEdit): the image's latents are noised to the schedule's point `strength`
//! of the way from the end and denoised from there, so the result keeps its layout and colours
//! and varies the rest (at 1 nothing of the image would remain). The prompt is optional: without
//! one the denoising is unconditioned, as DALL-E 2's variations take none.
use actix_multipart::Multipart;
use diffmesh_shared::wire::messages::FieldError;
use image::{GrayImage, ImageFormat, Luma};
use utoipa::ToSchema;

use crate::api::image_request::{read_edit_form, upload_edit, EditBody};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::job_driver::ImageRequest;
use crate::request_limits::check_pixels;
use crate::state::ApiState;
use crate::upload::image_size;
use crate::validate::Prompt;

/// A variation's `strength` when the request gives none.
pub const DEFAULT_STRENGTH: f32 = 0.75;

/// The multipart form of `POST /v1/images/variations` (what [`read_variation`] reads; text
/// fields are those of an edit, less `mask` and `template_id`).
#[derive(ToSchema)]
pub struct VariationForm {
    /// The image to vary: PNG, JPEG or WebP (`image[]` is taken too). The variations have its
    /// size.
    #[schema(value_type = String, format = Binary)]
    pub image: Vec<u8>,
    /// How far the variations may move from the image, above 0 to 1 (default 0.75): the share
    /// of the denoising schedule run from the image noised to that point. At least one step
    /// must run (`num_inference_steps` times `strength` at least 1).
    #[schema(minimum = 0.0, maximum = 1.0, exclusive_minimum = 0.0)]
    pub strength: Option<f64>,
    /// What the variations should show (optional; none: unconditioned, as OpenAI's).
    pub prompt: Option<String>,
    /// The model to run (`GET /v1/models`).
    pub model: Option<String>,
    #[schema(minimum = 1)]
    pub n: Option<i64>,
    /// Accepted for OpenAI compatibility; variations come back at the image's size.
    pub size: Option<String>,
    /// `b64_json` (default), `url` or `png` (n = 1).
    pub response_format: Option<String>,
    /// `png` (default), `jpeg` or `webp`.
    pub output_format: Option<String>,
    #[schema(minimum = 0, maximum = 100)]
    pub output_compression: Option<i64>,
    pub background: Option<String>,
    pub quality: Option<String>,
    /// The end user (at most 256 characters; accepted, not stored).
    pub user: Option<String>,
    #[schema(minimum = 1)]
    pub num_inference_steps: Option<i64>,
    #[schema(minimum = 0.0)]
    pub guidance_scale: Option<f64>,
    #[schema(minimum = 1.0)]
    pub true_cfg_scale: Option<f64>,
    pub negative_prompt: Option<String>,
    #[schema(minimum = 0)]
    pub seed: Option<u64>,
    /// Step caching (TeaCache), 0 to 1, as in generations.
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub cache_threshold: Option<f64>,
    /// `teacache` (default) or `first_block`, as in generations.
    pub cache_method: Option<String>,
    #[schema(minimum = 1, maximum = 86_400_000)]
    pub deadline_ms: Option<i64>,
    /// Where the job's ending is posted (async jobs only), as in generations.
    pub callback_url: Option<String>,
}

/// Read a variation request: the image, the edit's text fields, `strength`.
pub async fn read_variation(
    state: &ApiState,
    caller: &Caller,
    payload: Multipart,
) -> Result<ImageRequest, ApiError> {
    let EditBody {
        image,
        mask,
        mut text,
    } = read_edit_form(payload, state.max_body_bytes).await?;
    if mask.is_some() {
        return Err(FieldError::invalid(
            "mask",
            "a variation repaints the whole image: no mask (an edit takes one)",
        )
        .into());
    }
    if text.contains_key("template_id") {
        return Err(FieldError::invalid(
            "template_id",
            "variations take an uploaded image (a template's cache holds a full repaint only)",
        )
        .into());
    }
    let image =
        image.ok_or_else(|| FieldError::invalid("image", "required (multipart file field)"))?;
    for field in ["stream", "partial_images", "preview_every"] {
        if text.contains_key(field) {
            // Previews are planned over the whole schedule; a variation runs part of it.
            return Err(FieldError::invalid(field, "not served for variations").into());
        }
    }
    let strength = parse_strength(text.remove("strength").as_deref())?;
    let (width, height) = image_size(&image, "image")?;
    // Before the mask is made: it is as large as the image's header says.
    check_pixels("image", width, height, &state.limits)?;
    let everything = whole_image_mask(width, height)?;
    let endpoint = format!("variations:{strength}");
    let request = upload_edit(
        state,
        caller,
        image,
        Some(everything),
        &text,
        &endpoint,
        Prompt::Optional,
        Some(strength),
    )
    .await?;
    let steps = request.input.valid.params.num_inference_steps;
    // Counted as the engines count the steps they run, from the f32 the job carries.
    if (f64::from(steps) * f64::from(strength)).floor() < 1.0 {
        return Err(FieldError::invalid(
            "strength",
            format!("{strength} of {steps} steps runs none: raise strength or num_inference_steps"),
        )
        .into());
    }
    Ok(request)
}

fn parse_strength(text: Option<&str>) -> Result<f32, FieldError> {
    let Some(text) = text else {
        return Ok(DEFAULT_STRENGTH);
    };
    let value: f32 = text
        .trim()
        .parse()
        .map_err(|_| FieldError::invalid("strength", format!("must be a number, got {text:?}")))?;
    if !(value > 0.0 && value <= 1.0) {
        return Err(FieldError::invalid(
            "strength",
            format!("must be above 0 and at most 1, got {value}"),
        ));
    }
    Ok(value)
}

/// A white mask of the image's size: every pixel repainted.
fn whole_image_mask(width: u32, height: u32) -> Result<Vec<u8>, ApiError> {
    let mut png = std::io::Cursor::new(Vec::new());
    GrayImage::from_pixel(width, height, Luma([255]))
        .write_to(&mut png, ImageFormat::Png)
        .map_err(|e| ApiError::Internal(format!("encoding a variation's mask: {e}")))?;
    Ok(png.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strength_is_above_0_and_at_most_1() {
        assert_eq!(parse_strength(None).unwrap(), DEFAULT_STRENGTH);
        assert_eq!(parse_strength(Some(" 0.5")).unwrap(), 0.5);
        assert_eq!(parse_strength(Some("1")).unwrap(), 1.0);
        for bad in ["0", "-0.1", "1.01", "NaN", "much"] {
            assert_eq!(
                parse_strength(Some(bad)).unwrap_err().field,
                "strength",
                "{bad}"
            );
        }
    }

    #[test]
    fn the_mask_covers_the_whole_image() {
        let png = whole_image_mask(5, 3).unwrap();
        let mask = image::load_from_memory(&png).unwrap().to_luma8();
        assert_eq!(mask.dimensions(), (5, 3));
        assert!(mask.pixels().all(|p| p.0[0] == 255));
    }
}
