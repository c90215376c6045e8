//! Bounded reads of request parts and image headers: the upload-level checks every multipart
//! endpoint shares (a part's byte limit, an image's format and size from its header alone).
use std::io::Cursor;

use bytes::BytesMut;
use diffmesh_shared::wire::messages::FieldError;
use futures::{Stream, StreamExt};
use image::{ImageFormat, ImageReader};

use crate::error::ApiError;

/// Text fields are small; this caps each one independently of the body limit.
pub const MAX_TEXT_FIELD_BYTES: usize = 64 * 1024;

/// Read a body or multipart part, failing with 413 naming `field` above `limit` bytes.
pub async fn read_limited<S, E>(
    mut stream: S,
    limit: usize,
    field: &str,
) -> Result<Vec<u8>, ApiError>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut buf = BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk
            .map_err(|e| FieldError::invalid(field, format!("reading the upload failed: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::TooLarge {
                field: field.to_string(),
                limit,
            });
        }
        buf.extend_from_slice(&chunk);
    }
    // Without a copy: a LoRA upload may be hundreds of MB.
    Ok(buf.into())
}

/// Image dimensions from the header only (no decode): the edit's output size and the pixel
/// limit check. Full decoding and validation happen in the codec.
pub fn image_size(bytes: &[u8], field: &str) -> Result<(u32, u32), FieldError> {
    let not_image = || FieldError::invalid(field, "not a PNG, JPEG or WebP image");
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|_| not_image())?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP) => {}
        _ => return Err(not_image()),
    }
    reader
        .into_dimensions()
        .map_err(|e| FieldError::invalid(field, format!("unreadable image header: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_size_reads_the_header_only() {
        assert_eq!(
            image_size(b"GIF89a....", "image").unwrap_err().field,
            "image"
        );
        let img = image::DynamicImage::ImageRgb8(image::RgbImage::new(7, 3));
        let mut png = Cursor::new(Vec::new());
        img.write_to(&mut png, ImageFormat::Png).unwrap();
        assert_eq!(image_size(png.get_ref(), "image").unwrap(), (7, 3));
    }
}
