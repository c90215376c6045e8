//! The engine as an actix sync actor on a thread of its own (`SyncArbiter`: it owns the tch
//! tensors, which are `Send`, not `Sync`), and the async side's handle on it.
//!
//! Messages: those of every engine ([`super::handle`]), and [`Step`], which the engine sends itself while it has jobs: one step-loop iteration per
//! `Step`, so commands that arrive during a step are handled, in order, before the next one.
//!
//! Supervision: a handler that panics (the engine's own per-job panics are caught deeper down,
//! so this is a bug in the loop itself) fails the jobs that were running, with
//! [`EngineJobError::Restarted`] (the service places them again through the router), and stops
//! the actor; actix starts a new engine from the
//! factory, which takes over the model (its weights restored to the base model), the queued
//! jobs, untouched, and the event tap. `diffmesh_denoiser_engine_restarts_total` counts it.
#[cfg(feature = "fault-injection")]
use super::handle::PanicMidBatch;
use super::handle::{
    BeginShutdown, Cancel, EngineDrained, EngineHandle, RunInline, SetEventTap, Submit,
};
use super::SubmitError;
use super::{Engine, EngineConfig, EngineEvent, EngineJobError, EngineStatus};
use crate::metrics::DenoiserMetrics;
use crate::model::EngineModel;
use crate::step_samples::StepSamples;
use actix::{Actor, ActorContext, Handler, Message, SyncContext};
use diffmesh_model::lora::LoraPatcher;
use diffmesh_shared::panic_message;
use diffmesh_shared::wire::messages::DenoiseJob;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};

/// One step-loop iteration (the engine sends it to itself while it has jobs).
pub(super) struct Step;

impl Message for Step {
    type Result = ();
}

/// What one engine hands the next one it is restarted as (and what the first one starts from).
pub(super) struct Carry {
    pub model: EngineModel,
    pub patcher: LoraPatcher,
    pub ledger: super::ledger::Ledger,
    pub control_costs: super::control_costs::ControlCosts,
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
            queued = self.ledger.waiting.len(), "engine started");
        // After a restart: the queued jobs it took over run without waiting for a new submit.
        if !self.ledger.waiting.is_empty() {
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
        tracing::error!(%panic, running = self.active.len(), queued = self.ledger.waiting.len(),
            "the engine panicked: failing its running jobs and restarting");
        if let Some(m) = &self.metrics {
            m.engine_restarts.inc();
        }
        for a in std::mem::take(&mut self.active) {
            let error = EngineJobError::Restarted(panic.clone());
            self.ledger.fail(a.job, error, a.span);
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
            ledger: std::mem::replace(&mut self.ledger, super::ledger::Ledger::new(None, None, 0)),
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
        if self.ledger.shutting_down && self.active.is_empty() && self.ledger.waiting.is_empty() {
            self.publish_status();
            self.ledger.close();
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
                let queued = msg.run(|job, span| engine.enqueue(job, span));
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
        self.ledger.tap = msg.0;
    }
}

impl Handler<BeginShutdown> for Engine {
    type Result = Vec<DenoiseJob>;

    fn handle(&mut self, msg: BeginShutdown, ctx: &mut SyncContext<Self>) -> Vec<DenoiseJob> {
        self.supervised(ctx, Vec::new, |engine, _| {
            let _e = msg.span.enter();
            let handed_back = engine.ledger.begin_shutdown();
            tracing::info!(running = engine.active.len(), "engine draining");
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
                if engine.active.is_empty() && engine.ledger.waiting.is_empty() {
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
        ledger: super::ledger::Ledger::new(Some(events.clone()), metrics.clone(), config.max_queue),
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
    let handle = EngineHandle::new(addr, status, steps, pending_submits, command_capacity);
    Ok((handle, EngineDrained::new(drained_rx)))
}
