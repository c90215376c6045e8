//! Summary statistics of a simulated run.
use serde::Serialize;

/// The measures the simulator reports (the binary prints this as its last line).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub policy: String,
    pub submitted: usize,
    pub completed: usize,
    pub rejected: usize,
    /// End-to-end latency percentiles of completed requests (s).
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    /// p95 of the completed requests' standalone times (alone on an idle worker). Each
    /// request's latency is at least its standalone time when workers step as the cost models
    /// predict (no step noise, no factor below 1), so no policy's p95 can be lower: the floor
    /// routing works against.
    pub standalone_p95: f64,
    pub mean_latency: f64,
    /// Mean wait from arrival to joining a running batch (s).
    pub mean_queue: f64,
    /// Completed requests per second between the first arrival and the last completion.
    pub throughput: f64,
    /// Fraction of submitted requests done by arrival + slo_factor x standalone time.
    pub slo_attainment: f64,
    /// Mean running-batch rows over steps (a request's rows: one per image, two under true CFG).
    pub mean_batch: f64,
    /// Fraction of worker time spent stepping.
    pub utilization: f64,
}

/// Nearest-rank percentile of sorted values (NaN when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(|i| i as f64).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 95.0), 95.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
