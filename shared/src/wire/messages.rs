//! Message types exchanged over NATS, encoded with MessagePack (rmp-serde).
//!
//! Large payloads (images, masks, tensors) never ride in a message: they are written to the
//! JetStream object store (`subjects::BLOB_BUCKET`) and messages carry their keys.
use serde::{Deserialize, Serialize};

/// What a job asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobKind {
    /// Text-to-image.
    Generate,
    /// Inpainting/editing of an uploaded image under a mask.
    Edit,
    /// Template registration: the capture pass that records a template's activation cache
    /// (FlashPS). Produces no image; the denoiser stores the cache and reports
    /// [`JobEvent::Captured`] before `Done`.
    Capture,
}

/// The template an edit reads (or a capture job records): what its activation cache depends on,
/// besides the model and the template's pixels (`PreparedInputs::template_id`). Capture and edit
/// must agree on all of it; the denoiser derives the cache key from it and its own model
/// (`shared::wire::templates::cache_key`) and falls back to full compute when no cache matches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateRef {
    /// Public id (`/v1/templates/{id}`).
    pub template_id: String,
    /// Text the template's tokens attended to during capture (may be empty).
    pub prompt: String,
    /// Seed of the template's noise; edits use it for their unmasked tokens.
    pub seed: u64,
    pub steps: u32,
    pub guidance_scale: f32,
    /// Cache key the capturing denoiser reported (empty until captured).
    #[serde(default)]
    pub cache_key: String,
}

/// Validated generation parameters shared by every hop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationParams {
    /// The model to run (`ModelCard::id`): the router places the job only on a denoiser that
    /// holds it. Empty from older senders: any denoiser.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
    pub prompt: String,
    /// Number of images to produce for this request.
    pub n: u32,
    pub num_inference_steps: u32,
    pub guidance_scale: f32,
    pub seed: u64,
    /// Output size for text-to-image (edits keep the input image's size).
    pub width: u32,
    pub height: u32,
    /// Registered LoRA adapters to apply, with their weights (none: the base model).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loras: Vec<crate::wire::lora::LoraRef>,
    /// When the client wants the result by (Unix ms): the gateway's acceptance time plus the
    /// request's `deadline_ms`. Changes no pixel; a denoiser ordering its queue earliest
    /// deadline first (`--queue-order edf`) reads it. None: best effort.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_unix_ms: Option<u64>,
    /// The ControlNet steering a generation (its control image: `control_image_key` of the
    /// request to the codec, then of the prepared inputs). None: no ControlNet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controlnet: Option<crate::wire::controlnet::ControlNetRef>,
    /// ControlNets steering it besides `controlnet`, each with its own control image
    /// (`extra_control_image_keys`, in the same order); their residuals are summed with the
    /// first's (diffusers' `MultiControlNetModel`). UNet models take them. Empty: one or none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_controlnets: Vec<crate::wire::controlnet::ControlNetRef>,
    /// True classifier-free guidance against a negative prompt. None: the prompt alone steers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub true_cfg: Option<TrueCfg>,
    /// Steps (counted from 1) after which the denoiser sends a preview of the first image
    /// ([`JobEvent::Preview`]): OpenAI's `partial_images`, or a job's `preview_every`. Empty:
    /// none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preview_steps: Vec<u32>,
    /// An edit's strength, in (0, 1]: the share of the schedule it runs, starting from its
    /// image noised to that point (diffusers' `strength`); `None` is 1, all of it (the image
    /// only outside the mask). Below 1 only for variations (`POST /v1/images/variations`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strength: Option<f32>,
    /// Step caching (TeaCache): a step whose modulated input changed less than this, summed
    /// since the last computed step, reuses that step's transformer residual instead of
    /// running the blocks. In [0, 1]; None: every step computes. Flux denoisers serve it
    /// (`ModelFeatures::step_cache`); it combines with mask-aware edits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_threshold: Option<f32>,
    /// Which step cache `cache_threshold` runs. Absent (older senders too): TeaCache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_method: Option<StepCacheMethod>,
}

pub use super::step_cache::StepCacheMethod;

/// Most previews one job may ask for (each is a small image on the job's event subject).
pub const MAX_PREVIEWS: usize = 64;

/// True classifier-free guidance (diffusers' `true_cfg_scale` and `negative_prompt`): every step
/// runs each image twice, with the prompt and with the negative prompt, as two rows of the
/// batch, and steps with `uncond + scale * (cond - uncond)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrueCfg {
    /// Above 1.
    pub scale: f32,
    /// What to steer away from; empty is the unconditional input.
    pub negative_prompt: String,
}

