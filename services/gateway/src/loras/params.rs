//! The `loras` field of image requests, `[{"id": "...", "scale": 1.0}]` (a JSON array in the
//! generation body; the same array as the text of a multipart field in edits): read entry by
//! entry so errors name `loras[i].id` or `loras[i].scale`, checked (how many, each id once,
//! scale range; pure), and looked up (every id a registered LoRA; needs the KV bucket, so the
//! request readers call it after validation).
use diffmesh_shared::wire::lora::{
    LoraRecord, LoraRef, LoraTarget, MAX_LORAS_PER_REQUEST, MAX_LORA_SCALE,
};
use diffmesh_shared::wire::messages::FieldError;
use serde_json::Value;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::loras::store::{is_lora_id, LoraStore};

/// The scale of an entry that gives none (the adapter as trained).
pub const DEFAULT_SCALE: f64 = 1.0;

/// One requested LoRA as the client sent it, before checks (also its documented schema).
#[derive(
    Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize, utoipa::ToSchema,
)]
#[serde(deny_unknown_fields)]
pub struct RawLora {
    /// A registered LoRA's id (`POST /v1/loras`).
    #[schema(value_type = String, required = true)]
    pub id: Option<String>,
    /// How strongly to apply it (diffusers' adapter weight), -8 to 8 (`lora::MAX_LORA_SCALE`;
    /// `openapi` sets the bounds); default 1.
    #[schema(default = 1.0)]
    pub scale: Option<f64>,
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError::invalid(field, message)
}

/// The `loras` value of a JSON body (`null` entries' fields count as absent).
pub fn from_json(value: &Value) -> Result<Vec<RawLora>, FieldError> {
    let entries = value
        .as_array()
        .ok_or_else(|| invalid("loras", r#"must be an array of {"id", "scale"} objects"#))?;
    entries
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let obj = entry.as_object().ok_or_else(|| {
                invalid(
                    format!("loras[{i}]"),
                    "must be an object with `id` and an optional `scale`",
                )
            })?;
            let mut raw = RawLora::default();
            for (key, v) in obj {
                let field = || format!("loras[{i}].{key}");
                if v.is_null() {
                    continue;
                }
                match key.as_str() {
                    "id" => {
                        let id = v
                            .as_str()
                            .ok_or_else(|| invalid(field(), "must be a string"))?;
                        raw.id = Some(id.to_string());
                    }
                    "scale" => {
                        raw.scale = Some(
                            v.as_f64()
                                .ok_or_else(|| invalid(field(), "must be a number"))?,
                        )
                    }
                    // Our own extension, so a misspelt `scale` is an error, not ignored.
                    _ => {
                        return Err(invalid(
                            field(),
                            "unknown field (an entry has `id` and `scale`)",
                        ))
                    }
                }
            }
            Ok(raw)
        })
        .collect()
}

/// The `loras` text field of a multipart form: the same JSON array (blank: none).
pub fn from_text(text: &str) -> Result<Option<Vec<RawLora>>, FieldError> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let value: Value = serde_json::from_str(text).map_err(|e| {
        invalid(
            "loras",
            format!(r#"must be a JSON array like [{{"id": "...", "scale": 1.0}}]: {e}"#),
        )
    })?;
    from_json(&value).map(Some)
}

/// Check the requested LoRAs: at most `MAX_LORAS_PER_REQUEST`, each a LoRA id given once,
/// each scale finite and within `±MAX_LORA_SCALE`. Whether the caller may use them is
/// `check_registered`.
pub fn validate(raw: &[RawLora]) -> Result<Vec<LoraRef>, FieldError> {
    if raw.len() > MAX_LORAS_PER_REQUEST {
        return Err(invalid(
            "loras",
            format!(
                "at most {MAX_LORAS_PER_REQUEST} LoRAs per request, got {}",
                raw.len()
            ),
        ));
    }
    let mut loras: Vec<LoraRef> = Vec::with_capacity(raw.len());
    for (i, entry) in raw.iter().enumerate() {
        let id_field = format!("loras[{i}].id");
        let id = entry.id.as_deref().map(str::trim).unwrap_or_default();
        if id.is_empty() {
            return Err(invalid(
                id_field,
                "required: the id of a registered LoRA (POST /v1/loras)",
            ));
        }
        if !is_lora_id(id) {
            return Err(invalid(
                id_field,
                format!("must be a LoRA id (a UUID from POST /v1/loras), got {id:?}"),
            ));
        }
        if let Some(first) = loras.iter().position(|l| l.id == id) {
            return Err(invalid(
                id_field,
                format!("names the same LoRA as loras[{first}].id; give each LoRA once"),
            ));
        }
        let scale = entry.scale.unwrap_or(DEFAULT_SCALE);
        let max = f64::from(MAX_LORA_SCALE);
        if !scale.is_finite() || scale.abs() > max {
            return Err(invalid(
                format!("loras[{i}].scale"),
                format!("must be between -{max} and {max}, got {scale}"),
            ));
        }
        loras.push(LoraRef {
            id: id.to_string(),
            scale: scale as f32,
        });
    }
    Ok(loras)
}

/// 400 naming `loras[i].id` for the first LoRA that is not registered or that `caller` may not
/// access (another key's: answered as if it did not exist, as `GET /v1/loras/{id}` does);
/// else their records, in request order.
pub async fn check_registered(
    store: &LoraStore,
    caller: &Caller,
    loras: &[LoraRef],
) -> Result<Vec<LoraRecord>, ApiError> {
    let mut records = Vec::with_capacity(loras.len());
    for (i, lora) in loras.iter().enumerate() {
        let record = store.get(&lora.id).await?.filter(|r| caller.sees(r));
        let Some(record) = record else {
            return Err(invalid(
                format!("loras[{i}].id"),
                format!(
                    "no LoRA {:?} is registered (register one with POST /v1/loras; \
                     GET /v1/loras lists them)",
                    lora.id
                ),
            )
            .into());
        };
        records.push(record);
    }
    Ok(records)
}

