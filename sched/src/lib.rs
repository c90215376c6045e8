//! Scheduling for diffmesh.
//!
//! - [`cost_model`]: per-block compute latency linear in FLOPs and requests
//!   ([`compute_fit`]), load latency linear in bytes, least-squares fitted from a profile file
//!   (with R^2).
//! - [`planner`]: FlashPS Algorithm 1, made exact: per block, use the cached activations (loaded
//!   in order on a copy stream) or recompute all tokens, minimising the step latency.
//! - [`three_way`]: the per-block choice between full compute, loading K/V, and loading the
//!   hidden stream (FlashPS's Y), exact over the plans an engine can run.
//! - [`batching`]: the engine's step-level continuous-batching admission rule.
//! - [`queue_order`]: the order a worker admits its waiting requests in (GF-DiT's FCFS, SRTF,
//!   EDF), shared by the engine and the simulator.
//! - [`calibration`]: per-worker factor between the cost models and the steps a worker ran.
//! - [`policy`] / [`mask_aware`]: the one placement trait shared by the live router and the
//!   simulator, with round-robin, request-count, token-count and mask-aware (Algorithm 2) policies.
//! - [`sim`]: a discrete-event simulator that drives the same policies with the fitted costs.
//! - [`profiles`]: the measured profiles checked in under `sched/profiles/`, built in.
//! - [`elastic`]: GF-DiT's elastic parallelism: the policies that give each ready denoising
//!   step a number of ranks, a parallel-cost model, and their simulator (`diffmesh-sim
//!   --elastic`).
pub mod batching;
pub mod calibration;
pub mod compute_fit;
pub mod cost_model;
pub mod elastic;
pub mod error;
pub mod forecast;
pub mod linear_fit;
pub mod mask_aware;
pub mod planner;
pub mod policy;
pub mod profiles;
pub mod queue_order;
pub mod sim;
pub mod synthetic;
pub mod three_way;

pub use compute_fit::ComputeFit;
pub use cost_model::{CostModels, LinearFit, ModelShape, Profile};
pub use error::SchedError;
pub use planner::{plan, Plan};
pub use policy::{policy_by_name, Policy, RequestInfo, WorkerState};
pub use queue_order::{QueueOrder, QueuedJob};
