//! Placement policies behind one small trait, so the mask-aware (FlashPS Algorithm 2) policy can
//! replace round-robin without touching the router's NATS code.
use crate::registry::WorkerView;
use diffmesh_shared::messages::DenoiseJob;

/// Picks a worker for a job among the live ones.
pub trait Placement: Send {
    /// Policy name for logs and metrics labels.
    fn name(&self) -> &'static str;
    /// Index into `workers` of the chosen worker, or `None` when none can take the job.
    /// `workers` holds only live workers, ordered by id; callers exclude workers already tried.
    fn choose(&mut self, job: &DenoiseJob, workers: &[WorkerView]) -> Option<usize>;
}

/// Round-robin over workers that are not draining and have a free slot.
#[derive(Debug, Default)]
pub struct RoundRobin {
    /// Id of the worker chosen last; the next choice starts after it in id order, so adding or
    /// removing workers does not reset the rotation.
    last: Option<String>,
}

impl Placement for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn choose(&mut self, _job: &DenoiseJob, workers: &[WorkerView]) -> Option<usize> {
        if workers.is_empty() {
            return None;
        }
        let start = match &self.last {
            Some(last) => workers
                .iter()
                .position(|w| w.worker_id.as_str() > last.as_str())
                .unwrap_or(0),
            None => 0,
        };
        let n = workers.len();
        let chosen = (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| workers[i].has_capacity())?;
        self.last = Some(workers[chosen].worker_id.clone());
        Some(chosen)
    }
}

/// Selects a policy by name (the `--placement` flag).
pub fn policy_by_name(name: &str) -> Option<Box<dyn Placement>> {
    match name {
        "round_robin" | "round-robin" => Some(Box::new(RoundRobin::default())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::tests::job;

    fn view(id: &str, outstanding: u32, draining: bool) -> WorkerView {
        WorkerView {
            worker_id: id.into(),
            model: "tiny".into(),
            draining,
            max_batch: 2,
            queue_capacity: 0,
            outstanding,
            running: vec![],
        }
    }

    #[test]
    fn rotates_over_workers() {
        let mut rr = RoundRobin::default();
        let ws = vec![
            view("a", 0, false),
            view("b", 0, false),
            view("c", 0, false),
        ];
        let picks: Vec<String> = (0..4)
            .map(|_| ws[rr.choose(&job("j"), &ws).unwrap()].worker_id.clone())
            .collect();
        assert_eq!(picks, vec!["a", "b", "c", "a"]);
    }

    #[test]
    fn skips_full_and_draining_workers() {
        let mut rr = RoundRobin::default();
        let ws = vec![view("a", 2, false), view("b", 0, true), view("c", 1, false)];
        assert_eq!(rr.choose(&job("j"), &ws), Some(2));
        assert_eq!(rr.choose(&job("j"), &ws), Some(2));
        let full = vec![view("a", 2, false), view("b", 0, true)];
        assert_eq!(rr.choose(&job("j"), &full), None);
        assert_eq!(rr.choose(&job("j"), &[]), None);
    }

    #[test]
    fn rotation_survives_membership_changes() {
        let mut rr = RoundRobin::default();
        let ws = vec![
            view("a", 0, false),
            view("b", 0, false),
            view("c", 0, false),
        ];
        assert_eq!(rr.choose(&job("j"), &ws), Some(0));
        assert_eq!(rr.choose(&job("j"), &ws), Some(1)); // b
        let without_c = vec![view("a", 0, false), view("b", 0, false)];
        assert_eq!(rr.choose(&job("j"), &without_c), Some(0)); // wraps to a
    }

    #[test]
    fn unknown_policy_name_is_none() {
        assert!(policy_by_name("round_robin").is_some());
        assert!(policy_by_name("nope").is_none());
    }
}
