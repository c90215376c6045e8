//! Steered UNet generations' ControlNet residuals before each batched step, several per request
//! summed in the request's order as `MultiControlNetModel` sums them; and what they cost,
//! reported as the Flux engine reports its own (`diffmesh_denoiser_controlnet_*`, heartbeats'
//! `controlnet_step_s`).
//!
//! Each (image, ControlNet) pair comes from a ControlNet worker serving that ControlNet when the
//! denoiser runs `--controlnet-remote sync` (one session per pair, its rows one per guidance
//! branch; every request goes out before the engine waits for any, so pairs on different
//! workers compute at once), else from the ControlNets of `--controlnet-dir` on the engine
//! thread (checked against this UNet when loaded, each loaded at most once a step). A pair whose
//! worker fails falls back to the local ControlNet where the denoiser holds it; else the step
//! fails, and the engine's job-by-job retry fails that job alone.
use super::{Active, UnetEngine};
use crate::controlnet_service::client::{Arrived, Pending, Residuals};
use crate::controlnet_service::wire::from_wire;
use crate::controlnet_service::RemoteMode;
use crate::engine::EngineJobError;
use diffmesh_model::stable_diffusion::control::SdControlStep;
use diffmesh_model::tch::{Device, Kind};
use diffmesh_model::unet::config::UNetConfig;
use diffmesh_model::unet::UNetResiduals;
use diffmesh_model::ModelError;
use std::time::Instant;

fn failed(e: ModelError) -> EngineJobError {
    EngineJobError::ControlNet(format!("controlnet: {e}"))
}

/// One steered image of the batch: its job, its place among the job's images, its ControlNets'
/// names, its inputs for this step, and each ControlNet's residuals as they come.
struct Steered {
    job: usize,
    image: usize,
    names: Vec<String>,
    step: SdControlStep,
    parts: Vec<Option<UNetResiduals>>,
}

