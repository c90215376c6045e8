//! The terminal events and capture reports of jobs this denoiser ended lately, answered on
//! `subjects::DENOISER_OUTCOME`. A job's `Done`, `Failed` or `Captured` goes out as a core NATS
//! publish, which is lost when the gateway's subscription is away at that moment (a server
//! restart, a reconnect to another cluster node); the waiting gateway then asks here instead of
//! waiting until its deadline (or failing a template registration whose capture ran).
use std::time::Duration;

use diffmesh_shared::nats::reply_msgpack;
use diffmesh_shared::wire::messages::{decode, JobEvent, OutcomeQuery, WantedEvent};
use diffmesh_shared::{wire::subjects, MeshError};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

/// How long an ended job's event is kept: longer than a gateway waits between its checks.
pub const OUTCOME_TTL: Duration = Duration::from_secs(600);
/// Ended jobs kept at most (a few hundred bytes each).
const OUTCOMES_KEPT: u64 = 100_000;

/// Terminal events and capture reports by job id, for [`OUTCOME_TTL`].
#[derive(Clone)]
pub struct RecentOutcomes {
    events: moka::sync::Cache<(String, WantedEvent), JobEvent>,
}

impl Default for RecentOutcomes {
    fn default() -> Self {
        Self {
            events: moka::sync::Cache::builder()
                .max_capacity(OUTCOMES_KEPT)
                .time_to_live(OUTCOME_TTL)
                .build(),
        }
    }
}

impl RecentOutcomes {
    /// Keep `event` if it ends the job (`Done`, `Failed`) or reports its capture.
    pub fn note(&self, job_id: &str, event: &JobEvent) {
        if let Some(wanted) = WantedEvent::of(event) {
            self.events
                .insert((job_id.to_string(), wanted), event.clone());
        }
    }

    pub fn get(&self, job_id: &str, wanted: WantedEvent) -> Option<JobEvent> {
        self.events.get(&(job_id.to_string(), wanted))
    }

    /// Answer outcome queries for jobs kept here until `shutdown`; queries for other jobs get
    /// no answer (the denoiser that ended them answers).
    pub async fn serve(
        self,
        client: async_nats::Client,
        shutdown: CancellationToken,
    ) -> Result<(), MeshError> {
        let mut queries = client.subscribe(subjects::DENOISER_OUTCOME).await?;
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                msg = queries.next() => match msg { Some(m) => m, None => return Ok(()) },
            };
            let query = match decode::<OutcomeQuery>(&msg.payload) {
                Ok(query) => query,
                Err(err) => {
                    tracing::warn!(error = %err, "undecodable outcome query");
                    continue;
                }
            };
            if let Some(event) = self.get(&query.job_id, query.wanted) {
                if let Err(err) = reply_msgpack(&client, &msg, &event).await {
                    tracing::warn!(job_id = %query.job_id, error = %err, "could not answer an outcome query");
                }
            }
        }
    }
}

impl std::fmt::Debug for RecentOutcomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecentOutcomes")
            .field("kept", &self.events.entry_count())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_events_and_capture_reports_are_kept() {
        let outcomes = RecentOutcomes::default();
        outcomes.note(
            "a",
            &JobEvent::Step {
                step: 1,
                total: 4,
                ranks: None,
            },
        );
        assert_eq!(outcomes.get("a", WantedEvent::Terminal), None);
        let done = JobEvent::Done {
            png_keys: vec!["a/result-0.png".into()],
        };
        outcomes.note("a", &done);
        assert_eq!(outcomes.get("a", WantedEvent::Terminal), Some(done.clone()));
        assert_eq!(outcomes.get("a", WantedEvent::Captured), None);
        let failed = JobEvent::Failed {
            message: "m".into(),
            error_type: "internal".into(),
        };
        outcomes.note("b", &failed);
        assert_eq!(outcomes.get("b", WantedEvent::Terminal), Some(failed));
        let captured = JobEvent::Captured {
            cache_key: "k".into(),
            steps: 4,
            blocks: 2,
            bytes: 1024,
            quality: None,
        };
        outcomes.note("c", &captured);
        outcomes.note("c", &done);
        assert_eq!(outcomes.get("c", WantedEvent::Captured), Some(captured));
        assert_eq!(outcomes.get("c", WantedEvent::Terminal), Some(done));
        assert_eq!(outcomes.get("d", WantedEvent::Terminal), None);
    }
}
