//! The denoiser's side of ControlNet-as-a-Service: sessions on ControlNet workers, one per
//! steered image, and the step requests the engine thread sends without waiting (each runs as
//! a task on the service's runtime; the engine collects it when it needs the residuals).
use super::registry::ControlNetWorkers;
use super::wire::to_wire;
use bytes::Bytes;
use diffmesh_model::pipeline::control::ControlStep;
use diffmesh_model::stable_diffusion::control::SdControlStep;
use diffmesh_shared::nats::chunked::request_chunked;
use diffmesh_shared::nats::trace_context::headers_for;
use diffmesh_shared::wire::controlnet_service::{
    close_subject, open_subject, step_subject, OpenReply, SessionClose, SessionOpen, StepReply,
    StepRequest, UNetSession, WireTensor,
};
use diffmesh_shared::wire::messages::{decode, encode};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// Where a denoiser's steered steps get their ControlNet residuals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum RemoteMode {
    /// On the engine thread, from `--controlnet-dir`.
    #[default]
    Off,
    /// From a ControlNet worker, for the step about to run: the same image as `off`.
    Sync,
    /// From a ControlNet worker, one step behind (Katz's asynchronous pipeline): step t adds
    /// the residuals of step t-1's inputs while the worker computes step t's, so the
    /// ControlNet's time and transfer hide behind the transformer's forward.
    Pipelined,
}

/// Settings of the remote path.
#[derive(Debug, Clone)]
pub struct RemoteSettings {
    pub mode: RemoteMode,
    /// Per request to a worker (an open or a step).
    pub timeout: Duration,
    /// Requests tried per step, over different workers, before the step falls back.
    pub attempts: usize,
    /// Largest answer accepted (bytes).
    pub max_reply_bytes: usize,
}

/// The residuals of one step as they arrived.
#[derive(Debug)]
pub struct Arrived {
    pub residuals: Residuals,
    pub worker: String,
    pub compute_ms: f64,
}

/// A step's residuals by the network they steer.
#[derive(Debug)]
pub enum Residuals {
    /// Per Flux ControlNet double block, then per single block.
    Flux {
        double: Vec<WireTensor>,
        single: Vec<WireTensor>,
    },
    /// Per skip of the UNet's down path, and its mid block's.
    Unet {
        down: Vec<WireTensor>,
        mid: WireTensor,
    },
}

/// Residuals on their way (`Err`: every try failed; the message says why).
pub type Pending = oneshot::Receiver<Result<Arrived, String>>;

/// A client of the ControlNet workers (cheap to clone).
#[derive(Clone)]
pub struct RemoteControlNets {
    client: async_nats::Client,
    runtime: Handle,
    pub workers: ControlNetWorkers,
    pub settings: Arc<RemoteSettings>,
}

/// One steered image's session: its fixed inputs (sent again to whichever worker takes it
/// over) and the worker holding it now. Dropping the last handle closes it there.
pub struct SessionLink {
    pub id: String,
    job_id: String,
    controlnet: String,
    open: Bytes,
    worker: Mutex<Option<String>>,
    client: async_nats::Client,
    runtime: Handle,
}

impl SessionLink {
    pub fn worker(&self) -> Option<String> {
        self.worker.lock().ok().and_then(|w| w.clone())
    }

    fn set_worker(&self, w: Option<String>) {
        if let Ok(mut slot) = self.worker.lock() {
            *slot = w;
        }
    }
}

impl Drop for SessionLink {
    fn drop(&mut self) {
        let Some(worker) = self.worker.get_mut().ok().and_then(|w| w.take()) else {
            return;
        };
        let close = SessionClose {
            session: self.id.clone(),
        };
        let (client, job_id) = (self.client.clone(), self.job_id.clone());
        // Fire and forget: a worker that misses it drops the session when it idles out.
        self.runtime.spawn(async move {
            let _ = diffmesh_shared::nats::publish_msgpack(
                &client,
                close_subject(&worker),
                Some(&job_id),
                &close,
            )
            .await;
        });
    }
}

impl RemoteControlNets {
    /// `runtime` runs the requests (the engine thread has none of its own).
    pub fn new(
        client: async_nats::Client,
        runtime: Handle,
        workers: ControlNetWorkers,
        settings: RemoteSettings,
    ) -> Self {
        Self {
            client,
            runtime,
            workers,
            settings: Arc::new(settings),
        }
    }

    pub fn mode(&self) -> RemoteMode {
        self.settings.mode
    }

    /// A session for one steered image, from its first step's inputs (nothing is sent yet:
    /// the first step opens it on a worker).
    pub fn open_link(
        &self,
        session: String,
        job_id: &str,
        controlnet: &str,
        step: &ControlStep,
    ) -> Result<Arc<SessionLink>, String> {
        let i = &step.inputs;
        let open = SessionOpen {
            session: session.clone(),
            job_id: job_id.into(),
            controlnet: controlnet.into(),
            scale: step.scale,
            guidance_scale: step.guidance_scale,
            encoder_hidden_states: to_wire(&i.encoder_hidden_states)?,
            pooled_projections: Some(to_wire(&i.pooled_projections)?),
            img_ids: Some(to_wire(&i.img_ids)?),
            txt_ids: Some(to_wire(&i.txt_ids)?),
            control: to_wire(&step.control)?,
            unet: None,
        };
        self.link(session, job_id, controlnet, &open)
    }

