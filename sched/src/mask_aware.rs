//! Mask-aware placement (FlashPS Algorithm 2) and its literal published form.
use crate::cost_model::{BatchTotals, CostModels};
use crate::forecast::Forecaster;
use crate::policy::{argmin_by, Policy, RequestInfo, WorkerState};

/// Picks the worker where the request is predicted to finish first: the worker's running batch
/// and queue plus the request are fast-forwarded with the planner and cost models, so mask
/// sizes, cache-load time and remaining steps all count. A worker that lacks the template's
/// cache pays the part of the cold-fetch time that queueing does not hide; ties go to a worker
/// that holds the template, then to one that holds its LoRA adapters, then to the lowest index.
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
            let key = f.finish_s + cold_penalty(holds, cold, f.start_s);
            (key, !holds, !w.holds_all(req))
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

/// How a worker ranks for a request (lower first): its cost, then not holding the template's
/// cache, then not holding the LoRA adapters.
type Ranking = (f64, bool, bool);

/// [`MaskAwareMarginal`]'s pick, with what [`MaskAwareDeferring`] weighs it against.
#[derive(Debug, Clone, Copy)]
struct MarginalChoice {
    index: usize,
    /// Delay the request adds to everyone on the pick, itself included.
    marginal_s: f64,
    /// Seconds the request adds to the time the pick needs to run everything it holds.
    added_work_s: f64,
    /// Seconds until the first accepting worker drains, and that worker's step-time factor.
    first_drain_s: f64,
    first_drain_factor: f64,
}

impl MaskAwareMarginal {
    /// One forecast with the request and one without per accepting worker.
    fn choose(
        &mut self,
        req: &RequestInfo,
        workers: &[WorkerState],
        model: &CostModels,
    ) -> Option<MarginalChoice> {
        let cold = self.cold_fetch_s.unwrap_or_else(|| model.cold_fetch_s());
        let f = &mut self.scratch;
        // Index, marginal and added work of the best so far, with its ranking key.
        let mut best: Option<(usize, f64, f64, Ranking)> = None;
        let mut first_drain = (f64::INFINITY, 1.0);
        for (i, w) in workers.iter().enumerate() {
            if !w.accepts() {
                continue;
            }
            let with = f.drain(w, Some(req), model);
            let without = f.drain(w, None, model);
            if without.drain_s < first_drain.0 {
                first_drain = (without.drain_s, w.step_time_factor);
            }
            let holds = w.holds(req.template);
            let penalty = if holds || cold <= 0.0 {
                0.0
            } else {
                cold_penalty(false, cold, with.request.start_s)
            };
            let marginal_s = with.total_finish_s - without.total_finish_s;
            let key = (marginal_s + penalty, !holds, !w.holds_all(req));
            if best.as_ref().is_none_or(|b| key < b.3) {
                best = Some((i, marginal_s, with.drain_s - without.drain_s, key));
            }
        }
        best.map(|(index, marginal_s, added_work_s, _)| MarginalChoice {
            index,
            marginal_s,
            added_work_s,
            first_drain_s: first_drain.0,
            first_drain_factor: first_drain.1,
        })
    }
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
        self.choose(req, workers, model).map(|c| c.index)
    }
}

/// [`MaskAwareMarginal`] that may also hold a request back at the router, to run it alone on
/// the first worker to drain, when that costs less than joining a batch now. Whether sharing a
/// step pays is read off the cost models: on a GPU a step of eight costs little more than a
/// step of one, so joining a batch adds little work and the policy places at once; on a CPU a
/// batch costs about the sum of its rows, so a request that joins a busy worker saves no
/// capacity and only slows everyone on it (processor sharing), while holding it keeps workers
/// first-come first-served, which has the shorter tail for requests of similar size.
///
/// - Placing now on the marginal policy's pick `w`: the delay it adds to everyone on `w`, its
///   own latency included.
/// - Holding: it runs alone once the first worker drains (its wait plus its standalone time),
///   and the requests waiting behind it lose the capacity batching would have saved: the work
///   it adds to `w` short of its standalone time, shared over the live workers.
///
/// A request is never held while a worker is idle (holding then costs at least as much as
/// running there), so held requests never leave a worker idle.
#[derive(Debug, Clone)]
pub struct MaskAwareDeferring {
    /// Hold only where joining the pick's batch saves less than this fraction of the request's
    /// standalone work: near saturation any capacity given up is paid by everyone after.
    pub max_saving: f64,
    marginal: MaskAwareMarginal,
}

