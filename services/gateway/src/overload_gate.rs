//! Refusing at once what the router just refused. When a router answers a synchronous submit
//! `Overloaded` (the line for its model would not start within the router's admission wait),
//! the requests for that model right after it would be refused the same way: that line drains
//! by at most the time passed. For half the router's retry hint (at most a second) this gateway
//! answers such requests 429 itself, before storing uploads or preprocessing, so a refusal
//! costs microseconds of the mesh's time instead of a job record, a codec call and a router
//! round trip, and comes back within milliseconds. A denoiser joining meanwhile is noticed at
//! the window's end at the latest.
use std::time::{Duration, Instant};

use dashmap::DashMap;

use crate::error::ApiError;

/// The longest a router refusal closes the gate for.
const LONGEST_CLOSE: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct OverloadGate {
    /// By model: refuse until the first instant, retry hint until the second.
    closed: DashMap<String, (Instant, Instant)>,
}

impl OverloadGate {
    /// The router refused a submit for `model` with `retry_after`.
    pub fn refused(&self, model: &str, retry_after: Duration) {
        self.refused_at(model, retry_after, Instant::now());
    }

    fn refused_at(&self, model: &str, retry_after: Duration, now: Instant) {
        let close = (retry_after / 2).min(LONGEST_CLOSE);
        self.closed
            .insert(model.to_string(), (now + close, now + retry_after));
    }

    /// 429 when the router refused `model` moments ago.
    pub fn check(&self, model: &str) -> Result<(), ApiError> {
        self.check_at(model, Instant::now())
    }

    fn check_at(&self, model: &str, now: Instant) -> Result<(), ApiError> {
        let Some(entry) = self.closed.get(model) else {
            return Ok(());
        };
        let (until, hint_until) = *entry;
        drop(entry);
        if now >= until {
            self.closed.remove_if(model, |_, (u, _)| now >= *u);
            return Ok(());
        }
        let wait = hint_until.saturating_duration_since(now);
        Err(ApiError::Overloaded {
            message: "the mesh is at capacity for this model (its denoisers' queues would not \
                      start the job soon); retry later"
                .into(),
            retry_after_s: wait.as_secs_f64().ceil().max(1.0) as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_closes_the_gate_for_half_its_hint_and_for_its_model_only() {
        let gate = OverloadGate::default();
        let t0 = Instant::now();
        assert!(gate.check_at("m", t0).is_ok());
        gate.refused_at("m", Duration::from_millis(1500), t0);
        match gate.check_at("m", t0 + Duration::from_millis(100)) {
            Err(ApiError::Overloaded { retry_after_s, .. }) => assert_eq!(retry_after_s, 2),
            other => panic!("{other:?}"),
        }
        assert!(gate.check_at("other", t0).is_ok());
        assert!(gate.check_at("m", t0 + Duration::from_millis(760)).is_ok());
        // A long hint closes it for a second at most.
        gate.refused_at("m", Duration::from_secs(30), t0);
        assert!(gate.check_at("m", t0 + Duration::from_millis(990)).is_err());
        assert!(gate.check_at("m", t0 + Duration::from_millis(1001)).is_ok());
    }
}
