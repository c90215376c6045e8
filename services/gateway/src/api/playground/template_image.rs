//! `GET /v1/templates/{id}/image`: a registered template's image as it was uploaded, so a client
//! (the playground) can show it and paint a mask of the same size over it. Visible only to the
//! key that registered it (others get the same 404 as for an unknown id).
use std::time::Duration;

use actix_web::http::header::{CACHE_CONTROL, X_CONTENT_TYPE_OPTIONS};
use actix_web::{web, HttpRequest, HttpResponse};
use diffmesh_shared::MeshError;

use crate::error::{ApiError, ErrorBody};
use crate::state::ApiState;
use crate::templates::record::not_found;

/// Longest read of a template image from the object store (they are at most a request body).
const IMAGE_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The MIME type of an uploaded template (the gateway accepts PNG, JPEG and WebP only).
fn mime_of(bytes: &[u8]) -> &'static str {
    match image::guess_format(bytes) {
        Ok(image::ImageFormat::Png) => "image/png",
        Ok(image::ImageFormat::Jpeg) => "image/jpeg",
        Ok(image::ImageFormat::WebP) => "image/webp",
        _ => "application/octet-stream",
    }
}

#[utoipa::path(
    get,
    path = "/v1/templates/{id}/image",
    tag = "templates",
    params(("id" = String, Path, description = "Template id (UUID)")),
    responses(
        (status = 200, description = "The template's image as uploaded (PNG, JPEG or WebP)",
            content(
                (Vec<u8> = "image/png"),
                (Vec<u8> = "image/jpeg"),
                (Vec<u8> = "image/webp"),
            )),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
        (status = 404, description = "No such template for this API key", body = ErrorBody),
        (status = 504, description = "Reading the image timed out", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn get_template_image(
    req: HttpRequest,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    let store = &state.templates.store;
    caller.owned(store.get(&id).await?, || not_found(&id))?;
    let bytes = match tokio::time::timeout(IMAGE_READ_TIMEOUT, store.image(&id)).await {
        Ok(Ok(bytes)) => bytes,
        // Deleted (or its registration undone) between reading the record and the image.
        Ok(Err(ApiError::Mesh(MeshError::BlobNotFound { .. }))) => return Err(not_found(&id)),
        Ok(Err(err)) => return Err(err),
        // An object-store read waits for chunks that a concurrent delete purged, forever:
        // bound it, and answer 404 if the template is gone by now.
        Err(_) => {
            tracing::warn!(template_id = %id.as_str(), "reading the template image stalled");
            return Err(match store.get(&id).await? {
                None => not_found(&id),
                Some(_) => ApiError::Timeout {
                    message: format!("reading template {}'s image timed out", id.as_str()),
                },
            });
        }
    };
    Ok::<_, ApiError>(
        HttpResponse::Ok()
            .content_type(mime_of(&bytes))
            .insert_header((X_CONTENT_TYPE_OPTIONS, "nosniff"))
            // The image of a template id never changes (a new registration is a new id).
            .insert_header((CACHE_CONTROL, "private, max-age=3600"))
            .body(bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mime_follows_the_magic_bytes() {
        let img = image::DynamicImage::ImageRgb8(image::RgbImage::new(2, 2));
        let mut png = std::io::Cursor::new(Vec::new());
        img.write_to(&mut png, image::ImageFormat::Png).unwrap();
        assert_eq!(mime_of(png.get_ref()), "image/png");
        assert_eq!(mime_of(&[0xFF, 0xD8, 0xFF, 0xE0, 0, 0]), "image/jpeg");
        assert_eq!(mime_of(b"RIFF\0\0\0\0WEBPVP8 "), "image/webp");
        assert_eq!(mime_of(b"GIF89a"), "application/octet-stream");
    }
}
