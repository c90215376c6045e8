//! One engine step: every running job that can run, one batched forward per LoRA set among them
//! (the weights patched in place between, `lora_steps`), capture passes on their own, a failed
//! batch retried job by job; then metrics, step samples, spans and progress events.
use super::lora_steps::{self, LoraNeed};
use super::{panic_message, Active, Engine, EngineEvent, EngineJobError};
use crate::cached_step::StepReport;
use crate::lora::LoadedLora;
use crate::model::job_resolution_of;
use crate::previews;
use diffmesh_model::flux::ControlResiduals;
use diffmesh_model::pipeline::stepper::DenoiseState;
use diffmesh_shared::wire::messages::{BlockPlan, StepJob, StepSample};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;
use tracing::Span;

impl Engine {
    /// One step for every active job that can run: one batched forward per LoRA set among them,
    /// the weights patched in place between (`lora_steps`); a failed batch is retried job by job
    /// to isolate the bad job. Capture passes step on their own, on the base weights (their
    /// forward records K/V; it cannot be shared). Returns whether any job stepped.
    pub(super) fn step(&mut self) -> bool {
        if self.active.is_empty() {
            return false;
        }
        let started = Instant::now();
        // On a GPU the sample's seconds come from the device (see `step_samples`).
        let gpu_started = self.model.gpu_copy.as_ref().and_then(|g| g.compute_mark());
        let fraction = self.config.lora_async_fraction;
        let needs: Vec<LoraNeed> = self
            .active
            .iter()
            .map(|a| {
                let (done, total) = a.states.first().map(|s| s.progress()).unwrap_or((0, 0));
                lora_steps::need(a.lora.as_ref(), done, total, fraction)
            })
            .collect();
        for (a, n) in self.active.iter_mut().zip(&needs) {
            if let (LoraNeed::Failed(e), None) = (n, &a.failed) {
                a.failed = Some(EngineJobError::Lora(e.clone()));
            }
        }
        let runs: Vec<bool> = self
            .active
            .iter()
            .zip(&needs)
            .map(|(a, n)| n.key().is_some() && a.failed.is_none())
            .collect();
        let rows: usize = self
            .active
            .iter()
            .zip(&runs)
            .filter(|(_, r)| **r)
            .map(|(a, _)| a.rows())
            .sum();
        // One child span per job over this step (run in one batch with the others): the job's
        // trace shows every step's wall time. The step number is recorded once it is known.
        let step_spans: Vec<Option<Span>> = self
            .active
            .iter()
            .zip(&runs)
            .map(|(a, run)| {
                run.then(|| {
                    tracing::info_span!(parent: &a.span, "denoise_step", batch_rows = rows,
                        step = tracing::field::Empty, total = tracing::field::Empty)
                })
            })
            .collect();
        // A step that runs a capture, falls back job by job, or switches weights is no sample
        // of batched steps.
        let capturing = self.active.iter().any(|a| a.capture.is_some());
        let step_jobs = self.step_jobs(&runs);
        for a in &mut self.active {
            a.step_control_s = 0.0;
        }
        let mut switches = 0;
        if capturing {
            switches += self.switch_weights(&[], &[]);
        }
        self.step_captures();
        let groups = lora_steps::visit_order(&needs, self.patcher.current());
        let single_group = groups.len() == 1;
        let mut reports = Vec::new();
        let mut batched_ok = true;
        for (_, set, members) in groups {
            switches += self.switch_weights(&set, &members);
            let (group_reports, ok) = self.step_group(&members);
            reports.extend(group_reports);
            batched_ok &= ok;
        }
        if let Some(m) = &self.metrics {
            let mask_aware: usize = reports.iter().map(|r| r.cached).sum();
            let reused: usize = reports.iter().map(|r| r.reused).sum();
            m.step_rows
                .with_label_values(&["mask_aware"])
                .inc_by(mask_aware as u64);
            m.step_rows
                .with_label_values(&["reused"])
                .inc_by(reused as u64);
            m.step_rows
                .with_label_values(&["full"])
                .inc_by(rows.saturating_sub(mask_aware + reused) as u64);
            let kv_format = self.cached.settings().layout.kv().as_str();
            for r in reports.iter().filter(|r| r.cached > 0) {
                m.load_wait_seconds.observe(r.load_wait_s);
                let cached = r.blocks.saturating_sub(r.prefix);
                m.planned_blocks
                    .with_label_values(&["full"])
                    .inc_by(r.prefix as u64);
                m.planned_blocks
                    .with_label_values(&["hidden"])
                    .inc_by(r.hidden_blocks as u64);
                if kv_format != "hidden" {
                    m.planned_blocks
                        .with_label_values(&[kv_format])
                        .inc_by(cached.saturating_sub(r.hidden_blocks) as u64);
                }
            }
        }
        for (a, n) in self.active.iter_mut().zip(&needs) {
            let lora_metrics = self.metrics.as_ref().map(|m| &m.lora);
            let has_lora = a.lora.is_some();
            lora_steps::observe(
                n,
                has_lora,
                &mut a.lora_waiting_since,
                started,
                lora_metrics,
            );
        }
        let seconds = started.elapsed().as_secs_f64();
        if rows > 0 {
            if let Some(m) = &self.metrics {
                m.step_seconds.observe(seconds);
                m.batch_rows.observe(rows as f64);
            }
        }
        let step_jobs: Vec<StepJob> = step_jobs
            .into_iter()
            .map(|(i, job)| StepJob {
                control_s: self.active.get(i).map_or(0.0, |a| a.step_control_s),
                ..job
            })
            .collect();
        let mask_aware_rows: u32 = step_jobs
            .iter()
            .filter(|j| j.mask_ratio < 1.0)
            .map(|j| j.rows)
            .sum();
        // A step with rows that reused a cached residual ran less than its jobs say: not a
        // sample of what they cost.
        let all_as_planned = reports
            .first()
            .is_some_and(|r| r.cached >= mask_aware_rows as usize)
            && reports.iter().all(|r| r.reused == 0);
        let plain = batched_ok && !capturing && single_group && switches == 0;
        if plain && !step_jobs.is_empty() && all_as_planned {
            let mut sample = StepSample::of_jobs(step_jobs, seconds);
            sample.block_plan = reports.first().filter(|r| r.cached > 0).map(|r| BlockPlan {
                full: r.prefix as u32,
                cached: r.blocks.saturating_sub(r.prefix) as u32,
                hidden: r.hidden_blocks as u32,
                format: self.cached.settings().layout.as_str().into(),
            });
            let gpu_ended = self.model.gpu_copy.as_ref().and_then(|g| g.compute_mark());
            match (gpu_started, gpu_ended) {
                (Some(start), Some(end)) => self.steps.push_gpu_timed(start, end, sample),
                _ => self.steps.push(sample),
            }
        }
        for (a, span) in self.active.iter().zip(step_spans) {
            if let (Some(s), Some(span)) = (a.states.first(), span) {
                let (step, total) = s.progress();
                span.record("step", step).record("total", total);
            }
        }
        for (a, _) in self
            .active
            .iter()
            .zip(&runs)
            .filter(|(a, run)| **run && a.failed.is_none())
        {
            if let Some(s) = a.states.first() {
                let (step, total) = s.progress();
                self.ledger.emit(EngineEvent::Step {
                    job_id: a.job.job_id.clone(),
                    step: step as u32,
                    total: total as u32,
                    ranks: None,
                });
                let (height, width) = job_resolution_of(&a.job, &self.model.card);
                if let Some(event) = previews::preview_event(
                    self.model.preview.as_ref(),
                    &a.job,
                    step as u32,
                    total as u32,
                    (width as u32, height as u32),
                    || s.unpacked_latents(),
                    self.metrics.as_ref(),
                ) {
                    self.ledger.emit(event.into());
                }
            }
        }
        rows > 0 || capturing
    }

