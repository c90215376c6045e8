//! The engine's step-level continuous-batching admission rule, shared by the denoiser, the
//! forecasts inside policies and the simulator so all three batch alike.
use serde::{Deserialize, Serialize};

/// Per-worker batching limits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BatchLimits {
    /// Most batch rows in the running batch (FlashPS: throughput plateaus at 8). A request
    /// takes a row per image, two under true CFG.
    pub max_batch: u32,
    /// Most computed tokens (text + masked image tokens, per row) summed over the running batch.
    pub token_budget: u64,
    /// Most requests waiting in the worker's queue; placement skips a full queue.
    pub queue_capacity: u32,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            max_batch: 8,
            token_budget: 16_384,
            queue_capacity: 1_000_000,
        }
    }
}

/// How many requests from the head of the queue join the batch before the next step, given
/// the rows and tokens already running and each queued request's `(rows, tokens)`.
///
/// Strict FIFO: admission stops at the first request that does not fit, so a large request is
/// never starved by smaller ones behind it. A request alone is always admitted, even when its
/// rows or tokens exceed the limits, so no request can block the worker forever. (The
/// denoiser's engine admits by the same rule.)
pub fn admit_count(
    limits: &BatchLimits,
    running_rows: u32,
    running_tokens: u64,
    queued: impl IntoIterator<Item = (u32, u64)>,
) -> usize {
    let mut n = 0;
    let mut rows = u64::from(running_rows);
    let mut tokens = running_tokens;
    for (r, t) in queued {
        let over_rows = rows + u64::from(r) > u64::from(limits.max_batch);
        if rows > 0 && (over_rows || tokens + t > limits.token_budget) {
            break;
        }
        rows += u64::from(r);
        tokens += t;
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_batch: u32, token_budget: u64) -> BatchLimits {
        BatchLimits {
            max_batch,
            token_budget,
            queue_capacity: 100,
        }
    }

    fn ones(tokens: &[u64]) -> Vec<(u32, u64)> {
        tokens.iter().map(|&t| (1, t)).collect()
    }

    #[test]
    fn stops_at_max_batch() {
        assert_eq!(admit_count(&limits(3, 1000), 1, 10, ones(&[1, 1, 1, 1])), 2);
    }

    #[test]
    fn stops_at_first_request_over_budget_fifo() {
        // 60 + 30 fits, the 50 does not, and the 5 behind it must wait (no overtaking).
        assert_eq!(admit_count(&limits(8, 100), 1, 60, ones(&[30, 50, 5])), 1);
    }

    #[test]
    fn oversized_request_alone_is_admitted() {
        assert_eq!(admit_count(&limits(8, 100), 0, 0, ones(&[500, 1])), 1);
    }

    #[test]
    fn counts_rows_not_requests() {
        // 1 running row + 2 + 2 = 5 rows; the next 2-row request would make 7 > 6, and the
        // 1-row request behind it waits too.
        let queued = [(2, 1), (2, 1), (2, 1), (1, 1)];
        assert_eq!(admit_count(&limits(6, 1000), 1, 1, queued), 2);
        // A request wider than the whole batch runs, alone.
        assert_eq!(admit_count(&limits(2, 1000), 0, 0, [(4, 1), (1, 1)]), 1);
        assert_eq!(admit_count(&limits(2, 1000), 1, 1, [(4, 1)]), 0);
    }
}
