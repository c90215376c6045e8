//! OpenAI's output fields of the Images API: `output_format` (png, jpeg, webp) with
//! `output_compression`, `background`, `quality` (mapped to step counts) and `user`, checked
//! with errors naming the field, and the re-encoding of a job's PNGs into the asked format.
use diffmesh_shared::wire::messages::FieldError;
use std::io::Cursor;

/// The output fields as the client sent them (`crate::validate::RawParams` documents them).
#[derive(Debug, Clone, Copy, Default)]
pub struct RawOutput<'a> {
    pub output_format: Option<&'a str>,
    pub output_compression: Option<i64>,
    pub background: Option<&'a str>,
    pub quality: Option<&'a str>,
    pub user: Option<&'a str>,
}

/// The encoding of the returned images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    #[default]
    Png,
    /// JPEG at this quality (1 to 100).
    Jpeg(u8),
    /// Lossless WebP.
    Webp,
}

impl OutputFormat {
    pub fn content_type(self) -> &'static str {
        match self {
            OutputFormat::Png => "image/png",
            OutputFormat::Jpeg(_) => "image/jpeg",
            OutputFormat::Webp => "image/webp",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OutputFormat::Png => "png",
            OutputFormat::Jpeg(_) => "jpeg",
            OutputFormat::Webp => "webp",
        }
    }

    /// A PNG (as the codec stores results) in this format.
    pub fn encode(self, png: &[u8]) -> Result<Vec<u8>, String> {
        if self == OutputFormat::Png {
            return Ok(png.to_vec());
        }
        let image = image::load_from_memory_with_format(png, image::ImageFormat::Png)
            .map_err(|e| format!("reading a result PNG: {e}"))?
            .to_rgb8();
        self.encode_image(&image)
    }

    /// RGB8 pixels (`width` x `height`, a preview's) in this format.
    pub fn encode_rgb(self, rgb: Vec<u8>, width: u32, height: u32) -> Result<Vec<u8>, String> {
        let image = image::RgbImage::from_raw(width, height, rgb)
            .ok_or_else(|| format!("{width}x{height} RGB pixels of the wrong length"))?;
        self.encode_image(&image)
    }

    fn encode_image(self, image: &image::RgbImage) -> Result<Vec<u8>, String> {
        let mut out = Cursor::new(Vec::new());
        let written = match self {
            OutputFormat::Png => image.write_to(&mut out, image::ImageFormat::Png),
            OutputFormat::Jpeg(quality) => {
                let encoder = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality);
                image.write_with_encoder(encoder)
            }
            OutputFormat::Webp => {
                image.write_with_encoder(image::codecs::webp::WebPEncoder::new_lossless(&mut out))
            }
        };
        written.map_err(|e| format!("encoding {}: {e}", self.name()))?;
        Ok(out.into_inner())
    }
}

/// How `quality` changes the default step count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quality {
    Low,
    Default,
    High,
}

impl Quality {
    /// The default steps under this quality, within `[min, max]`.
    pub fn steps(self, default: u32, min: u32, max: u32) -> u32 {
        let steps = match self {
            Quality::Low => default / 2,
            Quality::Default => default,
            Quality::High => default.saturating_mul(2),
        };
        steps.clamp(min.max(1), max.max(1))
    }
}

fn invalid(field: &str, message: impl Into<String>) -> FieldError {
    FieldError::invalid(field, message)
}

