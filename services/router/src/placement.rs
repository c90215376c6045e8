//! The placement actor: it owns the router's decision state ([`RouterState`]: the worker
//! registry, the placement policy, the cost models, failover rules) and answers typed messages,
//! so heartbeats, submits, cancels, job events and the admin endpoint reach one owner in
//! arrival order and no lock is shared between the router's tasks.
//!
//! Handlers are synchronous bookkeeping and policy decisions (microseconds); NATS traffic stays
//! in the router's tokio tasks, which send these messages and act on the answers. Should the
//! actor die (a bug in a policy), the router reports itself unready (`/readyz`), so it is
//! restarted: its state is rebuilt from the next heartbeats.
use crate::cost_check::CostReport;
use crate::registry::LostWorker;
use crate::state::{Decision, Failover, RouterState};
use actix::{Actor, Addr, Context, Handler, Message};
use diffmesh_sched::SchedError;
use diffmesh_shared::wire::messages::{DenoiseJob, Heartbeat};
use std::time::{Duration, Instant};

pub struct Placement {
    state: RouterState,
}

impl Actor for Placement {
    type Context = Context<Self>;
}

impl Placement {
    /// Start the actor on the process's actor system.
    pub fn start(state: RouterState) -> Addr<Self> {
        diffmesh_shared::process::actors::start(move |_| Placement { state })
    }
}

/// A heartbeat arrived.
pub struct Observe(pub Heartbeat);

/// What a heartbeat told: whether the worker is new, its steps against the cost model, and
/// how many workers are live now.
pub struct Observed {
    pub new: bool,
    pub costs: CostReport,
    pub live: usize,
}

impl Message for Observe {
    type Result = Observed;
}

impl Handler<Observe> for Placement {
    type Result = actix::MessageResult<Observe>;

    fn handle(&mut self, msg: Observe, _: &mut Context<Self>) -> Self::Result {
        let (new, costs) = self.state.observe(msg.0, Instant::now());
        actix::MessageResult(Observed {
            new,
            costs,
            live: self.state.registry.live_workers(),
        })
    }
}

/// Expire the workers that stopped sending heartbeats.
pub struct Expire;

/// The lost workers with a failover decision per job, and how many workers are live now.
pub struct Expired {
    pub lost: Vec<(LostWorker, Vec<Failover>)>,
    pub live: usize,
}

impl Message for Expire {
    type Result = Expired;
}

impl Handler<Expire> for Placement {
    type Result = actix::MessageResult<Expire>;

    fn handle(&mut self, _: Expire, _: &mut Context<Self>) -> Self::Result {
        let lost = self.state.expire(Instant::now());
        actix::MessageResult(Expired {
            lost,
            live: self.state.registry.live_workers(),
        })
    }
}

/// Choose a worker for `job` and record the placement (`RouterState::place_holdable`);
/// answers the decision and how long the policy took.
pub struct Place {
    pub job: DenoiseJob,
    pub exclude: Vec<String>,
    pub waiting_behind: Option<u32>,
}

impl Message for Place {
    type Result = (Decision, Duration);
}

impl Handler<Place> for Placement {
    type Result = actix::MessageResult<Place>;

    fn handle(&mut self, msg: Place, _: &mut Context<Self>) -> Self::Result {
        let t = Instant::now();
        let decision = self
            .state
            .place_holdable(&msg.job, &msg.exclude, msg.waiting_behind);
        actix::MessageResult((decision, t.elapsed()))
    }
}

/// Undo a placement the worker refused or never answered.
pub struct Unplace(pub String);

impl Message for Unplace {
    type Result = ();
}

impl Handler<Unplace> for Placement {
    type Result = ();

    fn handle(&mut self, msg: Unplace, _: &mut Context<Self>) {
        self.state.unplace(&msg.0);
    }
}

/// A job ended: forget its placement; answers whether this router had placed it.
pub struct Finish(pub String);

impl Message for Finish {
    type Result = bool;
}

impl Handler<Finish> for Placement {
    type Result = bool;

    fn handle(&mut self, msg: Finish, _: &mut Context<Self>) -> bool {
        self.state.finish(&msg.0, Instant::now()).is_some()
    }
}

/// The expected wait of a job of `model` with `ahead` of its model's submits queued before it
/// (`RouterState::wait_for`).
pub struct EstimateWait {
    pub model: String,
    pub ahead: usize,
}

impl Message for EstimateWait {
    type Result = Option<Duration>;
}

impl Handler<EstimateWait> for Placement {
    type Result = Option<Duration>;

    fn handle(&mut self, msg: EstimateWait, _: &mut Context<Self>) -> Option<Duration> {
        self.state.wait_for(&msg.model, msg.ahead)
    }
}

/// The worker this router placed a job on, if it did.
pub struct Owner(pub String);

impl Message for Owner {
    type Result = Option<String>;
}

impl Handler<Owner> for Placement {
    type Result = Option<String>;

    fn handle(&mut self, msg: Owner, _: &mut Context<Self>) -> Option<String> {
        self.state.registry.owner(&msg.0).map(str::to_string)
    }
}

/// Switch the placement policy; answers the previous one's name.
pub struct SetPolicy(pub String);

impl Message for SetPolicy {
    type Result = Result<String, SchedError>;
}

impl Handler<SetPolicy> for Placement {
    type Result = Result<String, SchedError>;

    fn handle(&mut self, msg: SetPolicy, _: &mut Context<Self>) -> Self::Result {
        self.state.set_policy(&msg.0)
    }
}

/// The policy in use and the cost models it decides with (the admin endpoint's view).
pub struct Describe;

impl Message for Describe {
    type Result = serde_json::Value;
}

impl Handler<Describe> for Placement {
    type Result = actix::MessageResult<Describe>;

    fn handle(&mut self, _: Describe, _: &mut Context<Self>) -> Self::Result {
        let m = self.state.models();
        actix::MessageResult(serde_json::json!({
            "policy": self.state.policy_name(),
            "cost_models": {
                "label": m.label,
                "synthetic": m.synthetic,
                "compute_r2": m.compute.r2,
                "load_r2": m.load.r2,
                // The fitted terms: seconds per FLOP, per request, per mask-aware request,
                // and the intercept; per byte for loads.
                "compute": m.compute,
                "load": m.load,
            },
        }))
    }
}
