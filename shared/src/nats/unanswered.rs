//! Requests for work that must not be lost to a service restarting. A denoiser whose job has
//! finished every step must not fail it because no codec answered for a moment (codec workers
//! restarting, a rolling update, a NATS reconnect longer than the request helper's own
//! [`crate::nats::NO_RESPONDERS_GRACE`]); neither should an accepted request whose
//! pre-processing finds no codec. So such a request is sent again, with backoff, for a window
//! ([`resent_while_unanswered`]; counted in `diffmesh_nats_request_resends_total{subject,
//! reason="unanswered"}`). The responders it is used for are pure (the same inputs give the
//! same outputs under the same keys), so a request two instances both answer does no harm.
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::MeshError;
use crate::process::metrics::NatsMetrics;

/// First pause before sending again; it doubles up to [`MAX_DELAY`].
const FIRST_DELAY: Duration = Duration::from_millis(250);
const MAX_DELAY: Duration = Duration::from_secs(4);

/// Deadlines of successive attempts of one request: `first`, doubling up to `max`. A
/// responder killed while it held the request costs the caller `first` before it is sent
/// again, not `max`; a responder that is only slow (a long queue) gets ever longer deadlines,
/// so the copies sent to a busy service stay few (at most about log2(max / first)).
#[derive(Debug, Clone)]
pub struct AttemptDeadlines {
    next: Duration,
    max: Duration,
}

impl AttemptDeadlines {
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            next: first.min(max),
            max,
        }
    }

    /// The deadline of the next attempt.
    pub fn next_deadline(&mut self) -> Duration {
        let deadline = self.next;
        self.next = (deadline * 2).min(self.max);
        deadline
    }
}

/// Whether `err` says no instance of the service took the request (none subscribed, none
/// answered in time, the connection failed), rather than something about the request itself.
pub fn nobody_took_it(err: &MeshError) -> bool {
    matches!(
        err,
        MeshError::NoResponders { .. } | MeshError::Timeout { .. } | MeshError::Request { .. }
    )
}

/// Run `attempt` (one request on `subject`) until it succeeds, fails for a reason other than
/// [`nobody_took_it`], or the next try would start after `window` from the first (then the
/// last error is returned).
pub async fn resent_while_unanswered<T, F, Fut>(
    subject: &str,
    window: Duration,
    mut attempt: F,
) -> Result<T, MeshError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, MeshError>>,
{
    // Taken up front so the subject's counter is exported at 0 before the first resend.
    let resends = NatsMetrics::global()
        .request_resends
        .with_label_values(&[subject, "unanswered"]);
    let give_up = Instant::now() + window;
    let mut delay = FIRST_DELAY;
    let mut attempts = 1u32;
    loop {
        let err = match attempt().await {
            Ok(reply) => return Ok(reply),
            Err(err) => err,
        };
        let resume = Instant::now() + delay;
        if !nobody_took_it(&err) || resume >= give_up {
            return Err(err);
        }
        tracing::warn!(subject, attempts, error = %err, "no service took the request; sending it again");
        resends.inc();
        tokio::time::sleep_until(resume).await;
        delay = (delay * 2).min(MAX_DELAY);
        attempts += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempt_deadlines_double_from_first_up_to_max() {
        let mut d = AttemptDeadlines::new(Duration::from_secs(5), Duration::from_secs(30));
        let got: Vec<u64> = (0..5).map(|_| d.next_deadline().as_secs()).collect();
        assert_eq!(got, [5, 10, 20, 30, 30]);
        // A first deadline above the most is cut to it.
        let mut d = AttemptDeadlines::new(Duration::from_secs(60), Duration::from_secs(30));
        assert_eq!(d.next_deadline(), Duration::from_secs(30));
    }

    fn nobody() -> MeshError {
        MeshError::NoResponders {
            subject: "test.unanswered".into(),
        }
    }

    fn counted(subject: &str) -> u64 {
        NatsMetrics::global()
            .request_resends
            .with_label_values(&[subject, "unanswered"])
            .get()
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_nobody_took_is_sent_again_until_one_answers() {
        let mut calls = 0;
        let started = Instant::now();
        let reply = resent_while_unanswered("test.unanswered.a", Duration::from_secs(60), || {
            calls += 1;
            let answer = if calls < 4 { Err(nobody()) } else { Ok(calls) };
            async move { answer }
        })
        .await;
        assert_eq!(reply.unwrap(), 4);
        assert_eq!(counted("test.unanswered.a"), 3);
        // Backoff 0.25 + 0.5 + 1 s.
        assert_eq!(started.elapsed(), Duration::from_millis(1750));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_about_the_request_is_not_sent_again() {
        let mut calls = 0;
        let reply: Result<(), _> =
            resent_while_unanswered("test.unanswered.b", Duration::from_secs(60), || {
                calls += 1;
                async {
                    Err(MeshError::BlobNotFound {
                        key: "job/output-0.rgb".into(),
                    })
                }
            })
            .await;
        assert!(matches!(reply, Err(MeshError::BlobNotFound { .. })));
        assert_eq!(calls, 1);
        assert_eq!(counted("test.unanswered.b"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_bounds_the_resends() {
        let mut calls = 0u32;
        let started = Instant::now();
        let reply: Result<(), _> =
            resent_while_unanswered("test.unanswered.c", Duration::from_secs(10), || {
                calls += 1;
                async { Err(nobody()) }
            })
            .await;
        assert!(matches!(reply, Err(MeshError::NoResponders { .. })));
        // Sent at 0, 0.25, 0.75, 1.75, 3.75, 7.75 s; the next would be at 11.75 s.
        assert_eq!(calls, 6);
        assert_eq!(started.elapsed(), Duration::from_millis(7750));
    }
}
