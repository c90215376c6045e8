//! The router's admission queue: submits waiting, in arrival order, for a denoiser with a free
//! slot, and async jobs this router took from the durable queue (`async_jobs`), which wait
//! among them. Bounded (beyond it a submit is answered `Overloaded`), cancellable by job id, and
//! drained with an answer for everyone at shutdown. Pure data; the service owns the NATS side.
use async_nats::{HeaderMap, Subject};
use diffmesh_shared::wire::messages::DenoiseJob;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One submit waiting for capacity, with where to send its answer.
#[derive(Debug)]
pub struct Waiting {
    pub job: DenoiseJob,
    /// The submit's reply subject (None when the sender wants no answer).
    pub reply: Option<Subject>,
    /// The submit's headers (trace context), for the span of its placement.
    pub headers: Option<HeaderMap>,
    pub since: Instant,
    /// Taken from the durable queue of async jobs: acked there once placed or ended. Such an
    /// entry waits until its own deadline, not `--admission-wait`.
    pub durable: Option<Durable>,
}

/// An async job's message in the durable queue, held unacked while it waits here.
#[derive(Debug)]
pub struct Durable {
    pub message: async_nats::jetstream::Message,
    /// Unix ms after which it is failed instead of placed.
    pub place_by_ms: u64,
    /// When the server was last told this router still works on it.
    pub last_progress: Instant,
}

/// Why a submit was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull {
    pub depth: usize,
}

#[derive(Debug)]
pub struct AdmissionQueue {
    entries: VecDeque<Waiting>,
    capacity: usize,
}

impl AdmissionQueue {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            capacity,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Queue `w` at the back. A job already waiting (a sender that timed out and submitted
    /// again) keeps its place and takes the new reply subject; the old waiting entry's answer
    /// would go nowhere. Returns the job's position (0 = next).
    pub fn push(&mut self, w: Waiting) -> Result<usize, QueueFull> {
        if let Some(i) = self.position(&w.job.job_id) {
            let e = &mut self.entries[i];
            e.reply = w.reply;
            e.headers = w.headers;
            e.job = w.job;
            if w.durable.is_some() {
                e.durable = w.durable;
            }
            return Ok(i);
        }
        if self.entries.len() >= self.capacity {
            return Err(QueueFull {
                depth: self.entries.len(),
            });
        }
        self.entries.push_back(w);
        Ok(self.entries.len() - 1)
    }

    pub fn position(&self, job_id: &str) -> Option<usize> {
        self.entries.iter().position(|w| w.job.job_id == job_id)
    }

    /// The job next in line.
    pub fn front(&self) -> Option<&Waiting> {
        self.entries.front()
    }

    /// Take a job out of the queue (cancelled, or placed).
    pub fn remove(&mut self, job_id: &str) -> Option<Waiting> {
        let i = self.position(job_id)?;
        self.entries.remove(i)
    }

    /// Take every submit that waited longer than `max_wait`, and every durable entry past its
    /// deadline (`now_ms`, Unix ms).
    pub fn take_expired(&mut self, now: Instant, max_wait: Duration, now_ms: u64) -> Vec<Waiting> {
        let (expired, kept): (Vec<Waiting>, Vec<Waiting>) =
            self.entries.drain(..).partition(|w| match &w.durable {
                Some(d) => now_ms > d.place_by_ms,
                None => now.saturating_duration_since(w.since) > max_wait,
            });
        self.entries = kept.into();
        expired
    }

    /// Entries of `model` (a job's `params.model`) waiting.
    pub fn count_model(&self, model: &str) -> usize {
        self.entries
            .iter()
            .filter(|w| w.job.params.model == model)
            .count()
    }

    /// Entries taken from the durable queue.
    pub fn durable_count(&self) -> usize {
        self.entries.iter().filter(|w| w.durable.is_some()).count()
    }

    /// The job ids and models of every entry, in order (to try each without holding the queue).
    pub fn lineup(&self) -> Vec<(String, String)> {
        self.entries
            .iter()
            .map(|w| (w.job.job_id.clone(), w.job.params.model.clone()))
            .collect()
    }

    /// An entry by job id.
    pub fn get(&self, job_id: &str) -> Option<&Waiting> {
        self.entries.iter().find(|w| w.job.job_id == job_id)
    }

    /// The durable entries whose holder last reported progress before `due`; marked reported.
    pub fn progress_due(&mut self, due: Instant) -> Vec<async_nats::jetstream::Message> {
        let now = Instant::now();
        self.entries
            .iter_mut()
            .filter_map(|w| w.durable.as_mut())
            .filter(|d| d.last_progress < due)
            .map(|d| {
                d.last_progress = now;
                d.message.clone()
            })
            .collect()
    }

    /// Take every entry (shutdown).
    pub fn drain(&mut self) -> Vec<Waiting> {
        self.entries.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::tests::job;

    fn waiting(id: &str, reply: &str, since: Instant) -> Waiting {
        Waiting {
            job: job(id),
            reply: Some(Subject::from(reply)),
            headers: None,
            since,
            durable: None,
        }
    }

    #[test]
    fn fifo_bounded_and_deduplicated() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(2);
        assert_eq!(q.push(waiting("a", "r1", t0)), Ok(0));
        assert_eq!(q.push(waiting("b", "r2", t0)), Ok(1));
        assert_eq!(q.push(waiting("c", "r3", t0)), Err(QueueFull { depth: 2 }));
        // A resubmission of `a` keeps its place (even when full) and takes the new reply.
        assert_eq!(q.push(waiting("a", "r4", t0)), Ok(0));
        assert_eq!(q.len(), 2);
        assert_eq!(q.front().unwrap().reply.as_ref().unwrap().as_str(), "r4");
        assert_eq!(q.remove("a").unwrap().job.job_id, "a");
        assert_eq!(q.front().unwrap().job.job_id, "b");
        assert!(q.remove("zzz").is_none());
    }

    #[test]
    fn expiry_takes_only_the_old_ones_and_keeps_order() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(8);
        q.push(waiting("old", "r", t0)).unwrap();
        q.push(waiting("new1", "r", t0 + Duration::from_secs(5)))
            .unwrap();
        q.push(waiting("new2", "r", t0 + Duration::from_secs(6)))
            .unwrap();
        let gone = q.take_expired(t0 + Duration::from_secs(7), Duration::from_secs(3), 0);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].job.job_id, "old");
        let left: Vec<String> = q.drain().into_iter().map(|w| w.job.job_id).collect();
        assert_eq!(left, vec!["new1", "new2"]);
        assert!(q.is_empty());
    }
}
