//! Steered UNet generations' ControlNet residuals, computed on the engine thread from the
//! ControlNets of `--controlnet-dir` (diffusers' `ControlNetModel`, checked against this UNet
//! when loaded) before each batched step; and what they cost, reported as the Flux engine
//! reports its own (`diffmesh_denoiser_controlnet_*`, heartbeats' `controlnet_step_s`).
use super::UnetEngine;
use crate::engine::EngineJobError;
use diffmesh_model::unet::UNetResiduals;
use std::time::Instant;

impl UnetEngine {
    /// Per state of the jobs at `members` (indices into `active`, in order), its ControlNet's
    /// residuals for this step; empty when none of them is steered. The time is shared evenly
    /// by the steered jobs.
    pub(super) fn control_residuals(
        &mut self,
        members: &[usize],
    ) -> Result<Vec<Option<UNetResiduals>>, EngineJobError> {
        let steered: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&i| self.active[i].job.params.controlnet.is_some())
            .collect();
        if steered.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let base = &self.model.pipeline.unet.config;
        let metrics = self.shared.metrics.as_ref();
        let mut out = Vec::new();
        for (_, a) in self
            .active
            .iter()
            .enumerate()
            .filter(|(i, _)| members.contains(i))
        {
            let name = a.job.params.controlnet.as_ref().map(|c| c.name.as_str());
            for s in &a.states {
                let step = s.control_step().map_err(EngineJobError::from_model)?;
                let (Some(name), Some(step)) = (name, step) else {
                    out.push(None);
                    continue;
                };
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
                let forward = Instant::now();
                let r = step
                    .residuals(&[net])
                    .map_err(|e| EngineJobError::ControlNet(format!("controlnet: {e}")))?;
                if let Some(m) = metrics {
                    m.controlnet
                        .seconds
                        .observe(forward.elapsed().as_secs_f64());
                }
                out.push(Some(r));
            }
        }
        let share = started.elapsed().as_secs_f64() / steered.len() as f64;
        for i in steered {
            let a = &mut self.active[i];
            a.control_s.observe(share);
            if let Some(c) = &a.job.params.controlnet {
                self.control_costs.observe(&c.name, share);
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
