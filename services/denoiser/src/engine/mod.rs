//! The engine: an actix sync actor on a thread of its own that owns the model (tch tensors are
//! `Send`, not `Sync`) and runs step-level continuous batching ([`actor`]: its messages, its
//! supervision and the async side's [`EngineHandle`]).
//!
//! Every iteration ([`Engine::iterate`]): drop cancelled jobs, admit waiting jobs up to the
//! batch budget, run one denoising step for every active job (each at its own step index) in
//! one batched forward per LoRA set among them (`step`, `lora_steps`), report progress, and
//! retire finished jobs as RGB images. A panic or error in a batched step is retried job by job,
//! so one bad job fails alone and the engine lives on.
use crate::cached_step::{CachedStepper, CaptureSink};
use crate::lora::LoraSlot;
use crate::metrics::{DenoiserMetrics, EnginePhase, PhaseClock};
use crate::model::{
    apply_control, capture_state, job_resolution, step_requests, tensor_to_rgb, EngineModel,
};
use crate::prompt_stage::{slot_ready, take_slot};
use crate::step_samples::StepSamples;
use crate::templates::TemplateEntry;
use diffmesh_model::controlnets::ControlNets;
use diffmesh_model::lora::LoraPatcher;
use diffmesh_model::pipeline::conditioning_cache::ConditioningCache;
use diffmesh_model::pipeline::stepper::DenoiseState;
use diffmesh_model::ModelError;
use diffmesh_sched::{QueueOrder, QueuedJob};
use diffmesh_shared::panic_message;
use diffmesh_shared::wire::messages::{DenoiseJob, RunningJob};
use std::ops::{Deref, DerefMut};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Span;

mod actor;
mod control;
pub(crate) mod control_costs;
mod elastic;
mod handle;
pub(crate) mod ledger;
pub(crate) mod lora_steps;
mod quality_guard;
mod step;
mod types;
pub use actor::spawn_engine;
#[cfg(feature = "fault-injection")]
pub use handle::PanicMidBatch;
pub use handle::{
    BeginShutdown, Cancel, EngineDrained, EngineHandle, RunInline, SetEventTap, Submit,
};
pub use quality_guard::QUALITY_PROBE_PROMPT;
pub use types::{
    Batching, EngineConfig, EngineEvent, EngineJob, EngineJobError, EngineStatus, EventTap,
    InlineWork, SubmitError,
};

struct Active {
    job: DenoiseJob,
    span: Span,
    states: Vec<DenoiseState>,
    cancelled: bool,
    failed: Option<EngineJobError>,
    /// The template cache its edit states read (mask-aware steps).
    cache: Option<Arc<TemplateEntry>>,
    /// A capture job: its sink, cache key and start.
    capture: Option<(CaptureSink, String, Instant)>,
    /// A capture's quality guard, stepped beside it (`EngineConfig::cache_quality_floor`).
    probe: Option<quality_guard::QualityProbe>,
    /// Its LoRA adapters, once in memory.
    lora: Option<LoraSlot>,
    /// Since when it sits steps out for its adapters (past its bound).
    lora_waiting_since: Option<Instant>,
    /// Per state of a steered job on ControlNet workers: its session there (dropping it
    /// closes the session).
    control_rows: Vec<Option<control::RowControl>>,
    /// Seconds the step loop spent on its ControlNet: in the step now running, and smoothed
    /// over its steps (reported in heartbeats).
    step_control_s: f64,
    control_s: control_costs::Smoothed,
    /// On elastic ranks: its class, clock and the ranks of its steps (None elsewhere).
    elastic: Option<elastic::Placement>,
}

impl Active {
    /// Batch rows it takes in a step: one per image, two with true CFG.
    fn rows(&self) -> usize {
        self.states.iter().map(DenoiseState::rows).sum()
    }
}

pub struct Engine {
    /// Handed to the engine this one is restarted as (see [`actor`]).
    model: Handed<EngineModel>,
    /// The LoRA set the transformer's weights hold (handed on with the model).
    patcher: Handed<LoraPatcher>,
    cached: CachedStepper,
    /// Prompt embeddings, template latents and noise that admitted jobs share.
    conditioning: ConditioningCache,
    /// The ControlNets of steered generations (loaded on first use).
    controlnets: ControlNets,
    /// Per ControlNet, what one steered job costs the step loop a step.
    control_costs: control_costs::ControlCosts,
    config: EngineConfig,
    /// The waiting jobs, the drain flag and where events go.
    ledger: ledger::Ledger,
    status: Arc<Mutex<EngineStatus>>,
    steps: StepSamples,
    metrics: Option<DenoiserMetrics>,
    shared: Arc<actor::Shared>,
    active: Vec<Active>,
    /// A `Step` message is on its way (the engine sends one at a time).
    step_queued: bool,
    /// Stopping after a panic: no more steps; the next engine takes over.
    restarting: bool,
    #[cfg(feature = "fault-injection")]
    panic_mid_batch: bool,
}