/// 400 naming `loras[i].id` for the first LoRA of another network than the model's (a Flux
/// transformer's adapters on an SDXL model, or the reverse): the model of `family` (its card's;
/// `None`, a model announced without a card, is not checked) named `model_id`.
pub fn check_targets(
    model_id: &str,
    family: Option<&str>,
    records: &[LoraRecord],
) -> Result<(), FieldError> {
    let Some(family) = family else {
        return Ok(());
    };
    let wanted = LoraTarget::of_family(family);
    match records.iter().position(|r| r.target != wanted) {
        Some(i) => Err(invalid(
            format!("loras[{i}].id"),
            format!(
                "LoRA {:?} adapts a {} but model {model_id:?} ({family}) takes {} adapters",
                records[i].id,
                records[i].target.as_str(),
                wanted.as_str()
            ),
        )),
        None => Ok(()),
    }
}

/// 400 naming `loras` when an edit of a registered template asks for LoRAs.
pub fn refuse_for_template(raw: Option<&[RawLora]>) -> Result<(), FieldError> {
    match raw {
        Some(loras) if !loras.is_empty() => Err(invalid(
            "loras",
            "not supported for edits of a registered template: its activation cache holds the \
             base model's activations",
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const A: &str = "3f2b8c1e-5d4a-4e6f-9a0b-1c2d3e4f5a6b";
    const B: &str = "7a6b5c4d-3e2f-4a1b-8c9d-0e1f2a3b4c5d";

    fn entry(id: &str, scale: Option<f64>) -> RawLora {
        RawLora {
            id: Some(id.into()),
            scale,
        }
    }

    fn field(raw: &[RawLora]) -> String {
        validate(raw).unwrap_err().field
    }

    #[test]
    fn scales_default_to_one_and_order_is_kept() {
        let loras = validate(&[entry(B, Some(-0.5)), entry(A, None)]).unwrap();
        assert_eq!(
            loras,
            vec![
                LoraRef {
                    id: B.into(),
                    scale: -0.5
                },
                LoraRef {
                    id: A.into(),
                    scale: 1.0
                },
            ]
        );
        assert!(validate(&[]).unwrap().is_empty());
        // The bounds themselves are allowed.
        assert!(validate(&[entry(A, Some(8.0)), entry(B, Some(-8.0))]).is_ok());
    }

    #[test]
    fn errors_name_the_entry_and_limit() {
        let e = validate(&[entry(A, Some(1.0)), entry(B, Some(8.5))]).unwrap_err();
        assert_eq!(e.field, "loras[1].scale");
        assert!(e.message.contains("-8 and 8"), "{}", e.message);
        for bad in [f64::NAN, f64::INFINITY, -8.01] {
            assert_eq!(field(&[entry(A, Some(bad))]), "loras[0].scale", "{bad}");
        }
        let e = validate(&[entry(A, None), entry(B, None), entry(A, None)]).unwrap_err();
        assert_eq!(e.field, "loras[2].id");
        assert!(e.message.contains("loras[0]"), "{}", e.message);
        assert_eq!(field(&[RawLora::default()]), "loras[0].id");
        assert_eq!(
            field(&[entry(A, None), entry("lora-1", None)]),
            "loras[1].id"
        );
        let five: Vec<RawLora> = (0..=MAX_LORAS_PER_REQUEST)
            .map(|_| entry(&uuid::Uuid::new_v4().to_string(), None))
            .collect();
        let e = validate(&five).unwrap_err();
        assert_eq!(e.field, "loras");
        assert!(e
            .message
            .contains(&format!("at most {MAX_LORAS_PER_REQUEST}")));
        assert!(validate(&five[..MAX_LORAS_PER_REQUEST]).is_ok());
    }

    #[test]
    fn json_type_errors_name_the_entry_field() {
        let f = |v: Value| from_json(&v).unwrap_err().field;
        assert_eq!(f(json!({"id": A})), "loras");
        assert_eq!(f(json!([{"id": A}, 3])), "loras[1]");
        assert_eq!(f(json!([{"id": 7}])), "loras[0].id");
        assert_eq!(f(json!([{"id": A, "scale": "1"}])), "loras[0].scale");
        assert_eq!(f(json!([{"id": A, "weight": 1}])), "loras[0].weight");
        let raw = from_json(&json!([{"id": A, "scale": null}, {"id": B, "scale": 2}])).unwrap();
        assert_eq!(raw, vec![entry(A, None), entry(B, Some(2.0))]);
    }

    #[test]
    fn form_text_holds_the_same_array() {
        assert_eq!(from_text("  ").unwrap(), None);
        let raw = from_text(&format!(r#"[{{"id": "{A}", "scale": 0.75}}]"#)).unwrap();
        assert_eq!(raw, Some(vec![entry(A, Some(0.75))]));
        assert_eq!(from_text("[{").unwrap_err().field, "loras");
        assert_eq!(
            from_text(r#"[{"id": 1}]"#).unwrap_err().field,
            "loras[0].id"
        );
    }

    #[test]
    fn template_edits_take_no_loras() {
        assert!(refuse_for_template(None).is_ok());
        assert!(refuse_for_template(Some(&[])).is_ok());
        let e = refuse_for_template(Some(&[entry(A, None)])).unwrap_err();
        assert_eq!(e.field, "loras");
        assert!(e.message.contains("activation cache"), "{}", e.message);
    }
}
