//! `DELETE /v1/templates/{id}`: the record turns `deleting` at once (new edits get 409), and
//! the template's objects (cache entries, denoisers' local copies, image, kept pixels, record)
//! are removed once no accepted edit reads them any more (`uses`): at once when none is in
//! flight (200), else in the background when the last one ends (202).
//!
//! A delete left pending by a gateway that stopped is resumed by the next gateway to start
//! (`resume_pending`) or by repeating the `DELETE`.
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::stream;
use async_nats::Client;
use diffmesh_shared::stores::job::JobStore;
use diffmesh_shared::stores::transient::{self, no_error_settles, ELECTION_WINDOW};
use diffmesh_shared::wire::subjects::template_captured;
use tokio::time::Instant;

use crate::error::ApiError;
use crate::job_driver::Mesh;
use crate::templates::cache_view;
use crate::templates::record::reported_capture;
use crate::templates::record::{TemplateState, TemplateStore};
use crate::templates::uses::TemplateUses;

/// How often a pending delete counts the edits still in flight.
const POLL: Duration = Duration::from_millis(250);
/// Beyond the job deadline, how long a pending delete waits for edits whose record has not
/// ended (a driver that died: a router ends such records after their deadline).
const ENDING_GRACE: Duration = Duration::from_secs(30);
/// Between attempts to remove the objects when that failed (no cachestore running).
const RETRY: Duration = Duration::from_secs(5);
/// How long a pending delete keeps retrying before it leaves the template `deleting` for a
/// repeated `DELETE` or the next gateway start to finish.
const RETRY_FOR: Duration = Duration::from_secs(600);

/// What deleting a template touches; cheap to clone into a background task.
#[derive(Clone)]
pub struct Deleter {
    pub client: Client,
    pub store: TemplateStore,
    pub uses: TemplateUses,
    /// Job records: a capture's report, for a template whose record lacks its cache key.
    pub jobs: JobStore,
    pub cachestore_timeout: Duration,
    /// The longest an accepted job may run (`FlowConfig::job_timeout`).
    pub job_timeout: Duration,
    pub draining: Draining,
    /// The capture announcements (`subjects::TEMPLATE_CAPTURES_STREAM`): a deleted cache's
    /// announcement goes with it, so denoisers started later do not try to warm it.
    pub captures: stream::Stream,
}

/// Templates whose delete this gateway finishes in the background.
#[derive(Clone, Default)]
pub struct Draining(Arc<Mutex<HashSet<String>>>);

/// A running drain of one template; the template leaves [`Draining`] when it drops.
pub struct DrainClaim {
    draining: Draining,
    id: String,
}

