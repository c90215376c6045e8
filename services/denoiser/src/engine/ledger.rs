//! What every engine keeps of its jobs besides their model states, the Flux engine's and the
//! UNet family's alike: the bounded queue of waiting jobs, whether it is draining, and where its
//! events go.
use super::{EngineEvent, EngineJob, EngineJobError, EventTap, SubmitError};
use crate::metrics::DenoiserMetrics;
use diffmesh_model::ModelError;
use diffmesh_shared::panic_message;
use diffmesh_shared::wire::messages::{DenoiseJob, RunningJob};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tokio::sync::mpsc;
use tracing::Span;

pub(crate) struct Ledger {
    pub waiting: VecDeque<(EngineJob, Span)>,
    pub shutting_down: bool,
    pub tap: Option<EventTap>,
    /// `None` once drained.
    events: Option<mpsc::Sender<EngineEvent>>,
    metrics: Option<DenoiserMetrics>,
    max_queue: usize,
}

impl Ledger {
    pub fn new(
        events: Option<mpsc::Sender<EngineEvent>>,
        metrics: Option<DenoiserMetrics>,
        max_queue: usize,
    ) -> Self {
        Self {
            waiting: VecDeque::new(),
            shutting_down: false,
            tap: None,
            events,
            metrics,
            max_queue,
        }
    }

    pub fn emit(&self, event: EngineEvent) {
        if let Some(tap) = &self.tap {
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| tap(&event))) {
                tracing::warn!(panic = %panic_message(p), "event tap panicked");
            }
        }
        // Backpressure: a slow NATS side slows the engine rather than growing a queue.
        let Some(events) = &self.events else {
            tracing::debug!("engine event dropped: the engine has drained");
            return;
        };
        if events.blocking_send(event).is_err() {
            tracing::debug!("engine event dropped: receiver gone");
        }
    }

    pub fn fail(&self, job: DenoiseJob, error: EngineJobError, span: Span) {
        {
            let _e = span.enter();
            tracing::warn!(job_id = %job.job_id, %error, "job failed in the engine");
        }
        if let Some(m) = &self.metrics {
            m.failures.with_label_values(&[error.reason()]).inc();
        }
        self.emit(EngineEvent::Failed { job, error, span });
    }

    /// Queue a job (its queue position) unless draining, already here (waiting, or `active`
    /// says it runs) or the queue is full.
    pub fn enqueue(
        &mut self,
        job: EngineJob,
        span: Span,
        active: impl Fn(&str) -> bool,
    ) -> Result<u32, SubmitError> {
        let id = &job.job.job_id;
        if self.shutting_down {
            Err(SubmitError::ShuttingDown)
        } else if self.waiting.iter().any(|(j, _)| &j.job.job_id == id) || active(id) {
            Err(SubmitError::Duplicate(id.clone()))
        } else if self.waiting.len() >= self.max_queue {
            Err(SubmitError::QueueFull(self.max_queue))
        } else {
            self.waiting.push_back((job, span));
            Ok(self.waiting.len() as u32)
        }
    }

    /// Retire `job` with what decoding its images gave (RGB, `width` x `height`), caught
    /// panics included: `Finished`, or `Failed` naming why.
    pub fn finish(
        &self,
        job: DenoiseJob,
        span: Span,
        decoded: std::thread::Result<Result<Vec<Vec<u8>>, ModelError>>,
        (width, height): (i64, i64),
    ) {
        match decoded {
            Ok(Ok(images)) => {
                if let Some(m) = &self.metrics {
                    m.jobs_done.inc();
                }
                self.emit(EngineEvent::Finished {
                    job,
                    images,
                    width: width as u32,
                    height: height as u32,
                    span,
                });
            }
            Ok(Err(e)) => self.fail(job, EngineJobError::from_model(e), span),
            Err(p) => self.fail(job, EngineJobError::Panic(panic_message(p)), span),
        }
    }

    /// Drop `job_id` from the queue, answering `Cancelled`; false when it is not waiting.
    pub fn cancel_waiting(&mut self, job_id: &str) -> bool {
        let Some(pos) = self
            .waiting
            .iter()
            .position(|(j, _)| j.job.job_id == job_id)
        else {
            return false;
        };
        self.waiting.remove(pos);
        tracing::info!(%job_id, "cancelled while queued");
        self.emit(EngineEvent::Cancelled {
            job_id: job_id.to_string(),
        });
        true
    }

    /// Start draining: no more jobs; the waiting ones are handed back.
    pub fn begin_shutdown(&mut self) -> Vec<DenoiseJob> {
        self.shutting_down = true;
        let handed_back: Vec<DenoiseJob> = self.waiting.drain(..).map(|(j, _)| j.job).collect();
        tracing::info!(handed_back = handed_back.len(), "engine draining");
        handed_back
    }

    /// Drained: close the events (their receiver ends once it has the last one).
    pub fn close(&mut self) {
        self.events = None;
    }

    /// The waiting jobs as heartbeats report them, sized as they will run; `control_s`: what a
    /// step of the worker's loop spends on a job's ControlNet.
    pub fn waiting_jobs(&self, control_s: impl Fn(&DenoiseJob) -> f64) -> Vec<RunningJob> {
        self.waiting
            .iter()
            .map(|(j, _)| RunningJob {
                job_id: j.job.job_id.clone(),
                masked_tokens: j.job.inputs.masked_tokens,
                remaining_steps: j.job.params.num_inference_steps,
                rows: j.job.params.batch_rows(),
                images: j.job.params.n.max(1),
                control_s: control_s(&j.job),
            })
            .collect()
    }
}