impl Default for MaskAwareDeferring {
    fn default() -> Self {
        MaskAwareDeferring {
            max_saving: 0.05,
            marginal: MaskAwareMarginal::default(),
        }
    }
}

impl Policy for MaskAwareDeferring {
    fn name(&self) -> &str {
        "mask-aware-deferring"
    }

    fn place(
        &mut self,
        req: &RequestInfo,
        workers: &[WorkerState],
        model: &CostModels,
    ) -> Option<usize> {
        let pick = self.marginal.choose(req, workers, model)?;
        // With a worker idle there is nothing to wait for, even if the pick is another worker
        // (one that holds the template, say).
        let Some(behind) = req.waiting_behind.filter(|_| pick.first_drain_s > 0.0) else {
            return Some(pick.index);
        };
        let w = &workers[pick.index];
        let alone =
            model.standalone_request_s(req.masked_tokens, req.steps.max(1), w.footprint_of(req));
        let saved = (alone * w.step_time_factor - pick.added_work_s).max(0.0);
        if saved > self.max_saving * alone * w.step_time_factor {
            return Some(pick.index);
        }
        let live = workers.iter().filter(|w| w.alive).count().max(1) as f64;
        let hold =
            pick.first_drain_s + alone * pick.first_drain_factor + behind as f64 * saved / live;
        (pick.marginal_s <= hold).then_some(pick.index)
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
        let slack = |w: &WorkerState| w.rows() < u64::from(w.limits.max_batch);
        let any_slack = workers.iter().any(|w| w.accepts() && slack(w));
        argmin_by(workers, |w| {
            if any_slack && !slack(w) {
                return f64::INFINITY;
            }
            let mut t = BatchTotals::default();
            for r in w.running.iter().chain(&w.queued) {
                t.add_request(&model.shape, r.masked_tokens, r.footprint);
            }
            t.add_request(&model.shape, req.masked_tokens, w.footprint_of(req));
            model.step_latency(&t) * w.step_time_factor
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forecast::tests::token_seconds_model;
    use crate::policy::tests::{new_req, worker};
    use crate::policy::{ActiveRequest, Footprint, RequestCount, TokenCount};
    use crate::synthetic;

    fn active(masked: u32, remaining: u32) -> ActiveRequest {
        ActiveRequest {
            masked_tokens: masked,
            footprint: Footprint::ONE_ROW,
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
            footprint: Footprint::ONE_ROW,
            steps: 3,
            template: None,
            loras: crate::policy::NameKeys::NONE,
            controlnets: crate::policy::NameKeys::NONE,
            waiting_behind: Some(0),
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
    fn lora_residency_breaks_ties_after_the_template() {
        let m = synthetic::default_models();
        let req = RequestInfo {
            loras: crate::policy::NameKeys::of(["style"]),
            controlnets: crate::policy::NameKeys::NONE,
            ..new_req()
        };
        let key = crate::policy::template_key("style");
        let mut ws = vec![worker(&[], &[]), worker(&[], &[]), worker(&[], &[])];
        ws[2].resident_loras = vec![key];
        assert_eq!(MaskAware::default().place(&req, &ws, &m), Some(2));
        assert_eq!(MaskAwareMarginal::default().place(&req, &ws, &m), Some(2));
        // Without LoRAs every idle worker ties: the lowest index.
        assert_eq!(MaskAware::default().place(&new_req(), &ws, &m), Some(0));
        // The template's cache counts first: worker 1 holds it, worker 2 only the LoRA.
        let req = RequestInfo {
            template: Some(7),
            ..req
        };
        ws[1].resident_templates = vec![7];
        assert_eq!(MaskAware::default().place(&req, &ws, &m), Some(1));
        // Not a tie: a busy worker with the LoRA loses to an idle one without it.
        let mut ws = vec![worker(&[], &[]), worker(&[active(100, 5)], &[])];
        ws[1].resident_loras = vec![key];
        let req = RequestInfo {
            loras: crate::policy::NameKeys::of(["style"]),
            controlnets: crate::policy::NameKeys::NONE,
            ..new_req()
        };
        assert_eq!(MaskAware::default().place(&req, &ws, &m), Some(0));
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
            footprint: Footprint::ONE_ROW,
            steps: 3,
            template: None,
            loras: crate::policy::NameKeys::NONE,
            controlnets: crate::policy::NameKeys::NONE,
            waiting_behind: Some(0),
        };
        assert_eq!(MaskAware::default().place(&req, &ws, &m), Some(1));
        assert_eq!(MaskAwareMarginal::default().place(&req, &ws, &m), Some(0));
    }

    #[test]
    fn deferring_holds_where_batching_saves_no_work() {
        // Step seconds = summed masked tokens (a batch costs the sum of its rows). Worker 0
        // runs a 10-token request with one step left, worker 1 one with 30 steps left. Joining
        // worker 0 now: the new 10-token, 3-step request finishes at 20 + 10 + 10 = 40 and
        // delays the other by 10 -> 50. Waiting for worker 0 to drain (10 s) and running alone
        // (30 s) -> 40: hold.
        let m = token_seconds_model();
        let ws = vec![
            worker(&[active(10, 1)], &[]),
            worker(&[active(10, 30)], &[]),
        ];
        let req = RequestInfo {
            masked_tokens: 10,
            footprint: Footprint::ONE_ROW,
            steps: 3,
            template: None,
            loras: crate::policy::NameKeys::NONE,
            controlnets: crate::policy::NameKeys::NONE,
            waiting_behind: Some(0),
        };
        let mut p = MaskAwareDeferring::default();
        assert_eq!(p.place(&req, &ws, &m), None);
        // The marginal policy it refines places it on worker 0.
        assert_eq!(MaskAwareMarginal::default().place(&req, &ws, &m), Some(0));
        // A caller that cannot keep the request waiting gets the marginal pick.
        let must = RequestInfo {
            waiting_behind: None,
            ..req
        };
        assert_eq!(p.place(&must, &ws, &m), Some(0));
        // An idle worker is never passed over.
        let with_idle = vec![ws[0].clone(), ws[1].clone(), worker(&[], &[])];
        assert_eq!(p.place(&req, &with_idle, &m), Some(2));
        // Nor held for while one is idle: here the pick is worker 0, which holds the template,
        // over the idle worker 2 that would fetch it cold (30 s), and it goes there now.
        let mut cached = with_idle.clone();
        cached[0].resident_templates = vec![7];
        cached[1].resident_templates = vec![7];
        let templated = RequestInfo {
            template: Some(7),
            ..req
        };
        let mut cold = MaskAwareDeferring {
            marginal: MaskAwareMarginal {
                cold_fetch_s: Some(30.0),
                ..MaskAwareMarginal::default()
            },
            ..MaskAwareDeferring::default()
        };
        assert_eq!(cold.place(&templated, &cached, &m), Some(0));
    }

    #[test]
    fn deferring_places_at_once_where_batching_saves_work() {
        // The tiny model measured on an H100: a step of two costs far less than two steps of
        // one, so holding would give up capacity and the request goes now.
        let m = CostModels::fit(&crate::profiles::builtin("tiny-h100").unwrap()).unwrap();
        let ws = vec![
            worker(&[active(20, 1)], &[]),
            worker(&[active(20, 20)], &[]),
        ];
        let mut p = MaskAwareDeferring::default();
        let got = p.place(&new_req(), &ws, &m);
        assert!(got.is_some());
        assert_eq!(got, MaskAwareMarginal::default().place(&new_req(), &ws, &m));
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
