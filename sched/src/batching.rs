//! The engine's step-level continuous-batching admission rule, shared by the denoiser, the
//! forecasts inside policies and the simulator so all three batch alike.
use serde::{Deserialize, Serialize};

/// Per-worker batching limits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BatchLimits {
    /// Most requests in the running batch (FlashPS: throughput plateaus at 8).
    pub max_batch: u32,
    /// Most computed tokens (text + masked image tokens) summed over the running batch.
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

/// How many requests from the head of the queue join the batch before the next step.
///
/// Strict FIFO: admission stops at the first request that does not fit, so a large request is
/// never starved by smaller ones behind it. A request alone is always admitted, even when its
/// tokens exceed the budget, so no request can block the worker forever.
pub fn admit_count(
    limits: &BatchLimits,
    running: usize,
    running_tokens: u64,
    queued_tokens: impl IntoIterator<Item = u64>,
) -> usize {
    let mut n = 0;
    let mut tokens = running_tokens;
    for t in queued_tokens {
        let size = running + n;
        if size >= limits.max_batch as usize {
            break;
        }
        if size > 0 && tokens + t > limits.token_budget {
            break;
        }
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

    #[test]
    fn stops_at_max_batch() {
        assert_eq!(admit_count(&limits(3, 1000), 1, 10, [1, 1, 1, 1]), 2);
    }

    #[test]
    fn stops_at_first_request_over_budget_fifo() {
        // 60 + 30 fits, the 50 does not, and the 5 behind it must wait (no overtaking).
        assert_eq!(admit_count(&limits(8, 100), 1, 60, [30, 50, 5]), 1);
    }

    #[test]
    fn oversized_request_alone_is_admitted() {
        assert_eq!(admit_count(&limits(8, 100), 0, 0, [500, 1]), 1);
    }
}
