//! Per-API-key limits on image requests: a token bucket for the request rate and a cap on jobs
//! in flight (synchronous requests until they end; async jobs until they are in the durable
//! queue, whose per-key bound JetStream keeps for every replica). Kept in this process: with
//! `--replicas N` each gateway enforces 1/N of them ([`KeyLimits::share_of`]). A counter shared
//! in JetStream KV would cost a compare-and-set round trip on every request, contended by every
//! replica on the same key; a load balancer spreading a key's requests evenly makes the shares
//! add up to the limit, and an uneven one errs on the strict side for that replica only.
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;

use crate::error::ApiError;

/// Limit settings (0 = unlimited).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyLimits {
    /// Sustained image requests per second per key.
    pub rate_per_s: f64,
    /// Requests a key may make at once after being idle (the bucket's size).
    pub burst: u32,
    /// Jobs in flight per key.
    pub max_concurrent: usize,
}

impl KeyLimits {
    /// One of `replicas` gateways' share: rate, burst and concurrency divided (rounded up, so
    /// a limit never becomes 0 = unlimited).
    pub fn share_of(self, replicas: u32) -> Self {
        let n = replicas.max(1);
        if n == 1 {
            return self;
        }
        Self {
            rate_per_s: self.rate_per_s / f64::from(n),
            burst: self.burst.div_ceil(n),
            max_concurrent: self.max_concurrent.div_ceil(n as usize),
        }
    }
}

struct Usage {
    tokens: f64,
    refilled: Instant,
    in_flight: usize,
}

/// The limits and every key's usage: read and written on every image request, so a concurrent
/// map (one key's requests contend on its shard only, not on every other key's).
pub struct KeyLimiter {
    limits: KeyLimits,
    usage: DashMap<String, Usage>,
}

/// One job in flight for a key; dropping it frees the slot.
pub struct InFlight {
    limiter: Arc<KeyLimiter>,
    key: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(mut u) = self.limiter.usage.get_mut(&self.key) {
            u.in_flight = u.in_flight.saturating_sub(1);
        }
    }
}

impl KeyLimiter {
    pub fn new(limits: KeyLimits) -> Arc<Self> {
        let burst = if limits.burst == 0 {
            // A bucket must hold at least one request, and a second's worth by default.
            limits.rate_per_s.ceil().max(1.0) as u32
        } else {
            limits.burst
        };
        Arc::new(Self {
            limits: KeyLimits { burst, ..limits },
            usage: DashMap::new(),
        })
    }

    /// Take one request from `key`'s bucket, or 429 saying when the next one is allowed.
    pub fn check_rate(&self, key: &str) -> Result<(), ApiError> {
        self.check_rate_at(key, Instant::now())
    }

    fn check_rate_at(&self, key: &str, now: Instant) -> Result<(), ApiError> {
        let rate = self.limits.rate_per_s;
        if rate <= 0.0 {
            return Ok(());
        }
        let burst = f64::from(self.limits.burst);
        let mut u = self.usage.entry(key.to_string()).or_insert(Usage {
            tokens: burst,
            refilled: now,
            in_flight: 0,
        });
        let elapsed = now.saturating_duration_since(u.refilled).as_secs_f64();
        u.tokens = (u.tokens + elapsed * rate).min(burst);
        u.refilled = now;
        if u.tokens >= 1.0 {
            u.tokens -= 1.0;
            return Ok(());
        }
        let wait = Duration::from_secs_f64((1.0 - u.tokens) / rate);
        Err(ApiError::RateLimited {
            message: format!(
                "API key {key} is over its rate limit of {rate} image requests per second \
                 (burst {burst}); retry in {:.1}s",
                wait.as_secs_f64()
            ),
            retry_after_s: wait.as_secs_f64().ceil().max(1.0) as u64,
        })
    }

    /// Take a slot for one more job of `key`, or 429 when it already has the most allowed.
    pub fn acquire(self: &Arc<Self>, key: &str) -> Result<InFlight, ApiError> {
        let max = self.limits.max_concurrent;
        let mut u = self.usage.entry(key.to_string()).or_insert(Usage {
            tokens: f64::from(self.limits.burst),
            refilled: Instant::now(),
            in_flight: 0,
        });
        if max > 0 && u.in_flight >= max {
            return Err(ApiError::RateLimited {
                message: format!(
                    "API key {key} already has {max} jobs in flight (its limit); retry when one ends"
                ),
                retry_after_s: 1,
            });
        }
        u.in_flight += 1;
        Ok(InFlight {
            limiter: self.clone(),
            key: key.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(rate: f64, burst: u32, max: usize) -> Arc<KeyLimiter> {
        KeyLimiter::new(KeyLimits {
            rate_per_s: rate,
            burst,
            max_concurrent: max,
        })
    }

    #[test]
    fn token_bucket_allows_burst_then_refills() {
        let l = limiter(2.0, 3, 0);
        let t0 = Instant::now();
        for _ in 0..3 {
            l.check_rate_at("a", t0).unwrap();
        }
        let err = l.check_rate_at("a", t0).unwrap_err();
        match err {
            ApiError::RateLimited { retry_after_s, .. } => assert_eq!(retry_after_s, 1),
            other => panic!("{other:?}"),
        }
        // Another key has its own bucket.
        l.check_rate_at("b", t0).unwrap();
        // Half a second at 2/s refills one request, not two.
        let t1 = t0 + Duration::from_millis(500);
        l.check_rate_at("a", t1).unwrap();
        assert!(l.check_rate_at("a", t1).is_err());
    }

    #[test]
    fn slow_rates_ask_for_a_longer_wait() {
        let l = limiter(0.1, 1, 0);
        let t0 = Instant::now();
        l.check_rate_at("a", t0).unwrap();
        match l.check_rate_at("a", t0).unwrap_err() {
            ApiError::RateLimited { retry_after_s, .. } => assert_eq!(retry_after_s, 10),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn zero_means_unlimited() {
        let l = limiter(0.0, 0, 0);
        let t0 = Instant::now();
        for _ in 0..1000 {
            l.check_rate_at("a", t0).unwrap();
        }
        let slots: Vec<_> = (0..100).map(|_| l.acquire("a").unwrap()).collect();
        assert_eq!(slots.len(), 100);
    }

    #[test]
    fn replicas_share_the_limits_without_turning_them_off() {
        let limits = KeyLimits {
            rate_per_s: 9.0,
            burst: 10,
            max_concurrent: 5,
        };
        assert_eq!(limits.share_of(1), limits);
        let third = limits.share_of(3);
        assert_eq!(third.rate_per_s, 3.0);
        assert_eq!(third.burst, 4);
        assert_eq!(third.max_concurrent, 2);
        let many = limits.share_of(100);
        assert_eq!((many.burst, many.max_concurrent), (1, 1));
        assert!(many.rate_per_s > 0.0);
    }

    #[test]
    fn concurrency_slots_free_on_drop() {
        let l = limiter(0.0, 0, 2);
        let a1 = l.acquire("a").unwrap();
        let _a2 = l.acquire("a").unwrap();
        assert!(matches!(l.acquire("a"), Err(ApiError::RateLimited { .. })));
        let _b1 = l.acquire("b").unwrap();
        drop(a1);
        let _a3 = l.acquire("a").unwrap();
    }
}
