//! The router's decision state: registry + placement policy (`diffmesh_sched::Policy`, the
//! simulator's trait) + cost models + failover rules, all synchronous so it sits behind one
//! short-held mutex and is unit-tested without NATS.
use crate::cost_check::{CostCheck, CostReport};
use crate::registry::{ExpiryPolicy, LostWorker, WorkerRegistry};
use crate::wait_estimate::WaitEstimate;
use crate::worker_state::{fill_worker_state, request_info};
use diffmesh_sched::batching::BatchLimits;
use diffmesh_sched::policy::{policy_by_name, Policy, RequestInfo, WorkerState};
use diffmesh_sched::{CostModels, SchedError};
use diffmesh_shared::wire::messages::{DenoiseJob, Heartbeat};
use std::time::Instant;

/// Outcome of one placement decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The job is recorded on this worker (undo with [`RouterState::unplace`] if it refuses).
    Chosen(String),
    /// No worker is live at all (or every live one was excluded).
    NoLiveWorker,
    /// Workers are live, but none has a free slot now.
    NoCapacity,
}

/// What to do with one job of a lost worker.
#[derive(Debug, Clone)]
pub enum Failover {
    /// Place this copy (attempt incremented) on another worker.
    Retry(Box<DenoiseJob>),
    /// Give up and publish `JobEvent::Failed` with this message.
    Fail { job_id: String, message: String },
}

pub struct RouterState {
    pub registry: WorkerRegistry,
    policy: Box<dyn Policy>,
    models: CostModels,
    /// The cost model checked against the steps workers report.
    cost_check: CostCheck,
    /// Forecasts use each worker's learned step-time factor (else 1 for all).
    step_calibration: bool,
    max_attempts: u32,
    /// Reused per decision: the policy's view of each candidate and its worker id.
    views: Vec<WorkerState>,
    ids: Vec<String>,
    /// How long a job that finds its model's denoisers full would wait ([`Self::wait_for`]).
    waits: WaitEstimate,
}

impl RouterState {
    pub fn new(
        expiry: ExpiryPolicy,
        policy: Box<dyn Policy>,
        models: CostModels,
        max_attempts: u32,
    ) -> Self {
        Self {
            registry: WorkerRegistry::new(expiry),
            policy,
            models,
            cost_check: CostCheck::default(),
            step_calibration: true,
            max_attempts: max_attempts.max(1),
            views: Vec::new(),
            ids: Vec::new(),
            waits: WaitEstimate::default(),
        }
    }

    /// Whether forecasts use each worker's learned step-time factor (default true).
    pub fn with_step_calibration(mut self, on: bool) -> Self {
        self.step_calibration = on;
        self
    }

    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// Switch the placement policy (a fresh instance, so no state of the old one carries over).
    /// Returns the previous policy's name.
    pub fn set_policy(&mut self, name: &str) -> Result<String, SchedError> {
        let next = policy_by_name(name)?;
        let previous = self.policy.name().to_string();
        self.policy = next;
        Ok(previous)
    }

    pub fn models(&self) -> &CostModels {
        &self.models
    }

    /// Record a heartbeat; true when the worker is new. The report compares the steps it
    /// ran with the cost model's predictions.
    pub fn observe(&mut self, mut heartbeat: Heartbeat, now: Instant) -> (bool, CostReport) {
        let steps = std::mem::take(&mut heartbeat.recent_steps);
        let report = self
            .cost_check
            .observe(&heartbeat.worker_id, &steps, &self.models, now);
        (self.registry.observe(heartbeat, now), report)
    }

    /// Choose a worker for `job` among live workers not in `exclude`, and record the placement
    /// (before the request goes out, so a fast `Done` event cannot race the bookkeeping). The
    /// job goes now if any worker takes it: see [`Self::place_holdable`].
    pub fn place(&mut self, job: &DenoiseJob, exclude: &[String]) -> Decision {
        self.place_holdable(job, exclude, None)
    }

