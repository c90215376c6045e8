//! The engine as an actix sync actor on a thread of its own (`SyncArbiter`: it owns the tch
//! tensors, which are `Send`, not `Sync`), and the async side's handle on it.
//!
//! Messages: [`Submit`], [`Cancel`], [`RunInline`], [`SetEventTap`], [`BeginShutdown`], and
//! [`Step`], which the engine sends itself while it has jobs: one step-loop iteration per
//! `Step`, so commands that arrive during a step are handled, in order, before the next one.
//!
//! Supervision: a handler that panics (the engine's own per-job panics are caught deeper down,
//! so this is a bug in the loop itself) fails the jobs that were running, with
//! [`EngineJobError::Restarted`] (the service places them again through the router), and stops
//! the actor; actix starts a new engine from the
//! factory, which takes over the model (its weights restored to the base model), the queued
//! jobs, untouched, and the event tap. `diffmesh_denoiser_engine_restarts_total` counts it.
use super::{Engine, EngineConfig, EngineEvent, EngineJob, EngineJobError, EngineStatus};
use super::{EventTap, InlineWork, SubmitError};
use crate::metrics::DenoiserMetrics;
use crate::model::EngineModel;
use crate::step_samples::StepSamples;
use actix::{Actor, ActorContext, Addr, Handler, Message, SyncContext};
use diffmesh_model::lora::LoraPatcher;
use diffmesh_shared::panic_message;
use diffmesh_shared::wire::messages::{DenoiseJob, StepSample};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};
use tracing::Span;

/// Queue a job; answers its queue position.
pub struct Submit {
    pub job: Box<EngineJob>,
    pub span: Span,
}

impl Message for Submit {
    type Result = Result<u32, SubmitError>;
}

/// Drop a job at the next step boundary (or from the queue).
pub struct Cancel {
    pub job_id: String,
    pub span: Span,
}

impl Message for Cancel {
    type Result = ();
}

/// Run work on the engine thread at the next step boundary, pausing the step loop (the engine
/// bench's inline pre-processing strawman; the service never sends it). A job it returns is
/// queued like a submit.
pub struct RunInline {
    pub work: InlineWork,
    pub span: Span,
}

impl Message for RunInline {
    type Result = Result<Option<u32>, SubmitError>;
}

/// Install (or remove) the event tap.
pub struct SetEventTap(pub Option<EventTap>);

impl Message for SetEventTap {
    type Result = ();
}

/// Stop taking jobs and answer the queued ones (to hand back); the running ones finish.
pub struct BeginShutdown {
    pub span: Span,
}

impl Message for BeginShutdown {
    type Result = Vec<DenoiseJob>;
}

/// One step-loop iteration (the engine sends it to itself while it has jobs).
pub(super) struct Step;

impl Message for Step {
    type Result = ();
}

/// Make the next step panic in the middle of the batch (tests of the supervision).
#[cfg(feature = "fault-injection")]
pub struct PanicMidBatch;

#[cfg(feature = "fault-injection")]
impl Message for PanicMidBatch {
    type Result = ();
}

/// What one engine hands the next one it is restarted as (and what the first one starts from).
pub(super) struct Carry {
    pub model: EngineModel,
    pub patcher: LoraPatcher,
    pub waiting: VecDeque<(EngineJob, Span)>,
    pub tap: Option<EventTap>,
    pub shutting_down: bool,
    pub control_costs: super::control::ControlCosts,
}

/// What every engine of one handle shares.
pub(super) struct Shared {
    pub config: EngineConfig,
    /// Dropped once the engine has drained, so the receiver sees the end of the events.
    pub events: Mutex<Option<mpsc::Sender<EngineEvent>>>,
    pub status: Arc<Mutex<EngineStatus>>,
    pub steps: StepSamples,
    pub metrics: Option<DenoiserMetrics>,
    /// Submits sent and not yet handled (bounds the command channel, see `submit`).
    pub pending_submits: Arc<AtomicUsize>,
    /// Set once the engine has drained after `BeginShutdown`.
    pub drained: watch::Sender<bool>,
    /// The next engine's start: filled before the first start and by a failing engine.
    pub successor: Mutex<Option<Carry>>,
}

