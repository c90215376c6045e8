//! The `controlnet` object of a generation: which ControlNet steers it, the control image
//! (base64 PNG or JPEG, any size: the codec stretches it to the model resolution) and how strongly;
//! or a `controlnets` list of such objects steering it together. Read field by field so every
//! error names `controlnet.<field>` or `controlnets[i].<field>`.
use base64::Engine;
use diffmesh_shared::wire::controlnet::{
    name_problem, ControlNetRef, MAX_CONTROLNETS, MAX_CONTROLNET_SCALE,
};
use diffmesh_shared::wire::messages::FieldError;
use serde_json::Value;

use crate::request_limits::{check_pixels, Limits};
use crate::upload::image_size;

/// The client's `controlnet` object before checks (also its documented schema).
#[derive(
    Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize, utoipa::ToSchema,
)]
pub struct RawControlNet {
    /// A ControlNet the ControlNet workers hold (a folder of that name in their
    /// `--controlnet-dir`; the default model ships `silhouette`).
    #[schema(value_type = String, required = true, example = "silhouette")]
    pub name: Option<String>,
    /// The control image, base64 (PNG or JPEG).
    #[schema(value_type = String, required = true)]
    pub image: Option<String>,
    /// How strongly it steers (diffusers' `controlnet_conditioning_scale`), 0 to 2; default 1.
    #[schema(minimum = 0.0, maximum = 2.0, default = 1.0)]
    pub scale: Option<f64>,
}

fn invalid(field: &str, message: impl Into<String>) -> FieldError {
    FieldError::invalid(field, message)
}

/// The `controlnets` value of a JSON body: 1 to [`MAX_CONTROLNETS`] objects.
pub fn list_from_json(value: &Value) -> Result<Vec<RawControlNet>, FieldError> {
    let list = value
        .as_array()
        .filter(|l| (1..=MAX_CONTROLNETS).contains(&l.len()))
        .ok_or_else(|| {
            invalid(
                "controlnets",
                format!("must be a list of 1 to {MAX_CONTROLNETS} objects {{name, image, scale}}"),
            )
        })?;
    list.iter()
        .enumerate()
        .map(|(i, v)| from_json(v, &format!("controlnets[{i}]")))
        .collect()
}

/// One ControlNet object of a JSON body, at `at` (`controlnet` or `controlnets[i]`).
pub fn from_json(value: &Value, at: &str) -> Result<RawControlNet, FieldError> {
    let obj = value
        .as_object()
        .ok_or_else(|| invalid(at, "must be an object {name, image, scale}"))?;
    let mut raw = RawControlNet::default();
    for (key, v) in obj {
        if v.is_null() {
            continue;
        }
        let field = format!("{at}.{key}");
        let string = || {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| invalid(&field, "must be a string"))
        };
        match key.as_str() {
            "name" => raw.name = Some(string()?),
            "image" => raw.image = Some(string()?),
            "scale" => {
                raw.scale = Some(
                    v.as_f64()
                        .ok_or_else(|| invalid(&field, "must be a number"))?,
                )
            }
            _ => return Err(invalid(&field, "unknown field (name, image, scale)")),
        }
    }
    Ok(raw)
}

/// A checked ControlNet request: the reference every hop carries and the image bytes.
pub struct ValidControlNet {
    pub reference: ControlNetRef,
    pub image: Vec<u8>,
}

