//! Which waiting request a worker admits next: GF-DiT's ordering policies (section 5.4) at the
//! step-level batch's boundary, shared by the denoiser's engine and the simulator.
//!
//! Each denoising step is a trajectory task and each step boundary a rescheduling point, so a
//! worker re-reads its queue in this order every time a batch slot frees up. The running batch
//! is not preempted: a job that joined keeps its slot to the end (its latents and cache reads
//! stay where they are).
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;

/// The order a worker admits its waiting requests in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum QueueOrder {
    /// First come, first served (strict: a large request is never overtaken).
    #[default]
    Fcfs,
    /// Shortest remaining trajectory work first (lowest mean latency; a long request can wait
    /// while shorter ones keep coming).
    Srtf,
    /// Earliest deadline first; requests without a deadline go after every one with a deadline,
    /// first come, first served among themselves.
    Edf,
}

/// What the order looks at for one waiting request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueuedJob {
    /// When it reached the worker (any clock, the same for every job).
    pub arrival_s: f64,
    /// When it should be done (same clock), if it has a deadline.
    pub deadline_s: Option<f64>,
    /// Work left on its trajectory, in any unit proportional to time (seconds from a cost
    /// model, or computed tokens x steps).
    pub remaining_work: f64,
}

impl QueueOrder {
    pub fn name(self) -> &'static str {
        match self {
            QueueOrder::Fcfs => "fcfs",
            QueueOrder::Srtf => "srtf",
            QueueOrder::Edf => "edf",
        }
    }

    /// Whether `a` goes before `b` (`Less`), after (`Greater`), or they tie. Ties fall back to
    /// arrival, so every order is first come, first served among equals.
    pub fn compare(self, a: &QueuedJob, b: &QueuedJob) -> Ordering {
        let primary = match self {
            QueueOrder::Fcfs => Ordering::Equal,
            QueueOrder::Srtf => a.remaining_work.total_cmp(&b.remaining_work),
            QueueOrder::Edf => match (a.deadline_s, b.deadline_s) {
                (Some(x), Some(y)) => x.total_cmp(&y),
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (None, None) => Ordering::Equal,
            },
        };
        primary.then_with(|| a.arrival_s.total_cmp(&b.arrival_s))
    }

    /// Indices of `jobs` in admission order. Stable: jobs that tie on everything keep their
    /// queue positions.
    pub fn order(self, jobs: &[QueuedJob]) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..jobs.len()).collect();
        if self != QueueOrder::Fcfs {
            idx.sort_by(|&i, &j| self.compare(&jobs[i], &jobs[j]));
        }
        idx
    }
}

impl std::fmt::Display for QueueOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for QueueOrder {
    type Err = crate::SchedError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fcfs" => Ok(QueueOrder::Fcfs),
            "srtf" => Ok(QueueOrder::Srtf),
            "edf" => Ok(QueueOrder::Edf),
            other => Err(crate::SchedError::field(
                "queue_order",
                format!("unknown order `{other}` (known: fcfs, srtf, edf)"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(arrival_s: f64, deadline_s: Option<f64>, remaining_work: f64) -> QueuedJob {
        QueuedJob {
            arrival_s,
            deadline_s,
            remaining_work,
        }
    }

    #[test]
    fn fcfs_keeps_the_queue_as_it_is() {
        // Positions win even over arrival stamps: FCFS never reorders what the queue holds.
        let jobs = [job(2.0, None, 1.0), job(1.0, Some(0.5), 0.1)];
        assert_eq!(QueueOrder::Fcfs.order(&jobs), vec![0, 1]);
    }

    #[test]
    fn srtf_puts_the_least_remaining_work_first_and_ties_by_arrival() {
        let jobs = [
            job(0.0, None, 30.0),
            job(1.0, None, 10.0),
            job(2.0, None, 20.0),
            job(0.5, None, 10.0),
        ];
        assert_eq!(QueueOrder::Srtf.order(&jobs), vec![3, 1, 2, 0]);
    }

    #[test]
    fn edf_puts_the_earliest_deadline_first_and_best_effort_last() {
        let jobs = [
            job(0.0, None, 1.0),
            job(1.0, Some(9.0), 1.0),
            job(2.0, Some(4.0), 50.0),
            job(0.5, None, 1.0),
            job(3.0, Some(4.0), 1.0),
        ];
        // Deadlines 4 (arrived 2), 4 (arrived 3), 9, then the two without, by arrival.
        assert_eq!(QueueOrder::Edf.order(&jobs), vec![2, 4, 1, 0, 3]);
    }

    #[test]
    fn names_round_trip_and_unknown_names_the_field() {
        for o in [QueueOrder::Fcfs, QueueOrder::Srtf, QueueOrder::Edf] {
            assert_eq!(o.name().parse::<QueueOrder>().unwrap(), o);
        }
        let err = "lifo".parse::<QueueOrder>().unwrap_err().to_string();
        assert!(err.contains("queue_order") && err.contains("lifo"), "{err}");
    }
}
