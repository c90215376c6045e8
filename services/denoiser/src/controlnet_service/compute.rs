//! A ControlNet worker's compute thread: owns the loaded ControlNets (tch tensors are `Send`, not
//! `Sync`) and the open sessions, and runs one request at a time from a bounded channel.
use super::wire::{from_wire, to_wire};
use crate::controlnet::ControlNets;
use diffmesh_model::flux::FluxInputs;
use diffmesh_model::pipeline::control::ControlStep;
use diffmesh_model::tch::{Device, Tensor};
use diffmesh_shared::controlnet_service::{OpenReply, SessionOpen, StepReply, StepRequest};
use std::num::NonZeroUsize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// What the async side asks of the compute thread.
pub enum Work {
    Open(Box<SessionOpen>, oneshot::Sender<OpenReply>),
    Step(Box<StepRequest>, oneshot::Sender<StepReply>),
    Close(String),
}

/// What the heartbeats report, refreshed after every request.
#[derive(Debug, Clone, Default)]
pub struct ComputeStatus {
    pub resident: Vec<String>,
    pub sessions: u32,
}

/// How each request went, for the worker's metrics.
pub trait ComputeObserver: Send {
    /// `kind`: open, step; `outcome`: ok, unknown_session, failed.
    fn request(&self, kind: &'static str, outcome: &'static str);
    /// One step's forward (and loading), with the lookup's outcome.
    fn forward(&self, seconds: f64, lookup: crate::controlnet::Lookup);
}

/// One steered image's fixed inputs.
struct Session {
    controlnet: String,
    scale: f64,
    guidance_scale: f64,
    encoder_hidden_states: Tensor,
    pooled_projections: Tensor,
    img_ids: Tensor,
    txt_ids: Tensor,
    control: Tensor,
    used: Instant,
}

pub struct Compute {
    controlnets: ControlNets,
    device: Device,
    sessions: lru::LruCache<String, Session>,
    /// A session not used for this long is dropped (its denoiser died without closing it).
    idle: Duration,
    pub status: Arc<Mutex<ComputeStatus>>,
    pub observer: Option<Box<dyn ComputeObserver>>,
}

impl Compute {
    pub fn new(
        controlnets: ControlNets,
        device: Device,
        max_sessions: usize,
        idle: Duration,
    ) -> Self {
        Self {
            controlnets,
            device,
            sessions: lru::LruCache::new(NonZeroUsize::new(max_sessions.max(1)).expect("max 1")),
            idle,
            status: Arc::new(Mutex::new(ComputeStatus::default())),
            observer: None,
        }
    }

    /// Serve `rx` until every sender is gone.
    pub fn run(mut self, mut rx: mpsc::Receiver<Work>) {
        while let Some(work) = rx.blocking_recv() {
            self.expire_idle();
            match work {
                Work::Open(open, reply) => {
                    let answer = self
                        .guarded(|c| c.open(*open))
                        .unwrap_or_else(|error| OpenReply::Failed { error });
                    self.observe("open", matches!(answer, OpenReply::Opened));
                    let _ = reply.send(answer);
                }
                Work::Step(step, reply) => {
                    let answer = self
                        .guarded(|c| Ok(c.step(&step)))
                        .unwrap_or_else(|error| StepReply::Failed { error });
                    let outcome = match answer {
                        StepReply::Residuals { .. } => "ok",
                        StepReply::UnknownSession => "unknown_session",
                        StepReply::Failed { .. } => "failed",
                    };
                    if let Some(o) = &self.observer {
                        o.request("step", outcome);
                    }
                    let _ = reply.send(answer);
                }
                Work::Close(session) => {
                    self.sessions.pop(&session);
                }
            }
            self.publish_status();
        }
    }

    fn observe(&self, kind: &'static str, ok: bool) {
        if let Some(o) = &self.observer {
            o.request(kind, if ok { "ok" } else { "failed" });
        }
    }