    /// A session of ControlNet `k` (named `controlnet`) of a steered UNet image, from its first
    /// step's inputs (its rows: one per guidance branch).
    pub fn open_unet_link(
        &self,
        session: String,
        job_id: &str,
        controlnet: &str,
        step: &SdControlStep,
        k: usize,
    ) -> Result<Arc<SessionLink>, String> {
        let i = &step.inputs;
        let (image, scale) = step
            .images
            .get(k)
            .ok_or_else(|| format!("controlnet: control {k} of {}", step.images.len()))?;
        let open = SessionOpen {
            session: session.clone(),
            job_id: job_id.into(),
            controlnet: controlnet.into(),
            scale: *scale,
            guidance_scale: 1.0,
            encoder_hidden_states: to_wire(&i.encoder_hidden_states)?,
            pooled_projections: None,
            img_ids: None,
            txt_ids: None,
            control: to_wire(image)?,
            unet: Some(UNetSession {
                text_embeds: i.text_embeds.as_ref().map(to_wire).transpose()?,
                time_ids: i.time_ids.as_ref().map(to_wire).transpose()?,
            }),
        };
        self.link(session, job_id, controlnet, &open)
    }

    fn link(
        &self,
        session: String,
        job_id: &str,
        controlnet: &str,
        open: &SessionOpen,
    ) -> Result<Arc<SessionLink>, String> {
        Ok(Arc::new(SessionLink {
            id: session,
            job_id: job_id.into(),
            controlnet: controlnet.into(),
            open: Bytes::from(encode(open).map_err(|e| e.to_string())?),
            worker: Mutex::new(None),
            client: self.client.clone(),
            runtime: self.runtime.clone(),
        }))
    }

    /// Send `step` of `link`'s session; the residuals come on the returned channel.
    pub fn submit(&self, link: &Arc<SessionLink>, step: &ControlStep) -> Result<Pending, String> {
        let i = &step.inputs;
        let request = StepRequest {
            session: link.id.clone(),
            hidden_states: to_wire(&i.hidden_states)?,
            timestep: to_wire(&i.timestep)?,
            guidance: i.guidance.as_ref().map(to_wire).transpose()?,
        };
        self.send(link, &request)
    }

    /// Send a UNet session's `step` (its sample and timestep); the residuals of all the
    /// session's rows come on the returned channel.
    pub fn submit_unet(
        &self,
        link: &Arc<SessionLink>,
        step: &SdControlStep,
    ) -> Result<Pending, String> {
        let request = StepRequest {
            session: link.id.clone(),
            hidden_states: to_wire(&step.inputs.sample)?,
            timestep: to_wire(&step.inputs.timestep)?,
            guidance: None,
        };
        self.send(link, &request)
    }

    fn send(&self, link: &Arc<SessionLink>, request: &StepRequest) -> Result<Pending, String> {
        let payload = Bytes::from(encode(request).map_err(|e| e.to_string())?);
        let (tx, rx) = oneshot::channel();
        let this = self.clone();
        let link = link.clone();
        self.runtime.spawn(async move {
            let _ = tx.send(this.run_step(&link, payload).await);
        });
        Ok(rx)
    }

    /// One step on the session's worker, opening the session (again) where needed and
    /// moving to another worker when one fails or does not answer.
    async fn run_step(&self, link: &SessionLink, payload: Bytes) -> Result<Arrived, String> {
        let s = &self.settings;
        let headers = headers_for(Some(&link.job_id));
        let mut avoid: Vec<String> = Vec::new();
        let mut last_error = format!("no ControlNet worker serves `{}`", link.controlnet);
        for _ in 0..s.attempts.max(1) {
            let worker = match link.worker() {
                Some(w) => w,
                None => {
                    let Some(w) = self.workers.pick(&link.controlnet, &avoid) else {
                        break;
                    };
                    let opened = request_chunked(
                        &self.client,
                        &open_subject(&w),
                        &headers,
                        link.open.clone(),
                        s.timeout,
                        s.max_reply_bytes,
                    )
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|b| decode::<OpenReply>(&b).map_err(|e| e.to_string()));
                    match opened {
                        Ok(OpenReply::Opened) => {
                            link.set_worker(Some(w.clone()));
                            w
                        }
                        Ok(OpenReply::Failed { error }) | Err(error) => {
                            last_error = format!("worker {w}: {error}");
                            avoid.push(w);
                            continue;
                        }
                    }
                }
            };
            let answer = request_chunked(
                &self.client,
                &step_subject(&worker),
                &headers,
                payload.clone(),
                s.timeout,
                s.max_reply_bytes,
            )
            .await
            .map_err(|e| e.to_string())
            .and_then(|b| decode::<StepReply>(&b).map_err(|e| e.to_string()));
            match answer {
                Ok(StepReply::Residuals {
                    double,
                    single,
                    compute_ms,
                }) => {
                    return Ok(Arrived {
                        residuals: Residuals::Flux { double, single },
                        worker,
                        compute_ms,
                    })
                }
                Ok(StepReply::UnetResiduals {
                    down,
                    mid,
                    compute_ms,
                }) => {
                    return Ok(Arrived {
                        residuals: Residuals::Unet { down, mid },
                        worker,
                        compute_ms,
                    })
                }
                // Open it again there (the worker restarted or dropped it).
                Ok(StepReply::UnknownSession) => {
                    link.set_worker(None);
                    last_error = format!("worker {worker} lost the session");
                }
                Ok(StepReply::Failed { error }) | Err(error) => {
                    link.set_worker(None);
                    last_error = format!("worker {worker}: {error}");
                    avoid.push(worker);
                }
            }
        }
        Err(last_error)
    }
}