/// A part of the engine it hands on when it is restarted: there for the engine's whole life,
/// taken only as it stops.
struct Handed<T>(Option<T>);

impl<T> Handed<T> {
    fn take(&mut self) -> T {
        self.0
            .take()
            .expect("an engine part is taken once, as the engine stops")
    }
}

impl<T> Deref for Handed<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0
            .as_ref()
            .expect("the engine holds its parts until it stops")
    }
}

impl<T> DerefMut for Handed<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0
            .as_mut()
            .expect("the engine holds its parts until it stops")
    }
}

/// How long the loop sleeps when no job could step and no command came.
const IDLE_POLL: Duration = Duration::from_millis(1);

/// The template-cache stepper of an engine (it starts the cache loader thread).
fn new_stepper(config: &EngineConfig, model: &EngineModel) -> std::io::Result<CachedStepper> {
    CachedStepper::new(config.cache, model.gpu_copy.clone())
}

impl Engine {
    /// An engine from what it takes over (`carry`); `stepper`: the first engine's, made by
    /// `spawn_engine` (a restarted one makes its own).
    fn new(
        carry: actor::Carry,
        shared: Arc<actor::Shared>,
        stepper: Option<CachedStepper>,
    ) -> Self {
        let config = shared.config;
        let cached = stepper.unwrap_or_else(|| {
            new_stepper(&config, &carry.model)
                .expect("starting the cache loader thread of a restarted engine")
        });
        let (device, kind) = carry.model.model.transformer.device_kind();
        let controlnets = ControlNets::new(
            carry.model.controlnet_dir.clone(),
            config.controlnet_cache,
            device,
            kind,
        );
        Self {
            model: Handed(Some(carry.model)),
            patcher: Handed(Some(carry.patcher)),
            cached,
            conditioning: ConditioningCache::new(config.conditioning_cache_bytes),
            controlnets,
            control_costs: carry.control_costs,
            config,
            ledger: carry.ledger,
            status: shared.status.clone(),
            steps: shared.steps.clone(),
            metrics: shared.metrics.clone(),
            shared,
            active: Vec::new(),
            step_queued: false,
            restarting: false,
            #[cfg(feature = "fault-injection")]
            panic_mid_batch: false,
        }
    }

    /// One step-loop iteration; whether a batch stepped (false: every job waits on a loader).
    fn iterate(&mut self) -> bool {
        let mut clock = PhaseClock::new();
        self.drop_cancelled();
        clock.lap(self.metrics.as_ref(), EnginePhase::Commands);
        self.admit();
        clock.lap(self.metrics.as_ref(), EnginePhase::Admit);
        #[cfg(feature = "fault-injection")]
        if std::mem::take(&mut self.panic_mid_batch) && !self.active.is_empty() {
            panic!("injected: the engine panics mid-batch");
        }
        let stepped = if self.model.ranks.is_some() {
            self.step_on_ranks()
        } else {
            self.step()
        };
        clock.lap(self.metrics.as_ref(), EnginePhase::Step);
        self.retire();
        clock.lap(self.metrics.as_ref(), EnginePhase::Retire);
        self.publish_status();
        clock.lap(self.metrics.as_ref(), EnginePhase::Status);
        stepped
    }

    fn cancel(&mut self, job_id: String, span: Span) {
        let _e = span.enter();
        if self.ledger.cancel_waiting(&job_id) {
            return;
        }
        if let Some(a) = self.active.iter_mut().find(|a| a.job.job_id == job_id) {
            a.cancelled = true;
        } else {
            tracing::debug!(%job_id, "cancel for an unknown job");
        }
    }

    fn enqueue(&mut self, job: EngineJob, span: Span) -> Result<u32, SubmitError> {
        let active = &self.active;
        self.ledger
            .enqueue(job, span, |id| active.iter().any(|a| a.job.job_id == id))
    }

    fn drop_cancelled(&mut self) {
        let (cancelled, keep): (Vec<Active>, Vec<Active>) =
            self.active.drain(..).partition(|a| a.cancelled);
        self.active = keep;
        for a in cancelled {
            let _e = a.span.enter();
            tracing::info!(job_id = %a.job.job_id, "cancelled at step boundary");
            self.ledger.emit(EngineEvent::Cancelled {
                job_id: a.job.job_id.clone(),
            });
        }
    }

    fn rows(&self) -> usize {
        self.active.iter().map(Active::rows).sum()
    }