    /// Patch the weights to `set` for the jobs at `members` (indices into `active`); a set that
    /// does not fit the model fails those jobs. Returns the switches made (0 or 1).
    fn switch_weights(&mut self, set: &[LoadedLora], members: &[usize]) -> usize {
        if self.patcher.current() == &lora_steps::set_key(set) {
            return 0;
        }
        let result = lora_steps::patch(&mut self.patcher, set, |l| {
            l.blob.adapter().map_err(|e| e.to_string())
        });
        match result {
            Ok(stats) if stats.layers == 0 => 0,
            Ok(stats) => {
                if let Some(m) = &self.metrics {
                    m.lora.lora_patch_seconds.observe(stats.seconds);
                }
                tracing::debug!(set = %self.patcher.current(), layers = stats.layers,
                    seconds = stats.seconds, "weights switched");
                1
            }
            Err(e) => {
                let error = EngineJobError::from_model(e);
                for &i in members {
                    self.active[i].failed.get_or_insert_with(|| error.clone());
                }
                0
            }
        }
    }

    /// One batched step of the jobs at `members` (indices into `active`) that denoise; on
    /// failure, again job by job. Returns the reports and whether the batch succeeded.
    fn step_group(&mut self, members: &[usize]) -> (Vec<StepReport>, bool) {
        let pipeline = self.model.pipeline();
        let (cached, active) = (&mut self.cached, &mut self.active);
        let denoising = |a: &Active| a.capture.is_none() && a.failed.is_none();
        let member = |i: usize| members.contains(&i);
        // Step caching decides first: a steered job whose every image reuses its last
        // computed step this time needs no ControlNet (an error here is met again, and
        // reported, when the batch decides).
        let mut reusing = vec![false; active.len()];
        for (i, a) in active
            .iter_mut()
            .enumerate()
            .filter(|(i, a)| member(*i) && denoising(a))
        {
            let mut states = a.states.iter_mut().filter(|s| !s.is_done()).peekable();
            reusing[i] = states.peek().is_some()
                && states.all(|s| {
                    s.caches_steps()
                        && s.has_control()
                        && s.plan_step(&pipeline, false).unwrap_or(false)
                });
        }
        // Steered jobs' ControlNet residuals first: a job whose ControlNet fails sits out.
        let control_started = Instant::now();
        let control = {
            let mut sources = super::control::ControlSources {
                local: &mut self.controlnets,
                remote: self.model.controlnet_service.as_ref(),
                pipeline: &pipeline,
                metrics: self.metrics.as_ref(),
            };
            super::control::residuals_for_step(&mut sources, active, |i, a| {
                member(i) && denoising(a) && !reusing[i]
            })
        };
        // The step loop's ControlNet time, shared evenly by the jobs it steered.
        let steered: Vec<usize> = (0..active.len())
            .filter(|&i| !control[i].is_empty() && active[i].failed.is_none())
            .collect();
        if !steered.is_empty() {
            let share = control_started.elapsed().as_secs_f64() / steered.len() as f64;
            for &i in &steered {
                let a = &mut active[i];
                a.step_control_s += share;
                a.control_s.observe(share);
                if let Some(c) = &a.job.params.controlnet {
                    self.control_costs.observe(&c.name, share);
                    if let Some(m) = &self.metrics {
                        m.controlnet
                            .step_seconds
                            .with_label_values(&[&c.name])
                            .set(self.control_costs.of(&c.name));
                    }
                }
            }
        }
        let batched = {
            let mut states: Vec<&mut DenoiseState> = Vec::new();
            let mut caches = Vec::new();
            let mut residuals = Vec::new();
            for (i, a) in active
                .iter_mut()
                .enumerate()
                .filter(|(i, a)| member(*i) && denoising(a))
            {
                for (j, s) in a.states.iter_mut().enumerate() {
                    caches.push(a.cache.clone());
                    residuals.push(row_residuals(&control[i], j));
                    states.push(s);
                }
            }
            if states.is_empty() {
                return (Vec::new(), true);
            }
            catch_unwind(AssertUnwindSafe(|| {
                cached.step_controlled(&pipeline, &mut states, &caches, &residuals)
            }))
        };
        let mut reports = Vec::new();
        match batched {
            Ok(Ok(report)) => {
                reports.push(report);
                (reports, true)
            }
            _ => {
                tracing::warn!("batched step failed; stepping jobs one by one");
                for (i, a) in active
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, a)| member(*i) && denoising(a))
                {
                    let _e = a.span.enter();
                    let caches = vec![a.cache.clone(); a.states.len()];
                    let residuals: Vec<Option<ControlResiduals>> = (0..a.states.len())
                        .map(|j| row_residuals(&control[i], j))
                        .collect();
                    let mut states: Vec<&mut DenoiseState> = a.states.iter_mut().collect();
                    match catch_unwind(AssertUnwindSafe(|| {
                        cached.step_controlled(&pipeline, &mut states, &caches, &residuals)
                    })) {
                        Ok(Ok(report)) => reports.push(report),
                        Ok(Err(e)) => a.failed = Some(EngineJobError::from_model(e)),
                        Err(p) => a.failed = Some(EngineJobError::Panic(panic_message(p))),
                    }
                }
                (reports, false)
            }
        }
    }

    /// One capture step for every active capture job.
    pub(super) fn step_captures(&mut self) {
        let pipeline = self.model.pipeline();
        for a in self.active.iter_mut().filter(|a| a.failed.is_none()) {
            let (Some((sink, _, _)), Some(state)) = (a.capture.as_mut(), a.states.first_mut())
            else {
                continue;
            };
            let _e = a.span.enter();
            match catch_unwind(AssertUnwindSafe(|| state.capture_step(&pipeline, sink))) {
                Ok(Ok(())) => sink.end_step(),
                Ok(Err(e)) => a.failed = Some(EngineJobError::from_model(e)),
                Err(p) => a.failed = Some(EngineJobError::Panic(panic_message(p))),
            }
        }
        if self.active.iter().any(|a| a.probe.is_some()) {
            // A panic in a probe is the guard's, not the capture's: it drops the guards.
            if catch_unwind(AssertUnwindSafe(|| self.step_probes())).is_err() {
                tracing::warn!("capture quality guards dropped after a panic");
                self.active.iter_mut().for_each(|a| a.probe = None);
            }
        }
    }

    /// The jobs of the coming step (where `runs`), by index into `active`: each one's mask
    /// ratio if it steps mask-aware (else 1.0), rows, and cache streams (one per image); its
    /// ControlNet time is known once the step ran.
    fn step_jobs(&self, runs: &[bool]) -> Vec<(usize, StepJob)> {
        self.active
            .iter()
            .zip(runs)
            .enumerate()
            .filter(|(_, (a, run))| **run && a.capture.is_none() && a.failed.is_none())
            .map(|(i, (a, _))| {
                let job = StepJob {
                    mask_ratio: match a.cache {
                        Some(_) => a.job.inputs.mask_ratio.clamp(0.0, 1.0),
                        None => 1.0,
                    },
                    rows: a.rows() as u32,
                    cache_streams: a.states.len() as u32,
                    control_s: 0.0,
                };
                (i, job)
            })
            .collect()
    }
}

/// A second handle on row `j`'s residuals (the batch and its job-by-job retry read the same ones).
fn row_residuals(job: &[Option<ControlResiduals>], j: usize) -> Option<ControlResiduals> {
    job.get(j)
        .and_then(Option::as_ref)
        .map(ControlResiduals::shallow_clone)
}
