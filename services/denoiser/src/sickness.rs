//! A denoiser whose engine keeps failing jobs takes itself out (a circuit breaker): after
//! `--sick-after-failures` jobs in a row failed for a reason that was not their input (a model
//! error, an engine panic), it reports unready on `/readyz` and draining in its heartbeats, so
//! the router places nothing more on it and an orchestrator may restart it. After
//! `--sick-cooldown` it takes work again on probation: one more failure makes it sick again at
//! once; one job that ends well makes it healthy.
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The breaker's state.
#[derive(Debug)]
pub struct Sickness {
    /// Failures in a row that make the denoiser sick; 0 never does.
    threshold: u32,
    cooldown: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Jobs failed in a row (not counting input errors).
    failures: u32,
    /// When it last became sick (None: healthy).
    sick_since: Option<Instant>,
}

/// What a failure did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Healthy,
    /// This failure made the denoiser sick.
    FellSick,
    /// It was sick already (or on probation and failed again: sick anew).
    StillSick,
}

impl Sickness {
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold,
            cooldown,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is two numbers: a panic elsewhere cannot leave it half-written.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A job ended well: the count starts over and a denoiser on probation is healthy.
    pub fn succeeded(&self) {
        *self.state() = State::default();
    }

    /// A job failed for a reason that was not its input.
    pub fn failed(&self, now: Instant) -> Verdict {
        if self.threshold == 0 {
            return Verdict::Healthy;
        }
        let mut s = self.state();
        s.failures = s.failures.saturating_add(1);
        if s.failures < self.threshold {
            return Verdict::Healthy;
        }
        let was_sick = s
            .sick_since
            .is_some_and(|since| now.saturating_duration_since(since) < self.cooldown);
        // Sick from now on (a failure on probation starts a new cooldown).
        s.sick_since = Some(now);
        if was_sick || s.failures > self.threshold {
            Verdict::StillSick
        } else {
            Verdict::FellSick
        }
    }

    /// Whether it takes no work now: sick, and the cooldown not over.
    pub fn is_sick(&self, now: Instant) -> bool {
        self.state()
            .sick_since
            .is_some_and(|since| now.saturating_duration_since(since) < self.cooldown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOL: Duration = Duration::from_secs(30);

    #[test]
    fn failures_in_a_row_make_it_sick_and_a_success_starts_over() {
        let (s, t0) = (Sickness::new(3, COOL), Instant::now());
        assert_eq!(s.failed(t0), Verdict::Healthy);
        assert_eq!(s.failed(t0), Verdict::Healthy);
        s.succeeded();
        assert_eq!(s.failed(t0), Verdict::Healthy);
        assert_eq!(s.failed(t0), Verdict::Healthy);
        assert!(!s.is_sick(t0));
        assert_eq!(s.failed(t0), Verdict::FellSick);
        assert!(s.is_sick(t0));
        assert!(s.is_sick(t0 + COOL / 2));
    }

    #[test]
    fn after_the_cooldown_one_failure_is_enough_and_one_success_heals() {
        let (s, t0) = (Sickness::new(2, COOL), Instant::now());
        s.failed(t0);
        assert_eq!(s.failed(t0), Verdict::FellSick);
        let later = t0 + COOL;
        assert!(!s.is_sick(later), "probation: it takes work again");
        assert_eq!(s.failed(later), Verdict::StillSick);
        assert!(s.is_sick(later + COOL / 2), "a new cooldown");
        let healed = later + COOL * 2;
        s.succeeded();
        assert!(!s.is_sick(healed));
        assert_eq!(s.failed(healed), Verdict::Healthy, "the count started over");
    }

    #[test]
    fn a_threshold_of_zero_never_trips() {
        let (s, t0) = (Sickness::new(0, COOL), Instant::now());
        for _ in 0..100 {
            assert_eq!(s.failed(t0), Verdict::Healthy);
        }
        assert!(!s.is_sick(t0));
    }
}
