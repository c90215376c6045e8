//! The engine of a UNet-family model (SD 2.x, SDXL: `diffmesh_model::stable_diffusion`), the
//! Flux engine's counterpart behind the same [`crate::engine::EngineHandle`], messages and
//! events, so the service, router and gateway serve it unchanged.
//!
//! Every iteration: drop cancelled jobs, admit waiting jobs up to `max_batch` rows (a template
//! edit waits for its cache fetch), step every active job's states at their own step indices,
//! one batched UNet forward per group of the same latent size and kind (mask-aware edits batch
//! with edits: a batch mixing them with full rows would pad every row to every token), and
//! retire finished jobs as RGB images or, for captures, as template caches in the tiers' codec.
//! A failed batched step is retried job by job, so one bad job fails alone.
//!
//! LoRAs (diffusers' `unet.` keys or kohya's `lora_unet_`, read by
//! `diffmesh_model::unet::lora`) are patched into the UNet in place, as the Flux engine does:
//! groups also split by LoRA set, the set the weights hold steps first, and a job whose adapters
//! are still loading steps on the base model within its bound (`engine::lora_steps`). A set's
//! text-encoder adapters (kohya's `lora_te*`, diffusers' `text_encoder.`) apply to the prompts
//! of its jobs, encoded again when they first step with it ([`text_loras`]).
//!
//! Generations naming a ControlNet of `--controlnet-dir` are steered ([`control`]): before each
//! batched step the engine runs each steered state's ControlNet on that state's own UNet
//! inputs, and the forward adds the residuals to its rows (zeros in the others').
use crate::engine::control_costs::{ControlCosts, Smoothed};
use crate::engine::ledger::Ledger;
use crate::engine::lora_steps::{self, LoraNeed};
use crate::engine::SubmitError;
use crate::engine::{EngineConfig, EngineEvent, EngineJob, EngineJobError, EngineStatus};
use crate::lora::{LoadedLora, LoraSlot};
use crate::metrics::DenoiserMetrics;
use crate::model::{job_resolution_of, tensor_to_rgb};
use diffmesh_model::controlnets::ControlNets;
use diffmesh_model::lora::LoraPatcher;
use diffmesh_model::lora::LoraSetKey;
use diffmesh_model::pipeline::noise::seeded_noise;
use diffmesh_model::stable_diffusion::stepper::SdState;
use diffmesh_model::stable_diffusion::template::TemplateSteps;
use diffmesh_model::tch::Kind;
use diffmesh_model::unet::lora::{read_unet_lora_bytes, LoraTargets};
use diffmesh_model::unet::ControlNetModel;
use diffmesh_model::ModelError;
use diffmesh_shared::panic_message;
use diffmesh_shared::wire::messages::{DenoiseJob, RunningJob};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Span;

mod actor;
mod control;
pub mod entry_steps;
pub mod jobs;
mod text_loras;

pub use actor::spawn_unet_engine;
use entry_steps::EntrySteps;
pub use jobs::UnetModel;

/// How long the loop sleeps when every job waits on another thread (a template fetch).
const IDLE_POLL: Duration = Duration::from_millis(1);

struct Active {
    job: DenoiseJob,
    span: Span,
    states: Vec<SdState>,
    /// Per state, the seed its ancestral noise derives from.
    seeds: Vec<u64>,
    cancelled: bool,
    failed: Option<EngineJobError>,
    /// A capture job: its cache key and start.
    capture: Option<(String, Instant)>,
    /// Mask-aware (edits batch with edits only).
    masked: bool,
    /// Its LoRAs, once in memory (None: it names none).
    lora: Option<LoraSlot>,
    /// Since when it sits out waiting for its LoRAs (past its bound).
    lora_waiting_since: Option<Instant>,
    /// The LoRA set its prompts were encoded for (the base model's at start).
    conditioned_for: LoraSetKey,
    /// What its ControlNet costs a step (0 when not steered).
    control_s: Smoothed,
    /// Its sessions on ControlNet workers, per (image, ControlNet) pair in request order
    /// (dropped with the job: the workers close them).
    control_links: Vec<Option<std::sync::Arc<crate::controlnet_service::client::SessionLink>>>,
    /// Bumped when its sessions are dropped for new ones (session ids carry it, so a late close
    /// of an old session never closes its successor).
    control_generation: u32,
}

