//! The engine's latest steps, kept for the heartbeat: what each batch row computed and how long
//! the step took, so the router can compare its cost model with this worker's hardware.
//!
//! On a GPU the host's clock says when the step's kernels were queued, not how long they ran
//! (nothing waits for the device at the end of a step), so a step there is timed by two events
//! on the compute stream and becomes a sample once the device has passed the second.
use cudarc::driver::CudaEvent;
use diffmesh_shared::wire::messages::StepSample;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Steps kept between two heartbeats; older ones are dropped (a sample, not a log).
pub const KEPT_STEPS: usize = 32;

/// A step queued on the GPU: its sample's seconds come from `start` to `end`.
struct GpuTimed {
    start: CudaEvent,
    end: CudaEvent,
    sample: StepSample,
}

#[derive(Default)]
struct Kept {
    done: VecDeque<StepSample>,
    /// Oldest first; one compute stream runs them in this order.
    pending: VecDeque<GpuTimed>,
}

impl Kept {
    fn keep(&mut self, sample: StepSample) {
        if self.done.len() == KEPT_STEPS {
            self.done.pop_front();
        }
        self.done.push_back(sample);
    }

    /// Move the steps the device has finished into `done`, with the GPU's seconds.
    fn settle(&mut self) {
        while let Some(front) = self.pending.front() {
            match front.end.try_is_complete() {
                Ok(false) => break,
                complete => {
                    let Some(timed) = self.pending.pop_front() else {
                        break;
                    };
                    // Events that report an error leave the step unsampled.
                    if let (Ok(true), Ok(ms)) = (complete, timed.start.elapsed_ms(&timed.end)) {
                        self.keep(StepSample {
                            seconds: f64::from(ms) / 1e3,
                            ..timed.sample
                        });
                    }
                }
            }
        }
    }
}

/// Shared between the engine thread (push) and the heartbeat (take); clones share the buffer.
#[derive(Clone, Default)]
pub struct StepSamples(Arc<Mutex<Kept>>);

impl StepSamples {
    pub fn push(&self, sample: StepSample) {
        if let Ok(mut kept) = self.0.lock() {
            kept.keep(sample);
        }
    }

    /// A step queued on the GPU between `start` and `end` (timing events on the compute
    /// stream): sampled with the device's seconds once it has run.
    pub fn push_gpu_timed(&self, start: CudaEvent, end: CudaEvent, sample: StepSample) {
        if let Ok(mut kept) = self.0.lock() {
            kept.settle();
            if kept.pending.len() == KEPT_STEPS {
                kept.pending.pop_front();
            }
            kept.pending.push_back(GpuTimed { start, end, sample });
        }
    }

    /// The steps since the last call that have finished, oldest first.
    pub fn take(&self) -> Vec<StepSample> {
        self.0
            .lock()
            .map(|mut kept| {
                kept.settle();
                kept.done.drain(..).collect()
            })
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

    /// A step timed by compute-stream events: its sample appears once the device has run it,
    /// with the device's seconds, which the host's queueing time does not bound. Run where a
    /// GPU is: `cargo test -p diffmesh-denoiser --lib -- --ignored gpu_step`.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_step_samples_take_the_devices_seconds() {
        use crate::templates::GpuCopy;
        use diffmesh_model::tch::{Device, Kind, Tensor};
        let gpu = GpuCopy::new(0, 1).unwrap();
        let samples = StepSamples::default();
        let a = Tensor::randn([4096, 4096], (Kind::Float, Device::Cuda(0)));
        let queued = std::time::Instant::now();
        let start = gpu.compute_mark().unwrap();
        for _ in 0..20 {
            let _ = a.matmul(&a);
        }
        let end = gpu.compute_mark().unwrap();
        let host_queue_s = queued.elapsed().as_secs_f64();
        samples.push_gpu_timed(
            start,
            end,
            StepSample::of_jobs(vec![StepJob::row(1.0)], 0.0),
        );
        let mut taken = samples.take();
        for _ in 0..200 {
            if !taken.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            taken = samples.take();
        }
        assert_eq!(taken.len(), 1);
        // 20 products of 4096^3 are about 2.7 TFLOP: milliseconds on any GPU, far more than
        // queueing them takes.
        let s = taken[0].seconds;
        println!("device {s:.4} s, host queueing {host_queue_s:.4} s");
        assert!(s > 0.0 && s < 10.0, "{s}");
    }
}