impl Actor for Engine {
    type Context = SyncContext<Self>;

    fn started(&mut self, ctx: &mut SyncContext<Self>) {
        tracing::info!(model = %self.model.model_id, max_batch = self.config.max_batch,
            queued = self.waiting.len(), "engine started");
        // After a restart: the queued jobs it took over run without waiting for a new submit.
        if !self.waiting.is_empty() {
            self.schedule_step(ctx);
        }
    }
}

impl Engine {
    /// Run `f`; a panic fails the running jobs and restarts the engine (see the module doc),
    /// and the message is answered with `fallback`.
    fn supervised<T>(
        &mut self,
        ctx: &mut SyncContext<Self>,
        fallback: impl FnOnce() -> T,
        f: impl FnOnce(&mut Self, &mut SyncContext<Self>) -> T,
    ) -> T {
        match catch_unwind(AssertUnwindSafe(|| f(self, ctx))) {
            Ok(answer) => answer,
            Err(p) => {
                self.restart_after(panic_message(p), ctx);
                fallback()
            }
        }
    }

    fn restart_after(&mut self, panic: String, ctx: &mut SyncContext<Self>) {
        tracing::error!(%panic, running = self.active.len(), queued = self.waiting.len(),
            "the engine panicked: failing its running jobs and restarting");
        if let Some(m) = &self.metrics {
            m.engine_restarts.inc();
        }
        for a in std::mem::take(&mut self.active) {
            let error = EngineJobError::Restarted(panic.clone());
            self.fail(a.job, error, a.span);
        }
        // The weights may hold a half-applied LoRA patch: back to the base model exactly.
        let reset = match catch_unwind(AssertUnwindSafe(|| self.patcher.reset())) {
            Ok(reset) => reset.map_err(|e| e.to_string()),
            Err(p) => Err(panic_message(p)),
        };
        if let Err(error) = reset {
            // Nothing sound is left to serve from; the orchestrator restarts the process.
            tracing::error!(%error, "restoring the base weights failed: exiting");
            std::process::abort();
        }
        let carry = Carry {
            model: self.model.take(),
            patcher: self.patcher.take(),
            waiting: std::mem::take(&mut self.waiting),
            tap: self.tap.take(),
            shutting_down: self.shutting_down,
            control_costs: std::mem::take(&mut self.control_costs),
        };
        *self
            .shared
            .successor
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(carry);
        self.restarting = true;
        // A sync actor that stops is made again by its factory (`spawn_engine`).
        ctx.stop();
    }

    /// Queue a `Step` unless one is queued already.
    fn schedule_step(&mut self, ctx: &mut SyncContext<Self>) {
        if !self.step_queued && !self.restarting {
            self.step_queued = true;
            ctx.address().do_send(Step);
        }
    }

    /// Once shutting down with nothing left to run: say so (the drain waiter returns), and
    /// close the events (their receiver ends once it has the last one).
    fn signal_if_drained(&mut self) {
        if self.shutting_down && self.active.is_empty() && self.waiting.is_empty() {
            self.publish_status();
            self.events = None;
            self.shared
                .events
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            self.shared.drained.send_replace(true);
            tracing::info!("engine drained");
        }
    }
}

impl Handler<Submit> for Engine {
    type Result = Result<u32, SubmitError>;

    fn handle(&mut self, msg: Submit, ctx: &mut SyncContext<Self>) -> Self::Result {
        self.shared.pending_submits.fetch_sub(1, Ordering::SeqCst);
        let restarted = || Err(SubmitError::Restarting);
        self.supervised(ctx, restarted, |engine, ctx| {
            let queued = engine.enqueue(*msg.job, msg.span);
            if queued.is_ok() {
                engine.schedule_step(ctx);
            }
            queued
        })
    }
}

