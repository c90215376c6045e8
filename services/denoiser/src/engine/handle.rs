//! The async side's handle on an engine, whichever engine it is (the Flux engine of
//! [`super`], or the UNet family's [`crate::unet_engine`]): the messages every engine answers
//! and [`EngineHandle`], which holds them as recipients, so the service does not know which
//! model family runs behind it.
use super::{EngineJob, EngineStatus, EventTap, InlineWork, SubmitError};
use crate::step_samples::StepSamples;
use actix::{Actor, Addr, Handler, Message, Recipient, SyncContext};
use diffmesh_shared::wire::messages::{DenoiseJob, StepSample};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
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

impl RunInline {
    /// Run the work under its span (a panic is the answer's error) and queue the job it made
    /// with `enqueue`.
    pub(crate) fn run(
        self,
        enqueue: impl FnOnce(EngineJob, Span) -> Result<u32, SubmitError>,
    ) -> Result<Option<u32>, SubmitError> {
        let made = {
            let _e = self.span.enter();
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(self.work))
        };
        match made {
            Ok(Some(job)) => enqueue(job, self.span).map(Some),
            Ok(None) => Ok(None),
            Err(p) => Err(SubmitError::InlinePanic(diffmesh_shared::panic_message(p))),
        }
    }
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

/// Make the next step panic in the middle of the batch (tests of the supervision).
#[cfg(feature = "fault-injection")]
pub struct PanicMidBatch;

#[cfg(feature = "fault-injection")]
impl Message for PanicMidBatch {
    type Result = ();
}

/// What an engine answers: every message of this module.
#[cfg(not(feature = "fault-injection"))]
pub trait EngineMessages:
    Handler<Submit>
    + Handler<Cancel>
    + Handler<RunInline>
    + Handler<SetEventTap>
    + Handler<BeginShutdown>
{
}

/// What an engine answers: every message of this module.
#[cfg(feature = "fault-injection")]
pub trait EngineMessages:
    Handler<Submit>
    + Handler<Cancel>
    + Handler<RunInline>
    + Handler<SetEventTap>
    + Handler<BeginShutdown>
    + Handler<PanicMidBatch>
{
}

#[cfg(not(feature = "fault-injection"))]
impl<A> EngineMessages for A where
    A: Handler<Submit>
        + Handler<Cancel>
        + Handler<RunInline>
        + Handler<SetEventTap>
        + Handler<BeginShutdown>
{
}

#[cfg(feature = "fault-injection")]
impl<A> EngineMessages for A where
    A: Handler<Submit>
        + Handler<Cancel>
        + Handler<RunInline>
        + Handler<SetEventTap>
        + Handler<BeginShutdown>
        + Handler<PanicMidBatch>
{
}

/// The messages an engine answers, as recipients of whichever actor it is.
#[derive(Clone)]
struct EngineAddr {
    submit: Recipient<Submit>,
    cancel: Recipient<Cancel>,
    inline: Recipient<RunInline>,
    tap: Recipient<SetEventTap>,
    shutdown: Recipient<BeginShutdown>,
    #[cfg(feature = "fault-injection")]
    panic: Recipient<PanicMidBatch>,
}

/// The async side's handle on the engine actor (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    addr: EngineAddr,
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

impl EngineDrained {
    pub(crate) fn new(drained: watch::Receiver<bool>) -> Self {
        Self(drained)
    }
}

impl EngineHandle {
    /// The handle on engine `addr`, which publishes its load to `status` and its step samples
    /// to `steps`, counts its submits in flight in `pending_submits` (bounded by
    /// `command_capacity`).
    pub(crate) fn new<A>(
        addr: Addr<A>,
        status: Arc<Mutex<EngineStatus>>,
        steps: StepSamples,
        pending_submits: Arc<AtomicUsize>,
        command_capacity: usize,
    ) -> Self
    where
        A: Actor<Context = SyncContext<A>> + EngineMessages,
    {
        let addr = EngineAddr {
            submit: addr.clone().recipient(),
            cancel: addr.clone().recipient(),
            inline: addr.clone().recipient(),
            tap: addr.clone().recipient(),
            #[cfg(feature = "fault-injection")]
            panic: addr.clone().recipient(),
            shutdown: addr.recipient(),
        };
        Self {
            addr,
            status,
            steps,
            pending_submits,
            capacity: command_capacity.max(1),
        }
    }

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
        match self.addr.submit.send(msg).await {
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
        match self.addr.inline.send(RunInline { work, span }).await {
            Ok(answer) => answer,
            Err(_) => Err(SubmitError::ShuttingDown),
        }
    }

    /// Install (`Some`) or remove (`None`) the [`EventTap`]; returns once the engine has it.
    pub async fn set_event_tap(&self, tap: Option<EventTap>) -> Result<(), SubmitError> {
        self.addr
            .tap
            .send(SetEventTap(tap))
            .await
            .map_err(|_| SubmitError::ShuttingDown)
    }

    pub async fn cancel(&self, job_id: String, span: Span) {
        if self
            .addr
            .cancel
            .send(Cancel { job_id, span })
            .await
            .is_err()
        {
            tracing::debug!("cancel after engine exit ignored");
        }
    }

    /// Ask the engine to stop; returns the queued jobs it had not started (to hand back). The
    /// engine finishes its running jobs (see [`EngineDrained::wait`]).
    pub async fn begin_shutdown(&self) -> Vec<DenoiseJob> {
        let span = Span::current();
        self.addr
            .shutdown
            .send(BeginShutdown { span })
            .await
            .unwrap_or_default()
    }

    /// Make the engine's next step panic mid-batch (tests of its supervision).
    #[cfg(feature = "fault-injection")]
    pub async fn panic_mid_batch(&self) {
        let _ = self.addr.panic.send(PanicMidBatch).await;
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