impl Draining {
    /// Claim `id` for a drain; `None` while another claim of it lives.
    pub fn claim(&self, id: &str) -> Option<DrainClaim> {
        let mut set = self.0.lock().unwrap_or_else(|e| e.into_inner());
        set.insert(id.to_string()).then(|| DrainClaim {
            draining: self.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for DrainClaim {
    fn drop(&mut self) {
        let mut set = self.draining.0.lock().unwrap_or_else(|e| e.into_inner());
        set.remove(&self.id);
    }
}

/// How a delete request ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Everything was removed; how many cachestore entries existed.
    Deleted { cache_entries_deleted: u32 },
    /// Edits of the template are still running; the objects go once they end.
    Pending { edits_in_flight: u32 },
}

impl Deleter {
    /// Mark `id` as being deleted and remove it now if no edit reads it; otherwise leave the
    /// removal to a background task on `mesh`'s runtime. `Ok(None)` when there is no record.
    pub async fn delete(&self, mesh: &Mesh, id: &str) -> Result<Option<Outcome>, ApiError> {
        let marked = self
            .store
            .update(id, |r| r.state = TemplateState::Deleting)
            .await?;
        if marked.is_none() {
            return Ok(None);
        }
        // After the mark: any edit that began before it is counted here, any later one sees
        // the mark and is refused (`uses`). Once marked, a failure below leaves the rest to
        // the background task; the caller hears why it is not done yet.
        let in_flight = match self.uses.in_flight(id).await {
            Ok(in_flight) => in_flight,
            Err(err) => {
                self.spawn_drain(mesh, id);
                return Err(err);
            }
        };
        if in_flight.is_empty() {
            return match self.purge(id).await {
                Ok(cache_entries_deleted) => Ok(Some(Outcome::Deleted {
                    cache_entries_deleted,
                })),
                Err(err) => {
                    self.spawn_drain(mesh, id);
                    Err(err)
                }
            };
        }
        tracing::info!(template_id = %id, edits_in_flight = in_flight.len(),
            "template marked deleting; its objects go when its edits end");
        self.spawn_drain(mesh, id);
        Ok(Some(Outcome::Pending {
            edits_in_flight: in_flight.len() as u32,
        }))
    }

    /// Remove everything of `id`: cache entries (and the denoisers' copies), image, kept
    /// pixels, then the record. The record goes last, so a failure leaves it to retry with.
    /// Returns how many cachestore entries existed (0 if another gateway got there first).
    pub async fn purge(&self, id: &str) -> Result<u32, ApiError> {
        let Some(record) = self.store.get(id).await? else {
            return Ok(0);
        };
        // No key recorded: the capture may still have stored one that its gateway never
        // recorded (it stopped, or the delete came first); the capture job's record has it.
        let cache = match &record.cache_key {
            Some(key) => Some((key.clone(), record.cached_steps())),
            None => reported_capture(&self.jobs, &record)
                .await?
                .filter(|c| !c.cache_key.is_empty())
                .map(|c| (c.cache_key, c.steps)),
        };
        let cache_entries_deleted = match cache {
            Some((key, steps)) => self.remove_cache(id, &key, steps).await?,
            None => 0,
        };
        self.store.delete_image(id).await?;
        self.store.delete(id).await?;
        tracing::info!(template_id = %id, cache_entries_deleted, "template deleted");
        Ok(cache_entries_deleted)
    }

    /// Remove the cache `cache_key` of template `id` (cachestore entries, the denoisers' copies,
    /// the capture announcement) unless another template that is not being deleted uses it:
    /// templates of the same pixels and capture settings share one cache. Returns how many
    /// cachestore entries existed (0 when it stays).
    pub async fn remove_cache(
        &self,
        id: &str,
        cache_key: &str,
        steps: u32,
    ) -> Result<u32, ApiError> {
        let sharer = self.store.list().await?.into_iter().find(|r| {
            r.id != id
                && r.state != TemplateState::Deleting
                && r.cache_key.as_deref() == Some(cache_key)
        });
        if let Some(sharer) = sharer {
            tracing::info!(template_id = %id, %cache_key, shared_with = %sharer.id,
                "the cache stays: another template uses it");
            return Ok(0);
        }
        let existed =
            cache_view::remove(&self.client, id, cache_key, steps, self.cachestore_timeout).await?;
        self.forget_capture(cache_key).await;
        Ok(existed)
    }

    /// Purge the stored capture announcement of `cache_key`. Best effort: one left behind
    /// costs a denoiser that replays it one cachestore lookup (`missing`), and goes after a
    /// week anyway.
    async fn forget_capture(&self, cache_key: &str) {
        let subject = template_captured(cache_key);
        let purged = transient::retried_bounded(
            "template_captured.purge",
            ELECTION_WINDOW,
            Some(transient::REQUEST_ATTEMPT_TIMEOUT),
            no_error_settles,
            || {
                let purge = self.captures.purge().filter(subject.clone());
                async move { purge.await }
            },
        )
        .await;
        if let Err(err) = purged {
            tracing::warn!(%cache_key, error = %err, "could not purge the capture announcement");
        }
    }

    /// Wait (in the background) for `id`'s edits to end, then purge it; nothing new when this
    /// gateway drains `id` already (a repeated `DELETE`).
    pub fn spawn_drain(&self, mesh: &Mesh, id: &str) {
        let Some(claim) = self.draining.claim(id) else {
            tracing::debug!(template_id = %id, "a delete of this template is already running");
            return;
        };
        let (deleter, id) = (self.clone(), id.to_string());
        mesh.spawn_background(async move {
            deleter.drain_then_purge(&id).await;
            drop(claim);
        });
    }

    async fn drain_then_purge(&self, id: &str) {
        let give_up_waiting = Instant::now() + self.job_timeout + ENDING_GRACE;
        loop {
            match self.uses.in_flight(id).await {
                Ok(jobs) if jobs.is_empty() => break,
                Ok(jobs) if Instant::now() >= give_up_waiting => {
                    tracing::warn!(template_id = %id, ?jobs,
                        "edits still not ended past their deadline; deleting the template anyway");
                    break;
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(template_id = %id, error = %err, "could not count edits in flight")
                }
            }
            tokio::time::sleep(POLL).await;
        }
        let give_up = Instant::now() + RETRY_FOR;
        loop {
            match self.purge(id).await {
                Ok(_) => return,
                Err(err) if Instant::now() >= give_up => {
                    tracing::error!(template_id = %id, error = %err,
                        "could not delete the template; it stays `deleting` until DELETE is repeated");
                    return;
                }
                Err(err) => {
                    tracing::warn!(template_id = %id, error = %err, "deleting the template failed; retrying")
                }
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    /// Finish the deletes that a stopped gateway left pending (records still `deleting`).
    pub async fn resume_pending(&self, mesh: &Mesh) {
        let records = match self.store.list().await {
            Ok(records) => records,
            Err(err) => {
                tracing::warn!(error = %err, "could not look for pending template deletes");
                return;
            }
        };
        for r in records
            .iter()
            .filter(|r| r.state == TemplateState::Deleting)
        {
            tracing::info!(template_id = %r.id, "resuming a pending template delete");
            self.spawn_drain(mesh, &r.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_drain_per_template_until_it_ends() {
        let draining = Draining::default();
        let first = draining.claim("a").expect("first claim");
        assert!(
            draining.claim("a").is_none(),
            "a second drain of the same template"
        );
        let other = draining
            .claim("b")
            .expect("another template drains alongside");
        drop(first);
        assert!(
            draining.claim("a").is_some(),
            "claimable again once the drain ended"
        );
        drop(other);
    }
}
