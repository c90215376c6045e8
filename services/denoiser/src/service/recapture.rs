//! Templates captured again when their cache is gone: the cachestore keeps its cluster tier
//! within a budget by deleting the least recently used caches (`cachestore::cluster_lru`), so
//! an edit may find its template's cache in no tier at all. That edit runs in full compute (as
//! before), and this denoiser also runs the template's capture pass once more, in the
//! background, from the edit's own description of the template (prompt, seed, steps, guidance,
//! its prepared pixels): the cache is stored and announced as at registration, and the next
//! edits are mask-aware again. Without this, a template evicted once stayed on full compute
//! for good.
//!
//! A re-capture is an internal job (id prefix [`JOB_PREFIX`]): no job events, no record, never
//! handed to the router. It takes an engine slot like any job and is skipped when the engine
//! is full (a later edit asks again). One key is re-captured at most once per
//! [`RETRY_AFTER`] on this denoiser. A template deleted while its re-capture runs leaves a
//! cache no edit reads; the cluster tier's LRU removes it in time.
use super::Service;
use crate::engine::EngineJob;
use crate::model::job_prompts;
use crate::prompt_stage::PromptSlot;
use diffmesh_shared::wire::messages::{DenoiseJob, GenerationParams, JobKind};
use diffmesh_shared::MeshError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Job ids of re-captures start so.
pub const JOB_PREFIX: &str = "recapture-";

/// Least time between two re-captures of one cache key here.
pub const RETRY_AFTER: Duration = Duration::from_secs(600);

/// Edits waiting to have their template re-captured (more are dropped: a later edit asks
/// again), and keys remembered for [`RETRY_AFTER`].
const QUEUE: usize = 16;
const REMEMBERED: usize = 1024;

pub use crate::labels::RecaptureOutcome as Outcome;

/// Whether `job_id` is a re-capture's (whose events nobody waits for).
pub fn is_recapture(job_id: &str) -> bool {
    job_id.starts_with(JOB_PREFIX)
}

/// The capture job of the template an edit names, as the gateway's registration made it (its
/// id is the edit's, prefixed: unique as the edit's is).
pub fn capture_of(edit: &DenoiseJob) -> Option<DenoiseJob> {
    let t = edit.template.as_ref()?;
    edit.inputs.template_image_key.as_ref()?;
    let mut inputs = edit.inputs.clone();
    inputs.image_key = None;
    inputs.token_mask_key = None;
    inputs.mask_ratio = 1.0;
    inputs.masked_tokens = inputs.token_rows * inputs.token_cols;
    Some(DenoiseJob {
        job_id: format!("{JOB_PREFIX}{}", edit.job_id),
        kind: JobKind::Capture,
        params: GenerationParams {
            model: edit.params.model.clone(),
            prompt: t.prompt.clone(),
            n: 1,
            num_inference_steps: t.steps,
            guidance_scale: t.guidance_scale,
            seed: t.seed,
            width: inputs.model_width,
            height: inputs.model_height,
            loras: Vec::new(),
            preview_steps: Vec::new(),
            strength: None,
            cache_threshold: None,
            cache_method: None,
            deadline_unix_ms: None,
            controlnet: None,
            extra_controlnets: Vec::new(),
            true_cfg: None,
        },
        inputs,
        raw_image_key: None,
        raw_mask_key: None,
        attempt: 0,
        template: Some(t.clone()),
    })
}

/// The queue edits put their template on, and the keys re-captured lately.
pub struct Recaptures {
    tx: mpsc::Sender<DenoiseJob>,
    rx: Mutex<Option<mpsc::Receiver<DenoiseJob>>>,
    recent: Mutex<HashMap<String, Instant>>,
}

impl Default for Recaptures {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Self {
            tx,
            rx: Mutex::new(Some(rx)),
            recent: Mutex::default(),
        }
    }
}

impl Recaptures {
    /// Ask for the template of `edit` (whose cache was in no tier) to be captured again.
    /// Returns false when the queue was full.
    pub fn request(&self, edit: &DenoiseJob) -> bool {
        self.tx.try_send(edit.clone()).is_ok()
    }

    /// True when `key` may be re-captured now (and remembers that it is).
    fn claim(&self, key: &str, now: Instant) -> bool {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        recent.retain(|_, at| now.duration_since(*at) < RETRY_AFTER);
        if recent.contains_key(key) || recent.len() >= REMEMBERED {
            return false;
        }
        recent.insert(key.to_string(), now);
        true
    }

