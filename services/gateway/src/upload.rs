//! Bounded reads of request parts and image headers: the upload-level checks every multipart
//! endpoint shares (a part's byte limit, an image's format and size from its header alone).
use std::io::Cursor;

use actix_multipart::{Field, Multipart};
use bytes::BytesMut;
use diffmesh_shared::wire::messages::FieldError;
use futures::{Stream, StreamExt, TryStreamExt};
use image::{ImageFormat, ImageReader};

use crate::error::ApiError;

/// Text fields are small; this caps each one independently of the body limit.
pub const MAX_TEXT_FIELD_BYTES: usize = 64 * 1024;

/// Most parts one form may have (each form takes a handful of fields). An empty part costs none
/// of the byte budget, so without this a body of many empty parts kept a handler parsing and
/// collecting field names for as long as the client kept sending.
pub const MAX_PARTS: usize = 64;

/// What the header reader may allocate: an embedded ICC profile and one row of pixels. The PNG
/// decoder inflates an iCCP chunk while it reads the header, up to 512 MiB by default: a 600 KB
/// upload whose profile inflates to 600 MiB held 830 MB at once before this bound (the codec
/// has the same bound, services/codec/tests/hostile_images.rs).
const MAX_HEADER_ALLOC: u64 = 32 << 20;

/// The parts of a multipart body, one at a time, each counted against [`MAX_PARTS`].
pub struct Parts {
    payload: Multipart,
    seen: usize,
}

impl Parts {
    pub fn new(payload: Multipart) -> Self {
        Self { payload, seen: 0 }
    }

    /// The next part; 400 naming `body` when the body is malformed or has too many parts.
    pub async fn next(&mut self) -> Result<Option<Field>, ApiError> {
        let field =
            self.payload.try_next().await.map_err(|e| {
                FieldError::invalid("body", format!("malformed multipart body: {e}"))
            })?;
        if field.is_some() {
            self.seen += 1;
            if self.seen > MAX_PARTS {
                return Err(FieldError::invalid(
                    "body",
                    format!("has more than {MAX_PARTS} parts; send each field once"),
                )
                .into());
            }
        }
        Ok(field)
    }
}

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
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|_| not_image())?;
    let mut limits = image::Limits::default();
    limits.max_alloc = Some(MAX_HEADER_ALLOC);
    reader.limits(limits);
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
