//! A ControlNet worker's compute: an actix sync actor on a thread of its own that owns the loaded
//! ControlNets (tch tensors are `Send`, not `Sync`) and the open sessions. Opens and closes are
//! done as they come; steps are kept until a [`Flush`] the actor sends itself, so every step that
//! arrived meanwhile is answered together, those that can share a forward in one.
use crate::wire::{from_wire, to_wire};
use actix::{Actor, Handler, Message, SyncContext};
use diffmesh_model::controlnets::ControlNets;
use diffmesh_model::flux::FluxInputs;
use diffmesh_model::pipeline::control::ControlStep;
use diffmesh_model::tch::{Device, Tensor};
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
        device: Device,
        max_sessions: usize,
        idle: Duration,
        max_batch: usize,
    ) -> Self {
        Self {
            controlnets,
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

    /// Answer `steps`, those that can share a forward in one (up to `max_batch` rows); a
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
                    StepReply::Residuals { .. } => "ok",
                    StepReply::UnknownSession => "unknown_session",
                    StepReply::Failed { .. } => "failed",
                };
                o.request("step", outcome);
            }
            let _ = tx.send(answer);
        }
    }

    /// Whether steps `a` and `b` can share one forward: open sessions of one ControlNet, scale
    /// and guidance, with inputs of the same shapes and the same position ids.
    fn share_forward(&self, a: &StepRequest, b: &StepRequest) -> bool {
        let (Some(sa), Some(sb)) = (
            self.sessions.peek(&a.session),
            self.sessions.peek(&b.session),
        ) else {
            return false;
        };
        sa.controlnet == sb.controlnet
            && sa.scale.to_bits() == sb.scale.to_bits()
            && sa.guidance_scale.to_bits() == sb.guidance_scale.to_bits()
            && a.hidden_states.shape == b.hidden_states.shape
            && a.hidden_states.dtype == b.hidden_states.dtype
            && a.guidance.is_some() == b.guidance.is_some()
            && sa.encoder_hidden_states.size() == sb.encoder_hidden_states.size()
            && sa.img_ids.size() == sb.img_ids.size()
            && sa.txt_ids.size() == sb.txt_ids.size()
            && sa.img_ids.equal(&sb.img_ids)
            && sa.txt_ids.equal(&sb.txt_ids)
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
        let cat = |parts: Vec<Tensor>| Tensor::f_cat(&parts, 0).map_err(|e| e.to_string());
        let wired = |field: &str, pick: &dyn Fn(&StepRequest) -> &WireTensor| {
            let parts = reqs
                .iter()
                .map(|r| from_wire(pick(r), d, field))
                .collect::<Result<Vec<_>, String>>()?;
            cat(parts)
        };
        let held = |pick: &dyn Fn(&Session) -> &Tensor| {
            cat(rows.iter().map(|s| pick(s).shallow_clone()).collect())
        };
        let first = rows[0];
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
            scale: first.scale,
            guidance_scale: first.guidance_scale,
        };
        let name = first.controlnet.clone();
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
            pooled_projections: r(&[1, cfg.pooled_projection_dim]),
            img_ids: to_wire(&Tensor::zeros([16, 3], (Kind::Float, Device::Cpu))).unwrap(),
            txt_ids: to_wire(&Tensor::zeros([4, 3], (Kind::Float, Device::Cpu))).unwrap(),
            control: r(&[1, 16, cfg.in_channels]),
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
        let mut c = Compute::new(nets, Device::Cpu, 16, Duration::from_secs(60), 8);
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

        // Alone: one forward per step.
        let mut alone = Vec::new();
        for (id, seed, s) in [("a", 1, &steps_a), ("b", 2, &steps_b)] {
            let (otx, _orx) = oneshot::channel();
            let (stx, srx) = oneshot::channel();
            let work = vec![
                Work::Open(Box::new(open(id, cfg, seed)), otx),
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
            Work::Open(Box::new(open("a", cfg, 1)), o1),
            Work::Open(Box::new(open("b", cfg, 2)), o2),
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
}
