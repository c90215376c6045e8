//! Jobs whose gateway died before placing them. A gateway answers an async job's 202 once the
//! job's record holds the prepared job and the time by which that gateway will have placed it
//! (`place_by_ms`). The router watches every job record; one still unplaced a margin after that
//! time lost its driver, and the router adopts it: an async job is placed as its gateway would
//! have placed it (the router then records its ending like any job it placed), and so is a
//! synchronous one sent with an `Idempotency-Key` (`resumable`: its client can repeat the
//! request through another gateway and be answered with this job); any other synchronous one
//! is cancelled, since the client waiting for it was connected to the dead gateway (the
//! router writes an adopted job's progress too: [`crate::adopted_progress`]). A record
//! whose gateway died while preparing the job (before any answer, so no client knows the id)
//! holds no prepared job: past the job's deadline it is failed, so it does not stay queued.
//! Adoption is a compare-and-set on the record, so of several routers only one adopts a job.
use crate::service::Router;
use diffmesh_shared::stores::job::{now_ms, JobRecord};
use diffmesh_shared::wire::messages::{error_types, JobEvent};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Grace past a record's `place_by_ms` before it counts as lost: the driver's last writes and
/// clock differences between machines.
const ADOPTION_MARGIN_MS: u64 = 2_000;
/// How often the watched records are checked for lost drivers.
const CHECK_EVERY: Duration = Duration::from_millis(500);
/// How far back the record watch starts when a router starts: orphans whose record last
/// changed earlier than this before a router (re)started are not seen (one router up at all
/// times sees all).
const WATCH_LOOKBACK: Duration = Duration::from_secs(3600);
/// Wait before trying to open the record watch again when the first opening failed.
const REWATCH_AFTER: Duration = Duration::from_secs(1);

/// Unplaced records by job id, with the time after which each counts as lost.
#[derive(Debug, Default)]
pub struct Unplaced {
    due_ms: HashMap<String, u64>,
}

impl Unplaced {
    /// Follow one version of a record: keep it while it waits for placement, forget it once it
    /// was placed or ended.
    pub fn observe(&mut self, record: &JobRecord) {
        match record.place_by_ms {
            Some(place_by) if record.worker_id.is_none() && !record.state.is_terminal() => {
                self.due_ms
                    .insert(record.job_id.clone(), place_by + ADOPTION_MARGIN_MS);
            }
            _ => {
                self.due_ms.remove(&record.job_id);
            }
        }
    }

    /// Take out the jobs due at `now_ms` (their records are read again before adopting).
    pub fn take_due(&mut self, now_ms: u64) -> Vec<String> {
        let due: Vec<String> = self
            .due_ms
            .iter()
            .filter(|(_, t)| now_ms > **t)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &due {
            self.due_ms.remove(id);
        }
        due
    }

    pub fn len(&self) -> usize {
        self.due_ms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.due_ms.is_empty()
    }
}

/// What adopting a record decided.
enum Adoption {
    /// An async job: place it.
    Place(Box<diffmesh_shared::wire::messages::DenoiseJob>),
    /// A synchronous job: its client went with the gateway; the record is now cancelled.
    Cancelled,
    /// Never prepared: nothing to place; the record is now failed.
    Unprepared,
}

