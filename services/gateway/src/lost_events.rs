//! A job's terminal event or capture report when its publish was lost. Job events are core NATS
//! publishes: one sent while this gateway's subscription is away (a server restart, a reconnect
//! to another cluster node) never arrives, and the request would wait until its deadline
//! although the job ended. So a waiting request asks the denoisers how the job ended
//! (`subjects::DENOISER_OUTCOME`) after a reconnect and whenever it has heard nothing for a
//! while; a template registration asks what its capture stored.
use std::time::Duration;

use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::stores::job::CaptureReport;
use diffmesh_shared::wire::messages::{JobEvent, OutcomeQuery, WantedEvent};
use diffmesh_shared::wire::subjects::DENOISER_OUTCOME;
use diffmesh_shared::MeshError;

/// How long a waiting job may hear nothing before the denoisers are asked. Running jobs send
/// an event every step; a queued one is silent, and asking for it costs one small request.
pub const ASK_AFTER_SILENCE: Duration = Duration::from_secs(5);

/// How long an outcome query waits for the denoiser that ended the job; the others are silent.
const OUTCOME_QUERY_TIMEOUT: Duration = Duration::from_millis(500);

/// The terminal event (`Done`, `Failed`) of `job_id` if a denoiser ended it lately, else `None`
/// (still running or queued, or no denoiser knows it).
pub async fn ended_as(client: &async_nats::Client, job_id: &str) -> Option<JobEvent> {
    ask(client, job_id, WantedEvent::Terminal).await
}

/// What the capture job `job_id` stored, if a denoiser captured it lately, else `None`.
pub async fn captured(client: &async_nats::Client, job_id: &str) -> Option<CaptureReport> {
    let event = ask(client, job_id, WantedEvent::Captured).await?;
    CaptureReport::from_event(&event)
}

/// The `wanted` event of `job_id` from the denoiser that sent it; `None` when none answers or
/// the answer is of another kind.
async fn ask(client: &async_nats::Client, job_id: &str, wanted: WantedEvent) -> Option<JobEvent> {
    let query = OutcomeQuery {
        job_id: job_id.to_string(),
        wanted,
    };
    match request_msgpack::<_, JobEvent>(client, DENOISER_OUTCOME, &query, OUTCOME_QUERY_TIMEOUT)
        .await
    {
        Ok(event) if WantedEvent::of(&event) == Some(wanted) => Some(event),
        Ok(_) | Err(MeshError::Timeout { .. } | MeshError::NoResponders { .. }) => None,
        Err(err) => {
            tracing::warn!(%job_id, error = %err, "outcome query failed");
            None
        }
    }
}
