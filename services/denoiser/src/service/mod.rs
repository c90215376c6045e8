//! NATS side of the denoiser: submits and cancels in ([`intake`]), heartbeats out
//! ([`heartbeats`]), job events out and finished outputs written to the object store and handed
//! to the codec for compositing and PNG encoding ([`results`]). The engine actor does the work.
mod heartbeats;
mod intake;
pub mod recapture;
mod results;

use crate::cached_step::{CacheSettings, TemplateSlot};
use crate::engine::EngineHandle;
use crate::lora::LoraStore;
use crate::metrics::DenoiserMetrics;
use crate::outcomes::RecentOutcomes;
use crate::sickness::Sickness;
use crate::templates::store::CacheClient;
use crate::templates::{CacheFetcher, LocalTier, TemplatePixels};
use crate::DenoiserConfig;
use diffmesh_shared::nats::publish_msgpack;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::wire::messages::{DenoiseJob, JobEvent};
use diffmesh_shared::wire::models::ModelCard;
use diffmesh_shared::wire::subjects;
use diffmesh_shared::wire::templates::{cache_key, CacheKeyParts};
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Largest prepared input the denoiser reads from the object store (bytes).
pub const MAX_INPUT_BYTES: usize = 64 << 20;

pub struct Service {
    pub client: async_nats::Client,
    pub blobs: BlobStore,
    pub engine: EngineHandle,
    pub metrics: DenoiserMetrics,
    pub config: DenoiserConfig,
    pub worker_id: String,
    pub model_id: String,
    /// What heartbeats announce about the model (ControlNets filled in per heartbeat).
    pub card: ModelCard,
    /// Set once shutdown begins: heartbeats say draining, so the router places nothing new here.
    pub draining: AtomicBool,
    submitted_at: Mutex<HashMap<String, Instant>>,
    pub templates: Templates,
    /// LoRA adapters in memory, fetched for the jobs that ask for them.
    pub loras: LoraStore,
    /// Ended jobs' terminal events and capture reports, for gateways whose copy was lost
    /// (`outcomes`).
    pub outcomes: RecentOutcomes,
    /// The ControlNet workers steered steps may run on (`--controlnet-remote`).
    pub controlnet_workers: Option<crate::controlnet_service::ControlNetWorkers>,
    /// Where jobs' prompts are encoded ahead of admission; None: the engine encodes them.
    pub prompt_stage: Option<crate::prompt_stage::PromptStageHandle>,
    /// Whether the engine keeps failing jobs (then it takes no work for a while).
    pub sickness: Sickness,
    pub device_memory: crate::device_memory::MemorySource,
    /// Templates whose cache an edit found in no tier, to capture again (`recapture`).
    pub recaptures: Arc<recapture::Recaptures>,
}

/// What a [`Service`] is built from (`lib::start` builds each).
pub struct ServiceParts {
    pub client: async_nats::Client,
    pub blobs: BlobStore,
    pub engine: EngineHandle,
    pub metrics: DenoiserMetrics,
    pub config: DenoiserConfig,
    pub worker_id: String,
    pub model_id: String,
    pub card: ModelCard,
    pub templates: Templates,
    pub loras: LoraStore,
    pub controlnet_workers: Option<crate::controlnet_service::ControlNetWorkers>,
    pub prompt_stage: Option<crate::prompt_stage::PromptStageHandle>,
    /// Where the device's memory is read for `/metrics`.
    pub device_memory: crate::device_memory::MemorySource,
}

/// Template caches on this denoiser: the local tier, the cachestore client, the cache settings,
/// and the templates' own pixels.
pub struct Templates {
    pub local: LocalTier,
    pub store: CacheClient,
    /// Fills `local` from `store`, one fetch per cache key at a time.
    pub fetcher: CacheFetcher,
    pub settings: CacheSettings,
    /// Registered templates' model-resolution pixels (`inputs.template_image_key` in
    /// `subjects::TEMPLATE_BUCKET`), held for their next edits.
    pub pixels: TemplatePixels,
}

/// Sets a template slot to "unavailable" unless it was filled: a fetch that fails or panics
/// never leaves its edit waiting forever.
struct SlotGuard(TemplateSlot);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let _ = self.0.set(None);
    }
}

impl Service {
    pub fn new(parts: ServiceParts) -> Self {
        let ServiceParts {
            client,
            blobs,
            engine,
            metrics,
            config,
            worker_id,
            model_id,
            card,
            templates,
            loras,
            controlnet_workers,
            prompt_stage,
            device_memory,
        } = parts;
        let sickness = Sickness::new(config.sick_after_failures, config.sick_cooldown);
        Self {
            client,
            blobs,
            engine,
            metrics,
            config,
            worker_id,
            model_id,
            card,
            draining: AtomicBool::new(false),
            submitted_at: Mutex::new(HashMap::new()),
            templates,
            loras,
            outcomes: RecentOutcomes::default(),
            controlnet_workers,
            prompt_stage,
            sickness,
            device_memory,
            recaptures: Arc::default(),
        }
    }

    /// The ControlNets steered generations here may name: this denoiser's own and those its
    /// ControlNet workers serve.
    pub fn controlnets_served(&self) -> Vec<String> {
        let mut names =
            diffmesh_shared::wire::controlnet::served(self.config.controlnet_dir.as_deref());
        if let Some(workers) = &self.controlnet_workers {
            names.extend(workers.served());
            names.sort();
            names.dedup();
        }
        names
    }

    /// The cache key of a template job on this denoiser: its model (and compute dtype), the
    /// prepared template's content hash, resolution, the template's parameters and our cache
    /// format and dtype. `None` for jobs without a template.
    pub fn template_cache_key(&self, job: &DenoiseJob) -> Option<String> {
        let t = job.template.as_ref()?;
        let model = self.cache_model();
        let content = job.inputs.template_id.as_deref().unwrap_or("");
        let settings = &self.templates.settings;
        Some(cache_key(&CacheKeyParts::new(
            &model,
            content,
            job.inputs.model_width,
            job.inputs.model_height,
            t,
            settings.layout.as_str(),
            settings.dtype.as_str(),
        )))
    }

    /// The model part of this denoiser's cache keys: model id and compute dtype.
    pub fn cache_model(&self) -> String {
        format!("{}/{}", self.model_id, self.config.dtype)
    }

    async fn publish_event(&self, job_id: &str, event: &JobEvent) {
        if recapture::is_recapture(job_id) {
            // Internal: no client, record or router waits for its events.
            return;
        }
        self.outcomes.note(job_id, event);
        let subject = match event {
            JobEvent::Preview { .. } => subjects::job_previews(job_id),
            _ => subjects::job_events(job_id),
        };
        if let Err(err) = publish_msgpack(&self.client, subject, Some(job_id), event).await {
            tracing::warn!(%job_id, error = %err, "could not publish job event");
        }
    }

    async fn publish_failed(&self, job_id: &str, message: String, error_type: &str) {
        self.submitted_at.lock().map(|mut m| m.remove(job_id)).ok();
        let event = JobEvent::Failed {
            message,
            error_type: error_type.to_string(),
        };
        self.publish_event(job_id, &event).await;
    }
}