/// Check the output fields: the format to return and how `quality` sets the default steps.
pub fn validate(raw: &RawOutput<'_>) -> Result<(OutputFormat, Quality), FieldError> {
    let compression = match raw.output_compression {
        None => None,
        Some(c @ 0..=100) => Some(c as u8),
        Some(c) => {
            return Err(invalid(
                "output_compression",
                format!("must be between 0 and 100, got {c}"),
            ))
        }
    };
    let format = match raw.output_format.unwrap_or("png") {
        "png" if compression.is_some() => {
            return Err(invalid(
                "output_compression",
                "only for output_format jpeg (png is lossless)",
            ))
        }
        "png" => OutputFormat::Png,
        "jpeg" | "jpg" => OutputFormat::Jpeg(compression.unwrap_or(100).max(1)),
        "webp" if compression.is_some_and(|c| c != 100) => {
            return Err(invalid(
                "output_compression",
                "webp is encoded lossless here: only 100",
            ))
        }
        "webp" => OutputFormat::Webp,
        other => {
            return Err(invalid(
                "output_format",
                format!("must be png, jpeg or webp, got {other:?}"),
            ))
        }
    };
    match raw.background {
        None | Some("auto") | Some("opaque") => {}
        Some("transparent") => {
            return Err(invalid(
                "background",
                "transparent is not served: the models draw no alpha channel; use opaque or auto",
            ))
        }
        Some(other) => {
            return Err(invalid(
                "background",
                format!("must be auto, opaque or transparent, got {other:?}"),
            ))
        }
    }
    let quality = match raw.quality {
        None | Some("auto") | Some("standard") | Some("medium") => Quality::Default,
        Some("low") => Quality::Low,
        Some("high") | Some("hd") => Quality::High,
        Some(other) => {
            return Err(invalid(
                "quality",
                format!("must be auto, low, medium, high, standard or hd, got {other:?}"),
            ))
        }
    };
    if raw.user.is_some_and(|u| u.chars().count() > 256) {
        return Err(invalid("user", "at most 256 characters"));
    }
    Ok((format, quality))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(format: Option<&str>, compression: Option<i64>) -> RawOutput<'_> {
        RawOutput {
            output_format: format,
            output_compression: compression,
            ..RawOutput::default()
        }
    }

    fn field(raw: &RawOutput) -> String {
        validate(raw).unwrap_err().field
    }

    #[test]
    fn formats_and_their_errors_name_the_field() {
        assert_eq!(validate(&raw(None, None)).unwrap().0, OutputFormat::Png);
        assert_eq!(
            validate(&raw(Some("jpeg"), Some(80))).unwrap().0,
            OutputFormat::Jpeg(80)
        );
        assert_eq!(
            validate(&raw(Some("webp"), None)).unwrap().0,
            OutputFormat::Webp
        );
        assert_eq!(field(&raw(Some("gif"), None)), "output_format");
        assert_eq!(field(&raw(Some("png"), Some(50))), "output_compression");
        assert_eq!(field(&raw(Some("webp"), Some(50))), "output_compression");
        assert_eq!(field(&raw(Some("jpeg"), Some(101))), "output_compression");
        let transparent = RawOutput {
            background: Some("transparent"),
            ..RawOutput::default()
        };
        assert_eq!(field(&transparent), "background");
        let bad = RawOutput {
            quality: Some("ultra"),
            ..RawOutput::default()
        };
        assert_eq!(field(&bad), "quality");
    }

    #[test]
    fn quality_sets_the_default_steps_within_the_limits() {
        assert_eq!(Quality::Low.steps(20, 1, 100), 10);
        assert_eq!(Quality::Default.steps(20, 1, 100), 20);
        assert_eq!(Quality::High.steps(20, 1, 30), 30);
        assert_eq!(Quality::Low.steps(1, 1, 100), 1);
    }

    #[test]
    fn results_reencode_as_asked() {
        let image =
            image::RgbImage::from_fn(16, 8, |x, y| image::Rgb([x as u8 * 16, y as u8 * 32, 7]));
        let mut png = Cursor::new(Vec::new());
        image.write_to(&mut png, image::ImageFormat::Png).unwrap();
        let png = png.into_inner();
        for (format, kind) in [
            (OutputFormat::Jpeg(90), image::ImageFormat::Jpeg),
            (OutputFormat::Webp, image::ImageFormat::WebP),
        ] {
            let bytes = format.encode(&png).unwrap();
            assert_eq!(image::guess_format(&bytes).unwrap(), kind);
            let back = image::load_from_memory(&bytes).unwrap().to_rgb8();
            assert_eq!(back.dimensions(), (16, 8));
            if format == OutputFormat::Webp {
                assert_eq!(back, image, "lossless");
            }
        }
        assert_eq!(OutputFormat::Png.encode(&png).unwrap(), png);
    }
}
