//! Mask-aware placement (FlashPS Algorithm 2) and its literal published form.
use crate::cost_model::{BatchTotals, CostModels};
use crate::forecast::Forecaster;
use crate::policy::{argmin_by, Policy, RequestInfo, WorkerState};

/// Picks the worker where the request is predicted to finish first: the worker's running batch
/// and queue plus the request are fast-forwarded with the planner and cost models, so mask
/// sizes, cache-load time and remaining steps all count. A worker that lacks the template's
/// cache pays the part of the cold-fetch time that queueing does not hide; ties go to a worker
/// that holds the template, then to the lowest index.
#[derive(Debug, Default, Clone)]
pub struct MaskAware {
    /// Seconds to bring a template's cache into a worker's fast tier; `None` takes it from the
    /// cost models' slow-tier fit ([`CostModels::cold_fetch_s`], 0 without one, so residency then
    /// only breaks ties).
    pub cold_fetch_s: Option<f64>,
    scratch: Forecaster,
}

impl MaskAware {
    pub fn with_cold_fetch(cold_fetch_s: f64) -> Self {
        MaskAware {
            cold_fetch_s: Some(cold_fetch_s),
            scratch: Forecaster::default(),
        }
    }
}

/// Extra seconds a request pays on a worker without its template's cache: the fetch time not
/// hidden behind the wait before the request joins the batch.
fn cold_penalty(holds: bool, cold_fetch_s: f64, start_s: f64) -> f64 {
    if holds {
        0.0
    } else {
        (cold_fetch_s - start_s).max(0.0)
    }
}

impl Policy for MaskAware {
    fn name(&self) -> &str {
        "mask-aware"
    }

    fn place(
        &mut self,
        req: &RequestInfo,
        workers: &[WorkerState],
        model: &CostModels,
    ) -> Option<usize> {
        let cold = self.cold_fetch_s.unwrap_or_else(|| model.cold_fetch_s());
        let scratch = &mut self.scratch;
        argmin_by(workers, |w| {
            let f = scratch.forecast(w, req, model);
            let holds = w.holds(req.template);
            (f.finish_s + cold_penalty(holds, cold, f.start_s), !holds)
        })
    }
}

/// Like [`MaskAware`], but minimises the delay the request adds to everyone on the worker (its
/// own latency plus how much it slows the requests it shares steps with), not only its own
/// finish time: a greedy step towards minimising total latency rather than each arrival's.
#[derive(Debug, Default, Clone)]
pub struct MaskAwareMarginal {
    /// As [`MaskAware::cold_fetch_s`].
    pub cold_fetch_s: Option<f64>,
    scratch: Forecaster,
}

impl Policy for MaskAwareMarginal {
    fn name(&self) -> &str {
        "mask-aware-marginal"
    }

    fn place(
        &mut self,
        req: &RequestInfo,
        workers: &[WorkerState],
        model: &CostModels,
    ) -> Option<usize> {
        let cold = self.cold_fetch_s.unwrap_or_else(|| model.cold_fetch_s());
        let scratch = &mut self.scratch;
        argmin_by(workers, |w| {
            let with = scratch.total_finish(w, Some(req), model);
            let without = scratch.total_finish(w, None, model);
            let holds = w.holds(req.template);
            let penalty = if holds || cold <= 0.0 {
                0.0
            } else {
                cold_penalty(false, cold, scratch.forecast(w, req, model).start_s)
            };
            (with - without + penalty, !holds)
        })
    }
}

/// Algorithm 2 as published: among workers with slack in their batch (all accepting workers if
/// none has), the lowest planned step latency of the batch plus the new request. It ignores
/// remaining steps and queue waits; kept as a reference point.
#[derive(Debug, Default, Clone, Copy)]
pub struct FlashPsGreedy;

impl Policy for FlashPsGreedy {
    fn name(&self) -> &str {
        "flashps-greedy"
    }