impl UnetEngine {
    /// Per state of the jobs at `members` (indices into `active`, in order), its ControlNets'
    /// summed residuals for this step; empty when none of them is steered. The time is shared
    /// evenly by the steered jobs.
    pub(super) fn control_residuals(
        &mut self,
        members: &[usize],
    ) -> Result<Vec<Option<UNetResiduals>>, EngineJobError> {
        let steered: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&i| self.active[i].job.params.controlnets().next().is_some())
            .collect();
        if steered.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        // Per state of the batch, in order (None: not steered, or done).
        let mut batch: Vec<Option<Steered>> = Vec::new();
        for &i in members {
            let a = &self.active[i];
            let names: Vec<String> = a.job.params.controlnets().map(|c| c.name.clone()).collect();
            for (j, s) in a.states.iter().enumerate() {
                let step = s.control_step().map_err(EngineJobError::from_model)?;
                batch.push(step.map(|step| Steered {
                    job: i,
                    image: j,
                    parts: names.iter().map(|_| None).collect(),
                    names: names.clone(),
                    step,
                }));
            }
        }
        let in_flight = self.send_remote(&mut batch);
        let remote: Vec<(usize, usize)> = in_flight.iter().map(|(b, k, _)| (*b, *k)).collect();
        self.compute_local(&mut batch, |b, k| !remote.contains(&(b, k)))?;
        self.collect_remote(&mut batch, in_flight)?;
        // Summed in the request's order, as MultiControlNetModel sums them.
        let mut out = Vec::with_capacity(batch.len());
        for s in batch {
            let Some(s) = s else {
                out.push(None);
                continue;
            };
            let mut sum: Option<UNetResiduals> = None;
            for r in s.parts.into_iter().flatten() {
                sum = Some(match sum {
                    Some(total) => total.sum(&r).map_err(failed)?,
                    None => r,
                });
            }
            out.push(sum);
        }
        self.observe_control_cost(&steered, started);
        Ok(out)
    }

    /// Send every pair a ControlNet worker serves (sessions opened on first use); the pairs in
    /// flight as (index in `batch`, ControlNet), with where their residuals come.
    fn send_remote(&mut self, batch: &mut [Option<Steered>]) -> Vec<(usize, usize, Pending)> {
        let Some(remote) = self
            .model
            .controlnet_service
            .as_ref()
            .filter(|r| r.mode() != RemoteMode::Off)
        else {
            return Vec::new();
        };
        let mut in_flight = Vec::new();
        for (b, s) in batch.iter().enumerate() {
            let Some(s) = s else { continue };
            let a: &mut Active = &mut self.active[s.job];
            let pairs = s.names.len();
            if a.control_links.len() < a.states.len() * pairs {
                a.control_links.resize_with(a.states.len() * pairs, || None);
            }
            for (k, name) in s.names.iter().enumerate() {
                let slot = s.image * pairs + k;
                if a.control_links[slot].is_none() {
                    if !remote.workers.serves(name) {
                        continue;
                    }
                    let session =
                        format!("{}-{}-{k}-{}", a.job.job_id, s.image, a.control_generation);
                    match remote.open_unet_link(session, &a.job.job_id, name, &s.step, k) {
                        Ok(link) => a.control_links[slot] = Some(link),
                        Err(error) => {
                            tracing::warn!(%error, "ControlNet session not made; computing here");
                            continue;
                        }
                    }
                }
                let Some(link) = &a.control_links[slot] else {
                    continue;
                };
                match remote.submit_unet(link, &s.step) {
                    Ok(pending) => in_flight.push((b, k, pending)),
                    Err(error) => {
                        tracing::warn!(%error, "ControlNet step not sent; computing here")
                    }
                }
            }
        }
        in_flight
    }

    /// The pairs `local(index in batch, ControlNet)` picks, from the engine's own ControlNets:
    /// each once per step, over every state it steers (loading one evicts another when the
    /// batch names more than the registry keeps).
    fn compute_local(
        &mut self,
        batch: &mut [Option<Steered>],
        local: impl Fn(usize, usize) -> bool,
    ) -> Result<(), EngineJobError> {
        let mut distinct: Vec<String> = Vec::new();
        for (b, s) in batch.iter().enumerate() {
            let Some(s) = s else { continue };
            for (k, name) in s.names.iter().enumerate() {
                if local(b, k) && !distinct.contains(name) {
                    distinct.push(name.clone());
                }
            }
        }
        for name in distinct {
            for (b, s) in batch.iter_mut().enumerate() {
                let Some(s) = s else { continue };
                for k in 0..s.names.len() {
                    if s.names[k] == name && local(b, k) {
                        s.parts[k] = Some(self.local_pair(&name, &s.step, k)?);
                    }
                }
            }
        }
        Ok(())
    }

    /// Pair `k` of `step` from the engine's own ControlNet `name`.
    fn local_pair(
        &mut self,
        name: &str,
        step: &SdControlStep,
        k: usize,
    ) -> Result<UNetResiduals, EngineJobError> {
        let base = &self.model.pipeline.unet.config;
        let held = self.controlnets.holds(name);
        let (net, lookup) = self
            .controlnets
            .get(name, Some(base))
            .map_err(|e| match held {
                true => EngineJobError::ControlNet(e),
                // Served neither here nor (this step) by a worker: another placement may.
                false => EngineJobError::ControlNetAway(e),
            })?;
        let forward = Instant::now();
        let residuals = step.one(k, net).map_err(failed)?;
        if let Some(m) = self.shared.metrics.as_ref() {
            let c = &m.controlnet;
            c.lookups.with_label_values(&[lookup.as_str()]).inc();
            c.seconds.observe(forward.elapsed().as_secs_f64());
        }
        Ok(residuals)
    }

    /// Wait for the pairs in flight; one whose worker failed is computed here where the
    /// denoiser holds its ControlNet.
    fn collect_remote(
        &mut self,
        batch: &mut [Option<Steered>],
        in_flight: Vec<(usize, usize, Pending)>,
    ) -> Result<(), EngineJobError> {
        if in_flight.is_empty() {
            return Ok(());
        }
        let waited = Instant::now();
        let (device, kind) = self.model.pipeline.unet.device_kind();
        let config = self.model.pipeline.unet.config.clone();
        let mut outcome = Ok(());
        for (b, k, pending) in in_flight {
            let Some(s) = batch[b].as_mut() else { continue };
            let arrived = pending
                .blocking_recv()
                .unwrap_or_else(|_| Err("the request was dropped".into()))
                .and_then(|r| decode(&r, &s.step, &config, device, kind));
            let label = match arrived {
                Ok(residuals) => {
                    s.parts[k] = Some(residuals);
                    "remote"
                }
                Err(error) if self.controlnets.holds(&s.names[k]) => {
                    tracing::warn!(%error, controlnet = %s.names[k],
                        "ControlNet worker failed; computing here");
                    let name = s.names[k].clone();
                    match self.local_pair(&name, &s.step, k) {
                        Ok(r) => s.parts[k] = Some(r),
                        Err(e) => outcome = outcome.and(Err(e)),
                    }
                    "fallback_local"
                }
                Err(error) => {
                    outcome = outcome.and(Err(EngineJobError::ControlNetAway(format!(
                        "controlnet: {error}"
                    ))));
                    "failed"
                }
            };
            if let Some(m) = self.shared.metrics.as_ref() {
                m.controlnet.remote.with_label_values(&[label]).inc();
            }
        }
        if let Some(m) = self.shared.metrics.as_ref() {
            m.controlnet
                .remote_wait_seconds
                .observe(waited.elapsed().as_secs_f64());
        }
        outcome
    }

    /// The step's ControlNet time, shared evenly by the steered jobs (and by each job's
    /// ControlNets), smoothed per job and per ControlNet.
    fn observe_control_cost(&mut self, steered: &[usize], started: Instant) {
        let metrics = self.shared.metrics.as_ref();
        let share = started.elapsed().as_secs_f64() / steered.len().max(1) as f64;
        for &i in steered {
            let a = &mut self.active[i];
            a.control_s.observe(share);
            let count = a.job.params.controlnets().count().max(1) as f64;
            for c in a.job.params.controlnets() {
                self.control_costs.observe(&c.name, share / count);
                if let Some(m) = metrics {
                    m.controlnet
                        .step_seconds
                        .with_label_values(&[&c.name])
                        .set(self.control_costs.of(&c.name));
                }
            }
        }
    }
}

