//! Raw API requests -> validated requests. Every error names the field and, for ranges, the
//! limit, so clients can fix the request without reading server logs.
use diffmesh_shared::wire::messages::{
    FieldError, GenerationParams, StepCacheMethod, TrueCfg, MAX_PREVIEWS,
};

use crate::loras::params as lora_params;
use crate::output_format::{self, OutputFormat};
pub use crate::raw_params::RawParams;
use crate::request_limits::{check_pixels, in_range, parse_size, rand_seed, Defaults, Limits};

/// How the client wants the images back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFormat {
    /// OpenAI-style JSON with base64 PNGs.
    B64Json,
    /// The raw PNG as `image/png` (only with n = 1).
    Png,
    /// OpenAI-style JSON with a signed, expiring URL per image (`result_urls`).
    Url,
}

/// Most `partial_images` a streamed request may ask for (OpenAI's limit).
pub const MAX_PARTIAL_IMAGES: i64 = 3;

/// The steps after which previews go out: `partial` evenly spaced ones (never after the last
/// step, which the image itself ends), or one every `every` steps; at most
/// `messages::MAX_PREVIEWS`.
pub fn preview_steps(steps: u32, partial: u32, every: Option<u32>) -> Vec<u32> {
    let mut out: Vec<u32> = match every {
        Some(k) if k > 0 => (1..steps).filter(|s| s % k == 0).collect(),
        _ => (1..=partial)
            .map(|i| ((u64::from(i) * u64::from(steps)) / u64::from(partial + 1)) as u32)
            .filter(|s| (1..steps).contains(s))
            .collect(),
    };
    out.dedup();
    out.truncate(MAX_PREVIEWS);
    out
}

/// Largest step-caching threshold (`cache_threshold`): above it almost every step reuses.
pub const MAX_CACHE_THRESHOLD: f64 = 1.0;

/// Longest `deadline_ms` a request may give (a day).
pub const MAX_DEADLINE_MS: i64 = 86_400_000;

/// A request that passed every check.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidParams {
    pub params: GenerationParams,
    pub response_format: ResponseFormat,
    /// How the images are encoded.
    pub output: OutputFormat,
    /// Answer with Server-Sent Events (`RawParams::stream`).
    pub stream: bool,
    /// `RawParams::callback_url` as given (checked with the gateway's webhook policy, which
    /// knows whether the request is async: `webhooks::callback_url`).
    pub callback_url: Option<String>,
}

fn invalid(field: &str, message: impl Into<String>) -> FieldError {
    FieldError::invalid(field, message)
}

/// Whether a request must give a prompt (a variation may leave it empty: unconditioned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prompt {
    Required,
    Optional,
}

