//! Forecast of when a new request would start and finish on a worker: a fast-forward of the
//! worker's running batch and queue under the engine's batching rule, with every step's latency
//! from the cost models and the exact planner (the "extend Algorithm 1" of FlashPS Algorithm 2).
//!
//! Between two retirements the batch is fixed, so one planner call covers a whole phase; a
//! forecast costs O(requests) planner calls of O(1) each.
use crate::batching::admit_count;
use crate::cost_model::{BatchTotals, CostModels, RowCost};
use crate::policy::{ActiveRequest, Footprint, RequestInfo, WorkerState};

/// Predicted seconds from now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Forecast {
    /// When the new request joins the running batch.
    pub start_s: f64,
    pub finish_s: f64,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Tokens the request's rows compute per block (what the batching rule's token budget counts).
    computed: u64,
    /// The request's cost-model sums, so a phase only adds them up.
    row: RowCost,
    remaining: u32,
    is_new: bool,
}

impl Slot {
    fn new(model: &CostModels, r: &ActiveRequest, remaining: u32, is_new: bool) -> Self {
        Slot {
            computed: model.shape.request_tokens(r.masked_tokens, r.footprint),
            row: RowCost::of_request(&model.shape, r.masked_tokens, r.footprint),
            remaining,
            is_new,
        }
    }
}

/// A worker's forecast run to the end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Drain {
    /// Sum of every request's predicted finish time ([`Forecaster::total_finish`]).
    pub total_finish_s: f64,
    /// Seconds until the worker holds nothing (0 when idle).
    pub drain_s: f64,
    /// When `req` (if given) starts and finishes, as [`Forecaster::forecast`] gives it.
    pub request: Forecast,
}

/// Reusable scratch space so a forecast allocates nothing in steady state.
#[derive(Debug, Default, Clone)]
pub struct Forecaster {
    batch: Vec<Slot>,
}

impl Forecaster {
    /// Forecast of `req` placed at the tail of `worker`'s queue.
    pub fn forecast(
        &mut self,
        worker: &WorkerState,
        req: &RequestInfo,
        model: &CostModels,
    ) -> Forecast {
        self.run(worker, Some(req), model, false).0
    }

    /// Sum over every request on the worker (and `req`, if given) of its predicted finish time:
    /// the difference with and without `req` is the delay it adds to everyone, itself included.
    pub fn total_finish(
        &mut self,
        worker: &WorkerState,
        req: Option<&RequestInfo>,
        model: &CostModels,
    ) -> f64 {
        self.drain(worker, req, model).total_finish_s
    }

    /// The worker run until it holds nothing, with `req` if given.
    pub fn drain(
        &mut self,
        worker: &WorkerState,
        req: Option<&RequestInfo>,
        model: &CostModels,
    ) -> Drain {
        let (request, total_finish_s, drain_s) = self.run(worker, req, model, true);
        Drain {
            total_finish_s,
            drain_s,
            request,
        }
    }