/// Arrived residuals as tensors of the UNet's device and dtype, each of the shape this UNet's
/// skip (or mid block) has for the step's sample: a worker's ControlNet that does not fit this
/// UNet is a failure of that worker, not a broadcast into a wrong image.
fn decode(
    r: &Arrived,
    step: &SdControlStep,
    config: &UNetConfig,
    device: Device,
    kind: Kind,
) -> Result<UNetResiduals, String> {
    let Residuals::Unet { down, mid } = &r.residuals else {
        return Err(format!(
            "worker {} sent a Flux ControlNet's residuals for a UNet step",
            r.worker
        ));
    };
    let s = step.inputs.sample.size();
    let (want_down, want_mid) = config
        .control_residual_shapes(s[0], [s[2], s[3]])
        .map_err(|e| e.to_string())?;
    if down.len() != want_down.len() {
        return Err(format!(
            "worker {} sent {} down residuals; this UNet has {} skips",
            r.worker,
            down.len(),
            want_down.len()
        ));
    }
    let one = |w, want: &[i64; 4]| -> Result<_, String> {
        let t = from_wire(w, device, "residual")?;
        if t.size() != want {
            return Err(format!(
                "worker {} sent a residual of {:?}, expected {want:?}",
                r.worker,
                t.size()
            ));
        }
        t.f_to_kind(kind).map_err(|e| e.to_string())
    };
    Ok(UNetResiduals {
        down: down
            .iter()
            .zip(&want_down)
            .map(|(w, want)| one(w, want))
            .collect::<Result<_, _>>()?,
        mid: one(mid, &want_mid)?,
    })
}
