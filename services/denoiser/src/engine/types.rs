//! What the engine's handle and the engine exchange: jobs in, events out, per-job errors, and
//! the engine's configuration and load snapshot (its messages are in `actor`).
use crate::cached_step::{CacheSettings, TemplateSlot};
use crate::lora::{LoraFailure, LoraSlot};
use crate::model::EditInputs;
use crate::prompt_stage::PromptSlot;
use crate::templates::TemplateEntry;
use diffmesh_model::ModelError;
use diffmesh_shared::wire::messages::{error_types, ControlNetStepCost, DenoiseJob, RunningJob};
use std::sync::Arc;
use tracing::Span;

/// A job with the inputs the NATS side fetched for it.
#[derive(Debug)]
pub struct EngineJob {
    pub job: DenoiseJob,
    pub edit: Option<EditInputs>,
    /// An edit of a registered template: its cache, once fetched (admission waits for it).
    pub template: Option<TemplateSlot>,
    /// A capture job: the key its cache is stored under.
    pub capture_key: Option<String>,
    /// A job with LoRAs: its adapters, filled once they are in memory (it steps on the base
    /// model meanwhile, up to `EngineConfig::lora_async_fraction` of its steps).
    pub lora: Option<LoraSlot>,
    /// A steered generation's control images at the model resolution (RGB u8), one per
    /// ControlNet in `params.controlnets()` order.
    pub control_rgb: Vec<Vec<u8>>,
    /// Its prompts' embeddings, once the prompt stage has encoded them (admission waits for
    /// them). None: the engine's own text encoder encodes them (no prompt stage).
    pub prompts: Option<PromptSlot>,
}

impl EngineJob {
    /// A generation or an edit without a template cache.
    pub fn new(job: DenoiseJob, edit: Option<EditInputs>) -> Self {
        Self {
            job,
            edit,
            template: None,
            capture_key: None,
            lora: None,
            control_rgb: Vec::new(),
            prompts: None,
        }
    }
}

/// Why the engine did not take a job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("queue full ({0} jobs waiting)")]
    QueueFull(usize),
    #[error("denoiser is shutting down")]
    ShuttingDown,
    #[error("job {0} is already on this denoiser")]
    Duplicate(String),
    #[error("inline work panicked: {0}")]
    InlinePanic(String),
    /// The engine panicked while taking it and is restarting; the job was not queued.
    #[error("the engine is restarting after a panic")]
    Restarting,
}

/// Work run on the engine thread between two steps; a job it returns is queued like a submit.
pub type InlineWork = Box<dyn FnOnce() -> Option<EngineJob> + Send>;

/// Called on the engine thread with every event just before it is sent (so post-processing in
/// it runs in the step loop, right as a job retires: the bench's inline strawman).
pub type EventTap = Box<dyn Fn(&EngineEvent) + Send>;

/// What the engine reports; the NATS side turns these into job events and post-processing.
#[derive(Debug)]
pub enum EngineEvent {
    Started {
        job_id: String,
    },
    Step {
        job_id: String,
        step: u32,
        total: u32,
        /// Ranks the step ran on (elastic ranks only).
        ranks: Option<u32>,
    },
    /// A capture job recorded its template's cache.
    Captured {
        job: DenoiseJob,
        entry: Arc<TemplateEntry>,
        seconds: f64,
        /// The quality guard's verdict, where it ran (`--cache-quality-floor`).
        quality: Option<diffmesh_shared::wire::templates::CacheQuality>,
        span: Span,
    },
    /// Model-resolution RGB outputs, one per image.
    Finished {
        job: DenoiseJob,
        images: Vec<Vec<u8>>,
        width: u32,
        height: u32,
        span: Span,
    },
    Failed {
        job: DenoiseJob,
        error: EngineJobError,
        span: Span,
    },
    Cancelled {
        job_id: String,
    },
    /// A preview of the job's first image after `step` (`crate::previews`), RGB8.
    Preview {
        job_id: String,
        step: u32,
        total: u32,
        width: u32,
        height: u32,
        rgb: Vec<u8>,
    },
}

impl From<crate::previews::Preview> for EngineEvent {
    fn from(p: crate::previews::Preview) -> Self {
        EngineEvent::Preview {
            job_id: p.job_id,
            step: p.step,
            total: p.total,
            width: p.width,
            height: p.height,
            rgb: p.rgb,
        }
    }
}