    /// [`Self::place`] for a job the admission queue can keep: `waiting_behind` is `Some(n)`
    /// with the `n` submits queued behind it, and the policy may then hold the job back
    /// (answered `NoCapacity`) although a worker would take it.
    pub fn place_holdable(
        &mut self,
        job: &DenoiseJob,
        exclude: &[String],
        waiting_behind: Option<u32>,
    ) -> Decision {
        let now = Instant::now();
        let mut n = 0;
        // A steered generation goes where its ControlNets are; when no live worker says it has
        // them all (older workers say nothing), any may take it and the one chosen answers.
        let wanted: Vec<&str> = job.params.controlnets().map(|c| c.name.as_str()).collect();
        let serves = |w: &crate::registry::LiveWorker<'_>| {
            !wanted.is_empty()
                && wanted
                    .iter()
                    .all(|name| w.heartbeat.controlnets.iter().any(|c| c == name))
        };
        // Only a worker holding the job's model runs it (an older gateway names none: any).
        let model = job.params.model.as_str();
        let holds =
            |w: &crate::registry::LiveWorker<'_>| model.is_empty() || w.heartbeat.model == model;
        let someone_serves =
            !wanted.is_empty() && self.registry.live().any(|w| holds(&w) && serves(&w));
        for w in self.registry.live() {
            if exclude.iter().any(|e| e == w.worker_id)
                || !holds(&w)
                || (someone_serves && !serves(&w))
            {
                continue;
            }
            if n == self.views.len() {
                self.views.push(WorkerState::idle(BatchLimits::default()));
                self.ids.push(String::new());
            }
            let factor = if self.step_calibration {
                self.cost_check.step_time_factor(w.worker_id)
            } else {
                1.0
            };
            fill_worker_state(w, &self.models, factor, now, &mut self.views[n]);
            self.ids[n].clear();
            self.ids[n].push_str(w.worker_id);
            n += 1;
        }
        if n == 0 {
            return Decision::NoLiveWorker;
        }
        let req = RequestInfo {
            waiting_behind,
            ..request_info(job, &self.models.shape)
        };
        match self.policy.place(&req, &self.views[..n], &self.models) {
            Some(i) if i < n => {
                let worker = self.ids[i].clone();
                self.registry.record_placement(&worker, job.clone());
                self.waits.placed(&job.job_id, model, now);
                Decision::Chosen(worker)
            }
            _ => Decision::NoCapacity,
        }
    }

    /// Undo a placement the worker refused or never answered.
    pub fn unplace(&mut self, job_id: &str) {
        self.registry.finish(job_id);
        self.waits.unplaced(job_id);
    }

    /// A job ended (its `Done` or `Failed` event): forget its placement; answers the worker
    /// it was placed on, if this router placed it.
    pub fn finish(&mut self, job_id: &str, now: Instant) -> Option<String> {
        let model = self.model_of(job_id);
        let busy = model.as_deref().is_some_and(|m| self.all_busy(m));
        self.waits.finished(job_id, model.as_deref(), busy, now);
        self.registry.finish(job_id)
    }

    /// The model of a job: placed here, or listed by a denoiser's heartbeat.
    fn model_of(&self, job_id: &str) -> Option<String> {
        if let Some(model) = self.waits.model_of(job_id) {
            return Some(model.to_string());
        }
        self.registry
            .live()
            .find(|w| {
                w.heartbeat
                    .running
                    .iter()
                    .chain(&w.heartbeat.waiting)
                    .any(|r| r.job_id == job_id)
            })
            .map(|w| w.heartbeat.model.clone())
    }

    /// Whether every live denoiser of `model` is busy: a full batch, or jobs queued.
    fn all_busy(&self, model: &str) -> bool {
        let mut any = false;
        let holds =
            |w: &crate::registry::LiveWorker<'_>| model.is_empty() || w.heartbeat.model == model;
        for w in self.registry.live().filter(holds) {
            any = true;
            let running = w.running().count() as u32;
            if running < w.heartbeat.max_batch && w.heartbeat.queued == 0 {
                return false;
            }
        }
        any
    }

    /// The expected wait of a job of `model` with `ahead` submits of that model queued before
    /// it, while its denoisers are full (`wait_estimate`); None while unknown.
    pub fn wait_for(&self, model: &str, ahead: usize) -> Option<std::time::Duration> {
        let positions: u32 = self
            .registry
            .live()
            .filter(|w| model.is_empty() || w.heartbeat.model == model)
            .map(|w| w.heartbeat.max_batch + w.heartbeat.queue_capacity)
            .sum();
        self.waits.estimate(model, positions, ahead)
    }

    /// The next attempt of a job whose worker was lost, or why it must fail.
    pub fn failover(&self, lost_worker: &str, job: &DenoiseJob) -> Failover {
        let attempt = job.attempt + 1;
        if attempt >= self.max_attempts {
            return Failover::Fail {
                job_id: job.job_id.clone(),
                message: format!(
                    "denoiser {lost_worker} lost; job already placed {attempt} times (max attempts {})",
                    self.max_attempts
                ),
            };
        }
        let mut retry = job.clone();
        retry.attempt = attempt;
        Failover::Retry(Box::new(retry))
    }

    /// Expire silent workers; each lost job comes back with its failover decision.
    pub fn expire(&mut self, now: Instant) -> Vec<(LostWorker, Vec<Failover>)> {
        let lost = self.registry.expire(now);
        lost.into_iter()
            .map(|lost| {
                let plans = lost
                    .jobs
                    .iter()
                    .map(|j| self.failover(&lost.worker_id, j))
                    .collect();
                (lost, plans)
            })
            .collect()
    }
}

