//! A denoiser whose engine keeps failing jobs takes itself out (a circuit breaker): after
//! `--sick-after-failures` jobs in a row failed for a reason that was not their input (a model
//! error, an engine panic), it reports unready on `/readyz` and draining in its heartbeats, so
//! the router places nothing more on it and an orchestrator may restart it. After
//! `--sick-cooldown` it takes work again on probation: one more failure makes it sick again at
//! once; one job that ends well makes it healthy.
//!
//! A CUDA device fault (an illegal address, a launch failure, an ECC error, a device-side
//! assert) is different: it corrupts the CUDA context of the whole process, so every later
//! job would fail too. One such failure makes the denoiser sick for good ([`is_device_fault`]):
//! it drains and exits with an error ([`Sickness::device_fault`]), so its supervisor (Docker's
//! restart policy, Kubernetes) starts it again on a fresh context.
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The breaker's state.
#[derive(Debug)]
pub struct Sickness {
    /// Failures in a row that make the denoiser sick; 0 never does.
    threshold: u32,
    cooldown: Duration,
    state: Mutex<State>,
    /// Cancelled at the first device fault: the process should drain and exit.
    device_fault: CancellationToken,
}

#[derive(Debug, Default)]
struct State {
    /// Jobs failed in a row (not counting input errors).
    failures: u32,
    /// When it last became sick (None: healthy).
    sick_since: Option<Instant>,
    /// A device fault was seen: sick until the process restarts.
    device_fault: bool,
}

/// Whether a job's error text says the CUDA device itself failed (the context is lost for
/// every job in this process), as libtorch and the CUDA driver word it. An out-of-memory
/// error is not one: the next, smaller batch may fit.
pub fn is_device_fault(error: &str) -> bool {
    const FAULTS: &[&str] = &[
        "illegal memory access",
        "illegal address",
        "unspecified launch failure",
        "device-side assert",
        "uncorrectable ecc error",
        "cuda_error_illegal_address",
        "cuda_error_launch_failed",
        "cuda_error_ecc_uncorrectable",
        "cuda_error_hardware_stack_error",
        "cuda_error_illegal_instruction",
        "cudaerrorillegaladdress",
        "cudaerrorlaunchfailure",
        "misaligned address",
        "gpu has fallen off the bus",
        "cublas_status_execution_failed",
        "cublas_status_internal_error",
    ];
    let error = error.to_ascii_lowercase();
    FAULTS.iter().any(|fault| error.contains(fault))
}

/// What a failure did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Healthy,
    /// This failure made the denoiser sick.
    FellSick,
    /// It was sick already (or on probation and failed again: sick anew).
    StillSick,
    /// The device failed: sick until restarted (reported once; later failures are StillSick).
    DeviceFault,
}

impl Sickness {
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold,
            cooldown,
            state: Mutex::new(State::default()),
            device_fault: CancellationToken::new(),
        }
    }

    /// Cancelled once a device fault was seen (`run` then drains and exits with an error).
    pub fn device_fault(&self) -> CancellationToken {
        self.device_fault.clone()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is two numbers: a panic elsewhere cannot leave it half-written.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A job ended well: the count starts over and a denoiser on probation is healthy (a
    /// device fault stays: the job may have run on the CPU path or before the fault showed).
    pub fn succeeded(&self) {
        let mut s = self.state();
        let device_fault = s.device_fault;
        *s = State {
            device_fault,
            ..State::default()
        };
    }

    /// A job failed for a reason that was not its input; `error` is its text, which may name
    /// a device fault (sick at once, for good, whatever the threshold).
    pub fn failed(&self, now: Instant, error: &str) -> Verdict {
        let mut s = self.state();
        if is_device_fault(error) {
            let first = !s.device_fault;
            s.device_fault = true;
            s.sick_since.get_or_insert(now);
            self.device_fault.cancel();
            return if first {
                Verdict::DeviceFault
            } else {
                Verdict::StillSick
            };
        }
        if self.threshold == 0 {
            return Verdict::Healthy;
        }
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

    /// Whether it takes no work now: a device fault, or sick and the cooldown not over.
    pub fn is_sick(&self, now: Instant) -> bool {
        let s = self.state();
        s.device_fault
            || s.sick_since
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
        assert_eq!(s.failed(t0, "model error: boom"), Verdict::Healthy);
        assert_eq!(s.failed(t0, "model error: boom"), Verdict::Healthy);
        s.succeeded();
        assert_eq!(s.failed(t0, "model error: boom"), Verdict::Healthy);
        assert_eq!(s.failed(t0, "model error: boom"), Verdict::Healthy);
        assert!(!s.is_sick(t0));
        assert_eq!(s.failed(t0, "model error: boom"), Verdict::FellSick);
        assert!(s.is_sick(t0));
        assert!(s.is_sick(t0 + COOL / 2));
    }

    #[test]
    fn after_the_cooldown_one_failure_is_enough_and_one_success_heals() {
        let (s, t0) = (Sickness::new(2, COOL), Instant::now());
        s.failed(t0, "model error: boom");
        assert_eq!(s.failed(t0, "model error: boom"), Verdict::FellSick);
        let later = t0 + COOL;
        assert!(!s.is_sick(later), "probation: it takes work again");
        assert_eq!(s.failed(later, "model error: boom"), Verdict::StillSick);
        assert!(s.is_sick(later + COOL / 2), "a new cooldown");
        let healed = later + COOL * 2;
        s.succeeded();
        assert!(!s.is_sick(healed));
        assert_eq!(
            s.failed(healed, "model error: boom"),
            Verdict::Healthy,
            "the count started over"
        );
    }

    #[test]
    fn a_device_fault_makes_it_sick_at_once_and_for_good() {
        let (s, t0) = (Sickness::new(5, COOL), Instant::now());
        let fault = "model error: CUDA error: an illegal memory access was encountered";
        assert!(!s.device_fault().is_cancelled());
        assert_eq!(s.failed(t0, fault), Verdict::DeviceFault);
        assert!(
            s.device_fault().is_cancelled(),
            "the process is told to restart"
        );
        assert_eq!(s.failed(t0, fault), Verdict::StillSick);
        s.succeeded();
        assert!(
            s.is_sick(t0 + COOL * 100),
            "only a restart clears a device fault"
        );
        // Out of memory is not a fault of the device; nor is a plain model error.
        let (s, t0) = (Sickness::new(0, COOL), Instant::now());
        assert_eq!(
            s.failed(t0, "CUDA out of memory. Tried to allocate 2.00 GiB"),
            Verdict::Healthy
        );
        assert!(!s.is_sick(t0));
        assert!(is_device_fault(
            "RuntimeError: CUDA error: device-side assert triggered"
        ));
        assert!(is_device_fault(
            "DriverError(CUDA_ERROR_LAUNCH_FAILED, \"unspecified launch failure\")"
        ));
        assert!(!is_device_fault("prompt: too long"));
    }

    #[test]
    fn a_threshold_of_zero_never_trips() {
        let (s, t0) = (Sickness::new(0, COOL), Instant::now());
        for _ in 0..100 {
            assert_eq!(s.failed(t0, "model error: boom"), Verdict::Healthy);
        }
        assert!(!s.is_sick(t0));
    }
}