impl Router {
    /// Watch job records and adopt those whose driver died before placing them, until
    /// shutdown. The watch starts with the last hour of record changes and goes on through
    /// stopped consumers and reconnects after the last record it gave
    /// ([`JobStore::watch_since`]); only if its first opening fails is it opened afresh.
    ///
    /// [`JobStore::watch_since`]: diffmesh_shared::stores::job::JobStore::watch_since
    pub async fn adopt_orphans(self: Arc<Self>, shutdown: CancellationToken) {
        let mut unplaced = Unplaced::default();
        let mut tick = tokio::time::interval(CHECK_EVERY);
        loop {
            let mut records = match self.jobs.watch_since(WATCH_LOOKBACK).await {
                Ok(records) => records,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot watch job records; trying again");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(REWATCH_AFTER) => continue,
                    }
                }
            };
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    record = records.next() => match record {
                        Some(Ok(record)) => unplaced.observe(&record),
                        Some(Err(err)) => tracing::debug!(error = %err, "unreadable job record"),
                        // Not expected (the watch reopens without end), but not fatal either.
                        None => break,
                    },
                    _ = tick.tick() => {
                        for job_id in unplaced.take_due(now_ms()) {
                            let this = self.clone();
                            tokio::spawn(async move { this.adopt(&job_id).await });
                        }
                    }
                }
            }
        }
    }

    async fn adopt(&self, job_id: &str) {
        // Placed by this router, its record's placement not written yet: not lost.
        if self
            .ask(crate::placement::Owner(job_id.to_string()))
            .await
            .is_some()
        {
            return;
        }
        let wait = self.config.adopt_wait;
        let now = now_ms();
        let mut adoption = None;
        let adopted = self
            .jobs
            .update_if(job_id, |r| {
                if !r.lost_its_driver(now.saturating_sub(ADOPTION_MARGIN_MS)) {
                    return false;
                }
                if r.submitted.is_none() {
                    r.mark_failed(
                        "the gateway that accepted this request stopped before preparing the job",
                        error_types::UNAVAILABLE,
                    );
                    adoption = Some(Adoption::Unprepared);
                } else if r.detached || r.resumable {
                    r.adopted = true;
                    // Another router adopts it again only if this one dies while placing it.
                    r.place_by_ms = Some(now + wait.as_millis() as u64);
                    adoption = r.submitted.clone().map(|j| Adoption::Place(Box::new(j)));
                } else {
                    r.mark_cancelled(
                        "the gateway driving this request stopped before placing it (its client was disconnected)",
                    );
                    adoption = Some(Adoption::Cancelled);
                }
                true
            })
            .await;
        match (adopted, adoption) {
            (Ok(Some(_)), Some(Adoption::Place(job))) => {
                self.metrics.adoptions.with_label_values(&["placed"]).inc();
                let span = tracing::info_span!("adopt", %job_id);
                self.place_adopted(*job, wait).instrument(span).await;
            }
            (Ok(Some(_)), Some(Adoption::Unprepared)) => {
                self.metrics.adoptions.with_label_values(&["failed"]).inc();
                tracing::info!(%job_id, "failed a job whose gateway died before preparing it");
            }
            (Ok(Some(_)), _) => {
                self.metrics
                    .adoptions
                    .with_label_values(&["cancelled"])
                    .inc();
                tracing::info!(%job_id, "cancelled a synchronous job whose gateway died before placing it");
            }
            (Ok(None), _) => {}
            (Err(err), _) => tracing::warn!(%job_id, error = %err, "could not adopt a job"),
        }
    }

    /// Place an adopted job, waiting up to `wait` for a denoiser; fail it after that.
    async fn place_adopted(
        &self,
        job: diffmesh_shared::wire::messages::DenoiseJob,
        wait: Duration,
    ) {
        tracing::info!(job_id = %job.job_id, "placing a job whose gateway died before placing it");
        // Followed before it is placed: its first events may come before the placement returns.
        self.adopted.follow(&job.job_id);
        match self.place_within(&job, &[], wait).await {
            Ok(worker) => {
                self.metrics.placements.inc();
                tracing::info!(job_id = %job.job_id, %worker, "adopted job placed");
            }
            Err(err) => {
                self.adopted.forget(&job.job_id);
                self.count_failure(err.reason());
                let event = JobEvent::Failed {
                    message: format!(
                        "no denoiser could take the job within {:.0}s after its gateway stopped: {err}",
                        wait.as_secs_f64()
                    ),
                    error_type: error_types::UNAVAILABLE.to_string(),
                };
                self.publish_event(&job.job_id, &event).await;
                self.record_outcome(&job.job_id, event);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_shared::wire::messages::JobKind;

    fn unplaced_record(id: &str, place_by: u64) -> JobRecord {
        let mut r = JobRecord::new(id, JobKind::Generate);
        let job = diffmesh_shared::testing::generation_job(id, "a red circle", 1, 4);
        r.record_submission(&job, place_by);
        r
    }

    #[test]
    fn unplaced_records_fall_due_after_the_margin_and_leave_once_placed_or_ended() {
        let mut u = Unplaced::default();
        u.observe(&unplaced_record("a", 1_000));
        u.observe(&unplaced_record("b", 1_000));
        u.observe(&unplaced_record("c", 1_000));
        // A record without a deadline is not followed (an older gateway drives it).
        u.observe(&JobRecord::new("d", JobKind::Generate));
        assert_eq!(u.len(), 3);
        let mut placed = unplaced_record("a", 1_000);
        placed.mark_placed("w1");
        u.observe(&placed);
        let mut ended = unplaced_record("b", 1_000);
        ended.mark_failed("no denoiser", "service_unavailable");
        u.observe(&ended);
        assert!(
            u.take_due(1_000 + ADOPTION_MARGIN_MS).is_empty(),
            "not past the margin"
        );
        assert_eq!(
            u.take_due(1_001 + ADOPTION_MARGIN_MS),
            vec!["c".to_string()]
        );
        assert!(u.is_empty());
    }

    #[test]
    fn a_later_deadline_postpones_the_check() {
        let mut u = Unplaced::default();
        u.observe(&unplaced_record("a", 1_000));
        // The driver resubmitted (or another router adopted it): a new deadline.
        u.observe(&unplaced_record("a", 50_000));
        assert!(u.take_due(10_000).is_empty());
        assert_eq!(u.take_due(60_000), vec!["a".to_string()]);
    }
}