impl Active {
    fn rows(&self) -> usize {
        self.states.iter().map(|s| s.rows() as usize).sum()
    }

    fn done(&self) -> bool {
        self.states.iter().all(SdState::done)
    }
}

pub struct UnetEngine {
    model: UnetModel,
    config: EngineConfig,
    /// The waiting jobs, the drain flag and where events go.
    ledger: Ledger,
    shared: Arc<actor::Shared>,
    active: Vec<Active>,
    /// The templates edits read now, by cache key: edits of one template share its steps (each
    /// decoded once for all of them). Weak, so a template goes with its last edit.
    templates: std::collections::HashMap<String, std::sync::Weak<EntrySteps>>,
    /// Patches the UNet's linear layers with LoRA sets (None: a UNet without a variable store,
    /// which serves no LoRA).
    patcher: Option<LoraPatcher>,
    /// The UNet's linear layers, as LoRA files name them.
    linear_modules: Vec<String>,
    /// The text encoders' side of LoRA sets.
    text_loras: text_loras::TextLoras,
    /// The ControlNets of `--controlnet-dir` loaded now.
    controlnets: ControlNets<ControlNetModel>,
    /// Per ControlNet, what one steered job costs a step.
    control_costs: ControlCosts,
    step_queued: bool,
    #[cfg(feature = "fault-injection")]
    panic_mid_batch: bool,
}

impl UnetEngine {
    fn metrics(&self) -> Option<&DenoiserMetrics> {
        self.shared.metrics.as_ref()
    }

    /// One step-loop iteration; whether any state stepped.
    fn iterate(&mut self) -> bool {
        self.drop_cancelled();
        self.admit();
        #[cfg(feature = "fault-injection")]
        if std::mem::take(&mut self.panic_mid_batch) && !self.active.is_empty() {
            panic!("injected: the engine panics mid-batch");
        }
        let stepped = self.step();
        self.retire();
        self.publish_status();
        stepped
    }

    fn enqueue(&mut self, job: EngineJob, span: Span) -> Result<u32, SubmitError> {
        let active = &self.active;
        self.ledger
            .enqueue(job, span, |id| active.iter().any(|a| a.job.job_id == id))
    }