impl GenerationParams {
    /// Every ControlNet steering it, `controlnet` first.
    pub fn controlnets(&self) -> impl Iterator<Item = &crate::wire::controlnet::ControlNetRef> {
        self.controlnet.iter().chain(&self.extra_controlnets)
    }

    /// Batch rows the job takes in every step: one per image, two with true CFG.
    pub fn batch_rows(&self) -> u32 {
        let per_image = if self.true_cfg.is_some() { 2 } else { 1 };
        self.n.max(1).saturating_mul(per_image)
    }
}

/// Gateway -> codec (`CODEC_PRE`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PreprocessRequest {
    pub job_id: String,
    pub kind: JobKind,
    /// Object-store keys of the raw uploaded bytes (edits only; no `image_key` when
    /// `template_image` names the image).
    pub image_key: Option<String>,
    pub mask_key: Option<String>,
    pub params: GenerationParams,
    /// The job's image is a registered template's, read from the template bucket.
    #[serde(default)]
    pub template_image: Option<TemplateImage>,
    /// Object-store key of the raw uploaded control image (generations with a ControlNet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_image_key: Option<String>,
    /// Those of `params.extra_controlnets`, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_control_image_keys: Vec<String>,
    /// The request listed its ControlNets (`controlnets`, even one) rather than naming one
    /// (`controlnet`): errors about a control image name `controlnets[i].image` then. Older
    /// gateways: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub controlnets_listed: bool,
    /// The job's model's geometry from its announcement: the model resolution and token grid
    /// the codec prepares at. None from older gateways: the codec's own flags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub geometry: Option<crate::wire::models::ModelGeometry>,
}

/// The image of a job on a registered template (its capture, or an edit by `template_id`): it
/// stays in `subjects::TEMPLATE_BUCKET` (`templates::image_key`), so the job carries no copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateImage {
    pub template_id: String,
    /// What the template's capture prepared, for its edits: they then reuse the template's
    /// model-resolution pixels instead of resizing and hashing the image again. `None` for the
    /// capture itself, and for a template captured before the pixels were kept.
    pub prepared: Option<PreparedTemplate>,
}

/// A template's model-resolution pixels as its capture stored them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreparedTemplate {
    /// Template-bucket key of the pixels (`templates::prepared_image_key`).
    pub key: String,
    /// Their content hash (`PreparedInputs::template_id` of the capture).
    pub content_hash: String,
}

/// Model-resolution inputs the codec prepared, stored in the object store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreparedInputs {
    /// Key of the model-resolution image (RGB u8, `model_height * model_width * 3`), edits only.
    pub image_key: Option<String>,
    /// The same image's key in `subjects::TEMPLATE_BUCKET` instead, for jobs on a registered
    /// template (the template's pixels, kept with it).
    #[serde(default)]
    pub template_image_key: Option<String>,
    /// Key of the latent-token mask (one u8 per image token, 1 = repaint), edits only.
    pub token_mask_key: Option<String>,
    /// Fraction of image tokens that are repainted (1.0 for generations).
    pub mask_ratio: f32,
    /// Image tokens repainted (all of them for generations).
    pub masked_tokens: u32,
    /// The original input size, for the post-processing step.
    pub input_width: u32,
    pub input_height: u32,
    /// Model resolution the codec resized to (pixels); the denoiser checks it matches its model.
    #[serde(default)]
    pub model_width: u32,
    #[serde(default)]
    pub model_height: u32,
    /// Image-token grid at the model resolution (the token mask, when present, is
    /// `token_rows * token_cols` bytes, row-major).
    #[serde(default)]
    pub token_rows: u32,
    #[serde(default)]
    pub token_cols: u32,
    /// Content hash of the model-resolution template image (hex), so template activation caches
    /// (cachestore) are keyed by content, not by upload; edits only.
    #[serde(default)]
    pub template_id: Option<String>,
    /// Key of the model-resolution control image (RGB u8, `model_height * model_width * 3`),
    /// generations with a ControlNet only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_image_key: Option<String>,
    /// Those of `params.extra_controlnets`, in order, as `control_image_key`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_control_image_keys: Vec<String>,
}

/// A field-level validation error, returned to the client as a 4xx.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FieldError {
    pub field: String,
    pub message: String,
    pub error_type: String,
}