/// Why one job failed inside the engine.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineJobError {
    /// The job's inputs were unusable (names the field).
    #[error("{0}")]
    Input(String),
    #[error("model error: {0}")]
    Model(String),
    #[error("the model panicked: {0}")]
    Panic(String),
    /// It was running when the engine itself panicked and restarted (its state is lost).
    #[error("the engine restarted after a panic while this job ran: {0}")]
    Restarted(String),
    /// Its LoRA adapters could not be loaded (deleted, or the store unreachable).
    #[error("loras: {0}")]
    Lora(LoraFailure),
    /// Its ControlNet does not fit the model, or failed.
    #[error("{0}")]
    ControlNet(String),
    /// Its ControlNet is served neither here nor by a ControlNet worker that answered: another
    /// placement may have it (the job fails as unavailable, worth a retry).
    #[error("{0}")]
    ControlNetAway(String),
}

impl EngineJobError {
    pub(crate) fn from_model(e: ModelError) -> Self {
        match e {
            ModelError::Input { .. } => EngineJobError::Input(e.to_string()),
            other => EngineJobError::Model(other.to_string()),
        }
    }

    pub fn reason(&self) -> &'static str {
        match self {
            EngineJobError::Input(_) => "invalid_input",
            EngineJobError::Model(_) => "model_error",
            EngineJobError::Panic(_) => "panic",
            EngineJobError::Restarted(_) => "engine_restarted",
            EngineJobError::Lora(_) => "lora_unavailable",
            EngineJobError::ControlNet(_) | EngineJobError::ControlNetAway(_) => {
                "controlnet_unavailable"
            }
        }
    }

    /// The error type its job fails with (`error_types`; the gateway's HTTP status follows it):
    /// the client's input, a LoRA's own classification, an absent ControlNet's unavailability,
    /// else internal.
    pub fn error_type(&self) -> &'static str {
        match self {
            EngineJobError::Input(_) => error_types::INVALID_REQUEST,
            EngineJobError::Lora(f) => f.error_type,
            EngineJobError::ControlNetAway(_) => error_types::UNAVAILABLE,
            _ => error_types::INTERNAL,
        }
    }
}

/// When waiting jobs may join the running batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Batching {
    /// Step-level continuous batching: jobs join at every step boundary, finished ones leave.
    #[default]
    Continuous,
    /// Static batching (the baseline): a batch forms only when no job is active and runs until
    /// its last job finishes.
    Static,
}

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Batch rows denoised together in one step (a job of n images takes n rows, 2n with true
    /// CFG).
    pub max_batch: usize,
    /// Jobs waiting beyond the running batch.
    pub max_queue: usize,
    pub batching: Batching,
    /// Most image tokens computed per step over the running batch, each row counting its job's
    /// `inputs.masked_tokens` (every image token for generations); `None`: no limit. A job over
    /// the budget still runs, alone.
    pub token_budget: Option<u64>,
    /// The order waiting jobs are admitted in (FCFS, SRTF, EDF; `diffmesh_sched::queue_order`).
    pub queue_order: diffmesh_sched::QueueOrder,
    /// Template caches: stored format and dtype, loader lookahead, prefix planning.
    pub cache: CacheSettings,
    /// Byte budget of the prompt embeddings, template latents and template noise that admitted
    /// jobs reuse (`diffmesh_model::pipeline::conditioning_cache`); 0 prepares every job afresh.
    pub conditioning_cache_bytes: u64,
    /// Bounded asynchronous LoRA loading: the share of a job's steps it may run on the base
    /// model while its adapters load (floored; Katz's K = 10 of 50 steps is 0.2); 0 waits for
    /// the adapters before the first step.
    pub lora_async_fraction: f64,
    /// Where the LoRA patcher keeps the base copies of the layers it patches.
    pub lora_originals: diffmesh_model::lora::OriginalsOn,
    /// ControlNets kept loaded (least recently used evicted).
    pub controlnet_cache: usize,
    /// The captures' quality guard: a template whose typical edit, read from its cache, would
    /// have a box SSIM against full compute below this gets a cache of no steps (its edits
    /// compute in full); `None`: no guard, every capture is kept.
    pub cache_quality_floor: Option<f64>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch: 8,
            max_queue: 16,
            batching: Batching::Continuous,
            token_budget: None,
            queue_order: Default::default(),
            cache: CacheSettings::default(),
            conditioning_cache_bytes: 256 << 20,
            lora_async_fraction: 0.2,
            lora_originals: Default::default(),
            controlnet_cache: 4,
            cache_quality_floor: None,
        }
    }
}

/// Load snapshot for heartbeats.
#[derive(Debug, Clone, Default)]
pub struct EngineStatus {
    pub running: Vec<RunningJob>,
    pub queued: u32,
    /// The queued jobs in queue order, sized as they will run.
    pub waiting: Vec<RunningJob>,
    /// Per ControlNet, what one steered job costs the step loop a step (smoothed).
    pub controlnet_step_s: Vec<ControlNetStepCost>,
    pub draining: bool,
    /// Elastic ranks of the node, and how many have no step task now (0, 0 without ranks).
    pub ranks: u32,
    pub free_ranks: u32,
}
