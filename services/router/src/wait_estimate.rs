//! How long a submit that finds every denoiser of its model full would wait for one, so the
//! router refuses at once (429 with that wait as the retry hint) what it cannot start within
//! `--admission-wait`, instead of holding it and failing it later.
//!
//! Little's law on what the router sees: each placed job holds one of its denoiser's positions
//! (a batch slot or a place in its bounded queue) from placement to its end; with the model's
//! positions `P` (the live denoisers' `max_batch + queue_capacity`) all taken, one frees every
//! `T / P` seconds on average, `T` being the smoothed time a job held its position. The job
//! with `k` submits ahead of it then waits about `(k + 1) * T / P`. Until a job of the model
//! has ended there is no `T`, and only the admission queue's length bounds the wait.
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Weight of the newest job in the smoothed holding time.
const SMOOTHING: f64 = 0.2;
/// Placements followed at most (a job whose end the router never hears of is dropped with the
/// oldest when this is reached; its model's estimate just misses one sample).
const MAX_FOLLOWED: usize = 65_536;

#[derive(Debug, Default)]
pub struct WaitEstimate {
    /// Placed jobs: their model and when they were placed.
    placed: HashMap<String, (String, Instant)>,
    /// Smoothed seconds a job held its denoiser position, by model.
    holding_s: HashMap<String, f64>,
}

impl WaitEstimate {
    /// `job_id` of `model` was placed at `now`.
    pub fn placed(&mut self, job_id: &str, model: &str, now: Instant) {
        if self.placed.len() >= MAX_FOLLOWED && !self.placed.contains_key(job_id) {
            if let Some(oldest) = self
                .placed
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(id, _)| id.clone())
            {
                self.placed.remove(&oldest);
            }
        }
        self.placed
            .insert(job_id.to_string(), (model.to_string(), now));
    }

    /// The placement was undone (the denoiser refused): no sample.
    pub fn unplaced(&mut self, job_id: &str) {
        self.placed.remove(job_id);
    }

    /// `job_id` ended at `now`: one sample of its model's holding time.
    pub fn finished(&mut self, job_id: &str, now: Instant) {
        let Some((model, at)) = self.placed.remove(job_id) else {
            return;
        };
        let sample = now.saturating_duration_since(at).as_secs_f64();
        let smoothed = self.holding_s.entry(model).or_insert(sample);
        *smoothed += SMOOTHING * (sample - *smoothed);
    }

    /// The wait of a job of `model` with `ahead` submits of the same model before it, when the
    /// model's denoisers hold `positions` jobs in all; None while nothing is known.
    pub fn estimate(&self, model: &str, positions: u32, ahead: usize) -> Option<Duration> {
        let holding = *self.holding_s.get(model)?;
        if positions == 0 {
            return None;
        }
        let wait = (ahead as f64 + 1.0) * holding / f64::from(positions);
        Some(Duration::from_secs_f64(wait))
    }

    /// Placements followed now.
    pub fn followed(&self) -> usize {
        self.placed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_grows_with_the_queue_and_shrinks_with_positions() {
        let mut w = WaitEstimate::default();
        let t0 = Instant::now();
        assert_eq!(w.estimate("m", 4, 0), None, "nothing known yet");
        w.placed("a", "m", t0);
        w.finished("a", t0 + Duration::from_secs(2));
        // One job held a position 2 s: with 4 positions one frees every 0.5 s.
        assert_eq!(w.estimate("m", 4, 0), Some(Duration::from_millis(500)));
        assert_eq!(w.estimate("m", 4, 3), Some(Duration::from_secs(2)));
        assert_eq!(w.estimate("m", 8, 3), Some(Duration::from_secs(1)));
        assert_eq!(
            w.estimate("m", 0, 3),
            None,
            "no denoiser: nothing to wait for"
        );
        assert_eq!(w.estimate("other", 4, 0), None, "models are apart");
    }

    #[test]
    fn holding_times_are_smoothed_and_refusals_are_not_samples() {
        let mut w = WaitEstimate::default();
        let t0 = Instant::now();
        w.placed("a", "m", t0);
        w.finished("a", t0 + Duration::from_secs(1));
        w.placed("b", "m", t0);
        w.unplaced("b");
        w.finished("b", t0 + Duration::from_secs(100));
        assert_eq!(w.estimate("m", 1, 0), Some(Duration::from_secs(1)));
        w.placed("c", "m", t0);
        w.finished("c", t0 + Duration::from_secs(6));
        // 1 + 0.2 * (6 - 1) = 2.
        let s = w.estimate("m", 1, 0).unwrap().as_secs_f64();
        assert!((s - 2.0).abs() < 1e-9, "{s}");
        assert_eq!(w.followed(), 0);
    }
}