/// The message a job gets when its worker is lost and no denoiser was live to take it for
/// the whole failover wait.
pub fn no_worker_message(lost_worker: &str, waited: std::time::Duration) -> String {
    format!(
        "denoiser {lost_worker} lost; no denoiser available within {:.0} s",
        waited.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::tests::{heartbeat, job, policy};
    use diffmesh_shared::wire::messages::{RunningJob, StepJob, StepSample};
    use std::time::Duration;

    fn models() -> CostModels {
        diffmesh_sched::profiles::builtin_models().unwrap()
    }

    fn state_with(policy_name: &str, max_attempts: u32) -> RouterState {
        RouterState::new(
            policy(),
            policy_by_name(policy_name).unwrap(),
            models(),
            max_attempts,
        )
    }

    fn state(max_attempts: u32) -> RouterState {
        state_with("round-robin", max_attempts)
    }

    fn edit(id: &str, ratio: f32, template: &str) -> DenoiseJob {
        crate::worker_state::tests::edit(id, ratio, 20, template)
    }

    fn running(id: &str, masked_tokens: u32, remaining_steps: u32) -> RunningJob {
        RunningJob {
            job_id: id.into(),
            masked_tokens,
            remaining_steps,
            rows: 1,
            images: 1,
            control_s: 0.0,
        }
    }

    #[test]
    fn mask_aware_uses_remaining_work_where_request_count_ties() {
        // Worker a runs a full-image job that just started, b a small one about to finish:
        // one request each, so request-count takes a (lowest id); the new job finishes much
        // sooner on b.
        let t0 = Instant::now();
        for (name, want) in [("request-count", "a"), ("mask-aware", "b")] {
            let mut s = state_with(name, 3);
            let mut a = heartbeat("a", 4, 0);
            a.running = vec![running("big", 256, 20)];
            let mut b = heartbeat("b", 4, 0);
            b.running = vec![running("small", 8, 1)];
            s.observe(a, t0);
            s.observe(b, t0);
            assert_eq!(
                s.place(&edit("new", 0.1, "t"), &[]),
                Decision::Chosen(want.into()),
                "{name}"
            );
        }
    }

    #[test]
    fn deferring_holds_queued_jobs_only_and_never_past_an_idle_worker() {
        // medium-cpu: a batch costs the sum of its rows. Worker a's job has one step left, b's
        // twenty: running the new job alone once a drains beats sharing a step now.
        let t0 = Instant::now();
        let medium = CostModels::fit(&diffmesh_sched::profiles::builtin("medium-cpu").unwrap());
        let mut s = RouterState::new(
            policy(),
            policy_by_name("mask-aware-deferring").unwrap(),
            medium.unwrap(),
            3,
        );
        let mut a = heartbeat("a", 4, 0);
        a.running = vec![running("ending", 100, 1)];
        let mut b = heartbeat("b", 4, 0);
        b.running = vec![running("long", 100, 20)];
        s.observe(a, t0);
        s.observe(b, t0);
        let new = edit("new", 0.1, "t");
        assert_eq!(s.place_holdable(&new, &[], Some(0)), Decision::NoCapacity);
        assert_eq!(s.registry.owner("new"), None);
        // A job that cannot wait (a lost worker's) goes where the marginal cost is least.
        assert_eq!(s.place(&new, &[]), Decision::Chosen("a".into()));
        // An idle worker takes a holdable job at once.
        s.unplace("new");
        s.observe(heartbeat("c", 4, 0), t0);
        assert_eq!(
            s.place_holdable(&new, &[], Some(0)),
            Decision::Chosen("c".into())
        );
    }

    #[test]
    fn mask_aware_prefers_the_worker_holding_the_template() {
        let t0 = Instant::now();
        let mut s = state_with("mask-aware", 3);
        let mut b = heartbeat("b", 4, 0);
        b.cached_templates = vec!["tpl".into()];
        s.observe(heartbeat("a", 4, 0), t0);
        s.observe(b, t0);
        // Both idle: the tie goes to the holder, not to the lower id.
        assert_eq!(
            s.place(&edit("j1", 0.1, "tpl"), &[]),
            Decision::Chosen("b".into())
        );
        // Another template: no holder, the lower id.
        assert_eq!(
            s.place(&edit("j2", 0.1, "other"), &[]),
            Decision::Chosen("a".into())
        );
    }

    #[test]
    fn mask_aware_ranks_workers_by_the_step_times_they_report() {
        // a is idle but its steps take 4x what the profile predicts (another machine, or
        // another dtype); b steps as predicted and runs a job about to finish. Until enough
        // steps are reported the profile is trusted and idle a wins; then b does.
        let t0 = Instant::now();
        let mut s = state_with("mask-aware", 3);
        let reported = |s: &RouterState, factor: f64, n: usize| {
            let jobs = vec![StepJob::row(0.1)];
            let predicted = crate::cost_check::predicted_step_s(s.models(), &jobs);
            vec![StepSample::of_jobs(jobs, factor * predicted); n]
        };
        let mut b = heartbeat("b", 4, 0);
        b.running = vec![running("small", 8, 2)];
        s.observe(heartbeat("a", 4, 0), t0);
        s.observe(b.clone(), t0);
        assert_eq!(
            s.place(&edit("j1", 0.1, "t"), &[]),
            Decision::Chosen("a".into())
        );
        s.unplace("j1");
        let mut a = heartbeat("a", 4, 0);
        a.recent_steps = reported(&s, 4.0, 30);
        b.recent_steps = reported(&s, 1.0, 30);
        s.observe(a, t0);
        s.observe(b, t0);
        assert!((s.cost_check.step_time_factor("a") - 4.0).abs() < 1e-9);
        assert_eq!(
            s.place(&edit("j2", 0.1, "t"), &[]),
            Decision::Chosen("b".into())
        );
        s.unplace("j2");
        // Switched off, the profile is trusted again.
        let mut s = s.with_step_calibration(false);
        assert_eq!(
            s.place(&edit("j3", 0.1, "t"), &[]),
            Decision::Chosen("a".into())
        );
    }

    /// The bound: p99 of one decision under 100 us with 16 workers running batches of
    /// 8 (plus 2 waiting each), every job placed by this router. A timing, so run it in release:
    /// `cargo test -p diffmesh-router --release -- --ignored decision_latency --nocapture`.
    #[test]
    #[ignore]
    fn decision_latency_16_workers_batches_of_8() {
        // round-robin: the views, bookkeeping and no forecasting, what every policy pays.
        for policy in ["round-robin", "mask-aware", "mask-aware-deferring"] {
            decision_latency(policy);
        }
    }

    fn decision_latency(policy: &str) {
        let t0 = Instant::now();
        let mut s = state_with(policy, 3);
        for w in 0..16 {
            let id = format!("w{w:02}");
            let mut hb = heartbeat(&id, 8, 0);
            hb.queue_capacity = 16;
            s.observe(hb.clone(), t0);
            for j in 0..10u32 {
                let job_id = format!("{id}-j{j}");
                let ratio = 0.02 + 0.04 * ((w + j) % 10) as f32;
                s.registry
                    .record_placement(&id, edit(&job_id, ratio, "tpl"));
                if j < 8 {
                    hb.running.push(running(&job_id, 0, 1 + (w * 7 + j) % 20));
                }
            }
            hb.queued = 2;
            hb.cached_templates = vec![format!("tpl-{w}")];
            s.observe(hb, t0);
        }
        let mut times = Vec::new();
        for i in 0..5000 {
            let job = edit(&format!("new-{i}"), 0.1, "tpl-3");
            let t = Instant::now();
            // Holdable, as the admission path asks: a holding policy's whole decision.
            let d = s.place_holdable(&job, &[], Some(0));
            times.push(t.elapsed().as_secs_f64() * 1e6);
            match d {
                Decision::Chosen(_) => s.unplace(&job.job_id),
                Decision::NoCapacity if policy == "mask-aware-deferring" => {}
                other => panic!("{policy}: {other:?}"),
            }
        }
        times.sort_by(f64::total_cmp);
        let (p50, p99) = (times[times.len() / 2], times[times.len() * 99 / 100]);
        println!("router decision ({policy}), 16 workers x (8 running + 2 waiting): p50 {p50:.1} us, p99 {p99:.1} us");
        if !cfg!(debug_assertions) {
            assert!(p99 < 100.0, "{policy}: p99 {p99:.1} us");
        }
    }

    #[test]
    fn policy_switch_takes_effect_and_rejects_unknown_names() {
        let mut s = state_with("mask-aware", 3);
        assert_eq!(s.policy_name(), "mask-aware");
        assert_eq!(s.set_policy("token-count").unwrap(), "mask-aware");
        assert_eq!(s.policy_name(), "token-count");
        let err = s.set_policy("fastest").unwrap_err();
        assert!(err.to_string().contains("fastest"), "{err}");
        assert_eq!(s.policy_name(), "token-count");
    }

    #[test]
    fn place_records_and_unplace_forgets() {
        let mut s = state(3);
        let t0 = Instant::now();
        assert_eq!(s.place(&job("j1"), &[]), Decision::NoLiveWorker);
        s.observe(heartbeat("a", 1, 0), t0);
        assert_eq!(s.place(&job("j1"), &[]), Decision::Chosen("a".into()));
        assert_eq!(s.registry.owner("j1"), Some("a"));
        s.unplace("j1");
        assert_eq!(s.registry.owner("j1"), None);
    }

    #[test]
    fn a_job_goes_only_to_a_worker_holding_its_model() {
        let mut s = state(3);
        let t0 = Instant::now();
        // "tiny-1" is idle; "flux-1" is busier and holds the other model.
        s.observe(heartbeat("tiny-1", 4, 0), t0);
        let mut flux = heartbeat("flux-1", 4, 2);
        flux.model = "flux-dev".into();
        s.observe(flux, t0);
        let on = |id: &str, model: &str| {
            let mut j = job(id);
            j.params.model = model.into();
            j
        };
        for i in 0..3 {
            let j = on(&format!("f{i}"), "flux-dev");
            assert_eq!(s.place(&j, &[]), Decision::Chosen("flux-1".into()));
        }
        assert_eq!(
            s.place(&on("t", "tiny"), &[]),
            Decision::Chosen("tiny-1".into())
        );
        assert_eq!(
            s.place(&on("f9", "flux-dev"), &["flux-1".into()]),
            Decision::NoLiveWorker,
            "the idle worker of another model is no candidate"
        );
        assert_eq!(s.place(&on("x", "sdxl"), &[]), Decision::NoLiveWorker);
        // A job of an older gateway names no model: any worker.
        assert!(matches!(s.place(&job("old"), &[]), Decision::Chosen(_)));
    }

    #[test]
    fn steered_generations_go_where_their_controlnet_is() {
        let mut s = state(3);
        let t0 = Instant::now();
        // "a" is idle, "b" is busier but holds the ControlNet.
        s.observe(heartbeat("a", 4, 0), t0);
        let mut b = heartbeat("b", 4, 2);
        b.controlnets = vec!["silhouette".into()];
        s.observe(b, t0);
        let steered = |id: &str, name: &str| {
            let mut j = job(id);
            j.params.controlnet = Some(diffmesh_shared::wire::controlnet::ControlNetRef {
                name: name.into(),
                scale: 1.0,
            });
            j
        };
        assert_eq!(s.place(&job("plain"), &[]), Decision::Chosen("a".into()));
        for i in 0..3 {
            let j = steered(&format!("s{i}"), "silhouette");
            assert_eq!(s.place(&j, &[]), Decision::Chosen("b".into()));
        }
        // Only "b" serves it: with "b" excluded there is no worker for it.
        let j = steered("s9", "silhouette");
        assert_eq!(s.place(&j, &["b".into()]), Decision::NoLiveWorker);
        // A ControlNet no worker advertises: placed by the policy (the worker answers for it).
        let j = steered("u", "canny");
        assert!(matches!(s.place(&j, &[]), Decision::Chosen(_)));
    }

    #[test]
    fn excluded_and_full_workers() {
        let mut s = state(3);
        let t0 = Instant::now();
        s.observe(heartbeat("a", 1, 0), t0);
        s.observe(heartbeat("b", 1, 0), t0);
        assert_eq!(
            s.place(&job("j1"), &["a".into()]),
            Decision::Chosen("b".into())
        );
        assert_eq!(
            s.place(&job("j2"), &["a".into(), "b".into()]),
            Decision::NoLiveWorker
        );
        // Fill both: max_batch 1 + queue 2 = 3 slots each.
        for i in 0..5 {
            assert!(matches!(
                s.place(&job(&format!("f{i}")), &[]),
                Decision::Chosen(_)
            ));
        }
        assert_eq!(s.place(&job("over"), &[]), Decision::NoCapacity);
    }

    #[test]
    fn lost_worker_jobs_retry_with_next_attempt_then_fail_at_max() {
        let mut s = state(2);
        let t0 = Instant::now();
        s.observe(heartbeat("a", 2, 0), t0);
        s.observe(heartbeat("b", 2, 0), t0);
        let mut second_try = job("j2");
        second_try.attempt = 1;
        assert_eq!(
            s.place(&job("j1"), &["b".into()]),
            Decision::Chosen("a".into())
        );
        assert_eq!(
            s.place(&second_try, &["b".into()]),
            Decision::Chosen("a".into())
        );
        // b keeps beating, a goes silent.
        s.observe(heartbeat("b", 2, 0), t0 + Duration::from_secs(2));
        let lost = s.expire(t0 + Duration::from_millis(2100));
        assert_eq!(lost.len(), 1);
        let (worker, plans) = &lost[0];
        assert_eq!(worker.worker_id, "a");
        match &plans[0] {
            Failover::Retry(j) => {
                assert_eq!(j.job_id, "j1");
                assert_eq!(j.attempt, 1);
            }
            other => panic!("expected retry, got {other:?}"),
        }
        match &plans[1] {
            Failover::Fail { job_id, message } => {
                assert_eq!(job_id, "j2");
                assert!(message.contains("denoiser a lost"), "{message}");
            }
            other => panic!("expected failure, got {other:?}"),
        }
        // The retry goes to the surviving worker.
        let Failover::Retry(retry) = &plans[0] else {
            unreachable!()
        };
        assert_eq!(
            s.place(retry, std::slice::from_ref(&worker.worker_id)),
            Decision::Chosen("b".into())
        );
        assert_eq!(s.registry.owner("j1"), Some("b"));
    }

    #[test]
    fn no_survivor_means_no_live_worker() {
        let mut s = state(3);
        let t0 = Instant::now();
        s.observe(heartbeat("a", 2, 0), t0);
        s.place(&job("j1"), &[]);
        let lost = s.expire(t0 + Duration::from_secs(5));
        let Failover::Retry(retry) = &lost[0].1[0] else {
            panic!("expected retry")
        };
        assert_eq!(s.place(retry, &["a".into()]), Decision::NoLiveWorker);
        assert_eq!(
            no_worker_message("a", Duration::from_secs(60)),
            "denoiser a lost; no denoiser available within 60 s"
        );
    }

    #[test]
    fn a_heartbeats_steps_are_checked_against_the_cost_model() {
        let mut s = state(3);
        let mut hb = heartbeat("a", 2, 0);
        let jobs = vec![StepJob::row(0.2), StepJob::row(1.0)];
        let predicted = crate::cost_check::predicted_step_s(s.models(), &jobs);
        hb.recent_steps = vec![StepSample::of_jobs(jobs, 2.0 * predicted)];
        let (new, report) = s.observe(hb, Instant::now());
        assert!(new);
        assert_eq!(report.ratios.len(), 1);
        assert!((report.ratios[0] - 2.0).abs() < 1e-9, "{:?}", report.ratios);
    }
}
