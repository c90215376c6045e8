//! The ControlNet residuals of a step's steered jobs: computed here on the engine thread from
//! `--controlnet-dir`, or asked of ControlNet workers (`controlnet_service`), for this step
//! (`sync`) or one step ahead (`pipelined`). Remote requests of all rows go out before the
//! engine waits for any, so rows on different workers compute at once; a row whose worker
//! fails falls back to the local ControlNet when the denoiser holds it.
use super::Active;
use crate::controlnet_service::client::{Arrived, Pending, Residuals, SessionLink};
use crate::controlnet_service::wire::from_wire;
use crate::controlnet_service::{RemoteControlNets, RemoteMode};
use crate::metrics::DenoiserMetrics;
use diffmesh_model::controlnets::ControlNets;
use diffmesh_model::flux::{ControlResiduals, FluxConfig};
use diffmesh_model::pipeline::control::ControlStep;
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::tch::{Device, Kind};
use std::sync::Arc;
use std::time::Instant;

/// One steered image's remote session and what is in flight for it.
pub(super) struct RowControl {
    link: Arc<SessionLink>,
    /// Residuals of an earlier step still coming (pipelined).
    pending: Option<Pending>,
    /// The latest residuals that came (pipelined: what the next step adds if nothing newer).
    last: Option<ControlResiduals>,
    /// Where `last` came from (`remote` or `fallback_local`): a step that adds it again is
    /// counted so.
    last_from: &'static str,
}

/// What a row's coming step takes its residuals from.
enum Plan {
    /// Not steered, or done.
    None,
    Local(ControlStep),
    /// Wait for the residuals in flight (of this very step, or pipelined of an earlier one;
    /// none in flight: a pipelined row adds its latest). The step stays for the fallback.
    Remote {
        pending: Option<Pending>,
        step: ControlStep,
    },
}

/// What the engine needs besides the jobs.
pub(super) struct ControlSources<'a> {
    pub local: &'a mut ControlNets,
    pub remote: Option<&'a RemoteControlNets>,
    pub pipeline: &'a FluxPipeline<'a>,
    pub metrics: Option<&'a DenoiserMetrics>,
}

/// Per job of `active` (empty for those not in `members` or not steered), per state: the
/// residuals its coming step adds. A job whose residuals cannot be had gets `failed` set and
/// no rows (it sits the step out and fails).
pub(super) fn residuals_for_step(
    src: &mut ControlSources<'_>,
    active: &mut [Active],
    runs: impl Fn(usize, &Active) -> bool,
) -> Vec<Vec<Option<ControlResiduals>>> {
    let mut plans: Vec<Vec<Plan>> = Vec::with_capacity(active.len());
    for (i, a) in active.iter_mut().enumerate() {
        let plan = if runs(i, a) {
            plan_job(src, a)
        } else {
            Ok(Vec::new())
        };
        plans.push(plan.unwrap_or_else(|e| {
            a.failed = Some(super::EngineJobError::ControlNet(e));
            Vec::new()
        }));
    }
    let waited = Instant::now();
    let mut remote_rows = 0;
    let mut out = Vec::with_capacity(active.len());
    for (a, plan) in active.iter_mut().zip(plans) {
        let rows = plan
            .into_iter()
            .enumerate()
            .map(|(j, p)| {
                remote_rows += matches!(p, Plan::Remote { .. }) as usize;
                resolve(src, a, j, p)
            })
            .collect::<Result<Vec<_>, String>>();
        out.push(rows.unwrap_or_else(|e| {
            // Not held here and not had from a worker: another placement may serve it.
            let held = a
                .job
                .params
                .controlnet
                .as_ref()
                .is_some_and(|c| src.local.holds(&c.name));
            a.failed = Some(match held {
                true => super::EngineJobError::ControlNet(e),
                false => super::EngineJobError::ControlNetAway(e),
            });
            Vec::new()
        }));
    }
    if let (Some(m), true) = (src.metrics, remote_rows > 0) {
        m.controlnet
            .remote_wait_seconds
            .observe(waited.elapsed().as_secs_f64());
    }
    out
}

