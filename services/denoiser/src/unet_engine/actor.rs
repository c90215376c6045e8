//! The UNet engine as an actix sync actor on a thread of its own, answering every engine
//! message ([`crate::engine::EngineHandle`]) and sending itself [`Step`] while it has jobs.
//!
//! Supervision: a handler that panics (per-job panics are caught deeper down, so this is a bug
//! in the loop) fails the running jobs with [`EngineJobError::Restarted`] (the service places
//! them again through the router), puts the UNet's weights back to the base model exactly (a
//! panic inside a LoRA patch may have left it half-applied; if even that fails the process
//! aborts, for the orchestrator to restart) and goes on with the queued ones.
use super::{UnetEngine, UnetModel, IDLE_POLL};
use crate::engine::ledger::Ledger;
#[cfg(feature = "fault-injection")]
use crate::engine::PanicMidBatch;
use crate::engine::{
    BeginShutdown, Cancel, EngineConfig, EngineDrained, EngineEvent, EngineHandle, EngineJobError,
    EngineStatus, RunInline, SetEventTap, Submit, SubmitError,
};
use crate::metrics::DenoiserMetrics;
use crate::step_samples::StepSamples;
use actix::{Actor, Handler, Message, SyncContext};
use diffmesh_model::controlnets::ControlNets;
use diffmesh_model::lora::LoraPatcher;
use diffmesh_shared::panic_message;
use diffmesh_shared::wire::messages::DenoiseJob;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};

/// One step-loop iteration (the engine sends it to itself while it has jobs).
struct Step;

impl Message for Step {
    type Result = ();
}

/// What the engine shares with its handle.
pub(super) struct Shared {
    pub status: Arc<Mutex<EngineStatus>>,
    pub metrics: Option<DenoiserMetrics>,
    pub pending_submits: Arc<AtomicUsize>,
    pub drained: watch::Sender<bool>,
}

impl Actor for UnetEngine {
    type Context = SyncContext<Self>;

    fn started(&mut self, _: &mut SyncContext<Self>) {
        tracing::info!(model = %self.model.model_id, max_batch = self.config.max_batch,
            "UNet engine started");
    }
}

impl UnetEngine {
    fn supervised<T>(
        &mut self,
        ctx: &mut SyncContext<Self>,
        fallback: impl FnOnce() -> T,
        f: impl FnOnce(&mut Self, &mut SyncContext<Self>) -> T,
    ) -> T {
        match catch_unwind(AssertUnwindSafe(|| f(self, ctx))) {
            Ok(answer) => answer,
            Err(p) => {
                let panic = panic_message(p);
                tracing::error!(%panic, running = self.active.len(),
                    "the UNet engine panicked: failing its running jobs");
                if let Some(m) = self.metrics() {
                    m.engine_restarts.inc();
                }
                for a in std::mem::take(&mut self.active) {
                    self.ledger
                        .fail(a.job, EngineJobError::Restarted(panic.clone()), a.span);
                }
                if let Some(patcher) = self.patcher.as_mut() {
                    let reset = match catch_unwind(AssertUnwindSafe(|| patcher.reset())) {
                        Ok(reset) => reset.map_err(|e| e.to_string()),
                        Err(p) => Err(panic_message(p)),
                    };
                    if let Err(error) = reset {
                        tracing::error!(%error, "restoring the UNet's base weights failed: exiting");
                        std::process::abort();
                    }
                }
                self.schedule_step(ctx);
                fallback()
            }
        }
    }

    fn schedule_step(&mut self, ctx: &mut SyncContext<Self>) {
        let idle = self.active.is_empty() && self.ledger.waiting.is_empty();
        if !self.step_queued && !idle {
            self.step_queued = true;
            ctx.address().do_send(Step);
        }
    }

    /// Once shutting down with nothing left to run: say so and close the events.
    fn signal_if_drained(&mut self) {
        if self.ledger.shutting_down && self.active.is_empty() && self.ledger.waiting.is_empty() {
            self.publish_status();
            self.ledger.close();
            self.shared.drained.send_replace(true);
            tracing::info!("UNet engine drained");
        }
    }
}

impl Handler<Submit> for UnetEngine {
    type Result = Result<u32, SubmitError>;

