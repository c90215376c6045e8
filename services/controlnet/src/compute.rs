//! A ControlNet worker's compute: an actix sync actor on a thread of its own that owns the loaded
//! ControlNets, Flux's and the UNet family's ([`crate::unet_session`]; tch tensors are `Send`,
//! not `Sync`) and the open sessions. Opens and closes are
//! done as they come; steps are kept until a [`Flush`] the actor sends itself, so every step that
//! arrived meanwhile is answered together, those that can share a forward in one.
use crate::unet_session::{self, UnetSession};
use crate::wire::{from_wire, to_wire};
use actix::{Actor, Handler, Message, SyncContext};
use diffmesh_model::controlnets::ControlNets;
use diffmesh_model::flux::FluxInputs;
use diffmesh_model::pipeline::control::ControlStep;
use diffmesh_model::tch::{Device, Tensor};
use diffmesh_model::unet::ControlNetModel;
use diffmesh_shared::wire::controlnet_service::{
    OpenReply, SessionOpen, StepReply, StepRequest, WireTensor,
};
use std::num::NonZeroUsize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// What the async side asks of the compute actor.
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
    fn forward(&self, seconds: f64, lookup: diffmesh_model::controlnets::Lookup);
}

/// One steered image's session.
struct Session {
    controlnet: String,
    scale: f64,
    inputs: Inputs,
    used: Instant,
}

/// A session's fixed inputs, by the network its ControlNet steers.
enum Inputs {
    Flux(FluxSession),
    Unet(UnetSession),
}

struct FluxSession {
    guidance_scale: f64,
    encoder_hidden_states: Tensor,
    pooled_projections: Tensor,
    img_ids: Tensor,
    txt_ids: Tensor,
    control: Tensor,
}

pub struct Compute {
    controlnets: ControlNets,
    /// The UNet family's (`ControlNetModel` folders of the same directory).
    unet_controlnets: ControlNets<ControlNetModel>,
    device: Device,
    sessions: lru::LruCache<String, Session>,
    /// A session not used for this long is dropped (its denoiser died without closing it).
    idle: Duration,
    /// Most steps run in one forward.
    max_batch: usize,
    pub status: Arc<Mutex<ComputeStatus>>,
    pub observer: Option<Box<dyn ComputeObserver>>,
    /// Steps taken since the last flush.
    pending: Vec<(Box<StepRequest>, oneshot::Sender<StepReply>)>,
    /// A [`Flush`] is on its way.
    flush_queued: bool,
}

impl Compute {
    pub fn new(
        controlnets: ControlNets,
        unet_controlnets: ControlNets<ControlNetModel>,
        device: Device,
        max_sessions: usize,
        idle: Duration,
        max_batch: usize,
    ) -> Self {
        Self {
            controlnets,
            unet_controlnets,
            device,
            sessions: lru::LruCache::new(NonZeroUsize::new(max_sessions.max(1)).expect("max 1")),
            idle,
            max_batch: max_batch.max(1),
            status: Arc::new(Mutex::new(ComputeStatus::default())),
            observer: None,
            pending: Vec::new(),
            flush_queued: false,
        }
    }

    /// Take one piece of work: opens and closes at once, steps kept for the next
    /// [`flush`](Self::flush); whether a step is now waiting for it.
    pub fn take(&mut self, work: Work) -> bool {
        match work {
            Work::Open(open, reply) => {
                self.expire_idle();
                let answer = self
                    .guarded(|c| c.open(*open))
                    .unwrap_or_else(|error| OpenReply::Failed { error });
                self.observe("open", matches!(answer, OpenReply::Opened));
                let _ = reply.send(answer);
                self.publish_status();
            }
            Work::Step(step, reply) => self.pending.push((step, reply)),
            Work::Close(session) => {
                self.sessions.pop(&session);
                self.publish_status();
            }
        }
        !self.pending.is_empty()
    }

