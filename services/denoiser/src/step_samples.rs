//! The engine's latest steps, kept for the heartbeat: what each batch row computed and how long
//! the step took, so the router can compare its cost model with this worker's hardware.
use diffmesh_shared::wire::messages::StepSample;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Steps kept between two heartbeats; older ones are dropped (a sample, not a log).
pub const KEPT_STEPS: usize = 32;

/// Shared between the engine thread (push) and the heartbeat (take); clones share the buffer.
#[derive(Clone, Default)]
pub struct StepSamples(Arc<Mutex<VecDeque<StepSample>>>);

impl StepSamples {
    pub fn push(&self, sample: StepSample) {
        if let Ok(mut q) = self.0.lock() {
            if q.len() == KEPT_STEPS {
                q.pop_front();
            }
            q.push_back(sample);
        }
    }

    /// The steps since the last call, oldest first.
    pub fn take(&self) -> Vec<StepSample> {
        self.0
            .lock()
            .map(|mut q| q.drain(..).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_shared::wire::messages::StepJob;

    #[test]
    fn keeps_the_latest_steps_and_hands_each_out_once() {
        let samples = StepSamples::default();
        for i in 0..KEPT_STEPS + 3 {
            samples.push(StepSample::of_jobs(vec![StepJob::row(1.0)], i as f64));
        }
        let taken = samples.take();
        assert_eq!(taken.len(), KEPT_STEPS);
        assert_eq!(taken[0].seconds, 3.0);
        assert_eq!(taken.last().unwrap().seconds, (KEPT_STEPS + 2) as f64);
        assert!(samples.take().is_empty());
    }
}