impl Handler<Cancel> for Engine {
    type Result = ();

    fn handle(&mut self, msg: Cancel, ctx: &mut SyncContext<Self>) {
        self.supervised(ctx, || (), |engine, _| engine.cancel(msg.job_id, msg.span));
    }
}

impl Handler<RunInline> for Engine {
    type Result = Result<Option<u32>, SubmitError>;

    fn handle(&mut self, msg: RunInline, ctx: &mut SyncContext<Self>) -> Self::Result {
        self.supervised(
            ctx,
            || Err(SubmitError::Restarting),
            |engine, ctx| {
                let result = {
                    let _e = msg.span.enter();
                    catch_unwind(AssertUnwindSafe(msg.work))
                };
                let queued = match result {
                    Ok(Some(job)) => engine.enqueue(job, msg.span).map(Some),
                    Ok(None) => Ok(None),
                    Err(p) => Err(SubmitError::InlinePanic(panic_message(p))),
                };
                if matches!(queued, Ok(Some(_))) {
                    engine.schedule_step(ctx);
                }
                queued
            },
        )
    }
}

impl Handler<SetEventTap> for Engine {
    type Result = ();

    fn handle(&mut self, msg: SetEventTap, _: &mut SyncContext<Self>) {
        self.tap = msg.0;
    }
}

impl Handler<BeginShutdown> for Engine {
    type Result = Vec<DenoiseJob>;

    fn handle(&mut self, msg: BeginShutdown, ctx: &mut SyncContext<Self>) -> Vec<DenoiseJob> {
        self.supervised(ctx, Vec::new, |engine, _| {
            let _e = msg.span.enter();
            engine.shutting_down = true;
            let handed_back: Vec<DenoiseJob> =
                engine.waiting.drain(..).map(|(j, _)| j.job).collect();
            tracing::info!(
                handed_back = handed_back.len(),
                running = engine.active.len(),
                "engine draining"
            );
            engine.signal_if_drained();
            handed_back
        })
    }
}

impl Handler<Step> for Engine {
    type Result = ();

    fn handle(&mut self, _: Step, ctx: &mut SyncContext<Self>) {
        self.step_queued = false;
        self.supervised(
            ctx,
            || (),
            |engine, ctx| {
                let stepped = engine.iterate();
                if engine.active.is_empty() && engine.waiting.is_empty() {
                    engine.signal_if_drained();
                    return;
                }
                if !stepped {
                    // Every job waits on another thread (a template cache or LoRA still loading):
                    // poll gently instead of spinning the core the loaders need.
                    std::thread::sleep(super::IDLE_POLL);
                }
                engine.schedule_step(ctx);
            },
        );
    }
}

#[cfg(feature = "fault-injection")]
impl Handler<PanicMidBatch> for Engine {
    type Result = ();

    fn handle(&mut self, _: PanicMidBatch, _: &mut SyncContext<Self>) {
        self.panic_mid_batch = true;
    }
}

/// The async side's handle on the engine actor (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    addr: Addr<Engine>,
    status: Arc<Mutex<EngineStatus>>,
    steps: StepSamples,
    pending_submits: Arc<AtomicUsize>,
    capacity: usize,
}

/// Waits until the engine has drained (its running jobs finished after `begin_shutdown`).
pub struct EngineDrained(watch::Receiver<bool>);

impl EngineDrained {
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|drained| *drained).await;
    }
}