    fn cancel(&mut self, job_id: String, span: Span) {
        let _e = span.enter();
        if !self.ledger.cancel_waiting(&job_id) {
            if let Some(a) = self.active.iter_mut().find(|a| a.job.job_id == job_id) {
                a.cancelled = true;
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let (cancelled, keep): (Vec<Active>, Vec<Active>) =
            self.active.drain(..).partition(|a| a.cancelled);
        self.active = keep;
        for a in cancelled {
            self.ledger.emit(EngineEvent::Cancelled {
                job_id: a.job.job_id,
            });
        }
    }

    /// Admit waiting jobs in arrival order while their rows fit `max_batch` (a job larger than
    /// the batch runs alone); a job whose template cache is still being fetched is passed over.
    fn admit(&mut self) {
        let mut rows: usize = self.active.iter().map(Active::rows).sum();
        let mut queue = std::mem::take(&mut self.ledger.waiting);
        while let Some(pos) = queue
            .iter()
            .position(|(j, _)| j.template.as_ref().is_none_or(|s| s.get().is_some()))
        {
            let n = queue[pos].0.job.params.batch_rows() as usize;
            if rows > 0 && rows + n > self.config.max_batch {
                break;
            }
            let Some((job, span)) = queue.remove(pos) else {
                break;
            };
            rows += n;
            self.start(job, span);
        }
        self.ledger.waiting = queue;
    }

    fn start(&mut self, job: EngineJob, span: Span) {
        let prepared = {
            let _e = span.enter();
            catch_unwind(AssertUnwindSafe(|| self.prepare(&job)))
        };
        match prepared {
            Ok(Ok((states, masked))) => {
                self.ledger.emit(EngineEvent::Started {
                    job_id: job.job.job_id.clone(),
                });
                let seeds = (0..states.len() as u64)
                    .map(|i| job.job.params.seed.wrapping_add(i))
                    .collect();
                self.active.push(Active {
                    lora: job.lora,
                    lora_waiting_since: None,
                    conditioned_for: LoraSetKey::default(),
                    capture: job.capture_key.map(|key| (key, Instant::now())),
                    job: job.job,
                    span,
                    states,
                    seeds,
                    cancelled: false,
                    failed: None,
                    masked,
                    control_s: Smoothed::default(),
                    control_links: Vec::new(),
                    control_generation: 0,
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

    /// A job's states, and whether they are mask-aware.
    fn prepare(&mut self, job: &EngineJob) -> Result<(Vec<SdState>, bool), ModelError> {
        let named = job.job.params.controlnets().count();
        let kept = self.config.controlnet_cache.max(1);
        if named > kept {
            // Its ControlNets would evict one another every step.
            return Err(ModelError::input(
                "controlnets",
                format!(
                    "{named} ControlNets; this denoiser keeps {kept} loaded (--controlnet-cache)"
                ),
            ));
        }
        if job.capture_key.is_some() {
            let state = jobs::capture_state(&job.job, job.edit.as_ref(), &self.model)?;
            return Ok((vec![state], false));
        }
        let entry = job
            .template
            .as_ref()
            .and_then(|s| s.get().cloned().flatten());
        let template = match (entry, &job.job.template) {
            (Some(entry), Some(t)) => Some(self.template_steps(entry, t)?),
            _ => None,
        };
        let states = jobs::job_states(
            &job.job,
            job.edit.as_ref(),
            template.as_ref(),
            &job.control_rgb,
            &self.model,
        )?;
        Ok((states, template.is_some()))
    }

    /// The steps of the template `entry` holds, shared with the other edits of it in flight.
    fn template_steps(
        &mut self,
        entry: Arc<crate::templates::TemplateEntry>,
        t: &diffmesh_shared::wire::messages::TemplateRef,
    ) -> Result<Arc<dyn TemplateSteps>, ModelError> {
        let key = entry.meta.cache_key.clone();
        if let Some(steps) = self.templates.get(&key).and_then(std::sync::Weak::upgrade) {
            return Ok(steps);
        }
        self.templates.retain(|_, w| w.strong_count() > 0);
        let steps = Arc::new(EntrySteps::new(entry, t, &self.model.pipeline)?);
        self.templates.insert(key, Arc::downgrade(&steps));
        Ok(steps)
    }

    /// One step of every active job that can run, one batched forward per latent size, kind and
    /// LoRA set (the set the weights hold first); whether any stepped.
    fn step(&mut self) -> bool {
        let started = Instant::now();
        let fraction = self.config.lora_async_fraction;
        let needs: Vec<LoraNeed> = self
            .active
            .iter()
            .map(|a| {
                let (done, total) = a
                    .states
                    .first()
                    .map_or((0, 0), |s| (s.next_step(), s.steps()));
                lora_steps::need(a.lora.as_ref(), done, total, fraction)
            })
            .collect();
        let lora_metrics = self.shared.metrics.as_ref().map(|m| &m.lora);
        for (a, n) in self.active.iter_mut().zip(&needs) {
            if let (LoraNeed::Failed(e), None) = (n, &a.failed) {
                a.failed = Some(EngineJobError::Lora(e.clone()));
            }
            if a.failed.is_none() && !a.done() {
                let has_lora = a.lora.is_some();
                lora_steps::observe(
                    n,
                    has_lora,
                    &mut a.lora_waiting_since,
                    started,
                    lora_metrics,
                );
            }
        }
        // Per LoRA set (the one the weights hold first), one batch per latent size and kind.
        let current = self.patcher.as_ref().map(|p| p.current().clone());
        let mut groups: Vec<(bool, Vec<LoadedLora>, Vec<usize>)> = Vec::new();
        for (_, set, members) in lora_steps::visit_order(&needs, &current.unwrap_or_default()) {
            // (latent side, mask-aware) -> members
            type Batch = (([i64; 2], bool), Vec<usize>);
            let mut batches: Vec<Batch> = Vec::new();
            for i in members {
                let a = &self.active[i];
                if a.failed.is_some() || a.done() {
                    continue;
                }
                let key = (a.states[0].latent_side(), a.masked);
                match batches.iter_mut().find(|b| b.0 == key) {
                    Some(b) => b.1.push(i),
                    None => batches.push((key, vec![i])),
                }
            }
            for ((_, masked), batch) in batches {
                groups.push((masked, set.clone(), batch));
            }
        }
        let stepped = !groups.is_empty();
        for (masked, set, members) in groups {
            let key = lora_steps::set_key(&set);
            if !self.switch_weights(&set, &key, &members) {
                continue;
            }
            let in_batch = self
                .active
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| members.contains(i))
                .map(|(_, a)| a);
            let reading = text_loras::Reading {
                set: &set,
                key: &key,
                unet_modules: &self.linear_modules,
            };
            self.text_loras
                .recondition(reading, &self.model.pipeline, in_batch);
            let members: Vec<usize> = members
                .into_iter()
                .filter(|&i| self.active[i].failed.is_none())
                .collect();
            if members.is_empty() {
                continue;
            }
            let started = Instant::now();
            match self.step_jobs(&members) {
                Ok(()) => self.record_step(&members, masked, started),
                Err(error) if members.len() == 1 => self.active[members[0]].failed = Some(error),
                Err(_) => {
                    // Job by job, so the one at fault fails alone.
                    for &i in &members {
                        if let Err(error) = self.step_jobs(&[i]) {
                            self.active[i].failed = Some(error);
                        }
                    }
                }
            }
            for &i in &members {
                let a = &self.active[i];
                if let (None, Some(s)) = (&a.failed, a.states.first()) {
                    let (step, total) = (s.next_step() as u32, s.steps() as u32);
                    self.ledger.emit(EngineEvent::Step {
                        job_id: a.job.job_id.clone(),
                        step,
                        total,
                        ranks: None,
                    });
                    let (height, width) = job_resolution_of(&a.job, &self.model.card);
                    if let Some(event) = crate::previews::preview_event(
                        self.model.preview.as_ref(),
                        &a.job,
                        step,
                        total,
                        (width as u32, height as u32),
                        || Ok(s.latents().shallow_clone()),
                        self.shared.metrics.as_ref(),
                    ) {
                        self.ledger.emit(event.into());
                    }
                }
            }
        }
        stepped
    }

    /// Patch the UNet to `set` (its key `key`) for the jobs at `members` (indices into `active`); false, with
    /// those jobs failed, when the set cannot be had (a file that does not fit this UNet).
    fn switch_weights(&mut self, set: &[LoadedLora], key: &LoraSetKey, members: &[usize]) -> bool {
        let result = match self.patcher.as_mut() {
            Some(patcher) if patcher.current() == key => return true,
            None if key.is_base() => return true,
            None => Err(ModelError::input(
                "params.loras",
                "this UNet was built without a variable store: it serves no LoRA",
            )),
            Some(patcher) => {
                let unet = &self.model.pipeline.unet;
                // The UNet's adapters only: the text encoders' are read when a job needs them
                // (`text_loras`), not at every switch.
                let targets = LoraTargets {
                    config: &unet.config,
                    unet_modules: &self.linear_modules,
                    text_modules: &[],
                };
                lora_steps::patch(patcher, set, |l| {
                    read_unet_lora_bytes(&l.blob.id, l.blob.bytes.clone(), targets)
                        .map(|u| u.adapter)
                        .map_err(|e| e.to_string())
                })
            }
        };
        match result {
            Ok(stats) => {
                if let Some(m) = self.metrics().filter(|_| stats.layers > 0) {
                    m.lora.lora_patch_seconds.observe(stats.seconds);
                }
                true
            }
            Err(e) => {
                let error = EngineJobError::from_model(e);
                for &i in members {
                    self.active[i].failed.get_or_insert_with(|| error.clone());
                }
                false
            }
        }
    }

    /// Metrics of a batched step of jobs `members` that began at `started`.
    fn record_step(&self, members: &[usize], masked: bool, started: Instant) {
        let Some(m) = self.metrics() else {
            return;
        };
        let rows: usize = members.iter().map(|&i| self.active[i].rows()).sum();
        m.step_seconds.observe(started.elapsed().as_secs_f64());
        m.batch_rows.observe(rows as f64);
        let mode = if masked { "mask_aware" } else { "full" };
        m.step_rows.with_label_values(&[mode]).inc_by(rows as u64);
    }

    /// One batched step of the states of jobs `members` (their indices in `active`).
    fn step_jobs(&mut self, members: &[usize]) -> Result<(), EngineJobError> {
        if members.is_empty() {
            return Ok(());
        }
        let ran = catch_unwind(AssertUnwindSafe(|| -> Result<(), EngineJobError> {
            // Steered jobs' residuals first: nothing has stepped if they fail.
            let residuals = self.control_residuals(members)?;
            let mut seeds = Vec::new();
            let mut states: Vec<&mut SdState> = Vec::new();
            for (i, a) in self.active.iter_mut().enumerate() {
                if members.contains(&i) {
                    seeds.extend(a.seeds.iter().copied());
                    states.extend(a.states.iter_mut());
                }
            }
            let pipe = &self.model.pipeline;
            let mut noise = |i: usize, step: usize, shape: &[i64]| {
                let (device, _) = pipe.unet.device_kind();
                // Per image and step, independent of what it is batched with.
                let seed = seeds[i] ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                seeded_noise(seed, shape, device, Kind::Float)
            };
            pipe.step_batch_steered(&mut states, &mut noise, &residuals)
                .map_err(EngineJobError::from_model)
        }));
        match ran {
            Ok(result) => result,
            Err(p) => Err(EngineJobError::Panic(panic_message(p))),
        }
    }

    fn retire(&mut self) {
        let (finished, keep): (Vec<Active>, Vec<Active>) = self
            .active
            .drain(..)
            .partition(|a| a.failed.is_some() || a.done());
        self.active = keep;
        for mut a in finished {
            if let Some(error) = a.failed.take() {
                self.ledger.fail(a.job, error, a.span);
                continue;
            }
            if let Some((key, started)) = a.capture.take() {
                let dtype = self.config.cache.dtype;
                let entry = a
                    .states
                    .pop()
                    .and_then(SdState::into_template)
                    .ok_or_else(|| "the capture left no template".to_string())
                    .and_then(|t| jobs::capture_entry(&t, key, dtype));
                match entry {
                    Ok(entry) => self.ledger.emit(EngineEvent::Captured {
                        job: a.job,
                        entry: Arc::new(entry),
                        seconds: started.elapsed().as_secs_f64(),
                        // The quality guard runs for Flux captures only.
                        quality: None,
                        span: a.span,
                    }),
                    Err(e) => self.ledger.fail(a.job, EngineJobError::Model(e), a.span),
                }
                continue;
            }
            let (height, width) = job_resolution_of(&a.job, &self.model.card);
            let pipe = &self.model.pipeline;
            let decoded = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<Vec<u8>>, ModelError> {
                a.states
                    .iter()
                    .map(|s| {
                        // decode gives [0, 1]; the RGB conversion takes [-1, 1].
                        let image = pipe.decode(s)?.f_mul_scalar(2.0)?.f_sub_scalar(1.0)?;
                        tensor_to_rgb(&image)
                    })
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
                let s = a.states.first();
                RunningJob {
                    job_id: a.job.job_id.clone(),
                    masked_tokens: a.job.inputs.masked_tokens,
                    remaining_steps: s.map_or(0, |s| s.steps() - s.next_step()) as u32,
                    rows: a.rows() as u32,
                    images: a.states.len() as u32,
                    control_s: a.control_s.value(),
                }
            })
            .collect();
        let costs = &self.control_costs;
        let waiting = self
            .ledger
            .waiting_jobs(|j| j.params.controlnets().map(|c| costs.of(&c.name)).sum());
        if let Some(m) = self.metrics() {
            m.queued.set(self.ledger.waiting.len() as i64);
            m.running.set(self.active.len() as i64);
        }
        if let Ok(mut s) = self.shared.status.lock() {
            *s = EngineStatus {
                running,
                queued: self.ledger.waiting.len() as u32,
                waiting,
                controlnet_step_s: self.control_costs.list(),
                draining: self.ledger.shutting_down,
                ..EngineStatus::default()
            };
        }
    }
}