/// Send what goes to ControlNet workers now; say where each row's residuals come from.
fn plan_job(src: &mut ControlSources<'_>, a: &mut Active) -> Result<Vec<Plan>, String> {
    let Some(control) = a.job.params.controlnet.clone() else {
        return Ok(Vec::new());
    };
    let remote = src.remote.filter(|r| {
        r.mode() != RemoteMode::Off
            && (!a.control_rows.is_empty() || r.workers.serves(&control.name))
    });
    let mut plans = Vec::with_capacity(a.states.len());
    for (j, s) in a.states.iter().enumerate() {
        let Some(step) = s.control_step().map_err(|e| format!("controlnet: {e}"))? else {
            plans.push(Plan::None);
            continue;
        };
        let Some(remote) = remote else {
            plans.push(Plan::Local(step));
            continue;
        };
        if a.control_rows.is_empty() {
            a.control_rows.resize_with(a.states.len(), || None);
        }
        if a.control_rows[j].is_none() {
            let session = format!("{}-{j}", a.job.job_id);
            match remote.open_link(session, &a.job.job_id, &control.name, &step) {
                Ok(link) => {
                    a.control_rows[j] = Some(RowControl {
                        link,
                        pending: None,
                        last: None,
                        last_from: "remote",
                    })
                }
                Err(e) => {
                    tracing::warn!(error = %e, "ControlNet session not made; computing here");
                    plans.push(Plan::Local(step));
                    continue;
                }
            }
        }
        let Some(row) = a.control_rows[j].as_mut() else {
            plans.push(Plan::Local(step));
            continue;
        };
        let (done, total) = s.progress();
        let last_step = done + 1 >= total;
        let plan = match remote.mode() {
            RemoteMode::Pipelined if row.last.is_some() || row.pending.is_some() => {
                // Use what came of an earlier step; ask for this step's for the next one.
                let earlier = row.pending.take();
                if !last_step {
                    row.pending = remote.submit(&row.link, &step).ok();
                }
                Plan::Remote {
                    pending: earlier,
                    step,
                }
            }
            // Sync, and a pipelined row's first step: this step's residuals, now.
            _ => match remote.submit(&row.link, &step) {
                Ok(pending) => Plan::Remote {
                    pending: Some(pending),
                    step,
                },
                Err(e) => {
                    tracing::warn!(error = %e, "ControlNet step not sent; computing here");
                    Plan::Local(step)
                }
            },
        };
        plans.push(plan);
    }
    Ok(plans)
}

/// Row `j`'s residuals: computed here, or waited for (falling back to here on failure).
fn resolve(
    src: &mut ControlSources<'_>,
    a: &mut Active,
    j: usize,
    plan: Plan,
) -> Result<Option<ControlResiduals>, String> {
    let name = match &a.job.params.controlnet {
        Some(c) => c.name.clone(),
        None => return Ok(None),
    };
    let (pending, step) = match plan {
        Plan::None => return Ok(None),
        Plan::Local(step) => return local(src, &name, &step).map(Some),
        Plan::Remote { pending, step } => (pending, step),
    };
    let Some(row) = a.control_rows.get_mut(j).and_then(Option::as_mut) else {
        return local(src, &name, &step).map(Some);
    };
    let arrived = pending.map(|p| {
        p.blocking_recv()
            .unwrap_or_else(|_| Err("the request was dropped".into()))
    });
    let count = |outcome: &str| {
        if let Some(m) = src.metrics {
            m.controlnet.remote.with_label_values(&[outcome]).inc();
        }
    };
    let came = match arrived {
        Some(Ok(r)) => Some(decode(&r, &step, &src.pipeline.transformer.cfg)),
        Some(Err(e)) => Some(Err(e)),
        None => None,
    };
    match came {
        Some(Ok(residuals)) => {
            count("remote");
            if src
                .remote
                .is_some_and(|r| r.mode() == RemoteMode::Pipelined)
            {
                row.last = Some(residuals.shallow_clone());
                row.last_from = "remote";
            }
            Ok(Some(residuals))
        }
        // Pipelined, nothing newer in flight: the latest that came.
        None => match &row.last {
            Some(last) => {
                count(row.last_from);
                Ok(Some(last.shallow_clone()))
            }
            None => {
                count("fallback_local");
                local(src, &name, &step).map(Some)
            }
        },
        Some(Err(e)) => {
            if !src.local.holds(&name) {
                count("failed");
                return Err(format!("controlnet: {e}"));
            }
            tracing::warn!(error = %e, controlnet = %name, "ControlNet worker failed; computing here");
            count("fallback_local");
            let r = local(src, &name, &step)?;
            row.last = Some(r.shallow_clone());
            row.last_from = "fallback_local";
            Ok(Some(r))
        }
    }
}

/// Residuals from the engine's own ControlNets.
fn local(
    src: &mut ControlSources<'_>,
    name: &str,
    step: &ControlStep,
) -> Result<ControlResiduals, String> {
    let started = Instant::now();
    let base = &src.pipeline.transformer.cfg;
    let (r, lookup) = src.local.residuals(name, step, Some(base))?;
    if let Some(m) = src.metrics {
        let c = &m.controlnet;
        c.lookups.with_label_values(&[lookup.as_str()]).inc();
        c.seconds.observe(started.elapsed().as_secs_f64());
    }
    Ok(r)
}

/// Arrived residuals as tensors of the transformer's device and dtype, each `[1, N, inner]`.
fn decode(r: &Arrived, step: &ControlStep, base: &FluxConfig) -> Result<ControlResiduals, String> {
    let Residuals::Flux { double, single } = &r.residuals else {
        return Err(format!(
            "worker {} sent a UNet ControlNet's residuals for a Flux step",
            r.worker
        ));
    };
    let like = &step.inputs.hidden_states;
    let (device, kind): (Device, Kind) = (like.device(), like.kind());
    let expect = [1, like.size()[1], base.inner_dim()];
    let one = |w| -> Result<_, String> {
        let t = from_wire(w, device, "residual")?;
        if t.size() != expect {
            return Err(format!(
                "worker {} sent a residual of {:?}, expected {expect:?}",
                r.worker,
                t.size()
            ));
        }
        t.f_to_kind(kind).map_err(|e| e.to_string())
    };
    Ok(ControlResiduals {
        double: double.iter().map(one).collect::<Result<_, _>>()?,
        single: single.iter().map(one).collect::<Result<_, _>>()?,
    })
}