/// Codec -> gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PreprocessReply {
    Prepared(PreparedInputs),
    Invalid(FieldError),
    Failed { message: String },
}

/// A prepared job: gateway -> router (`ROUTER_SUBMIT`) and router -> denoiser.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DenoiseJob {
    pub job_id: String,
    pub kind: JobKind,
    pub params: GenerationParams,
    pub inputs: PreparedInputs,
    /// Object-store keys of the raw uploads, for compositing at the input size. An edit of a
    /// registered template has no `raw_image_key`: its image is the template's
    /// (`templates::image_key` of `template`).
    pub raw_image_key: Option<String>,
    pub raw_mask_key: Option<String>,
    /// How many times this job was placed already (retries after a denoiser loss).
    pub attempt: u32,
    /// The registered template: what a `Capture` job records, or what an `Edit` reads.
    #[serde(default)]
    pub template: Option<TemplateRef>,
}

/// Gateway -> denoisers (`subjects::TEMPLATES_EVICT`): a template was deleted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvictTemplate {
    pub template_id: String,
    pub cache_key: String,
}

/// Denoiser -> denoisers (`subjects::template_captured`, kept by the stream
/// `subjects::TEMPLATE_CAPTURES_STREAM`): a capture was stored in the cachestore. A denoiser
/// of the same model and cache settings may load it ahead of its edits, also one that starts
/// later and replays the stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateCaptured {
    /// The denoiser that captured it (it holds the cache already).
    pub worker_id: String,
    pub cache_key: String,
    /// Encoded bytes of the whole cache (what a local tier would hold).
    pub bytes: u64,
    /// `{model_id}/{compute dtype}` of the capturing denoiser; with `format` and `dtype` it
    /// tells a denoiser whether its own edits would ever read this cache.
    pub model: String,
    pub format: String,
    pub dtype: String,
    /// The template's model-resolution pixels (`DenoiseInputs::template_image_key`), which
    /// its edits read too.
    #[serde(default)]
    pub template_image_key: Option<String>,
}

/// Router/denoiser answer to a submit.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum SubmitReply {
    Accepted {
        worker_id: String,
    },
    /// No capacity now; the caller may retry after the given delay.
    Rejected {
        reason: String,
        retry_after_ms: u64,
    },
    /// The router's admission queue is full: the client should back off (HTTP 429).
    Overloaded {
        queue_depth: u32,
        retry_after_ms: u64,
    },
}

/// Denoiser -> codec (`CODEC_POST`): turn the model output into PNGs at the input's size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PostprocessRequest {
    pub job: DenoiseJob,
    /// Object-store keys of the model-resolution outputs (RGB u8), one per image.
    pub output_keys: Vec<String>,
    pub model_width: u32,
    pub model_height: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PostprocessReply {
    /// Object-store keys of the final PNGs, one per image.
    Done {
        png_keys: Vec<String>,
    },
    Failed {
        message: String,
    },
}

/// Gateway -> denoisers (`subjects::DENOISER_OUTCOME`): how did `job_id` end, or what did its
/// capture store? Answered with the asked [`JobEvent`] by the denoiser that sent it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutcomeQuery {
    pub job_id: String,
    /// Absent in queries of older gateways: they ask for the terminal event.
    #[serde(default)]
    pub wanted: WantedEvent,
}

/// Which of a job's events an [`OutcomeQuery`] asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WantedEvent {
    /// `Done` or `Failed`.
    #[default]
    Terminal,
    /// A capture job's `Captured` report.
    Captured,
}

impl WantedEvent {
    /// The kind of `event` a query may ask for; `None` for progress events.
    pub fn of(event: &JobEvent) -> Option<Self> {
        match event {
            JobEvent::Done { .. } | JobEvent::Failed { .. } => Some(Self::Terminal),
            JobEvent::Captured { .. } => Some(Self::Captured),
            _ => None,
        }
    }
}