    /// Image tokens a job computes per step (see [`EngineConfig::token_budget`]).
    fn job_tokens(job: &DenoiseJob) -> u64 {
        u64::from(job.params.batch_rows()) * u64::from(job.inputs.masked_tokens)
    }

    /// Where each waiting job stands in `config.queue_order`: queue position as its arrival
    /// (jobs are queued as they come), its `deadline_unix_ms`, and image tokens x steps as its
    /// remaining work.
    fn queue_keys(&self) -> Vec<QueuedJob> {
        self.ledger
            .waiting
            .iter()
            .enumerate()
            .map(|(i, (j, _))| QueuedJob {
                arrival_s: i as f64,
                deadline_s: j.job.params.deadline_unix_ms.map(|ms| ms as f64),
                remaining_work: Self::job_tokens(&j.job) as f64
                    * f64::from(j.job.params.num_inference_steps.max(1)),
            })
            .collect()
    }

    /// Queue indices of the jobs that join the batch before the next step, in the queue
    /// order. Admission stops at the first job that does not fit (no overtaking within the
    /// order); a job whose template cache is still being fetched, or whose prompts the prompt
    /// stage has not encoded yet, is passed over (the fetch or the encoding overlaps the
    /// queueing).
    fn pick_admissions(&self) -> Vec<usize> {
        let mut rows = self.rows();
        let mut tokens: u64 = self.active.iter().map(|a| Self::job_tokens(&a.job)).sum();
        let mut picked = Vec::new();
        let order = match self.config.queue_order {
            // Arrival order needs no keys (this runs before every step).
            QueueOrder::Fcfs => (0..self.ledger.waiting.len()).collect(),
            order => order.order(&self.queue_keys()),
        };
        for i in order {
            let next = &self.ledger.waiting[i].0;
            if next
                .template
                .as_ref()
                .is_some_and(|slot| slot.get().is_none())
                || next.prompts.as_ref().is_some_and(|slot| !slot_ready(slot))
            {
                continue;
            }
            let n = next.job.params.batch_rows() as usize;
            let job_tokens = Self::job_tokens(&next.job);
            let over_tokens = self
                .config
                .token_budget
                .is_some_and(|b| tokens + job_tokens > b);
            // A job larger than the whole budget still runs, alone.
            if rows > 0 && (rows + n > self.config.max_batch || over_tokens) {
                break;
            }
            rows += n;
            tokens += job_tokens;
            picked.push(i);
        }
        picked
    }

    fn admit(&mut self) {
        if self.config.batching == Batching::Static && !self.active.is_empty() {
            return;
        }
        let before = self.conditioning.counts();
        let picked = self.pick_admissions();
        if picked.is_empty() {
            return;
        }
        // Take the picked jobs out in their order; the rest stay queued as they were.
        let mut slots: Vec<Option<(EngineJob, Span)>> =
            self.ledger.waiting.drain(..).map(Some).collect();
        let admitted: Vec<(EngineJob, Span)> =
            picked.iter().filter_map(|&i| slots[i].take()).collect();
        self.ledger.waiting.extend(slots.into_iter().flatten());
        for (mut job, span) in admitted {
            if let Some(error) = self
                .model
                .ranks
                .as_ref()
                .and_then(|_| elastic::refusal(&job))
            {
                self.ledger.fail(job.job, error, span);
                continue;
            }
            let offered = match job.prompts.take().map(|slot| take_slot(&slot)) {
                Some(Some(Err(message))) => {
                    let error = EngineJobError::from_model(ModelError::input("prompt", message));
                    self.ledger.fail(job.job, error, span);
                    continue;
                }
                Some(Some(Ok(embeddings))) => self.model.pre_encoded.as_ref().map(|handle| {
                    handle.offer(embeddings);
                    handle.clone()
                }),
                // Admission waits for the slot; an engine without a stand-in encodes itself.
                Some(None) | None => None,
            };
            let prepared = {
                let _e = span.enter();
                let model = &self.model;
                let conditioning = &mut self.conditioning;
                catch_unwind(AssertUnwindSafe(
                    || -> Result<Vec<DenoiseState>, ModelError> {
                        if job.capture_key.is_some() {
                            return Ok(vec![capture_state(&job.job, job.edit.as_ref(), model)?]);
                        }
                        let pipeline = model.pipeline();
                        // The template's content hash names its image at this resolution.
                        let template = job.job.inputs.template_id.as_deref();
                        let mut requests = step_requests(&job.job, job.edit.as_ref(), model)?;
                        apply_control(&mut requests, &job.job, &job.control_rgb, model)?;
                        requests
                            .iter()
                            .map(|r| DenoiseState::new_cached(&pipeline, r, conditioning, template))
                            .collect()
                    },
                ))
            };
            // Before the offered prompt embeddings are withdrawn: the probe's prompt was
            // encoded with the capture's.
            let probe = match (&prepared, &job.capture_key, self.config.cache_quality_floor) {
                (Ok(Ok(_)), Some(_), Some(_)) => self.quality_probe(&job, &span),
                _ => None,
            };
            if let Some(handle) = offered {
                handle.clear();
            }
            match prepared {
                Ok(Ok(states)) => {
                    self.ledger.emit(EngineEvent::Started {
                        job_id: job.job.job_id.clone(),
                    });
                    let settings = self.cached.settings();
                    self.active.push(Active {
                        job: job.job,
                        span,
                        states,
                        cancelled: false,
                        failed: None,
                        cache: job.template.and_then(|slot| slot.get().cloned().flatten()),
                        lora: job.lora,
                        lora_waiting_since: None,
                        control_rows: Vec::new(),
                        step_control_s: 0.0,
                        control_s: control_costs::Smoothed::default(),
                        elastic: None,
                        probe,
                        capture: job.capture_key.map(|key| {
                            (
                                CaptureSink::new(settings.layout, settings.dtype),
                                key,
                                Instant::now(),
                            )
                        }),
                    });
                }
                Ok(Err(e)) => self
                    .ledger
                    .fail(job.job, EngineJobError::from_model(e), span),
                Err(p) => self
                    .ledger
                    .fail(job.job, EngineJobError::Panic(panic_message(p)), span),
            }
        }
        // Once per admission round, and only when a job was prepared (this runs every step).
        let after = self.conditioning.counts();
        if let Some(m) = self.metrics.as_ref().filter(|_| after != before) {
            m.record_conditioning(before, after);
        }
    }

