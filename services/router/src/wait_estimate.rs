//! How long a submit that finds every denoiser of its model full would wait for one, so the
//! router refuses at once (429 with that wait as the retry hint) what it cannot start within
//! `--admission-wait`, instead of holding it and failing it later.
//!
//! With the model's denoiser positions (batch slots and places in their bounded queues) all
//! taken, a position frees at each job's end, so the job with `k` submits ahead of it waits
//! about `k + 1` completions. The time between completions is measured where it means that:
//! over the last completions (up to 32) that came while every denoiser of the model was busy (a
//! full batch or jobs queued), from every job's end event, whichever router placed it; an idle
//! spell ends the run (its gaps say nothing of the capacity) and the last rate is kept.
//!
//! Until 8 such completions were seen, Little's law stands in: each placed job holds one
//! position from placement to its end; with the model's `P` positions all taken one frees every
//! `T / P` seconds, `T` being the smoothed time a job held its position. It underestimates while
//! load ramps up (`T` was learnt with less queueing than the jobs now meet). Until a job of the
//! model has ended there is neither, and only the admission queue's length bounds the wait.
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Weight of the newest job in the smoothed holding time.
const SMOOTHING: f64 = 0.2;
/// Placements followed at most (a job whose end the router never hears of is dropped with the
/// oldest when this is reached; its model's estimate just misses one sample).
const MAX_FOLLOWED: usize = 65_536;
/// Busy completions the rate is measured over, at most.
const RATE_WINDOW: usize = 32;
/// Busy completions in a row before the rate is trusted.
const RATE_MIN: usize = 8;

#[derive(Debug, Default)]
pub struct WaitEstimate {
    /// Placed jobs: their model and when they were placed.
    placed: HashMap<String, (String, Instant)>,
    /// Smoothed seconds a job held its denoiser position, by model.
    holding_s: HashMap<String, f64>,
    /// The current run of completions while the model's denoisers were all busy, by model.
    busy_run: HashMap<String, VecDeque<Instant>>,
    /// Seconds between completions in the last busy run long enough to tell, by model.
    per_completion_s: HashMap<String, f64>,
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

    /// The model of a job this router placed.
    pub fn model_of(&self, job_id: &str) -> Option<&str> {
        self.placed.get(job_id).map(|(model, _)| model.as_str())
    }

    /// `job_id` ended at `now`: one sample of its model's holding time when this router placed
    /// it. `model` (known from the denoisers' heartbeats for another router's job) and `busy`
    /// (whether every denoiser of it was busy as it ended) feed the completion rate.
    pub fn finished(&mut self, job_id: &str, model: Option<&str>, busy: bool, now: Instant) {
        if let Some(model) = model {
            self.completed(model, busy, now);
        }
        let Some((model, at)) = self.placed.remove(job_id) else {
            return;
        };
        let sample = now.saturating_duration_since(at).as_secs_f64();
        let smoothed = self.holding_s.entry(model).or_insert(sample);
        *smoothed += SMOOTHING * (sample - *smoothed);
    }

    fn completed(&mut self, model: &str, busy: bool, now: Instant) {
        if !busy {
            self.busy_run.remove(model);
            return;
        }
        let run = self.busy_run.entry(model.to_string()).or_default();
        run.push_back(now);
        if run.len() > RATE_WINDOW {
            run.pop_front();
        }
        if run.len() >= RATE_MIN {
            let span = run
                .back()
                .unwrap()
                .saturating_duration_since(*run.front().unwrap());
            if !span.is_zero() {
                let per = span.as_secs_f64() / (run.len() - 1) as f64;
                self.per_completion_s.insert(model.to_string(), per);
            }
        }
    }

    /// The wait of a job of `model` with `ahead` submits of the same model before it, when the
    /// model's denoisers hold `positions` jobs in all; None while nothing is known.
    pub fn estimate(&self, model: &str, positions: u32, ahead: usize) -> Option<Duration> {
        if let Some(per) = self.per_completion_s.get(model) {
            return Some(Duration::from_secs_f64((ahead as f64 + 1.0) * per));
        }
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
        w.finished("a", None, false, t0 + Duration::from_secs(2));
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
        w.finished("a", None, false, t0 + Duration::from_secs(1));
        w.placed("b", "m", t0);
        w.unplaced("b");
        w.finished("b", None, false, t0 + Duration::from_secs(100));
        assert_eq!(w.estimate("m", 1, 0), Some(Duration::from_secs(1)));
        w.placed("c", "m", t0);
        w.finished("c", None, false, t0 + Duration::from_secs(6));
        // 1 + 0.2 * (6 - 1) = 2.
        let s = w.estimate("m", 1, 0).unwrap().as_secs_f64();
        assert!((s - 2.0).abs() < 1e-9, "{s}");
        assert_eq!(w.followed(), 0);
    }

    #[test]
    fn the_rate_of_busy_completions_takes_over_and_idle_gaps_do_not_count() {
        let mut w = WaitEstimate::default();
        let t0 = Instant::now();
        // Little's law first: one job held its position 10 s, 20 positions.
        w.placed("a", "m", t0);
        w.finished("a", Some("m"), false, t0 + Duration::from_secs(10));
        assert_eq!(w.estimate("m", 20, 3), Some(Duration::from_secs(2)));
        // Busy completions every 0.5 s (another router's jobs count too); an idle spell in
        // between starts a new run, and its gap is not a sample.
        let mut t = t0 + Duration::from_secs(20);
        for i in 0..5 {
            w.finished(&format!("x{i}"), Some("m"), true, t);
            t += Duration::from_millis(500);
        }
        w.finished("idle", Some("m"), false, t + Duration::from_secs(60));
        t += Duration::from_secs(120);
        for i in 0..(RATE_MIN - 1) {
            w.finished(&format!("y{i}"), Some("m"), true, t);
            t += Duration::from_millis(500);
        }
        assert_eq!(
            w.estimate("m", 20, 3),
            Some(Duration::from_secs(2)),
            "too few in a row yet"
        );
        w.finished("y-last", Some("m"), true, t);
        let s = w.estimate("m", 20, 3).unwrap().as_secs_f64();
        assert!((s - 2.0).abs() < 1e-9, "4 x 0.5 s, not {s}");
        let s = w.estimate("m", 1, 9).unwrap().as_secs_f64();
        assert!((s - 5.0).abs() < 1e-9, "positions no longer matter: {s}");
        // Jobs ending together (one batch) say nothing on their own.
        let mut v = WaitEstimate::default();
        for i in 0..RATE_MIN {
            v.finished(&format!("z{i}"), Some("m"), true, t0);
        }
        assert_eq!(v.estimate("m", 4, 0), None);
    }
}
