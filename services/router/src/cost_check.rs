//! Checks the cost model against the steps denoisers report (`Heartbeat::recent_steps`). The
//! router ranks workers by predicted latency from a profile measured on some machine; on other
//! hardware, in another dtype, or under co-running load, every prediction is off by a factor.
//! Each reported step's measured time over the model's prediction for the same batch is
//! exported (`diffmesh_router_step_prediction_ratio`) and smoothed per worker
//! ([`StepCalibration`]); placement scales that worker's forecasts by the result
//! ([`CostCheck::step_time_factor`]), so a mixed fleet is ranked by what each worker really
//! takes. A worker whose smoothed ratio stays off by more than [`OFF_FACTOR`] is still named in
//! a warning (at most every [`WARN_EVERY`]): the profile is for another machine or model.
use diffmesh_sched::calibration::{StepCalibration, MIN_SAMPLES};
use diffmesh_sched::cost_model::{BatchTotals, Footprint};
use diffmesh_sched::CostModels;
use diffmesh_shared::wire::messages::{StepJob, StepSample};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A smoothed measured/predicted ratio beyond this factor (either way) is reported.
pub const OFF_FACTOR: f64 = 2.0;
/// How often the warning for one worker repeats while its ratio stays off.
pub const WARN_EVERY: Duration = Duration::from_secs(600);
/// A worker not heard of for this long is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// Predicted time of one step of a batch of `jobs`, in the terms the router places with
/// (`worker_state::job_masked_tokens`, `job_footprint`): each row of a full-compute job counts
/// every image token of the profile's grid, a mask-aware row its mask ratio of them, and each
/// job's cache bytes count once per stream (a guided image's two rows read one).
pub fn predicted_step_s(models: &CostModels, jobs: &[StepJob]) -> f64 {
    let shape = &models.shape;
    let mut totals = BatchTotals::default();
    for j in jobs {
        let masked = if j.mask_ratio >= 1.0 {
            shape.image_tokens
        } else {
            shape.masked_tokens(f64::from(j.mask_ratio))
        };
        let footprint = Footprint {
            rows: j.rows,
            cache_streams: j.cache_streams,
            control_s: 0.0,
        }
        .with_control_s(j.control_s);
        totals.add_request(shape, masked, footprint);
    }
    models.step_latency(&totals)
}

#[derive(Debug)]
struct WorkerFit {
    calibration: StepCalibration,
    warned_at: Option<Instant>,
    seen_at: Instant,
}

/// What one heartbeat's steps showed.
#[derive(Debug, Default, PartialEq)]
pub struct CostReport {
    /// Measured / predicted, one per usable sample.
    pub ratios: Vec<f64>,
    /// The worker's step-time factor after these samples ([`CostCheck::step_time_factor`]).
    pub factor: f64,
    /// The worker's smoothed ratio, when it is off by more than [`OFF_FACTOR`] and a warning
    /// is due.
    pub warn: Option<f64>,
}

#[derive(Debug, Default)]
pub struct CostCheck {
    workers: HashMap<String, WorkerFit>,
}

impl CostCheck {
    pub fn observe(
        &mut self,
        worker: &str,
        steps: &[StepSample],
        models: &CostModels,
        now: Instant,
    ) -> CostReport {
        self.workers
            .retain(|_, w| now.saturating_duration_since(w.seen_at) < FORGET_AFTER);
        let mut report = CostReport {
            factor: self.step_time_factor(worker),
            ..CostReport::default()
        };
        if steps.is_empty() {
            return report;
        }
        let fit = self
            .workers
            .entry(worker.to_string())
            .or_insert_with(|| WorkerFit {
                calibration: StepCalibration::default(),
                warned_at: None,
                seen_at: now,
            });
        fit.seen_at = now;
        for s in steps {
            let predicted = predicted_step_s(models, &s.step_jobs());
            if let Some(ratio) = fit.calibration.observe(s.seconds, predicted) {
                report.ratios.push(ratio);
            }
        }
        report.factor = fit.calibration.factor();
        let smoothed = fit.calibration.ratio();
        let off = smoothed.ln().abs() > OFF_FACTOR.ln();
        let due = fit
            .warned_at
            .is_none_or(|t| now.saturating_duration_since(t) >= WARN_EVERY);
        if off && due && fit.calibration.samples() >= MIN_SAMPLES {
            fit.warned_at = Some(now);
            report.warn = Some(smoothed);
        }
        report
    }