    fn place(
        &mut self,
        req: &RequestInfo,
        workers: &[WorkerState],
        model: &CostModels,
    ) -> Option<usize> {
        let slack = |w: &WorkerState| w.requests() < w.limits.max_batch as usize;
        let any_slack = workers.iter().any(|w| w.accepts() && slack(w));
        argmin_by(workers, |w| {
            if any_slack && !slack(w) {
                return f64::INFINITY;
            }
            let mut t = BatchTotals::default();
            for r in w.running.iter().chain(&w.queued) {
                t.add(&model.shape, r.masked_tokens);
            }
            t.add(&model.shape, req.masked_tokens);
            model.step_latency(&t) * w.step_time_factor
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forecast::tests::token_seconds_model;
    use crate::policy::tests::{new_req, worker};
    use crate::policy::{ActiveRequest, RequestCount, TokenCount};
    use crate::synthetic;

    fn active(masked: u32, remaining: u32) -> ActiveRequest {
        ActiveRequest {
            masked_tokens: masked,
            remaining_steps: remaining,
        }
    }

    #[test]
    fn remaining_steps_beat_counts() {
        let m = synthetic::default_models();
        // Worker 0: one small-mask request just started (28 steps left). Worker 1: one large-mask
        // request about to finish. The counts favour worker 0; the new request finishes
        // sooner on worker 1, which is free after one step.
        let ws = vec![
            worker(&[active(0, 28)], &[]),
            worker(&[active(800, 1)], &[]),
        ];
        assert_eq!(RequestCount.place(&new_req(), &ws, &m), Some(0));
        assert_eq!(TokenCount.place(&new_req(), &ws, &m), Some(0));
        assert_eq!(MaskAware::default().place(&new_req(), &ws, &m), Some(1));
    }

    #[test]
    fn mask_sizes_count_in_the_queue() {
        // Step seconds = summed masked tokens. Worker 0 runs two 1-token requests, worker 1
        // one 50-token request. Worker 0 runs the new 10-token request at
        // 12 s per step, worker 1 at 60 s, although worker 0 holds more requests.
        let m = token_seconds_model();
        let mut ws = vec![
            worker(&[active(1, 3), active(1, 3)], &[]),
            worker(&[active(50, 3)], &[]),
        ];
        for w in &mut ws {
            w.limits.max_batch = 4;
        }
        let req = RequestInfo {
            masked_tokens: 10,
            steps: 3,
            template: None,
        };
        assert_eq!(RequestCount.place(&req, &ws, &m), Some(1));
        assert_eq!(MaskAware::default().place(&req, &ws, &m), Some(0));
    }

    #[test]
    fn template_residency_breaks_ties_and_costs_a_cold_fetch() {
        let m = synthetic::default_models();
        let req = RequestInfo {
            template: Some(7),
            ..new_req()
        };
        let mut ws = vec![worker(&[], &[]), worker(&[], &[])];
        ws[1].resident_templates = vec![7];
        assert_eq!(MaskAware::default().place(&req, &ws, &m), Some(1));
        // Worker 0 idle but cold; worker 1 holds the template behind a short request.
        let mut ws = vec![worker(&[], &[]), worker(&[active(100, 1)], &[])];
        ws[1].resident_templates = vec![7];
        assert_eq!(MaskAware::default().place(&req, &ws, &m), Some(0));
        assert_eq!(
            MaskAware::with_cold_fetch(30.0).place(&req, &ws, &m),
            Some(1)
        );
    }

    #[test]
    fn marginal_counts_the_slowdown_of_co_runners() {
        // Step seconds = summed masked tokens; the new request has 10 tokens and 3 steps.
        // Worker 0 runs one 30-token request with 3 steps left: the new one finishes at
        // 3 * 40 = 120 and delays the old one by 30 s -> marginal 150.
        // Worker 1 runs four 1-token requests with 30 steps left: the new one finishes at
        // 3 * 14 = 42 but delays each of the four by 3 * 10 = 30 s -> marginal 42 + 120 = 162.
        // Own-finish picks worker 1, marginal picks worker 0.
        let m = token_seconds_model();
        let ws = vec![
            worker(&[active(30, 3)], &[]),
            worker(
                &[active(1, 30), active(1, 30), active(1, 30), active(1, 30)],
                &[],
            ),
        ];
        let req = RequestInfo {
            masked_tokens: 10,
            steps: 3,
            template: None,
        };
        assert_eq!(MaskAware::default().place(&req, &ws, &m), Some(1));
        assert_eq!(MaskAwareMarginal::default().place(&req, &ws, &m), Some(0));
    }

    #[test]
    fn dead_workers_are_never_chosen() {
        let m = synthetic::default_models();
        let mut ws = vec![worker(&[], &[]), worker(&[active(100, 20)], &[])];
        ws[0].alive = false;
        assert_eq!(MaskAware::default().place(&new_req(), &ws, &m), Some(1));
        ws[1].alive = false;
        assert_eq!(MaskAware::default().place(&new_req(), &ws, &m), None);
    }

    #[test]
    fn flashps_greedy_prefers_slack_then_lowest_step() {
        let m = synthetic::default_models();
        let full: Vec<_> = (0..8).map(|_| active(10, 1)).collect();
        let ws = vec![
            worker(&full, &[]),
            worker(&[active(2000, 28), active(2000, 28)], &[]),
            worker(&[active(100, 28), active(100, 28)], &[]),
        ];
        assert_eq!(FlashPsGreedy.place(&new_req(), &ws, &m), Some(2));
    }
}