/// Progress and terminal events, published on `subjects::job_events(job_id)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum JobEvent {
    Queued {
        worker_id: String,
        position: u32,
    },
    Started {
        worker_id: String,
    },
    Step {
        step: u32,
        total: u32,
        /// Ranks the step ran on, on a denoiser with elastic ranks (its policy may change
        /// them from step to step). None from others and older senders.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ranks: Option<u32>,
    },
    Done {
        png_keys: Vec<String>,
    },
    Failed {
        message: String,
        error_type: String,
    },
    /// A capture job stored its template's cache (sent before `Done`).
    Captured {
        cache_key: String,
        steps: u32,
        blocks: u32,
        bytes: u64,
        /// The quality guard's verdict, where it ran; absent from older senders.
        #[serde(default)]
        quality: Option<super::templates::CacheQuality>,
    },
    /// The job lost its worker (or the worker failed it) and was placed again.
    Retrying {
        attempt: u32,
        reason: String,
    },
    /// A cheap preview of the first image after `step` of `total` (the latents projected to
    /// RGB, not decoded: see `diffmesh_model::preview`), `width` x `height` RGB8.
    Preview {
        step: u32,
        total: u32,
        width: u32,
        height: u32,
        #[serde(with = "serde_bytes")]
        rgb: Vec<u8>,
    },
}

/// Machine-readable `error_type` values used in [`FieldError`], [`JobEvent::Failed`] and the
/// gateway's HTTP errors, so every hop spells them the same way.
pub mod error_types {
    /// The request is malformed or a field is out of range (HTTP 400).
    pub const INVALID_REQUEST: &str = "invalid_request_error";
    /// The request body or an upload is larger than allowed (HTTP 413).
    pub const TOO_LARGE: &str = "request_too_large";
    /// No denoiser can take the job now (HTTP 503).
    pub const UNAVAILABLE: &str = "service_unavailable";
    /// The job did not finish within its deadline (HTTP 504).
    pub const TIMEOUT: &str = "timeout";
    /// Too many requests: the admission queue or a per-key limit is full (HTTP 429).
    pub const RATE_LIMITED: &str = "rate_limited";
    /// The job was cancelled (by its owner, or because its synchronous client went away).
    pub const CANCELLED: &str = "cancelled";
    /// A worker was lost and the job could not be placed again.
    pub const WORKER_LOST: &str = "worker_lost";
    /// Anything else that went wrong inside the mesh (HTTP 500).
    pub const INTERNAL: &str = "internal_error";
}

/// Denoiser -> router heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub worker_id: String,
    /// Jobs running in the current batch plus queued ones.
    pub running: Vec<RunningJob>,
    pub queued: u32,
    /// The queued jobs in queue order, sized as the running ones (`remaining_steps`: all of
    /// them), so a router can cost jobs other routers placed. Empty from older senders, whose
    /// queued jobs are only counted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting: Vec<RunningJob>,
    pub max_batch: u32,
    /// Model id the worker serves, so the router only places compatible jobs.
    pub model: String,
    /// What the worker announces about that model (geometry, features). None from older
    /// senders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub card: Option<crate::wire::models::ModelCard>,
    pub draining: bool,
    /// Jobs the worker accepts beyond its running batch (its bounded wait queue), so the router
    /// knows when a worker is full. 0 from older senders.
    #[serde(default)]
    pub queue_capacity: u32,
    /// Template cache keys resident in the worker's local tier (the router prefers such a worker).
    #[serde(default)]
    pub cached_templates: Vec<String>,
    /// LoRA ids in the worker's memory (the router prefers such a worker among equals).
    #[serde(default)]
    pub cached_loras: Vec<String>,
    /// Named ControlNets the worker serves (`--controlnet-dir`), so the router sends a steered
    /// generation where its ControlNet is. Empty from older senders.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub controlnets: Vec<String>,
    /// The latest engine steps since the previous heartbeat (at most a few dozen), so the
    /// router can check its cost model against this worker's hardware. Empty from older senders.
    #[serde(default)]
    pub recent_steps: Vec<StepSample>,
    /// Per ControlNet it steered with: the seconds its step loop spends on one steered request
    /// per step (smoothed), so a router costs a steered job here. Empty from older senders.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub controlnet_step_s: Vec<ControlNetStepCost>,
    /// How often this worker sends heartbeats (ms): a router expires it after missing a few
    /// of them, so the period is set once, on the denoiser. 0 from older senders
    /// ([`Heartbeat::interval`] then assumes [`DEFAULT_HEARTBEAT_INTERVAL`]).
    #[serde(default)]
    pub interval_ms: u32,
    /// Elastic ranks of the worker (`--ranks`; 0 from workers without them and older senders:
    /// one device), and how many run no step now: its capacity in devices and what is free.
    #[serde(default)]
    pub ranks: u32,
    #[serde(default)]
    pub free_ranks: u32,
}

/// The heartbeat period of senders that do not say theirs.
pub const DEFAULT_HEARTBEAT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