    /// Answer every step taken since the last flush, batched where they can share a forward.
    pub fn flush(&mut self) {
        self.expire_idle();
        let steps = std::mem::take(&mut self.pending);
        if !steps.is_empty() {
            self.run_steps(steps);
        }
        self.publish_status();
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
            Err(p) => Err(diffmesh_shared::panic_message(p)),
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
                .into_iter()
                .chain(self.unet_controlnets.resident())
                .map(str::to_string)
                .collect();
            s.sessions = self.sessions.len() as u32;
        }
    }

    /// Check and keep a session's inputs; the ControlNet is loaded now, so the first step
    /// does not pay for it.
    fn open(&mut self, o: SessionOpen) -> Result<OpenReply, String> {
        let inputs = match &o.unet {
            Some(added) => {
                let (net, _) = self.unet_controlnets.get(&o.controlnet, None)?;
                Inputs::Unet(UnetSession::open(net, &o, added, self.device)?)
            }
            None => Inputs::Flux(self.open_flux(&o)?),
        };
        let session = Session {
            controlnet: o.controlnet,
            scale: o.scale,
            inputs,
            used: Instant::now(),
        };
        self.sessions.put(o.session, session);
        Ok(OpenReply::Opened)
    }

    fn open_flux(&mut self, o: &SessionOpen) -> Result<FluxSession, String> {
        let d = self.device;
        let (in_channels, joint_attention_dim, kind) = {
            let (net, _) = self.controlnets.get(&o.controlnet, None)?;
            (
                net.cfg.in_channels,
                net.cfg.joint_attention_dim,
                net.device_kind().1,
            )
        };
        let needed = |t: &Option<WireTensor>, field: &str| -> Result<Tensor, String> {
            let w = t
                .as_ref()
                .ok_or_else(|| format!("{field}: a Flux ControlNet's session needs it"))?;
            from_wire(w, d, field)
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
        Ok(FluxSession {
            guidance_scale: o.guidance_scale,
            encoder_hidden_states: encoder_hidden_states
                .f_to_kind(kind)
                .map_err(|e| e.to_string())?,
            pooled_projections: needed(&o.pooled_projections, "pooled_projections")?
                .f_to_kind(kind)
                .map_err(|e| e.to_string())?,
            img_ids: needed(&o.img_ids, "img_ids")?,
            txt_ids: needed(&o.txt_ids, "txt_ids")?,
            control: control.f_to_kind(kind).map_err(|e| e.to_string())?,
        })
    }

    /// Answer `steps`, those that can share a forward in one (up to `max_batch` steps; a guided
    /// UNet session's step is 2 rows); a
    /// shared forward that fails is tried again request by request.
    fn run_steps(&mut self, steps: Vec<(Box<StepRequest>, oneshot::Sender<StepReply>)>) {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (i, (r, _)) in steps.iter().enumerate() {
            let joins = groups
                .iter_mut()
                .find(|g| g.len() < self.max_batch && self.share_forward(&steps[g[0]].0, r));
            match joins {
                Some(g) => g.push(i),
                None => groups.push(vec![i]),
            }
        }
        let mut answers: Vec<Option<StepReply>> = steps.iter().map(|_| None).collect();
        for g in groups {
            let reqs: Vec<&StepRequest> = g.iter().map(|&i| &*steps[i].0).collect();
            let together = self.guarded(|c| c.step_group(&reqs));
            let replies = match together {
                Ok(replies) => replies,
                Err(error) if reqs.len() == 1 => vec![StepReply::Failed { error }],
                Err(_) => reqs
                    .iter()
                    .map(|r| {
                        self.guarded(|c| c.step_group(&[r]))
                            .map(|mut one| one.remove(0))
                            .unwrap_or_else(|error| StepReply::Failed { error })
                    })
                    .collect(),
            };
            for (i, reply) in g.into_iter().zip(replies) {
                answers[i] = Some(reply);
            }
        }
        for ((_, tx), answer) in steps.into_iter().zip(answers) {
            let answer = answer.unwrap_or(StepReply::Failed {
                error: "not run".into(),
            });
            if let Some(o) = &self.observer {
                let outcome = match answer {
                    StepReply::Residuals { .. } | StepReply::UnetResiduals { .. } => "ok",
                    StepReply::UnknownSession => "unknown_session",
                    StepReply::Failed { .. } => "failed",
                };
                o.request("step", outcome);
            }
            let _ = tx.send(answer);
        }
    }

    /// Whether steps `a` and `b` can share one forward: open sessions of one ControlNet and
    /// scale, with inputs that batch (Flux: the same shapes, guidance and position ids; UNet:
    /// [`UnetSession::shares_forward`]).
    fn share_forward(&self, a: &StepRequest, b: &StepRequest) -> bool {
        let (Some(sa), Some(sb)) = (
            self.sessions.peek(&a.session),
            self.sessions.peek(&b.session),
        ) else {
            return false;
        };
        if sa.controlnet != sb.controlnet || sa.scale.to_bits() != sb.scale.to_bits() {
            return false;
        }
        match (&sa.inputs, &sb.inputs) {
            (Inputs::Unet(ua), Inputs::Unet(ub)) => ua.shares_forward(a, ub, b),
            (Inputs::Flux(fa), Inputs::Flux(fb)) => {
                fa.guidance_scale.to_bits() == fb.guidance_scale.to_bits()
                    && a.hidden_states.shape == b.hidden_states.shape
                    && a.hidden_states.dtype == b.hidden_states.dtype
                    && a.guidance.is_some() == b.guidance.is_some()
                    && fa.encoder_hidden_states.size() == fb.encoder_hidden_states.size()
                    && fa.img_ids.size() == fb.img_ids.size()
                    && fa.txt_ids.size() == fb.txt_ids.size()
                    && fa.img_ids.equal(&fb.img_ids)
                    && fa.txt_ids.equal(&fb.txt_ids)
            }
            _ => false,
        }
    }

    /// One forward for `reqs` (sessions that share it, or one request), a reply per request.
    fn step_group(&mut self, reqs: &[&StepRequest]) -> Result<Vec<StepReply>, String> {
        let started = Instant::now();
        let d = self.device;
        for r in reqs {
            match self.sessions.get_mut(&r.session) {
                Some(s) => s.used = started,
                None if reqs.len() == 1 => return Ok(vec![StepReply::UnknownSession]),
                None => return Err(format!("session {} is gone", r.session)),
            }
        }
        let rows: Vec<&Session> = reqs
            .iter()
            .filter_map(|r| self.sessions.peek(&r.session))
            .collect();
        let (name, scale) = (rows[0].controlnet.clone(), rows[0].scale);
        let unets: Vec<&UnetSession> = rows
            .iter()
            .filter_map(|s| match &s.inputs {
                Inputs::Unet(u) => Some(u),
                Inputs::Flux(_) => None,
            })
            .collect();
        if !unets.is_empty() {
            if unets.len() != rows.len() {
                return Err("Flux and UNet sessions in one forward".into());
            }
            let (net, lookup) = self.unet_controlnets.get(&name, None)?;
            let replies = unet_session::step(net, scale, &unets, reqs, d, || {
                started.elapsed().as_secs_f64() * 1e3
            })?;
            if let Some(o) = &self.observer {
                o.forward(started.elapsed().as_secs_f64(), lookup);
            }
            return Ok(replies);
        }
        let flux: Vec<&FluxSession> = rows
            .iter()
            .filter_map(|s| match &s.inputs {
                Inputs::Flux(f) => Some(f),
                Inputs::Unet(_) => None,
            })
            .collect();
        let cat = |parts: Vec<Tensor>| Tensor::f_cat(&parts, 0).map_err(|e| e.to_string());
        let wired = |field: &str, pick: &dyn Fn(&StepRequest) -> &WireTensor| {
            let parts = reqs
                .iter()
                .map(|r| from_wire(pick(r), d, field))
                .collect::<Result<Vec<_>, String>>()?;
            cat(parts)
        };
        let held = |pick: &dyn Fn(&FluxSession) -> &Tensor| {
            cat(flux.iter().map(|s| pick(s).shallow_clone()).collect())
        };
        let first = flux[0];
        let inputs = FluxInputs {
            hidden_states: wired("hidden_states", &|r| &r.hidden_states)?,
            encoder_hidden_states: held(&|s| &s.encoder_hidden_states)?,
            pooled_projections: held(&|s| &s.pooled_projections)?,
            timestep: wired("timestep", &|r| &r.timestep)?,
            img_ids: first.img_ids.shallow_clone(),
            txt_ids: first.txt_ids.shallow_clone(),
            guidance: match reqs[0].guidance {
                Some(_) => Some(wired("guidance", &|r| {
                    r.guidance.as_ref().expect("grouped")
                })?),
                None => None,
            },
        };
        let step = ControlStep {
            inputs,
            control: held(&|s| &s.control)?,
            scale,
            guidance_scale: first.guidance_scale,
        };
        let (residuals, lookup) = self.controlnets.residuals(&name, &step, None)?;
        let seconds = started.elapsed().as_secs_f64();
        if let Some(o) = &self.observer {
            o.forward(seconds, lookup);
        }
        let row = |ts: &[Tensor], i: usize| -> Result<Vec<WireTensor>, String> {
            ts.iter()
                .map(|t| to_wire(&t.f_narrow(0, i as i64, 1).map_err(|e| e.to_string())?))
                .collect()
        };
        (0..reqs.len())
            .map(|i| {
                Ok(StepReply::Residuals {
                    double: row(&residuals.double, i)?,
                    single: row(&residuals.single, i)?,
                    compute_ms: seconds * 1e3,
                })
            })
            .collect()
    }
}

