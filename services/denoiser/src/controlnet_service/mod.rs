//! The denoiser's side of ControlNet-as-a-Service (Katz, section 5): ControlNets on dedicated
//! workers (`diffmesh-controlnet`, the `services/controlnet` crate) that the denoisers call once
//! per steered step ([`client`]), instead of running them on their own step loop.
//!
//! Why: a ControlNet costs a large share of a step (the default model's `silhouette` one about
//! half a transformer forward), and on the denoiser it runs before the forward. On a worker of
//! its own it runs beside the forward; in `pipelined` mode (residuals one step behind) it is off
//! the denoiser's critical path entirely. The workers keep the popular ControlNets loaded and
//! are scaled apart from the denoisers. A denoiser that finds no worker for a ControlNet, or
//! whose worker fails mid-job, computes the residuals itself when it holds that ControlNet.
pub mod client;
pub mod registry;
pub mod wire;

pub use client::{RemoteControlNets, RemoteMode, RemoteSettings};
pub use registry::{ControlNetWorkers, Network};