impl Heartbeat {
    /// The announcement of the model this worker holds (None from older senders, and for a
    /// card that names another model than `model`).
    pub fn model_card(&self) -> Option<&crate::wire::models::ModelCard> {
        self.card.as_ref().filter(|c| c.id == self.model)
    }

    /// How often this worker sends heartbeats.
    pub fn interval(&self) -> std::time::Duration {
        match self.interval_ms {
            0 => DEFAULT_HEARTBEAT_INTERVAL,
            ms => std::time::Duration::from_millis(u64::from(ms)),
        }
    }
}

/// A denoiser's measured per-step cost of one ControlNet ([`Heartbeat::controlnet_step_s`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlNetStepCost {
    pub name: String,
    pub seconds: f64,
}

/// One batched engine step a denoiser ran: the fraction of image tokens each batch row computed
/// (its mask ratio when it ran mask-aware, 1.0 for full compute) and the step's wall time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepSample {
    pub row_ratios: Vec<f32>,
    /// The same rows by job, with the cache streams each job read: a guided image's two rows
    /// read its cached activations once. Empty from older senders (each row is then costed as
    /// a job of its own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<StepJob>,
    pub seconds: f64,
    /// The planner's choice for the step's mask-aware rows: how many leading blocks it
    /// computed over every token, and how many read the template cache (and in which
    /// format). None: no mask-aware rows (or an older sender).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_plan: Option<BlockPlan>,
}

/// Blocks of a mask-aware step by how they ran (see [`StepSample::block_plan`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockPlan {
    /// Leading blocks computed over every token.
    pub full: u32,
    /// Blocks whose unmasked tokens came from the cache.
    pub cached: u32,
    /// Of the `cached` blocks, those read as the hidden stream (the Y cache); the others
    /// read K/V. Absent from older senders.
    #[serde(default)]
    pub hidden: u32,
    /// The cache's layout (`raw`, `prepared`, `hidden`: the Y cache; `prepared+hidden`:
    /// both, each block read as the three-way planner chose).
    pub format: String,
}

impl StepSample {
    /// A step that ran `jobs` in `seconds` (`row_ratios` filled for older readers).
    pub fn of_jobs(jobs: Vec<StepJob>, seconds: f64) -> Self {
        let row_ratios = jobs
            .iter()
            .flat_map(|j| std::iter::repeat_n(j.mask_ratio, j.rows as usize))
            .collect();
        Self {
            row_ratios,
            jobs,
            seconds,
            block_plan: None,
        }
    }

    /// The step's jobs; an older sender's rows one job each.
    pub fn step_jobs(&self) -> std::borrow::Cow<'_, [StepJob]> {
        if self.jobs.is_empty() {
            self.row_ratios.iter().map(|&r| StepJob::row(r)).collect()
        } else {
            std::borrow::Cow::Borrowed(&self.jobs)
        }
    }
}

/// One job's part of a [`StepSample`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepJob {
    /// Fraction of image tokens each of its rows computed (1.0: full compute).
    pub mask_ratio: f32,
    /// Its batch rows (images, twice over when guided).
    pub rows: u32,
    /// Cached-activation streams it read (one per image; full compute reads none, and a
    /// stream of a full row costs nothing).
    pub cache_streams: u32,
    /// Seconds the step spent on its ControlNet outside the batched forward.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub control_s: f64,
}

impl StepJob {
    /// One row reading one stream.
    pub fn row(mask_ratio: f32) -> Self {
        Self {
            mask_ratio,
            rows: 1,
            cache_streams: 1,
            control_s: 0.0,
        }
    }
}

/// Gateway -> router (`ROUTER_CANCEL`) and router -> denoiser (`denoiser_cancel`): drop a job at
/// the next step boundary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelJob {
    pub job_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunningJob {
    pub job_id: String,
    /// Masked image tokens of each of its rows.
    pub masked_tokens: u32,
    pub remaining_steps: u32,
    /// Batch rows it takes in every step ([`GenerationParams::batch_rows`]); 1 from a
    /// denoiser that predates the field.
    #[serde(default = "one")]
    pub rows: u32,
    /// Images it makes (each reads its own template-cache stream); 1 when not reported.
    #[serde(default = "one")]
    pub images: u32,
    /// Seconds a step of the worker's loop spends on it outside the batched forward (its
    /// ControlNet's forward, or the wait for a ControlNet worker), smoothed over its steps; for
    /// a queued job, the worker's figure for its ControlNet. 0 when not steered or not reported.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub control_s: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn one() -> u32 {
    1
}