/// Check one ControlNet object found at `at` (`controlnet` or `controlnets[i]`).
pub fn validate(
    raw: &RawControlNet,
    limits: &Limits,
    at: &str,
) -> Result<ValidControlNet, FieldError> {
    let field = |name: &str| format!("{at}.{name}");
    let name = raw
        .name
        .clone()
        .ok_or_else(|| invalid(&field("name"), "required"))?;
    if let Some(problem) = name_problem(&name) {
        return Err(invalid(&field("name"), problem));
    }
    let scale = raw.scale.unwrap_or(1.0);
    if !scale.is_finite() || !(0.0..=f64::from(MAX_CONTROLNET_SCALE)).contains(&scale) {
        return Err(invalid(
            &field("scale"),
            format!("must be between 0 and {MAX_CONTROLNET_SCALE}, got {scale}"),
        ));
    }
    let image_field = field("image");
    let b64 = raw
        .image
        .as_deref()
        .ok_or_else(|| invalid(&image_field, "required (base64 PNG or JPEG)"))?;
    let image = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|e| invalid(&image_field, format!("not valid base64: {e}")))?;
    let (w, h) = image_size(&image, &image_field)?;
    check_pixels(&image_field, w, h, limits)?;
    Ok(ValidControlNet {
        reference: ControlNetRef {
            name,
            scale: scale as f32,
        },
        image,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> Limits {
        Limits {
            max_n: 4,
            min_steps: 1,
            max_steps: 100,
            max_guidance: 30.0,
            max_pixels: 1 << 20,
            max_prompt_chars: 100,
        }
    }

    fn png_b64(w: u32, h: u32) -> String {
        let mut buf = std::io::Cursor::new(Vec::new());
        image::DynamicImage::new_rgb8(w, h)
            .write_to(&mut buf, image::ImageFormat::Png)
            .unwrap();
        base64::engine::general_purpose::STANDARD.encode(buf.into_inner())
    }

    fn check(v: serde_json::Value) -> Result<ValidControlNet, FieldError> {
        validate(&from_json(&v, "controlnet")?, &limits(), "controlnet")
    }

    #[test]
    fn a_good_controlnet_passes_with_its_defaults() {
        let ok = check(json!({"name": "silhouette", "image": png_b64(8, 8)})).unwrap();
        assert_eq!(ok.reference.name, "silhouette");
        assert_eq!(ok.reference.scale, 1.0);
        assert!(!ok.image.is_empty());
    }

    #[test]
    fn every_bad_field_is_named() {
        let img = png_b64(8, 8);
        let cases = [
            (json!("silhouette"), "controlnet"),
            (json!({"image": img}), "controlnet.name"),
            (json!({"name": "a/b", "image": img}), "controlnet.name"),
            (json!({"name": 3, "image": img}), "controlnet.name"),
            (json!({"name": "s"}), "controlnet.image"),
            (json!({"name": "s", "image": "%%%"}), "controlnet.image"),
            (
                json!({"name": "s", "image": "aGVsbG8="}),
                "controlnet.image",
            ),
            (
                json!({"name": "s", "image": img, "scale": 2.5}),
                "controlnet.scale",
            ),
            (
                json!({"name": "s", "image": img, "scale": "1"}),
                "controlnet.scale",
            ),
            (
                json!({"name": "s", "image": img, "strength": 1}),
                "controlnet.strength",
            ),
            (
                json!({"name": "s", "image": png_b64(2048, 1024)}),
                "controlnet.image",
            ),
        ];
        for (value, field) in cases {
            let err = check(value.clone())
                .err()
                .unwrap_or_else(|| panic!("{value} passed"));
            assert_eq!(err.field, field, "{value}: {}", err.message);
        }
    }

    #[test]
    fn a_list_names_each_entry_and_is_bounded() {
        let img = png_b64(8, 8);
        let good = json!({"name": "edges", "image": img});
        let two = list_from_json(&json!([good, {"name": "depth", "image": img, "scale": 0.5}]));
        assert_eq!(two.unwrap().len(), 2);
        let bad = list_from_json(&json!([good, {"name": "depth", "image": img, "x": 1}]));
        assert_eq!(bad.unwrap_err().field, "controlnets[1].x");
        let raw = list_from_json(&json!([good, {"name": "a/b", "image": img}])).unwrap();
        let err = validate(&raw[1], &limits(), "controlnets[1]")
            .err()
            .unwrap();
        assert_eq!(err.field, "controlnets[1].name");
        for wrong in [
            json!([]),
            json!(good),
            json!(vec![good.clone(); MAX_CONTROLNETS + 1]),
        ] {
            assert_eq!(list_from_json(&wrong).unwrap_err().field, "controlnets");
        }
    }
}