/// Start the engine actor. `command_capacity` bounds the submits not yet taken.
pub fn spawn_engine(
    model: EngineModel,
    config: EngineConfig,
    command_capacity: usize,
    events: mpsc::Sender<EngineEvent>,
    metrics: Option<DenoiserMetrics>,
) -> std::io::Result<(EngineHandle, EngineDrained)> {
    let status = Arc::new(Mutex::new(EngineStatus::default()));
    let steps = StepSamples::default();
    let pending_submits = Arc::new(AtomicUsize::new(0));
    let (drained, drained_rx) = watch::channel(false);
    let patcher =
        LoraPatcher::with_originals_on(&model.model.transformer_store, config.lora_originals);
    let first = Carry {
        model,
        patcher,
        waiting: VecDeque::new(),
        tap: None,
        shutting_down: false,
        control_costs: Default::default(),
    };
    // The loader thread of the first engine starts here, so a failure is this call's error.
    let first_stepper = super::new_stepper(&config, &first.model)?;
    let shared = Arc::new(Shared {
        config,
        events: Mutex::new(Some(events)),
        status: status.clone(),
        steps: steps.clone(),
        metrics,
        pending_submits: pending_submits.clone(),
        drained,
        successor: Mutex::new(Some(first)),
    });
    let stepper = Mutex::new(Some(first_stepper));
    let addr = diffmesh_shared::process::actors::start_sync("denoiser-engine", 1, move || {
        let carry = shared
            .successor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .expect("an engine starts from what the first start or the last engine left");
        let stepper = stepper.lock().unwrap_or_else(|p| p.into_inner()).take();
        Engine::new(carry, shared.clone(), stepper)
    });
    let handle = EngineHandle {
        addr,
        status,
        steps,
        pending_submits,
        capacity: command_capacity.max(1),
    };
    Ok((handle, EngineDrained(drained_rx)))
}

impl EngineHandle {
    /// Queue a job. Fails fast when `command_capacity` submits are already on their way to
    /// the engine (it is saturated).
    pub async fn submit(&self, job: EngineJob, span: Span) -> Result<u32, SubmitError> {
        if self.pending_submits.fetch_add(1, Ordering::SeqCst) >= self.capacity {
            self.pending_submits.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(self.capacity));
        }
        let msg = Submit {
            job: Box::new(job),
            span,
        };
        match self.addr.send(msg).await {
            Ok(answer) => answer,
            Err(_) => Err(SubmitError::ShuttingDown),
        }
    }

    /// Run `work` on the engine thread at its next step boundary (see [`RunInline`]); returns
    /// the queue position of the job it produced, if any.
    pub async fn run_inline(
        &self,
        work: InlineWork,
        span: Span,
    ) -> Result<Option<u32>, SubmitError> {
        match self.addr.send(RunInline { work, span }).await {
            Ok(answer) => answer,
            Err(_) => Err(SubmitError::ShuttingDown),
        }
    }

    /// Install (`Some`) or remove (`None`) the [`EventTap`]; returns once the engine has it.
    pub async fn set_event_tap(&self, tap: Option<EventTap>) -> Result<(), SubmitError> {
        self.addr
            .send(SetEventTap(tap))
            .await
            .map_err(|_| SubmitError::ShuttingDown)
    }

    pub async fn cancel(&self, job_id: String, span: Span) {
        if self.addr.send(Cancel { job_id, span }).await.is_err() {
            tracing::debug!("cancel after engine exit ignored");
        }
    }

    /// Ask the engine to stop; returns the queued jobs it had not started (to hand back). The
    /// engine finishes its running jobs (see [`EngineDrained::wait`]).
    pub async fn begin_shutdown(&self) -> Vec<DenoiseJob> {
        let span = Span::current();
        self.addr
            .send(BeginShutdown { span })
            .await
            .unwrap_or_default()
    }

    /// Make the engine's next step panic mid-batch (tests of its supervision).
    #[cfg(feature = "fault-injection")]
    pub async fn panic_mid_batch(&self) {
        let _ = self.addr.send(PanicMidBatch).await;
    }

    pub fn status(&self) -> EngineStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The batched steps run since the last call (at most
    /// [`crate::step_samples::KEPT_STEPS`], the latest).
    pub fn take_step_samples(&self) -> Vec<StepSample> {
        self.steps.take()
    }
}