    /// What the router multiplies `worker`'s predicted steps by (1 for a worker it has too
    /// few steps of).
    pub fn step_time_factor(&self, worker: &str) -> f64 {
        self.workers
            .get(worker)
            .map_or(1.0, |w| w.calibration.factor())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> CostModels {
        diffmesh_sched::profiles::builtin_models().unwrap()
    }

    fn rows(ratios: &[f32]) -> Vec<StepJob> {
        ratios.iter().map(|&r| StepJob::row(r)).collect()
    }

    fn steps(models: &CostModels, factor: f64, n: usize) -> Vec<StepSample> {
        let jobs = rows(&[0.1, 0.3, 1.0]);
        let seconds = predicted_step_s(models, &jobs) * factor;
        (0..n)
            .map(|_| StepSample::of_jobs(jobs.clone(), seconds))
            .collect()
    }

    #[test]
    fn predictions_follow_the_batch() {
        let m = models();
        let one = predicted_step_s(&m, &rows(&[0.1]));
        assert!(one > 0.0);
        assert!(
            predicted_step_s(&m, &rows(&[1.0])) > one,
            "a full row costs more"
        );
        assert!(
            predicted_step_s(&m, &rows(&[0.1, 0.1])) > one,
            "two rows cost more"
        );
        assert_eq!(predicted_step_s(&m, &[]), 0.0);
    }

    #[test]
    fn a_guided_images_rows_read_its_cache_once_as_placement_assumes() {
        let m = models();
        let guided = StepJob {
            mask_ratio: 0.1,
            rows: 2,
            cache_streams: 1,
            control_s: 0.0,
        };
        let two_images = predicted_step_s(&m, &rows(&[0.1, 0.1]));
        let predicted = predicted_step_s(&m, &[guided]);
        assert!(predicted < two_images, "{predicted} vs {two_images}");
        // The same job as the router costs it when placing.
        let mut totals = BatchTotals::default();
        let masked = m.shape.masked_tokens(0.1);
        totals.add_request(&m.shape, masked, Footprint::new(1, true));
        assert_eq!(predicted, m.step_latency(&totals));
    }

    #[test]
    fn an_older_senders_rows_are_costed_one_job_each() {
        let m = models();
        let old = StepSample {
            row_ratios: vec![0.2, 1.0],
            jobs: vec![],
            seconds: 1.0,
            block_plan: None,
        };
        let new = StepSample::of_jobs(rows(&[0.2, 1.0]), 1.0);
        assert_eq!(old.row_ratios, new.row_ratios);
        assert_eq!(
            predicted_step_s(&m, &old.step_jobs()),
            predicted_step_s(&m, &new.step_jobs())
        );
    }

    #[test]
    fn a_worker_the_model_fits_is_never_named() {
        let (m, mut check, t0) = (models(), CostCheck::default(), Instant::now());
        for i in 0..10 {
            let report = check.observe("w", &steps(&m, 1.3, 10), &m, t0 + WARN_EVERY * i);
            assert_eq!(report.ratios.len(), 10);
            assert!((report.ratios[0] - 1.3).abs() < 1e-9);
            assert_eq!(report.warn, None);
        }
    }

    #[test]
    fn a_worker_three_times_slower_is_named_once_per_period() {
        let (m, mut check, t0) = (models(), CostCheck::default(), Instant::now());
        // Too few samples to judge yet.
        assert_eq!(check.observe("w", &steps(&m, 3.0, 10), &m, t0).warn, None);
        let warned = check.observe("w", &steps(&m, 3.0, 10), &m, t0).warn;
        assert!(warned.is_some_and(|r| (r - 3.0).abs() < 1e-6), "{warned:?}");
        let soon = t0 + WARN_EVERY / 2;
        assert_eq!(check.observe("w", &steps(&m, 3.0, 5), &m, soon).warn, None);
        let later = t0 + WARN_EVERY;
        assert!(check
            .observe("w", &steps(&m, 3.0, 5), &m, later)
            .warn
            .is_some());
        // Another worker has its own record, and a fast one is named too.
        assert_eq!(
            check.observe("v", &steps(&m, 0.2, 10), &m, later).warn,
            None
        );
        assert!(check
            .observe("v", &steps(&m, 0.2, 10), &m, later)
            .warn
            .is_some());
    }

    #[test]
    fn unusable_samples_are_skipped() {
        let (m, mut check) = (models(), CostCheck::default());
        let bad = vec![
            StepSample::of_jobs(vec![], 0.1),
            StepSample::of_jobs(rows(&[0.5]), 0.0),
            StepSample::of_jobs(rows(&[0.5]), f64::NAN),
        ];
        assert!(check
            .observe("w", &bad, &m, Instant::now())
            .ratios
            .is_empty());
    }
}