    fn retire(&mut self) {
        let (finished, keep): (Vec<Active>, Vec<Active>) = self
            .active
            .drain(..)
            .partition(|a| a.failed.is_some() || a.states.iter().all(|s| s.is_done()));
        self.active = keep;
        for mut a in finished {
            if let Some(error) = a.failed {
                self.ledger.fail(a.job, error, a.span);
                continue;
            }
            if let Some((sink, key, started)) = a.capture.take() {
                let blocks = self.model.pipeline().transformer.num_blocks();
                let quality = self.judge_capture(a.probe.take(), &a.span);
                let finished = match quality {
                    Some(q) if q.full_compute => sink.finish_full_compute(key, blocks),
                    _ => sink.finish(key, blocks),
                };
                match finished {
                    Ok(entry) => self.ledger.emit(EngineEvent::Captured {
                        job: a.job,
                        entry: Arc::new(entry),
                        seconds: started.elapsed().as_secs_f64(),
                        quality,
                        span: a.span,
                    }),
                    Err(e) => self.ledger.fail(a.job, EngineJobError::Model(e), a.span),
                }
                continue;
            }
            let (height, width) = job_resolution(&a.job, &self.model);
            let pipeline = self.model.pipeline();
            let decoded = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<Vec<u8>>, ModelError> {
                a.states
                    .iter()
                    .map(|s| tensor_to_rgb(&s.decode(&pipeline)?))
                    .collect()
            }));
            self.ledger.finish(a.job, a.span, decoded, (width, height));
        }
    }

    fn publish_status(&self) {
        let running = self
            .active
            .iter()
            .map(|a| {
                let (done, total) = a.states.first().map(|s| s.progress()).unwrap_or((0, 0));
                RunningJob {
                    job_id: a.job.job_id.clone(),
                    masked_tokens: a.job.inputs.masked_tokens,
                    remaining_steps: (total - done) as u32,
                    rows: a.rows() as u32,
                    images: a.states.len() as u32,
                    control_s: a.control_s.value(),
                }
            })
            .collect();
        let waiting = self.ledger.waiting_jobs(|job| {
            job.params
                .controlnet
                .as_ref()
                .map_or(0.0, |c| self.control_costs.of(&c.name))
        });
        if let Some(m) = &self.metrics {
            m.queued.set(self.ledger.waiting.len() as i64);
            m.running.set(self.active.len() as i64);
        }
        let (ranks, free_ranks) = self.model.ranks.as_ref().map_or((0, 0), |r| {
            let size = r.pool.size();
            (size as u32, (size - r.pool.busy()) as u32)
        });
        if let Ok(mut s) = self.status.lock() {
            *s = EngineStatus {
                ranks,
                free_ranks,
                running,
                queued: self.ledger.waiting.len() as u32,
                waiting,
                controlnet_step_s: self.control_costs.list(),
                draining: self.ledger.shutting_down,
            };
        }
    }
}
