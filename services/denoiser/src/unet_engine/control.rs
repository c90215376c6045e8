//! Steered UNet generations' ControlNet residuals, computed on the engine thread from the
//! ControlNets of `--controlnet-dir` (diffusers' `ControlNetModel`, checked against this UNet
//! when loaded) before each batched step, several per request summed as `MultiControlNetModel`
//! sums them, each ControlNet loaded at most once a step; and what they cost, reported as the Flux engine reports its own
//! (`diffmesh_denoiser_controlnet_*`, heartbeats' `controlnet_step_s`).
use super::UnetEngine;
use crate::engine::EngineJobError;
use diffmesh_model::stable_diffusion::control::SdControlStep;
use diffmesh_model::unet::UNetResiduals;
use diffmesh_model::ModelError;
use std::time::Instant;

fn failed(e: ModelError) -> EngineJobError {
    EngineJobError::ControlNet(format!("controlnet: {e}"))
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
        let base = &self.model.pipeline.unet.config;
        let metrics = self.shared.metrics.as_ref();
        // Per state of the batch: its ControlNets' names and inputs for this step, and the
        // residuals of each as they come.
        type Pending<'a> = (Vec<&'a str>, SdControlStep, Vec<Option<UNetResiduals>>);
        let mut pending: Vec<Option<Pending>> = Vec::new();
        for (_, a) in self
            .active
            .iter()
            .enumerate()
            .filter(|(i, _)| members.contains(i))
        {
            let names: Vec<&str> = a
                .job
                .params
                .controlnets()
                .map(|c| c.name.as_str())
                .collect();
            for s in &a.states {
                let step = s.control_step().map_err(EngineJobError::from_model)?;
                pending.push(step.map(|step| {
                    let parts = names.iter().map(|_| None).collect();
                    (names.clone(), step, parts)
                }));
            }
        }
        // Each ControlNet once per step, over every state it steers: loading one evicts
        // another when the batch names more than the registry keeps.
        let mut distinct: Vec<&str> = Vec::new();
        for (names, _, _) in pending.iter().flatten() {
            for name in names {
                if !distinct.contains(name) {
                    distinct.push(name);
                }
            }
        }
        for name in distinct {
            let (net, lookup) = self
                .controlnets
                .get(name, Some(base))
                .map_err(EngineJobError::ControlNet)?;
            if let Some(m) = metrics {
                m.controlnet
                    .lookups
                    .with_label_values(&[lookup.as_str()])
                    .inc();
            }
            for (names, step, parts) in pending.iter_mut().flatten() {
                for (k, _) in names.iter().enumerate().filter(|(_, n)| **n == name) {
                    let forward = Instant::now();
                    parts[k] = Some(step.one(k, net).map_err(failed)?);
                    if let Some(m) = metrics {
                        m.controlnet
                            .seconds
                            .observe(forward.elapsed().as_secs_f64());
                    }
                }
            }
        }
        // Summed in the request's order, as MultiControlNetModel sums them.
        let mut out = Vec::with_capacity(pending.len());
        for p in pending {
            let Some((_, _, parts)) = p else {
                out.push(None);
                continue;
            };
            let mut sum: Option<UNetResiduals> = None;
            for r in parts.into_iter().flatten() {
                sum = Some(match sum {
                    Some(total) => total.sum(&r).map_err(failed)?,
                    None => r,
                });
            }
            out.push(sum);
        }
        let share = started.elapsed().as_secs_f64() / steered.len() as f64;
        for i in steered {
            let a = &mut self.active[i];
            a.control_s.observe(share);
            // A job's ControlNets cost it the share together: split evenly among them.
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
        Ok(out)
    }
}