/// Validate the parameters shared by every endpoint; `size` is the output size (the request's
/// `size` for generations, the uploaded image's size for edits and variations).
fn validate_common(
    raw: RawParams,
    size: (u32, u32),
    limits: &Limits,
    defaults: &Defaults,
    prompt_rule: Prompt,
) -> Result<ValidParams, FieldError> {
    let (output, quality) = output_format::validate(&raw.output())?;
    let prompt = raw.prompt.unwrap_or_default();
    if prompt_rule == Prompt::Required && prompt.trim().is_empty() {
        return Err(invalid("prompt", "required and must not be empty"));
    }
    let chars = prompt.chars().count();
    if chars > limits.max_prompt_chars {
        return Err(invalid(
            "prompt",
            format!(
                "is {chars} characters, above the limit of {}",
                limits.max_prompt_chars
            ),
        ));
    }
    let n = in_range("n", raw.n, 1, 1, limits.max_n)?;
    let steps = in_range(
        "num_inference_steps",
        raw.num_inference_steps,
        quality.steps(defaults.steps, limits.min_steps, limits.max_steps),
        limits.min_steps,
        limits.max_steps,
    )?;
    let guidance = raw.guidance_scale.unwrap_or(f64::from(defaults.guidance));
    if !guidance.is_finite() || guidance < 0.0 || guidance > f64::from(limits.max_guidance) {
        return Err(invalid(
            "guidance_scale",
            format!(
                "must be between 0 and {}, got {guidance}",
                limits.max_guidance
            ),
        ));
    }
    let cache_threshold = match raw.cache_threshold {
        None => None,
        Some(t) if (0.0..=MAX_CACHE_THRESHOLD).contains(&t) => Some(t as f32),
        Some(t) => {
            return Err(invalid(
                "cache_threshold",
                format!("must be between 0 and {MAX_CACHE_THRESHOLD}, got {t}"),
            ))
        }
    };
    let cache_method = validate_cache_method(raw.cache_method.as_deref(), cache_threshold)?;
    let true_cfg = validate_true_cfg(
        raw.true_cfg_scale.unwrap_or(f64::from(defaults.true_cfg)),
        raw.negative_prompt,
        limits,
    )?;
    let response_format = match raw.response_format.as_deref().unwrap_or("b64_json") {
        "b64_json" => ResponseFormat::B64Json,
        "png" => ResponseFormat::Png,
        // The URL serves the stored PNG.
        "url" if output != OutputFormat::Png => {
            return Err(invalid(
                "output_format",
                "png only with response_format url (the URL serves the stored PNG)",
            ))
        }
        "url" => ResponseFormat::Url,
        other => {
            return Err(invalid(
                "response_format",
                format!("must be b64_json, url or png, got {other:?}"),
            ))
        }
    };
    if response_format == ResponseFormat::Png && n != 1 {
        return Err(invalid(
            "response_format",
            format!("png returns one image; n must be 1, got {n}"),
        ));
    }
    let stream = raw.stream.unwrap_or(false);
    if stream && n != 1 {
        return Err(invalid(
            "n",
            format!("a stream carries one image; n must be 1, got {n}"),
        ));
    }
    if stream && response_format != ResponseFormat::B64Json {
        return Err(invalid(
            "response_format",
            "a stream carries b64_json images: b64_json only",
        ));
    }
    let partial = match raw.partial_images {
        None => 0,
        Some(_) if !stream => {
            return Err(invalid("partial_images", "needs stream: true"));
        }
        Some(p) if (0..=MAX_PARTIAL_IMAGES).contains(&p) => p as u32,
        Some(p) => {
            return Err(invalid(
                "partial_images",
                format!("must be between 0 and {MAX_PARTIAL_IMAGES}, got {p}"),
            ))
        }
    };
    let every = match raw.preview_every {
        None => None,
        Some(_) if stream => {
            return Err(invalid(
                "preview_every",
                "not with stream: partial_images sets a stream's previews",
            ))
        }
        Some(k)
            if (1..=i64::from(steps)).contains(&k)
                && (i64::from(steps) - 1) / k <= MAX_PREVIEWS as i64 =>
        {
            Some(k as u32)
        }
        Some(k) if (1..=i64::from(steps)).contains(&k) => {
            return Err(invalid(
                "preview_every",
                format!(
                "{k} gives more than {MAX_PREVIEWS} previews over {steps} steps; take a larger one"
            ),
            ))
        }
        Some(k) => {
            return Err(invalid(
                "preview_every",
                format!("must be between 1 and num_inference_steps ({steps}), got {k}"),
            ))
        }
    };
    let loras = lora_params::validate(raw.loras.as_deref().unwrap_or_default())?;
    let seed = raw.seed.unwrap_or_else(rand_seed);
    let deadline_unix_ms = deadline_from_now(raw.deadline_ms)?;
    let callback_url = raw.callback_url;
    Ok(ValidParams {
        params: GenerationParams {
            model: String::new(),
            prompt,
            n,
            num_inference_steps: steps,
            guidance_scale: guidance as f32,
            seed,
            width: size.0,
            height: size.1,
            loras,
            deadline_unix_ms,
            // Set by the caller from `raw.controlnet` (generations only).
            controlnet: None,
            extra_controlnets: Vec::new(),
            true_cfg,
            preview_steps: preview_steps(steps, partial, every),
            // Set by the caller for variations.
            strength: None,
            cache_threshold,
            cache_method,
        },
        response_format,
        output,
        stream,
        callback_url,
    })
}