    /// Let `key` be re-captured again at once (its attempt never reached the engine).
    fn release(&self, key: &str) {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        recent.remove(key);
    }
}

impl Service {
    /// Run re-captures as edits ask for them, until `shutdown`.
    pub async fn recaptures(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), MeshError> {
        let taken = self.recaptures.rx.lock().ok().and_then(|mut rx| rx.take());
        let Some(mut rx) = taken else { return Ok(()) };
        loop {
            let edit = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                edit = rx.recv() => match edit { Some(e) => e, None => return Ok(()) },
            };
            let outcome = self.recapture(&edit).await;
            self.metrics
                .recaptures
                .with_label_values(&[outcome.as_str()])
                .inc();
        }
    }

    async fn recapture(&self, edit: &DenoiseJob) -> Outcome {
        let (Some(job), Some(key)) = (capture_of(edit), self.template_cache_key(edit)) else {
            return Outcome::Failed;
        };
        if self.templates.local.contains(&key) || !self.recaptures.claim(&key, Instant::now()) {
            return Outcome::Recent;
        }
        let span = tracing::info_span!("recapture", job_id = %job.job_id, cache_key = %key);
        let edit_inputs = match self.fetch_edit_inputs(&job).await {
            Ok(inputs) => inputs,
            Err(message) => {
                tracing::warn!(%key, %message, "cannot capture the template again");
                return Outcome::Failed;
            }
        };
        let prompts = self
            .prompt_stage
            .as_ref()
            .map(|stage| (stage, job_prompts(&job), PromptSlot::default()));
        let engine_job = EngineJob {
            job,
            edit: edit_inputs,
            template: None,
            capture_key: Some(key.clone()),
            lora: None,
            control_rgb: Vec::new(),
            prompts: prompts.as_ref().map(|(_, _, slot)| slot.clone()),
        };
        match self.engine.submit(engine_job, span).await {
            Ok(_) => {
                if let Some((stage, texts, slot)) = prompts {
                    stage.encode(texts, slot);
                }
                tracing::info!(%key, "template cache gone from every tier; capturing it again");
                Outcome::Started
            }
            Err(err) => {
                tracing::info!(%key, error = %err, "engine full; the template's next edit asks again");
                self.recaptures.release(&key);
                Outcome::Busy
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_shared::testing::generation_job;
    use diffmesh_shared::wire::messages::TemplateRef;

    fn edit() -> DenoiseJob {
        let mut job = generation_job("e1", "a red hat", 3, 8);
        job.kind = JobKind::Edit;
        job.inputs.template_image_key = Some("tpl/pixels".into());
        job.inputs.token_mask_key = Some("e1/mask".into());
        (job.inputs.token_rows, job.inputs.token_cols) = (4, 4);
        job.inputs.mask_ratio = 0.25;
        job.params.guidance_scale = 7.0;
        job.template = Some(TemplateRef {
            template_id: "t1".into(),
            prompt: "a blue background".into(),
            seed: 7,
            steps: 4,
            guidance_scale: 1.0,
            cache_key: "tpl-k".into(),
        });
        job
    }

    #[test]
    fn the_capture_job_is_the_templates_own() {
        let job = capture_of(&edit()).unwrap();
        assert_eq!(job.job_id, "recapture-e1");
        assert!(is_recapture(&job.job_id));
        assert_eq!(job.kind, JobKind::Capture);
        let p = &job.params;
        assert_eq!(
            (
                p.prompt.as_str(),
                p.seed,
                p.num_inference_steps,
                p.guidance_scale,
                p.n
            ),
            ("a blue background", 7, 4, 1.0, 1)
        );
        assert_eq!(job.inputs.token_mask_key, None);
        assert_eq!((job.inputs.mask_ratio, job.inputs.masked_tokens), (1.0, 16));
        assert_eq!(job.inputs.template_image_key.as_deref(), Some("tpl/pixels"));
        assert_eq!(job.template, edit().template);
        // An edit of an upload (no registered template) has nothing to capture.
        let mut upload = edit();
        upload.template = None;
        assert!(capture_of(&upload).is_none());
    }

    #[test]
    fn one_key_is_claimed_once_until_released_or_old() {
        let r = Recaptures::default();
        let now = Instant::now();
        assert!(r.claim("k", now));
        assert!(!r.claim("k", now + Duration::from_secs(1)));
        assert!(r.claim("other", now));
        r.release("k");
        assert!(r.claim("k", now + Duration::from_secs(2)));
        assert!(r.claim("k", now + RETRY_AFTER + Duration::from_secs(3)));
    }
}