impl FieldError {
    /// An `invalid_request_error` naming `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
            error_type: error_types::INVALID_REQUEST.to_string(),
        }
    }
}

/// Encode a message as MessagePack (named fields, so versions can add fields).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, rmp_serde::encode::Error> {
    rmp_serde::to_vec_named(msg)
}

/// Decode a MessagePack message.
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, rmp_serde::decode::Error> {
    rmp_serde::from_slice(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> GenerationParams {
        GenerationParams {
            model: String::new(),
            prompt: "a red square".into(),
            n: 2,
            num_inference_steps: 8,
            guidance_scale: 3.5,
            seed: 42,
            width: 64,
            height: 48,
            loras: Vec::new(),
            preview_steps: Vec::new(),
            strength: None,
            cache_threshold: None,
            cache_method: None,
            deadline_unix_ms: None,
            controlnet: None,
            extra_controlnets: Vec::new(),
            true_cfg: None,
        }
    }

    fn prepared() -> PreparedInputs {
        PreparedInputs {
            image_key: Some("job/prepared-image".into()),
            template_image_key: None,
            token_mask_key: Some("job/token-mask".into()),
            mask_ratio: 0.25,
            masked_tokens: 64,
            input_width: 640,
            input_height: 480,
            model_width: 64,
            model_height: 64,
            token_rows: 16,
            token_cols: 16,
            template_id: Some("abc".into()),
            control_image_key: None,
            extra_control_image_keys: Vec::new(),
        }
    }

    #[test]
    fn denoise_job_round_trips() {
        let job = DenoiseJob {
            job_id: "j1".into(),
            kind: JobKind::Edit,
            params: params(),
            inputs: prepared(),
            raw_image_key: Some("j1/image".into()),
            raw_mask_key: None,
            attempt: 1,
            template: None,
        };
        let back: DenoiseJob = decode(&encode(&job).unwrap()).unwrap();
        assert_eq!(back.job_id, job.job_id);
        assert_eq!(back.kind, job.kind);
        assert_eq!(back.params, job.params);
        assert_eq!(back.inputs, job.inputs);
        assert_eq!(back.raw_image_key, job.raw_image_key);
        assert_eq!(back.raw_mask_key, None);
        assert_eq!(back.attempt, 1);
    }

    #[test]
    fn enums_round_trip() {
        let events = vec![
            JobEvent::Queued {
                worker_id: "w".into(),
                position: 3,
            },
            JobEvent::Step {
                step: 2,
                total: 8,
                ranks: None,
            },
            JobEvent::Step {
                step: 3,
                total: 8,
                ranks: Some(4),
            },
            JobEvent::Done {
                png_keys: vec!["a".into(), "b".into()],
            },
            JobEvent::Failed {
                message: "boom".into(),
                error_type: error_types::INTERNAL.into(),
            },
            JobEvent::Preview {
                step: 2,
                total: 8,
                width: 2,
                height: 1,
                rgb: vec![1, 2, 3, 4, 5, 6],
            },
            JobEvent::Retrying {
                attempt: 2,
                reason: "worker lost".into(),
            },
        ];
        for e in events {
            let back: JobEvent = decode(&encode(&e).unwrap()).unwrap();
            assert_eq!(back, e);
        }
        let reply = PreprocessReply::Invalid(FieldError::invalid("mask", "size differs"));
        match decode::<PreprocessReply>(&encode(&reply).unwrap()).unwrap() {
            PreprocessReply::Invalid(f) => {
                assert_eq!(f, FieldError::invalid("mask", "size differs"))
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Messages from an older sender (without the fields added later) still decode.
    #[test]
    fn added_fields_default_when_missing() {
        #[derive(Serialize)]
        struct OldPrepared {
            image_key: Option<String>,
            token_mask_key: Option<String>,
            mask_ratio: f32,
            masked_tokens: u32,
            input_width: u32,
            input_height: u32,
        }
        let old = OldPrepared {
            image_key: None,
            token_mask_key: None,
            mask_ratio: 1.0,
            masked_tokens: 0,
            input_width: 8,
            input_height: 8,
        };
        let back: PreparedInputs = decode(&encode(&old).unwrap()).unwrap();
        assert_eq!(back.model_width, 0);
        assert_eq!(back.template_id, None);
        assert_eq!(back.template_image_key, None);
        assert_eq!(back.input_width, 8);
    }

    #[test]
    fn garbage_is_a_decode_error() {
        assert!(decode::<DenoiseJob>(b"\xc1not msgpack").is_err());
    }
}
