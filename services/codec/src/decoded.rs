//! Decoded template images kept by content. Every edit decodes its template twice (pre: to
//! stretch it to the model resolution; post: to composite the output onto it), and the edits of
//! a registered template, or repeated uploads of one photo, bring the same bytes each time: the
//! cache decodes those once. An upload is keyed by its SHA-256, so a hit is the very image the
//! bytes decode to; a registered template's image by its id (`template_key`), so its edits need
//! not even read it. Only successful decodes are kept (a bad upload fails every time, with its
//! field error). Masks are not cached: they differ per edit.
use std::sync::Arc;

use diffmesh_shared::wire::messages::FieldError;
use image::DynamicImage;
use moka::sync::Cache;
use prometheus::IntCounterVec;
use sha2::{Digest, Sha256};

use crate::imaging;

/// The decoded-image cache of one codec replica (clones share it).
#[derive(Clone)]
pub struct DecodedImages {
    /// `None` when the capacity is 0: every call decodes.
    cache: Option<Cache<[u8; 32], Arc<DynamicImage>>>,
    /// `diffmesh_codec_decoded_cache_total{outcome="hit"|"miss"}`.
    lookups: IntCounterVec,
}

impl DecodedImages {
    /// A cache holding at most `capacity_bytes` of decoded pixels (least recently used go
    /// first); 0 turns it off.
    pub fn new(capacity_bytes: u64, lookups: IntCounterVec) -> Self {
        let cache = (capacity_bytes > 0).then(|| {
            Cache::builder()
                .max_capacity(capacity_bytes)
                .weigher(|_key, image: &Arc<DynamicImage>| {
                    u32::try_from(image.as_bytes().len()).unwrap_or(u32::MAX)
                })
                .build()
        });
        DecodedImages { cache, lookups }
    }

    /// The image `bytes` decode to (see [`imaging::decode_upload`]; errors name `field`).
    pub fn decode(
        &self,
        bytes: &[u8],
        field: &str,
        max_pixels: u64,
    ) -> Result<Arc<DynamicImage>, FieldError> {
        let key: [u8; 32] = Sha256::digest(bytes).into();
        match self.cached(&key, field, max_pixels)? {
            Some(image) => Ok(image),
            None => self.decode_as(key, bytes, field, max_pixels),
        }
    }

    /// Cache key of a registered template's image: its id stands for its bytes (a template's
    /// image is written once, at registration, and never replaced), so a hit needs no read of
    /// the image at all. Prefixed, so it cannot be the digest of an upload.
    pub fn template_key(template_id: &str) -> [u8; 32] {
        Sha256::digest(format!("template-image:{template_id}")).into()
    }

    /// The image kept under `key` (a hit), or `None` (a miss; always `None` when the cache is
    /// off). The pixel limit holds for a hit too (a caller may pass a lower one than the miss
    /// did).
    pub fn cached(
        &self,
        key: &[u8; 32],
        field: &str,
        max_pixels: u64,
    ) -> Result<Option<Arc<DynamicImage>>, FieldError> {
        let Some(cache) = &self.cache else {
            return Ok(None);
        };
        match cache.get(key) {
            Some(image) => {
                self.lookups.with_label_values(&["hit"]).inc();
                imaging::check_pixel_count(field, image.width(), image.height(), max_pixels)?;
                Ok(Some(image))
            }
            None => {
                self.lookups.with_label_values(&["miss"]).inc();
                Ok(None)
            }
        }
    }

    /// Decode `bytes` and keep the image under `key` (only successful decodes are kept).
    pub fn decode_as(
        &self,
        key: [u8; 32],
        bytes: &[u8],
        field: &str,
        max_pixels: u64,
    ) -> Result<Arc<DynamicImage>, FieldError> {
        let image = Arc::new(imaging::decode_upload(bytes, field, max_pixels)?);
        if let Some(cache) = &self.cache {
            cache.insert(key, image.clone());
        }
        Ok(image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{Rgb, RgbImage};
    use std::io::Cursor;

    fn png(width: u32, shade: u8) -> Vec<u8> {
        let image = RgbImage::from_fn(width, 8, |x, y| Rgb([shade, x as u8, y as u8]));
        let mut out = Vec::new();
        DynamicImage::ImageRgb8(image)
            .write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        out
    }

    fn lookups() -> IntCounterVec {
        IntCounterVec::new(prometheus::Opts::new("lookups", "test"), &["outcome"]).unwrap()
    }

    fn count(c: &IntCounterVec, outcome: &str) -> u64 {
        c.with_label_values(&[outcome]).get()
    }

    #[test]
    fn the_same_bytes_are_decoded_once_and_give_the_same_image() {
        let c = lookups();
        let cache = DecodedImages::new(1 << 20, c.clone());
        let a = png(16, 1);
        let first = cache.decode(&a, "image", 1 << 20).unwrap();
        let again = cache.decode(&a, "image", 1 << 20).unwrap();
        assert!(Arc::ptr_eq(&first, &again), "the second call decoded again");
        assert_eq!(
            *first,
            imaging::decode_upload(&a, "image", 1 << 20).unwrap()
        );
        // Other bytes are another image, even at the same size.
        let other = cache.decode(&png(16, 2), "image", 1 << 20).unwrap();
        assert_ne!(*other, *first);
        assert_eq!((count(&c, "hit"), count(&c, "miss")), (1, 2));
    }

    #[test]
    fn bad_uploads_fail_every_time_and_are_not_kept() {
        let c = lookups();
        let cache = DecodedImages::new(1 << 20, c.clone());
        for _ in 0..2 {
            let err = cache.decode(b"not an image", "image", 1 << 20).unwrap_err();
            assert_eq!(err.field, "image");
        }
        assert_eq!(count(&c, "hit"), 0);
        // Over the pixel limit: refused, whatever an earlier call allowed.
        let big = png(64, 3);
        cache.decode(&big, "image", 64 * 8).unwrap();
        let err = cache.decode(&big, "image", 64 * 8 - 1).unwrap_err();
        assert!(err.message.contains("above the limit"), "{}", err.message);
    }

    #[test]
    fn the_capacity_bounds_the_decoded_bytes() {
        // Each 64x8 RGB image weighs 1536 bytes; room for two.
        let cache = DecodedImages::new(3200, lookups());
        for shade in 0..6 {
            cache.decode(&png(64, shade), "image", 1 << 20).unwrap();
        }
        let moka = cache.cache.as_ref().unwrap();
        moka.run_pending_tasks();
        assert!(moka.weighted_size() <= 3200, "{}", moka.weighted_size());
    }

    #[test]
    fn capacity_zero_decodes_every_time() {
        let c = lookups();
        let cache = DecodedImages::new(0, c.clone());
        let a = png(16, 1);
        let first = cache.decode(&a, "image", 1 << 20).unwrap();
        let again = cache.decode(&a, "image", 1 << 20).unwrap();
        assert!(!Arc::ptr_eq(&first, &again));
        assert_eq!((count(&c, "hit"), count(&c, "miss")), (0, 0));
    }
}