/// `true_cfg_scale` and `negative_prompt` as true CFG (None at scale 1: off).
pub(crate) fn validate_true_cfg(
    scale: f64,
    negative_prompt: Option<String>,
    limits: &Limits,
) -> Result<Option<TrueCfg>, FieldError> {
    let max = f64::from(limits.max_guidance).max(1.0);
    if !scale.is_finite() || !(1.0..=max).contains(&scale) {
        return Err(invalid(
            "true_cfg_scale",
            format!("must be between 1 and {max}, got {scale}"),
        ));
    }
    if let Some(chars) = negative_prompt.as_ref().map(|p| p.chars().count()) {
        if chars > limits.max_prompt_chars {
            return Err(invalid(
                "negative_prompt",
                format!(
                    "is {chars} characters, above the limit of {}",
                    limits.max_prompt_chars
                ),
            ));
        }
    }
    if scale == 1.0 {
        if negative_prompt.is_some() {
            return Err(invalid(
                "negative_prompt",
                "takes effect only with true_cfg_scale above 1",
            ));
        }
        return Ok(None);
    }
    Ok(Some(TrueCfg {
        scale: scale as f32,
        negative_prompt: negative_prompt.unwrap_or_default(),
    }))
}

/// `cache_method`: a known name, and only with a `cache_threshold` (its units are the
/// method's own). Absent: TeaCache where there is a threshold.
fn validate_cache_method(
    method: Option<&str>,
    threshold: Option<f32>,
) -> Result<Option<StepCacheMethod>, FieldError> {
    let Some(name) = method.map(str::trim) else {
        return Ok(None);
    };
    let method = StepCacheMethod::from_name(name).ok_or_else(|| {
        invalid(
            "cache_method",
            format!("must be `teacache` or `first_block`, got {name:?}"),
        )
    })?;
    match threshold {
        Some(_) => Ok(Some(method)),
        None => Err(invalid(
            "cache_method",
            "needs `cache_threshold` (each method's threshold is in its own units)",
        )),
    }
}

/// Edits of a registered template run mask-aware: first-block caching, which runs every token
/// through the first block, does not combine with them (TeaCache does).
pub fn refuse_first_block_for_template(method: Option<&str>) -> Result<(), FieldError> {
    match method.map(str::trim).and_then(StepCacheMethod::from_name) {
        Some(StepCacheMethod::FirstBlock) => Err(invalid(
            "cache_method",
            "`first_block` runs every token through the first block; edits of a registered \
             template compute only the masked tokens and combine with `teacache`",
        )),
        _ => Ok(()),
    }
}