    /// Fast-forward; stops when the new request finishes unless `drain`.
    fn run(
        &mut self,
        worker: &WorkerState,
        req: Option<&RequestInfo>,
        model: &CostModels,
        drain: bool,
    ) -> (Forecast, f64, f64) {
        let shape = &model.shape;
        let new = req.map(|r| ActiveRequest {
            masked_tokens: r.masked_tokens,
            footprint: worker.footprint_of(r),
            remaining_steps: r.steps.max(1),
        });
        let queue_len = worker.queued.len() + usize::from(new.is_some());
        let queued = |i: usize| -> ActiveRequest {
            match (worker.queued.get(i), new) {
                (Some(q), _) => *q,
                (None, Some(n)) => n,
                (None, None) => ActiveRequest {
                    masked_tokens: 0,
                    footprint: Footprint::ONE_ROW,
                    remaining_steps: 1,
                },
            }
        };
        self.batch.clear();
        self.batch.extend(
            worker
                .running
                .iter()
                .filter(|r| r.remaining_steps > 0)
                .map(|r| Slot::new(model, r, r.remaining_steps, false)),
        );
        let mut t = worker.step_remaining_s.max(0.0);
        // Running requests with no step left finish when the step in flight ends.
        let mut sum_finish = t * worker
            .running
            .iter()
            .filter(|r| r.remaining_steps == 0)
            .count() as f64;
        let mut start = None;
        let mut finish = None;
        let mut next = 0;
        loop {
            let tokens: u64 = self.batch.iter().map(|s| s.computed).sum();
            let rows: u32 = self.batch.iter().map(|s| s.row.rows).sum();
            let admit = admit_count(
                &worker.limits,
                rows,
                tokens,
                (next..queue_len).map(|i| {
                    let q = queued(i);
                    (
                        q.footprint.rows,
                        shape.request_tokens(q.masked_tokens, q.footprint),
                    )
                }),
            );
            for i in next..next + admit {
                let q = queued(i);
                let is_new = new.is_some() && i + 1 == queue_len;
                if is_new {
                    start = Some(t);
                }
                self.batch
                    .push(Slot::new(model, &q, q.remaining_steps.max(1), is_new));
            }
            next += admit;
            let Some(phase) = self.batch.iter().map(|s| s.remaining).min() else {
                break;
            };
            let mut totals = BatchTotals::default();
            for s in &self.batch {
                totals.add_row(&s.row);
            }
            t += phase as f64 * model.step_latency(&totals) * worker.step_time_factor;
            for s in &mut self.batch {
                s.remaining -= phase;
                if s.remaining == 0 {
                    sum_finish += t;
                    if s.is_new {
                        finish = Some(t);
                    }
                }
            }
            if finish.is_some() && !drain {
                break;
            }
            self.batch.retain(|s| s.remaining > 0);
        }
        let finish = finish.unwrap_or(t);
        let forecast = Forecast {
            start_s: start.unwrap_or(finish),
            finish_s: finish,
        };
        (forecast, sum_finish, t)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::batching::BatchLimits;
    use crate::compute_fit::ComputeFit;
    use crate::cost_model::{LinearFit, ModelShape};

    /// One block, no text, H = 1, 100 image tokens, free loads: a step costs the batch's summed
    /// masked tokens in seconds (cached FLOPs per request = 424 * masked).
    pub(crate) fn token_seconds_model() -> CostModels {
        CostModels {
            label: "test".into(),
            synthetic: true,
            shape: ModelShape {
                blocks: 1,
                hidden: 1,
                image_tokens: 100,
                text_tokens: 0,
                cache_bytes_per_token: 1,
                steps: 10,
                cache_layout: Default::default(),
            },
            compute: ComputeFit::from_line(LinearFit {
                slope: 1.0 / 424.0,
                intercept: 0.0,
                r2: 1.0,
                samples: 0,
            }),
            load: LinearFit {
                slope: 0.0,
                intercept: 0.0,
                r2: 1.0,
                samples: 0,
            },
            disk_load: None,
            step_overhead: None,
            job_work: None,
        }
    }

    #[test]
    fn hand_computed_timeline() {
        let m = token_seconds_model();
        let w = WorkerState {
            running: vec![ActiveRequest {
                masked_tokens: 2,
                footprint: Footprint::ONE_ROW,
                remaining_steps: 3,
            }],
            queued: vec![ActiveRequest {
                masked_tokens: 1,
                footprint: Footprint::ONE_ROW,
                remaining_steps: 2,
            }],
            step_remaining_s: 0.5,
            limits: BatchLimits {
                max_batch: 2,
                ..BatchLimits::default()
            },
            ..WorkerState::idle(BatchLimits::default())
        };
        let req = RequestInfo {
            masked_tokens: 4,
            footprint: Footprint::ONE_ROW,
            steps: 1,
            template: None,
            loras: crate::policy::NameKeys::NONE,
            controlnets: crate::policy::NameKeys::NONE,
            waiting_behind: Some(0),
        };
        // t=0.5: batch {2,1} runs 2 steps of 3 s -> 6.5; the queued one retires, the new one
        // joins: batch {2,4} runs 1 step of 6 s -> 12.5.
        let f = Forecaster::default().forecast(&w, &req, &m);
        assert!((f.start_s - 6.5).abs() < 1e-9, "{f:?}");
        assert!((f.finish_s - 12.5).abs() < 1e-9, "{f:?}");
        // Everyone: running one at 12.5, queued one at 6.5, new one at 12.5; without the new
        // one: 6.5, then the running one alone for 1 step of 2 s -> 8.5.
        let mut fc = Forecaster::default();
        assert!((fc.total_finish(&w, Some(&req), &m) - 31.5).abs() < 1e-9);
        assert!((fc.total_finish(&w, None, &m) - 15.0).abs() < 1e-9);
    }

    #[test]
    fn a_steered_request_costs_its_controlnet_as_the_worker_measured_it() {
        let m = token_seconds_model();
        let steered = RequestInfo {
            masked_tokens: 4,
            footprint: Footprint::ONE_ROW,
            steps: 2,
            template: None,
            loras: crate::policy::NameKeys::NONE,
            controlnets: crate::policy::NameKeys::of_keys([7]),
            waiting_behind: Some(0),
        };
        // Alone: 4 s a step of the batched forward.
        let unmeasured = WorkerState::idle(BatchLimits::default());
        let f = Forecaster::default().forecast(&unmeasured, &steered, &m);
        assert!((f.finish_s - 8.0).abs() < 1e-9, "{f:?}");
        // A worker whose step loop spends 1.5 s a step on that ControlNet (another one: 9 s).
        let measured = WorkerState {
            controlnet_step_s: vec![(3, 9.0), (7, 1.5)],
            ..WorkerState::idle(BatchLimits::default())
        };
        let f = Forecaster::default().forecast(&measured, &steered, &m);
        assert!((f.finish_s - 11.0).abs() < 1e-9, "{f:?}");
        // A running steered request slows every step the new one shares with it.
        let busy = WorkerState {
            running: vec![ActiveRequest {
                masked_tokens: 2,
                footprint: Footprint::ONE_ROW.with_control_s(1.0),
                remaining_steps: 1,
            }],
            ..WorkerState::idle(BatchLimits::default())
        };
        let plain = RequestInfo {
            controlnets: crate::policy::NameKeys::NONE,
            ..steered
        };
        // Step 1: {2, 4} + 1 s = 7 s; step 2: {4} = 4 s.
        let f = Forecaster::default().forecast(&busy, &plain, &m);
        assert!((f.finish_s - 11.0).abs() < 1e-9, "{f:?}");
        // Nonsense measurements cost nothing.
        assert_eq!(Footprint::ONE_ROW.with_control_s(f64::NAN).control_s, 0.0);
        assert_eq!(Footprint::ONE_ROW.with_control_s(-1.0).control_s, 0.0);
    }

    #[test]
    fn a_guided_request_costs_its_rows_and_waits_for_room_for_both() {
        let m = token_seconds_model();
        let guided = |masked| RequestInfo {
            masked_tokens: masked,
            footprint: Footprint::new(1, true),
            steps: 1,
            template: None,
            loras: crate::policy::NameKeys::NONE,
            controlnets: crate::policy::NameKeys::NONE,
            waiting_behind: Some(0),
        };
        // Alone: two rows of 4 masked tokens, a step of 8 s.
        let idle = WorkerState::idle(BatchLimits::default());
        let f = Forecaster::default().forecast(&idle, &guided(4), &m);
        assert!((f.finish_s - 8.0).abs() < 1e-9, "{f:?}");
        // One running row of 2 (3 steps) and batches of 2 rows: no room for both rows until
        // it retires at 6 s.
        let w = WorkerState {
            running: vec![ActiveRequest {
                masked_tokens: 2,
                footprint: Footprint::ONE_ROW,
                remaining_steps: 3,
            }],
            limits: BatchLimits {
                max_batch: 2,
                ..BatchLimits::default()
            },
            ..WorkerState::idle(BatchLimits::default())
        };
        let f = Forecaster::default().forecast(&w, &guided(4), &m);
        assert!((f.start_s - 6.0).abs() < 1e-9, "{f:?}");
        assert!((f.finish_s - 14.0).abs() < 1e-9, "{f:?}");
    }

    #[test]
    fn idle_worker_forecast_is_standalone_time() {
        let m = crate::synthetic::default_models();
        let req = RequestInfo {
            masked_tokens: 450,
            footprint: Footprint::ONE_ROW,
            steps: 28,
            template: None,
            loras: crate::policy::NameKeys::NONE,
            controlnets: crate::policy::NameKeys::NONE,
            waiting_behind: Some(0),
        };
        let f =
            Forecaster::default().forecast(&WorkerState::idle(BatchLimits::default()), &req, &m);
        assert_eq!(f.start_s, 0.0);
        assert!((f.finish_s - m.standalone_s(450, 28)).abs() < 1e-12);
    }
}