    /// `f`, with a panic in tch turned into an error.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, String>) -> Result<T, String> {
        match catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(r) => r,
            Err(p) => Err(crate::engine::panic_message(p)),
        }
    }

    fn expire_idle(&mut self) {
        while let Some((_, s)) = self.sessions.peek_lru() {
            if s.used.elapsed() < self.idle {
                break;
            }
            self.sessions.pop_lru();
        }
    }

    fn publish_status(&self) {
        if let Ok(mut s) = self.status.lock() {
            s.resident = self
                .controlnets
                .resident()
                .iter()
                .map(|n| n.to_string())
                .collect();
            s.sessions = self.sessions.len() as u32;
        }
    }

    /// Check and keep a session's inputs; the ControlNet is loaded now, so the first step
    /// does not pay for it.
    fn open(&mut self, o: SessionOpen) -> Result<OpenReply, String> {
        let d = self.device;
        let (in_channels, joint_attention_dim, kind) = {
            let (net, _) = self.controlnets.get(&o.controlnet, None)?;
            (
                net.cfg.in_channels,
                net.cfg.joint_attention_dim,
                net.device_kind().1,
            )
        };
        let control = from_wire(&o.control, d, "control")?;
        let encoder_hidden_states =
            from_wire(&o.encoder_hidden_states, d, "encoder_hidden_states")?;
        let want = |field: &str, t: &Tensor, dims: usize, last: i64| -> Result<(), String> {
            let size = t.size();
            if size.len() != dims || size.last() != Some(&last) {
                return Err(format!(
                    "{field}: expected {dims} dimensions ending in {last} for `{}`, got {size:?}",
                    o.controlnet
                ));
            }
            Ok(())
        };
        want("control", &control, 3, in_channels)?;
        want(
            "encoder_hidden_states",
            &encoder_hidden_states,
            3,
            joint_attention_dim,
        )?;
        let session = Session {
            controlnet: o.controlnet,
            scale: o.scale,
            guidance_scale: o.guidance_scale,
            encoder_hidden_states: encoder_hidden_states
                .f_to_kind(kind)
                .map_err(|e| e.to_string())?,
            pooled_projections: from_wire(&o.pooled_projections, d, "pooled_projections")?
                .f_to_kind(kind)
                .map_err(|e| e.to_string())?,
            img_ids: from_wire(&o.img_ids, d, "img_ids")?,
            txt_ids: from_wire(&o.txt_ids, d, "txt_ids")?,
            control: control.f_to_kind(kind).map_err(|e| e.to_string())?,
            used: Instant::now(),
        };
        self.sessions.put(o.session, session);
        Ok(OpenReply::Opened)
    }

    fn step(&mut self, r: &StepRequest) -> StepReply {
        let Some(s) = self.sessions.get_mut(&r.session) else {
            return StepReply::UnknownSession;
        };
        s.used = Instant::now();
        let started = Instant::now();
        let d = self.device;
        let inputs = (|| -> Result<FluxInputs, String> {
            Ok(FluxInputs {
                hidden_states: from_wire(&r.hidden_states, d, "hidden_states")?,
                encoder_hidden_states: s.encoder_hidden_states.shallow_clone(),
                pooled_projections: s.pooled_projections.shallow_clone(),
                timestep: from_wire(&r.timestep, d, "timestep")?,
                img_ids: s.img_ids.shallow_clone(),
                txt_ids: s.txt_ids.shallow_clone(),
                guidance: r
                    .guidance
                    .as_ref()
                    .map(|g| from_wire(g, d, "guidance"))
                    .transpose()?,
            })
        })();
        let inputs = match inputs {
            Ok(i) => i,
            Err(error) => return StepReply::Failed { error },
        };
        let step = ControlStep {
            inputs,
            control: s.control.shallow_clone(),
            scale: s.scale,
            guidance_scale: s.guidance_scale,
        };
        let name = s.controlnet.clone();
        let (residuals, lookup) = match self.controlnets.residuals(&name, &step, None) {
            Ok(r) => r,
            Err(error) => return StepReply::Failed { error },
        };
        let wire = |ts: &[Tensor]| ts.iter().map(to_wire).collect::<Result<Vec<_>, String>>();
        let (double, single) = match (wire(&residuals.double), wire(&residuals.single)) {
            (Ok(d), Ok(s)) => (d, s),
            (Err(error), _) | (_, Err(error)) => return StepReply::Failed { error },
        };
        let seconds = started.elapsed().as_secs_f64();
        if let Some(o) = &self.observer {
            o.forward(seconds, lookup);
        }
        StepReply::Residuals {
            double,
            single,
            compute_ms: seconds * 1e3,
        }
    }
}