impl Actor for Compute {
    type Context = SyncContext<Self>;
}

impl Message for Work {
    type Result = ();
}

impl Handler<Work> for Compute {
    type Result = ();

    fn handle(&mut self, work: Work, ctx: &mut SyncContext<Self>) {
        if self.take(work) && !self.flush_queued {
            // Behind every message already queued: the steps among them join this flush.
            self.flush_queued = true;
            ctx.address().do_send(Flush);
        }
    }
}

/// Run the steps taken so far (the actor sends it to itself).
pub struct Flush;

impl Message for Flush {
    type Result = ();
}

impl Handler<Flush> for Compute {
    type Result = ();

    fn handle(&mut self, _: Flush, _: &mut SyncContext<Self>) {
        self.flush_queued = false;
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::to_wire;
    use diffmesh_model::tch::{nn, Kind};
    use diffmesh_model::tiny::controlnet_train::{controlnet_from_transformer, save_controlnet};
    use diffmesh_model::tiny::model::TinyModel;
    use diffmesh_model::unet::UNetInputs;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Forwards(Arc<AtomicUsize>);
    impl ComputeObserver for Forwards {
        fn request(&self, _: &'static str, _: &'static str) {}
        fn forward(&self, _: f64, _: diffmesh_model::controlnets::Lookup) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn open(session: &str, cfg: &diffmesh_model::flux::FluxConfig, seed: i64) -> SessionOpen {
        diffmesh_model::tch::manual_seed(seed);
        let r = |shape: &[i64]| to_wire(&Tensor::randn(shape, (Kind::Float, Device::Cpu))).unwrap();
        SessionOpen {
            session: session.into(),
            job_id: "j".into(),
            controlnet: "rand".into(),
            scale: 0.8,
            guidance_scale: 1.0,
            encoder_hidden_states: r(&[1, 4, cfg.joint_attention_dim]),
            pooled_projections: Some(r(&[1, cfg.pooled_projection_dim])),
            img_ids: Some(to_wire(&Tensor::zeros([16, 3], (Kind::Float, Device::Cpu))).unwrap()),
            txt_ids: Some(to_wire(&Tensor::zeros([4, 3], (Kind::Float, Device::Cpu))).unwrap()),
            control: r(&[1, 16, cfg.in_channels]),
            unet: None,
        }
    }

    fn step(session: &str, cfg: &diffmesh_model::flux::FluxConfig, t: f32) -> StepRequest {
        StepRequest {
            session: session.into(),
            hidden_states: to_wire(&Tensor::randn(
                [1, 16, cfg.in_channels],
                (Kind::Float, Device::Cpu),
            ))
            .unwrap(),
            timestep: to_wire(&Tensor::from_slice(&[t])).unwrap(),
            guidance: None,
        }
    }

    /// Take all of `work`, then flush (as the actor does with work that arrives together).
    /// Returns the forwards run.
    fn run(dir: &std::path::Path, work: Vec<Work>) -> usize {
        let nets = ControlNets::new(Some(dir.to_path_buf()), 2, Device::Cpu, Kind::Float);
        let unet_nets = ControlNets::new(Some(dir.to_path_buf()), 2, Device::Cpu, Kind::Float);
        let mut c = Compute::new(nets, unet_nets, Device::Cpu, 16, Duration::from_secs(60), 8);
        let forwards = Arc::new(AtomicUsize::new(0));
        c.observer = Some(Box::new(Forwards(forwards.clone())));
        for w in work {
            c.take(w);
        }
        c.flush();
        forwards.load(Ordering::SeqCst)
    }

    fn residuals(reply: StepReply) -> Vec<Tensor> {
        match reply {
            StepReply::Residuals { double, single, .. } => double
                .iter()
                .chain(&single)
                .map(|w| from_wire(w, Device::Cpu, "r").unwrap())
                .collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn steps_of_several_sessions_share_a_forward_and_get_their_own_rows() {
        let dir = tempfile::tempdir().unwrap();
        let m = TinyModel::random_for_tests(5, Device::Cpu).unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let net =
            controlnet_from_transformer(&vs, &m.transformer, &m.transformer_vs, 1, 1).unwrap();
        diffmesh_model::tch::no_grad(|| {
            for (name, mut v) in vs.variables() {
                if name.starts_with("controlnet_") {
                    v.copy_(&(Tensor::randn(v.size(), (Kind::Float, Device::Cpu)) * 0.05));
                }
            }
        });
        save_controlnet(&net, &vs, &dir.path().join("rand")).unwrap();
        let cfg = &m.transformer.cfg;
        let (steps_a, steps_b) = (step("a", cfg, 0.9), step("b", cfg, 0.3));

        // Each session's inputs are drawn once (drawing them again from the same seed races with
        // other tests on torch's global RNG).
        let (open_a, open_b) = (open("a", cfg, 1), open("b", cfg, 2));
        // Alone: one forward per step.
        let mut alone = Vec::new();
        for (o, s) in [(&open_a, &steps_a), (&open_b, &steps_b)] {
            let (otx, _orx) = oneshot::channel();
            let (stx, srx) = oneshot::channel();
            let work = vec![
                Work::Open(Box::new(o.clone()), otx),
                Work::Step(Box::new(s.clone()), stx),
            ];
            assert_eq!(run(dir.path(), work), 1);
            alone.push(residuals(srx.blocking_recv().unwrap()));
        }
        // Together: one forward for both, each its own rows; an unknown session alone.
        let (o1, _r1) = oneshot::channel();
        let (o2, _r2) = oneshot::channel();
        let (s1, r1) = oneshot::channel();
        let (s2, r2) = oneshot::channel();
        let (s3, r3) = oneshot::channel();
        let work = vec![
            Work::Open(Box::new(open_a), o1),
            Work::Open(Box::new(open_b), o2),
            Work::Step(Box::new(steps_a), s1),
            Work::Step(Box::new(steps_b), s2),
            Work::Step(Box::new(step("nobody", cfg, 0.5)), s3),
        ];
        assert_eq!(
            run(dir.path(), work),
            1,
            "the two steps did not share a forward"
        );
        assert!(matches!(
            r3.blocking_recv().unwrap(),
            StepReply::UnknownSession
        ));
        for (reply, alone) in [(r1, &alone[0]), (r2, &alone[1])] {
            let together = residuals(reply.blocking_recv().unwrap());
            assert_eq!(together.len(), alone.len());
            for (t, a) in together.iter().zip(alone) {
                assert_eq!(t.size(), a.size());
                let err = (t - a).abs().max().double_value(&[]);
                let scale = a.abs().max().double_value(&[]);
                assert!(
                    err <= 1e-5 * scale.max(1.0),
                    "batched row off by {err} (of {scale})"
                );
            }
        }
        // The two sessions' residuals differ (each got its own row back).
        assert!(!alone[0][0].allclose(&alone[1][0], 1e-3, 1e-3, false));
    }

    /// A random SDXL-shaped UNet ControlNet (`ControlNetModel`) saved as folder `name` in `dir`.
    fn unet_controlnet(dir: &std::path::Path, name: &str) -> ControlNetModel {
        let config = serde_json::json!({
            "_class_name": "ControlNetModel",
            "block_out_channels": [16, 32],
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
            "layers_per_block": 1,
            "cross_attention_dim": 16,
            "attention_head_dim": 2,
            "norm_num_groups": 8,
            "use_linear_projection": true,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 4,
            "projection_class_embeddings_input_dim": 8 + 6 * 4,
            "conditioning_embedding_out_channels": [8, 16],
        });
        let vs = nn::VarStore::new(Device::Cpu);
        // Its variables, randomly initialised, are what gets saved.
        ControlNetModel::new(&vs.root(), serde_json::from_value(config.clone()).unwrap()).unwrap();
        let folder = dir.join(name);
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
        let vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        Tensor::write_safetensors(&vars, folder.join("diffusion_pytorch_model.safetensors"))
            .unwrap();
        ControlNetModel::load(&folder, Device::Cpu, Kind::Float).unwrap()
    }

    fn unet_open(session: &str, rows: i64, seed: i64) -> SessionOpen {
        diffmesh_model::tch::manual_seed(seed);
        let r = |shape: &[i64]| to_wire(&Tensor::rand(shape, (Kind::Float, Device::Cpu))).unwrap();
        SessionOpen {
            session: session.into(),
            job_id: "j".into(),
            controlnet: "depth-xl".into(),
            scale: 0.7,
            guidance_scale: 5.0,
            encoder_hidden_states: r(&[rows, 5, 16]),
            pooled_projections: None,
            img_ids: None,
            txt_ids: None,
            control: r(&[rows, 3, 16, 16]),
            unet: Some(diffmesh_shared::wire::controlnet_service::UNetSession {
                text_embeds: Some(r(&[rows, 8])),
                time_ids: Some(r(&[rows, 6])),
            }),
        }
    }

    /// A step of a session of `rows` rows; the timestep once per row (as the UNet engine sends
    /// it) where `per_row`, else once for all.
    fn unet_step(session: &str, rows: i64, t: f32, per_row: bool) -> StepRequest {
        let timestep = if per_row {
            Tensor::from_slice(&vec![t; rows as usize])
        } else {
            Tensor::from_slice(&[t])
        };
        StepRequest {
            session: session.into(),
            hidden_states: to_wire(&Tensor::randn([rows, 4, 8, 8], (Kind::Float, Device::Cpu)))
                .unwrap(),
            timestep: to_wire(&timestep).unwrap(),
            guidance: None,
        }
    }

    fn unet_residuals(reply: StepReply) -> Vec<Tensor> {
        match reply {
            StepReply::UnetResiduals { down, mid, .. } => down
                .iter()
                .chain([&mid])
                .map(|w| from_wire(w, Device::Cpu, "r").unwrap())
                .collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unet_sessions_share_a_forward_and_get_the_residuals_of_their_own_rows() {
        let dir = tempfile::tempdir().unwrap();
        let net = unet_controlnet(dir.path(), "depth-xl");
        // A guided session (2 rows) and an unguided one (1 row), at different steps.
        let (a, b) = (
            unet_step("a", 2, 801.0, true),
            unet_step("b", 1, 201.0, false),
        );
        // Each session's inputs are drawn once and used for both the expectation and the work:
        // drawing them again from the same seed races with other tests on torch's global RNG.
        let (open_a, open_b) = (unet_open("a", 2, 1), unet_open("b", 1, 2));
        let expected: Vec<Vec<Tensor>> = [(&a, open_a.clone()), (&b, open_b.clone())]
            .iter()
            .map(|(s, o)| {
                let w = |t: &WireTensor| from_wire(t, Device::Cpu, "x").unwrap();
                let u = o.unet.as_ref().unwrap();
                let rows = w(&o.encoder_hidden_states).size()[0];
                let inputs = UNetInputs {
                    sample: w(&s.hidden_states),
                    timestep: w(&s.timestep).reshape([-1]).expand([rows], false),
                    encoder_hidden_states: w(&o.encoder_hidden_states),
                    text_embeds: u.text_embeds.as_ref().map(w),
                    time_ids: u.time_ids.as_ref().map(w),
                };
                let r = diffmesh_model::tch::no_grad(|| net.forward(&inputs, &w(&o.control), 0.7))
                    .unwrap();
                r.down.into_iter().chain([r.mid]).collect()
            })
            .collect();
        let (o1, _r1) = oneshot::channel();
        let (o2, _r2) = oneshot::channel();
        let (s1, r1) = oneshot::channel();
        let (s2, r2) = oneshot::channel();
        let work = vec![
            Work::Open(Box::new(open_a), o1),
            Work::Open(Box::new(open_b), o2),
            Work::Step(Box::new(a), s1),
            Work::Step(Box::new(b), s2),
        ];
        assert_eq!(
            run(dir.path(), work),
            1,
            "the two steps did not share a forward"
        );
        for (reply, (want, rows)) in [r1, r2].into_iter().zip(expected.iter().zip([2, 1])) {
            let got = unet_residuals(reply.blocking_recv().unwrap());
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                assert_eq!(g.size()[0], rows);
                let err = (g - w).abs().max().double_value(&[]);
                let scale = w.abs().max().double_value(&[]);
                assert!(
                    scale > 1e-3,
                    "residuals of a random ControlNet are not zero"
                );
                assert!(err <= 1e-5 * scale.max(1.0), "off by {err} (of {scale})");
            }
        }
    }

    #[test]
    fn a_unet_open_that_does_not_fit_fails_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        unet_controlnet(dir.path(), "depth-xl");
        let mut bad_rows = unet_open("a", 2, 1);
        bad_rows.control = unet_open("x", 1, 1).control;
        let mut bad_width = unet_open("b", 1, 1);
        bad_width.encoder_hidden_states =
            to_wire(&Tensor::zeros([1, 5, 12], (Kind::Float, Device::Cpu))).unwrap();
        let mut flux_without_ids = unet_open("c", 1, 1);
        flux_without_ids.unet = None;
        for (open, field) in [
            (bad_rows, "control"),
            (bad_width, "encoder_hidden_states"),
            (flux_without_ids, "controlnet.name"),
        ] {
            let (tx, rx) = oneshot::channel();
            run(dir.path(), vec![Work::Open(Box::new(open), tx)]);
            match rx.blocking_recv().unwrap() {
                OpenReply::Failed { error } => assert!(error.contains(field), "{field}: {error}"),
                OpenReply::Opened => panic!("{field}: opened"),
            }
        }
    }
}
