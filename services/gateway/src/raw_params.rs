//! The image requests' fields as the client sent them ([`RawParams`]): the documented JSON body
//! of generations (and the text fields of edits and variations), before `validate` checks them.
use crate::loras::params::RawLora;
use crate::output_format::RawOutput;

/// Parameters as the client sent them (JSON body or multipart text fields), before checks.
/// Integers are signed so a negative value is reported as out of range, not as a type error.
/// Also the documented JSON body of `POST /v1/images/generations` (limits are gateway flags).
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize, utoipa::ToSchema)]
pub struct RawParams {
    /// The model to run (`GET /v1/models` lists them): default `--default-model`, else the
    /// mesh's only model. An edit by `template_id` runs on the template's model.
    // Left out of the fingerprint's JSON when absent, so requests without it hash as before.
    #[schema(example = "tiny")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// What to draw (required, non-empty; at most `--max-prompt-chars` characters).
    #[schema(
        value_type = String,
        required = true,
        min_length = 1,
        example = "a red circle on the left on a blue background"
    )]
    pub prompt: Option<String>,
    /// Images to make, 1 to `--max-n` (default 1).
    #[schema(minimum = 1)]
    pub n: Option<i64>,
    /// `WxH` output size of a generation, or `auto` (the model's default, as when absent);
    /// at most `--max-pixels`.
    #[schema(example = "64x64")]
    pub size: Option<String>,
    /// `b64_json` (default), `url` (a signed result URL per image, expiring after
    /// `--result-url-ttl`; png only) or `png` (the raw image in `output_format`; n must be 1).
    #[schema(example = "b64_json")]
    pub response_format: Option<String>,
    /// `png` (default), `jpeg` or `webp` (lossless). Async jobs (`Prefer: respond-async`)
    /// keep PNG results: png only.
    #[schema(example = "png")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_format: Option<String>,
    /// JPEG quality in percent, 0 to 100 (default 100); `jpeg` only (`webp` is lossless
    /// here: only 100).
    #[schema(minimum = 0, maximum = 100)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_compression: Option<i64>,
    /// `auto` or `opaque`; `transparent` is refused (the models draw no alpha channel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub background: Option<String>,
    /// Sets the default of `num_inference_steps` (when that is absent): `low` half the
    /// default steps, `auto`, `standard` or `medium` the default, `high` or `hd` twice it, within
    /// the step limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<String>,
    /// The end user, for the caller's own abuse tracking: at most 256 characters, accepted and
    /// not stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Denoising steps, 1 to `--max-steps` (default `--default-steps`).
    #[schema(minimum = 1)]
    pub num_inference_steps: Option<i64>,
    /// 0 to `--max-guidance` (default `--default-guidance`).
    #[schema(minimum = 0.0)]
    pub guidance_scale: Option<f64>,
    /// True classifier-free guidance, 1 (off) to `--max-guidance` (default
    /// `--default-true-cfg-scale`). Above 1 every
    /// step runs with the prompt and with `negative_prompt` and steers away from the latter;
    /// it costs a second batch row per image. The shipped tiny model was trained for it (4 is a
    /// good value); guidance-distilled models use `guidance_scale` instead.
    #[schema(minimum = 1.0, example = 4.0)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub true_cfg_scale: Option<f64>,
    /// What true CFG steers away from (default: the empty prompt, the unconditional input);
    /// only with `true_cfg_scale` above 1; at most `--max-prompt-chars` characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    /// Makes the result reproducible (random when left out).
    #[schema(minimum = 0)]
    pub seed: Option<u64>,
    /// Step caching (TeaCache), 0 to 1: a step whose modulated input changed less than this
    /// since the last computed step reuses that step's transformer residual instead of
    /// running the blocks: faster, at some quality (`docs/BENCHMARKS.md` has the curve on the
    /// tiny model). 0 computes every step. Absent: off. Flux models; combines with
    /// mask-aware edits.
    #[schema(minimum = 0.0, maximum = 1.0, example = 0.1)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_threshold: Option<f64>,
    /// Which step cache `cache_threshold` runs: `teacache` (the default: probes each step's
    /// modulated input, a reused step runs no block) or `first_block` (runs each step's first
    /// block and compares its residual, a reused step runs that block only; not for edits of a
    /// registered template). Only with `cache_threshold`.
    #[schema(example = "teacache")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_method: Option<String>,
    /// Registered LoRAs to apply (`POST /v1/loras`): at most 4, each id once; none = the base
    /// model. Not for edits of a registered template.
    // Left out of the fingerprint's JSON when absent, so requests without it hash as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loras: Option<Vec<RawLora>>,
    /// Service-level objective: milliseconds after acceptance the result is wanted by, 1 to
    /// 86400000 (a day). Changes no pixel; denoisers run with `--queue-order edf` serve the
    /// earliest deadline first. Absent: best effort.
    #[schema(minimum = 1, maximum = 86_400_000, example = 5000)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<i64>,
    /// A ControlNet steering the generation (generations only): the control image is drawn
    /// over, at its place and size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controlnet: Option<crate::controlnet::RawControlNet>,
    /// Several ControlNets steering the generation together, instead of `controlnet` (models
    /// whose card says `multi_controlnet`; at most 4): their residuals are summed, each with its
    /// own image and scale (diffusers' `MultiControlNetModel`).
    #[schema(min_items = 1, max_items = 4)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controlnets: Option<Vec<crate::controlnet::RawControlNet>>,
    /// Answer with Server-Sent Events in OpenAI's shapes (`image_generation.partial_image`
    /// per preview, then `image_generation.completed`; `image_edit.` for edits) instead of
    /// one JSON body: n 1, response_format b64_json, not with `Prefer: respond-async` or an
    /// `Idempotency-Key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// With `stream`: previews sent before the image, 0 to 3 (default 0), at evenly spaced
    /// steps. A preview is the current latents projected to RGB (cheap, blurry), not decoded.
    #[schema(minimum = 0, maximum = 3)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_images: Option<i64>,
    /// A preview every this many steps on the job's event stream (`GET
    /// /v1/jobs/{id}/events`, `preview` events): 1 to the step count. Absent: none.
    #[schema(minimum = 1)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview_every: Option<i64>,
    /// Where the job's ending is posted, signed (Standard Webhooks), retried with backoff:
    /// only with `Prefer: respond-async`, on a gateway with `--webhook-signing-key`; https
    /// (http with `--webhook-allow-http`), a public address (not a private, loopback or
    /// link-local one), at most 2048 characters.
    #[schema(example = "https://example.com/hooks/diffmesh")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback_url: Option<String>,
}

impl RawParams {
    /// The output fields, for [`output_format::validate`].
    pub fn output(&self) -> RawOutput<'_> {
        RawOutput {
            output_format: self.output_format.as_deref(),
            output_compression: self.output_compression,
            background: self.background.as_deref(),
            quality: self.quality.as_deref(),
            user: self.user.as_deref(),
        }
    }

    /// Whether a generation names its size (`auto` does not).
    pub fn size_given(&self) -> bool {
        self.size.as_deref().is_some_and(|s| s != "auto")
    }
}