    fn handle(&mut self, msg: Submit, ctx: &mut SyncContext<Self>) -> Self::Result {
        self.shared.pending_submits.fetch_sub(1, Ordering::SeqCst);
        let restarted = || Err(SubmitError::Restarting);
        self.supervised(ctx, restarted, |engine, ctx| {
            let queued = engine.enqueue(*msg.job, msg.span);
            engine.schedule_step(ctx);
            queued
        })
    }
}

impl Handler<Cancel> for UnetEngine {
    type Result = ();

    fn handle(&mut self, msg: Cancel, ctx: &mut SyncContext<Self>) {
        self.supervised(ctx, || (), |engine, _| engine.cancel(msg.job_id, msg.span));
    }
}

impl Handler<RunInline> for UnetEngine {
    type Result = Result<Option<u32>, SubmitError>;

    fn handle(&mut self, msg: RunInline, ctx: &mut SyncContext<Self>) -> Self::Result {
        self.supervised(
            ctx,
            || Err(SubmitError::Restarting),
            |engine, ctx| {
                let queued = msg.run(|job, span| engine.enqueue(job, span));
                engine.schedule_step(ctx);
                queued
            },
        )
    }
}

impl Handler<SetEventTap> for UnetEngine {
    type Result = ();

    fn handle(&mut self, msg: SetEventTap, _: &mut SyncContext<Self>) {
        self.ledger.tap = msg.0;
    }
}

impl Handler<BeginShutdown> for UnetEngine {
    type Result = Vec<DenoiseJob>;

    fn handle(&mut self, msg: BeginShutdown, ctx: &mut SyncContext<Self>) -> Vec<DenoiseJob> {
        self.supervised(ctx, Vec::new, |engine, _| {
            let _e = msg.span.enter();
            let handed_back = engine.ledger.begin_shutdown();
            engine.signal_if_drained();
            handed_back
        })
    }
}

impl Handler<Step> for UnetEngine {
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
                    // Every job waits on a template fetch: poll gently.
                    std::thread::sleep(IDLE_POLL);
                }
                engine.schedule_step(ctx);
            },
        );
    }
}

#[cfg(feature = "fault-injection")]
impl Handler<PanicMidBatch> for UnetEngine {
    type Result = ();

    fn handle(&mut self, _: PanicMidBatch, _: &mut SyncContext<Self>) {
        self.panic_mid_batch = true;
    }
}

/// Start the UNet engine actor on `model`. `command_capacity` bounds the submits not yet taken.
pub fn spawn_unet_engine(
    model: Box<UnetModel>,
    config: EngineConfig,
    command_capacity: usize,
    events: mpsc::Sender<EngineEvent>,
    metrics: Option<DenoiserMetrics>,
) -> std::io::Result<(EngineHandle, EngineDrained)> {
    let status = Arc::new(Mutex::new(EngineStatus::default()));
    let pending_submits = Arc::new(AtomicUsize::new(0));
    let (drained, drained_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        status: status.clone(),
        metrics: metrics.clone(),
        pending_submits: pending_submits.clone(),
        drained,
    });
    let unet = &model.pipeline.unet;
    let patcher = unet
        .var_store()
        .map(|vs| LoraPatcher::with_originals_on(vs, config.lora_originals));
    let linear_modules = unet.linear_modules();
    let (device, kind) = unet.device_kind();
    let controlnets = ControlNets::new(
        model.controlnet_dir.clone(),
        config.controlnet_cache,
        device,
        kind,
    );
    let text_loras = super::text_loras::TextLoras::new(&model.pipeline, config.lora_originals);
    let engine = UnetEngine {
        patcher,
        linear_modules,
        text_loras,
        controlnets,
        control_costs: Default::default(),
        ledger: Ledger::new(Some(events), metrics.clone(), config.max_queue),
        model: *model,
        config,
        shared,
        active: Vec::new(),
        templates: Default::default(),
        step_queued: false,
        #[cfg(feature = "fault-injection")]
        panic_mid_batch: false,
    };
    // Supervision never stops this actor (see the module doc): the factory runs once.
    let first = Mutex::new(Some(engine));
    let addr = diffmesh_shared::process::actors::start_sync("denoiser-unet-engine", 1, move || {
        first
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .expect("the UNet engine actor is never restarted")
    });
    let handle = EngineHandle::new(
        addr,
        status,
        StepSamples::default(),
        pending_submits,
        command_capacity,
    );
    Ok((handle, EngineDrained::new(drained_rx)))
}