/// `deadline_ms` after now as a Unix-ms deadline (checked: 1 ms to a day).
fn deadline_from_now(deadline_ms: Option<i64>) -> Result<Option<u64>, FieldError> {
    let Some(ms) = deadline_ms else {
        return Ok(None);
    };
    if !(1..=MAX_DEADLINE_MS).contains(&ms) {
        return Err(invalid(
            "deadline_ms",
            format!("must be between 1 and {MAX_DEADLINE_MS}, got {ms}"),
        ));
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Ok(Some(now_ms + ms as u64))
}

/// Validate a text-to-image request.
pub fn validate_generation(
    raw: RawParams,
    limits: &Limits,
    defaults: &Defaults,
) -> Result<ValidParams, FieldError> {
    let size = match raw.size.as_deref() {
        Some(s) if s != "auto" => parse_size(s)?,
        _ => (defaults.width, defaults.height),
    };
    check_pixels("size", size.0, size.1, limits)?;
    validate_common(raw, size, limits, defaults, Prompt::Required)
}

/// Validate an edit (a variation: `Prompt::Optional`) whose image header says `image_size`.
pub fn validate_edit(
    raw: RawParams,
    image_size: (u32, u32),
    limits: &Limits,
    defaults: &Defaults,
    prompt_rule: Prompt,
) -> Result<ValidParams, FieldError> {
    check_pixels("image", image_size.0, image_size.1, limits)?;
    if let Some(size) = raw.size.as_deref().filter(|s| *s != "auto") {
        // Accepted for OpenAI compatibility, but edits always come back at the input's size.
        parse_size(size)?;
    }
    validate_common(raw, image_size, limits, defaults, prompt_rule)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loras::params::RawLora;

    fn limits() -> Limits {
        Limits {
            max_n: 4,
            min_steps: 1,
            max_steps: 100,
            max_guidance: 30.0,
            max_pixels: 1024 * 1024,
            max_prompt_chars: 100,
        }
    }
    fn defaults() -> Defaults {
        Defaults {
            steps: 20,
            guidance: 3.5,
            true_cfg: 1.0,
            width: 64,
            height: 64,
        }
    }
    fn raw(prompt: &str) -> RawParams {
        RawParams {
            prompt: Some(prompt.into()),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_fill_in() {
        let v = validate_generation(raw("cat"), &limits(), &defaults()).unwrap();
        assert_eq!(v.params.n, 1);
        assert_eq!(v.params.num_inference_steps, 20);
        assert_eq!((v.params.width, v.params.height), (64, 64));
        assert_eq!(v.response_format, ResponseFormat::B64Json);
    }

    #[test]
    fn deadline_is_acceptance_plus_deadline_ms_and_out_of_range_names_the_field() {
        let with = |ms: i64| RawParams {
            deadline_ms: Some(ms),
            ..raw("x")
        };
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let v = validate_generation(with(5000), &limits(), &defaults()).unwrap();
        let at = v.params.deadline_unix_ms.unwrap();
        assert!(
            (before + 5000..before + 6000).contains(&at),
            "{at} vs {before}"
        );
        let none = validate_generation(raw("x"), &limits(), &defaults()).unwrap();
        assert_eq!(none.params.deadline_unix_ms, None);
        for bad in [0, -1, MAX_DEADLINE_MS + 1] {
            let e = validate_generation(with(bad), &limits(), &defaults()).unwrap_err();
            assert_eq!(e.field, "deadline_ms", "{bad}");
        }
    }

    #[test]
    fn openai_output_fields_parse_and_quality_sets_the_default_steps() {
        let body = br#"{"prompt": "x", "size": "auto", "output_format": "jpeg",
            "output_compression": 70, "quality": "low", "background": "opaque", "user": "u-1"}"#;
        let parsed = crate::parse::raw_from_json(body).unwrap();
        let (l, d) = (limits(), defaults());
        let v = validate_generation(parsed, &l, &d).unwrap();
        assert_eq!(v.output, OutputFormat::Jpeg(70));
        assert_eq!(v.params.num_inference_steps, (d.steps / 2).max(l.min_steps));
        assert_eq!((v.params.width, v.params.height), (d.width, d.height));
        // An explicit step count wins over `quality`.
        let explicit = RawParams {
            quality: Some("high".into()),
            num_inference_steps: Some(3),
            ..raw("x")
        };
        assert_eq!(
            validate_generation(explicit, &l, &d)
                .unwrap()
                .params
                .num_inference_steps,
            3
        );
        let transparent = RawParams {
            background: Some("transparent".into()),
            ..raw("x")
        };
        let e = validate_generation(transparent, &l, &d).unwrap_err();
        assert_eq!(e.field, "background");
    }

    #[test]
    fn cache_threshold_is_kept_in_range_and_errors_name_the_field() {
        let (l, d) = (limits(), defaults());
        let with = |t: Option<f64>| {
            let raw = RawParams {
                cache_threshold: t,
                ..raw("x")
            };
            validate_generation(raw, &l, &d).map(|v| v.params.cache_threshold)
        };
        assert_eq!(with(None).unwrap(), None);
        assert_eq!(with(Some(0.0)).unwrap(), Some(0.0));
        assert_eq!(with(Some(0.25)).unwrap(), Some(0.25));
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let e = with(Some(bad)).unwrap_err();
            assert_eq!(e.field, "cache_threshold", "{bad}");
        }
    }

    #[test]
    fn cache_method_needs_a_threshold_and_a_known_name() {
        let (l, d) = (limits(), defaults());
        let with = |m: &str, t: Option<f64>| {
            let raw = RawParams {
                cache_method: Some(m.into()),
                cache_threshold: t,
                ..raw("x")
            };
            validate_generation(raw, &l, &d).map(|v| v.params.cache_method)
        };
        assert_eq!(
            with("first_block", Some(0.1)).unwrap(),
            Some(StepCacheMethod::FirstBlock)
        );
        assert_eq!(
            with(" teacache ", Some(0.1)).unwrap(),
            Some(StepCacheMethod::Teacache)
        );
        for (m, t) in [("first_block", None), ("fbcache", Some(0.1))] {
            assert_eq!(with(m, t).unwrap_err().field, "cache_method", "{m}");
        }
        let e = refuse_first_block_for_template(Some("first_block")).unwrap_err();
        assert_eq!(e.field, "cache_method");
        assert!(refuse_first_block_for_template(Some("teacache")).is_ok());
        assert!(refuse_first_block_for_template(None).is_ok());
    }

    #[test]
    fn true_cfg_is_off_at_scale_1_and_errors_name_the_field() {
        let (l, d) = (limits(), defaults());
        let cfg = |scale: Option<f64>, negative: Option<&str>| {
            validate_generation(
                RawParams {
                    true_cfg_scale: scale,
                    negative_prompt: negative.map(str::to_string),
                    ..raw("x")
                },
                &l,
                &d,
            )
        };
        assert_eq!(cfg(None, None).unwrap().params.true_cfg, None);
        assert_eq!(cfg(Some(1.0), None).unwrap().params.true_cfg, None);
        let on = cfg(Some(4.0), None).unwrap().params;
        assert_eq!(
            on.true_cfg,
            Some(TrueCfg {
                scale: 4.0,
                negative_prompt: String::new()
            })
        );
        assert_eq!((on.n, on.batch_rows()), (1, 2));
        let neg = cfg(Some(2.5), Some("blurry"))
            .unwrap()
            .params
            .true_cfg
            .unwrap();
        assert_eq!(neg.negative_prompt, "blurry");
        // A gateway whose default is on guides requests that give no scale; 1 turns it off.
        let on_by_default = Defaults {
            true_cfg: 4.0,
            ..d.clone()
        };
        let with = |scale: Option<f64>, negative: Option<&str>| {
            let raw = RawParams {
                true_cfg_scale: scale,
                negative_prompt: negative.map(str::to_string),
                ..raw("x")
            };
            validate_generation(raw, &l, &on_by_default)
                .unwrap()
                .params
                .true_cfg
        };
        assert_eq!(with(None, Some("blurry")).unwrap().scale, 4.0);
        assert_eq!(with(None, None).unwrap().negative_prompt, "");
        assert_eq!(with(Some(1.0), None), None);
        for (scale, negative, field) in [
            (Some(0.5), None, "true_cfg_scale"),
            (Some(31.0), None, "true_cfg_scale"),
            (Some(f64::INFINITY), None, "true_cfg_scale"),
            (None, Some("blurry"), "negative_prompt"),
            (Some(2.0), Some(&*"a".repeat(101)), "negative_prompt"),
        ] {
            let e = cfg(scale, negative).unwrap_err();
            assert_eq!(e.field, field, "{scale:?} {negative:?}: {}", e.message);
        }
    }

    #[test]
    fn errors_name_the_field() {
        let l = limits();
        let d = defaults();
        let field = |r: RawParams| validate_generation(r, &l, &d).unwrap_err().field;
        assert_eq!(field(RawParams::default()), "prompt");
        assert_eq!(field(raw("  ")), "prompt");
        assert_eq!(
            field(RawParams {
                n: Some(5),
                ..raw("x")
            }),
            "n"
        );
        assert_eq!(
            field(RawParams {
                n: Some(0),
                ..raw("x")
            }),
            "n"
        );
        let e = validate_generation(
            RawParams {
                num_inference_steps: Some(101),
                ..raw("x")
            },
            &l,
            &d,
        )
        .unwrap_err();
        assert_eq!(e.field, "num_inference_steps");
        assert!(e.message.contains("1 and 100"), "{}", e.message);
        assert_eq!(
            field(RawParams {
                num_inference_steps: Some(-3),
                ..raw("x")
            }),
            "num_inference_steps"
        );
        assert_eq!(
            field(RawParams {
                guidance_scale: Some(f64::NAN),
                ..raw("x")
            }),
            "guidance_scale"
        );
        assert_eq!(
            field(RawParams {
                size: Some("big".into()),
                ..raw("x")
            }),
            "size"
        );
        assert_eq!(
            field(RawParams {
                size: Some("4096x4096".into()),
                ..raw("x")
            }),
            "size"
        );
        assert_eq!(
            field(RawParams {
                response_format: Some("gif".into()),
                ..raw("x")
            }),
            "response_format"
        );
        // A result URL serves the stored PNG.
        assert_eq!(
            field(RawParams {
                response_format: Some("url".into()),
                output_format: Some("jpeg".into()),
                ..raw("x")
            }),
            "output_format"
        );
        let url = RawParams {
            response_format: Some("url".into()),
            ..raw("x")
        };
        assert_eq!(
            validate_generation(url, &l, &d).unwrap().response_format,
            ResponseFormat::Url
        );
        let png_many = RawParams {
            response_format: Some("png".into()),
            n: Some(2),
            ..raw("x")
        };
        assert_eq!(field(png_many), "response_format");
        assert_eq!(field(raw(&"a".repeat(101))), "prompt");
        let bad_scale = RawParams {
            loras: Some(vec![RawLora {
                id: Some("3f2b8c1e-5d4a-4e6f-9a0b-1c2d3e4f5a6b".into()),
                scale: Some(9.0),
            }]),
            ..raw("x")
        };
        assert_eq!(field(bad_scale), "loras[0].scale");
    }

    #[test]
    fn loras_reach_the_params_of_both_endpoints() {
        let id = "3f2b8c1e-5d4a-4e6f-9a0b-1c2d3e4f5a6b";
        let with = RawParams {
            loras: Some(vec![RawLora {
                id: Some(id.into()),
                scale: Some(0.5),
            }]),
            ..raw("x")
        };
        let want = vec![diffmesh_shared::wire::lora::LoraRef {
            id: id.into(),
            scale: 0.5,
        }];
        let v = validate_generation(with.clone(), &limits(), &defaults()).unwrap();
        assert_eq!(v.params.loras, want);
        let v = validate_edit(with, (8, 8), &limits(), &defaults(), Prompt::Required).unwrap();
        assert_eq!(v.params.loras, want);
        let v = validate_generation(raw("x"), &limits(), &defaults()).unwrap();
        assert!(v.params.loras.is_empty());
    }

    #[test]
    fn previews_fall_on_evenly_spaced_steps_before_the_last() {
        assert_eq!(preview_steps(8, 2, None), vec![2, 5]);
        assert_eq!(preview_steps(8, 3, None), vec![2, 4, 6]);
        assert_eq!(preview_steps(2, 3, None), vec![1]);
        assert!(preview_steps(1, 3, None).is_empty());
        assert_eq!(preview_steps(10, 0, Some(3)), vec![3, 6, 9]);
        assert_eq!(preview_steps(10, 0, Some(10)), Vec::<u32>::new());
        assert_eq!(preview_steps(1000, 0, Some(1)).len(), 64);
    }

    #[test]
    fn streams_take_one_b64_image_and_partial_images_need_one() {
        let stream = |partial: Option<i64>| RawParams {
            stream: Some(true),
            partial_images: partial,
            num_inference_steps: Some(8),
            ..raw("x")
        };
        let v = validate_generation(stream(Some(2)), &limits(), &defaults()).unwrap();
        assert!(v.stream);
        assert_eq!(v.params.preview_steps, vec![2, 5]);
        let field = |r: RawParams| {
            validate_generation(r, &limits(), &defaults())
                .unwrap_err()
                .field
        };
        assert_eq!(field(stream(Some(4))), "partial_images");
        assert_eq!(
            field(RawParams {
                n: Some(2),
                ..stream(None)
            }),
            "n"
        );
        let url = RawParams {
            response_format: Some("url".into()),
            ..stream(None)
        };
        assert_eq!(field(url), "response_format");
        let unstreamed = RawParams {
            partial_images: Some(1),
            ..raw("x")
        };
        assert_eq!(field(unstreamed), "partial_images");
        let every = |k| RawParams {
            preview_every: Some(k),
            num_inference_steps: Some(8),
            ..raw("x")
        };
        let v = validate_generation(every(4), &limits(), &defaults()).unwrap();
        assert_eq!(v.params.preview_steps, vec![4]);
        assert_eq!(field(every(0)), "preview_every");
        assert_eq!(field(every(9)), "preview_every");
        assert_eq!(
            field(RawParams {
                preview_every: Some(2),
                ..stream(None)
            }),
            "preview_every"
        );
    }

    #[test]
    fn edits_keep_input_size_and_check_pixels() {
        let v = validate_edit(
            raw("x"),
            (300, 200),
            &limits(),
            &defaults(),
            Prompt::Required,
        )
        .unwrap();
        assert_eq!((v.params.width, v.params.height), (300, 200));
        let e = validate_edit(
            raw("x"),
            (2048, 2048),
            &limits(),
            &defaults(),
            Prompt::Required,
        )
        .unwrap_err();
        assert_eq!(e.field, "image");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512x256").unwrap(), (512, 256));
        assert!(parse_size("0x5").is_err());
        assert!(parse_size("512").is_err());
    }
}
