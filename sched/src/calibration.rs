//! Per-worker calibration of the cost models against the steps a worker really ran.
//!
//! A profile is measured on one machine, in one dtype; a fleet mixes machines (a CPU with bf16
//! units steps 2-3x faster than one without, an H100 faster than an A100) and co-running load
//! slows a worker down. Each reported step's measured time over the cost models' prediction for
//! the same batch is smoothed (in log space, so a 2x and a 0.5x error weigh alike) into a factor
//! that the forecasts multiply every step of that worker by ([`crate::WorkerState`]'s
//! `step_time_factor`). The live router and the simulator both learn it this way.

/// Weight of each new sample in the smoothed log ratio.
pub const SMOOTHING: f64 = 0.05;
/// Samples before the factor is used (before that a worker is taken at the profile's word).
pub const MIN_SAMPLES: u64 = 20;
/// The factor is clamped to `[1 / MAX_FACTOR, MAX_FACTOR]`: beyond it the profile is for
/// another model, not another machine, and no scaling makes its shape right.
pub const MAX_FACTOR: f64 = 20.0;

/// A worker's smoothed measured / predicted step time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepCalibration {
    log_ratio: f64,
    samples: u64,
}

impl StepCalibration {
    /// Add one step: `measured_s` for a batch the models predicted `predicted_s` for. Unusable
    /// samples (an empty batch, a model predicting nothing, a bad clock reading) are skipped;
    /// returns the sample's ratio when it was used.
    pub fn observe(&mut self, measured_s: f64, predicted_s: f64) -> Option<f64> {
        if !(predicted_s > 0.0 && measured_s > 0.0 && measured_s.is_finite()) {
            return None;
        }
        let ratio = measured_s / predicted_s;
        self.log_ratio = if self.samples == 0 {
            ratio.ln()
        } else {
            (1.0 - SMOOTHING) * self.log_ratio + SMOOTHING * ratio.ln()
        };
        self.samples += 1;
        Some(ratio)
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The smoothed ratio (1 before any sample), unclamped: what the warning reports.
    pub fn ratio(&self) -> f64 {
        self.log_ratio.exp()
    }

    /// What forecasts multiply this worker's predicted steps by: 1 until [`MIN_SAMPLES`]
    /// steps were seen, then the smoothed ratio within `[1 / MAX_FACTOR, MAX_FACTOR]`.
    pub fn factor(&self) -> f64 {
        if self.samples < MIN_SAMPLES {
            return 1.0;
        }
        self.ratio().clamp(1.0 / MAX_FACTOR, MAX_FACTOR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factor_is_one_until_enough_samples_then_the_ratio() {
        let mut c = StepCalibration::default();
        assert_eq!(c.factor(), 1.0);
        for _ in 0..MIN_SAMPLES - 1 {
            assert!(c.observe(0.3, 0.1).is_some_and(|r| (r - 3.0).abs() < 1e-12));
        }
        assert_eq!(c.factor(), 1.0, "too few samples to trust");
        c.observe(0.3, 0.1);
        assert!((c.factor() - 3.0).abs() < 1e-9, "{}", c.factor());
    }

    #[test]
    fn follows_a_worker_that_changes_speed() {
        let mut c = StepCalibration::default();
        for _ in 0..50 {
            c.observe(0.2, 0.1);
        }
        assert!((c.factor() - 2.0).abs() < 1e-9);
        // The worker gets twice as fast (another job left its machine): after 100 steps the
        // factor is within 1% of the new ratio.
        for _ in 0..100 {
            c.observe(0.1, 0.1);
        }
        assert!((c.factor() - 1.0).abs() < 0.01, "{}", c.factor());
    }

    #[test]
    fn noise_averages_out_in_log_space() {
        // Alternating 2x and 0.5x errors around a true ratio of 1.5.
        let mut c = StepCalibration::default();
        for i in 0..400 {
            let noise = if i % 2 == 0 { 2.0 } else { 0.5 };
            c.observe(0.15 * noise, 0.1);
        }
        assert!((c.factor() - 1.5).abs() < 0.1, "{}", c.factor());
    }

    #[test]
    fn bad_samples_are_skipped_and_the_factor_is_clamped() {
        let mut c = StepCalibration::default();
        assert_eq!(c.observe(0.1, 0.0), None);
        assert_eq!(c.observe(0.0, 0.1), None);
        assert_eq!(c.observe(f64::NAN, 0.1), None);
        assert_eq!(c.observe(f64::INFINITY, 0.1), None);
        assert_eq!(c.samples(), 0);
        for _ in 0..MIN_SAMPLES {
            c.observe(1000.0, 0.1);
        }
        assert_eq!(c.factor(), MAX_FACTOR);
        assert!(c.ratio() > 9999.0, "the warning sees the real ratio");
    }
}
