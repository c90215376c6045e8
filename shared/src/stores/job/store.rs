//! The job records' KV store (`subjects::JOB_BUCKET`): create, read, compare-and-set updates
//! (with the revisions it last saw, when enabled) and watches that reopen after a server
//! restart or reconnect.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv};
use futures::stream::BoxStream;
use futures::StreamExt;

use crate::error::MeshError;
use crate::nats::reconnects::Reconnects;
use crate::stores::jetstream_layout;
use crate::stores::record::{Record, RecordStore};
use crate::stores::reopening_watch::{reopening, WATCH_REOPEN_WINDOW};
use crate::stores::transient::KvUpdated;

use super::{now_ms, JobRecord};

impl Record for JobRecord {
    const KIND: &'static str = "job";
}

/// Job records by job id in the KV bucket ([`RecordStore`]: every call is tried again while
/// the bucket has no leader), with watches and the revisions it last saw.
#[derive(Clone)]
pub struct JobStore {
    records: RecordStore<JobRecord>,
    /// For the inboxes of record watches.
    client: async_nats::Client,
    /// The records this store last wrote or read, with their revisions, when enabled
    /// ([`JobStore::with_known_revisions`]): an update first tries its compare-and-set on
    /// these and reads the record only when another writer got in first.
    known: Option<moka::sync::Cache<String, (JobRecord, u64)>>,
}

/// How long a known record revision is kept ([`JobStore::with_known_revisions`]): longer
/// than the time between a job's updates, far shorter than the record's life.
pub const KNOWN_REVISION_TTL: Duration = Duration::from_secs(300);

impl JobStore {
    /// Open `subjects::JOB_BUCKET`, creating it when missing (records expire after a week,
    /// [`jetstream_layout::JOBS`]).
    pub async fn open(js: &jetstream::Context) -> Result<Self, MeshError> {
        Ok(Self {
            records: RecordStore::open(js, &jetstream_layout::JOBS).await?,
            client: js.client(),
            known: None,
        })
    }

    /// Remember up to `capacity` records this store wrote or read (each for
    /// [`KNOWN_REVISION_TTL`]) and write updates of them without reading them first. For
    /// the writer of most of a job's changes (the gateway driving it); a store whose records
    /// others change in between would pay a failed write for each stale one.
    pub fn with_known_revisions(mut self, capacity: u64) -> Self {
        self.known = Some(
            moka::sync::Cache::builder()
                .max_capacity(capacity)
                .time_to_live(KNOWN_REVISION_TTL)
                .build(),
        );
        self
    }

    fn remember(&self, record: &JobRecord, revision: u64) {
        if let Some(known) = &self.known {
            known.insert(record.job_id.clone(), (record.clone(), revision));
        }
    }

    /// Try failing calls again for `window` instead of the default election window.
    pub fn with_retry_window(mut self, window: Duration) -> Self {
        self.records = self.records.with_retry_window(window);
        self
    }

    fn kv(&self) -> &kv::Store {
        self.records.kv()
    }

    /// Store a new record; fails if the job id already exists.
    ///
    /// A write that landed but whose reply was lost reads as "already exists" on the next
    /// attempt (async-nats also looks the key up after a failed create): that counts as
    /// created when the stored record is this one.
    /// Its entry in the owner index ([`super::owner_index`]) is written after it: a failure
    /// there leaves the job out of `GET /v1/jobs` (logged), not the job failed.
    pub async fn create(&self, record: &JobRecord) -> Result<(), MeshError> {
        let revision = self.records.create(&record.job_id, record).await?;
        self.remember(record, revision);
        let key = super::owner_index::index_key(
            record.owner.as_deref(),
            record.created_at_ms,
            &record.job_id,
        );
        if let Err(e) = self.records.put_bytes(&key, bytes::Bytes::new()).await {
            tracing::warn!(job_id = %record.job_id, error = %e, "job not indexed for its key's listing");
        }
        Ok(())
    }

    /// The ids of the jobs `owner` created that the bucket still holds, newest first
    /// ([`super::owner_index::owned_job_ids`]).
    pub async fn owned_job_ids(
        &self,
        owner: Option<&str>,
    ) -> Result<super::owner_index::OwnedJobs, MeshError> {
        super::owner_index::owned_job_ids(self.kv(), &self.client, owner).await
    }

    /// Overwrite the record unconditionally.
    pub async fn put(&self, record: &JobRecord) -> Result<(), MeshError> {
        let revision = self.records.put(&record.job_id, record).await?;
        self.remember(record, revision);
        Ok(())
    }

    pub async fn get(&self, job_id: &str) -> Result<Option<JobRecord>, MeshError> {
        Ok(self.get_with_revision(job_id).await?.map(|(r, _)| r))
    }

    async fn get_with_revision(&self, job_id: &str) -> Result<Option<(JobRecord, u64)>, MeshError> {
        let read = self.records.get_with_revision(job_id).await?;
        if let Some((record, revision)) = &read {
            self.remember(record, *revision);
        }
        Ok(read)
    }

    /// The record now (first item, once it exists) and every later version of it. The watch
    /// is opened again when its consumer stops (a server restart, a leader change) or NATS
    /// reconnects, for up to [`WATCH_REOPEN_WINDOW`] ([`reopening`]).
    pub async fn watch(
        &self,
        job_id: &str,
    ) -> Result<BoxStream<'static, Result<JobRecord, MeshError>>, MeshError> {
        let reconnects = Reconnects::from_now();
        let first = records(self.kv().watch_with_history(job_id).await?);
        let (kv, job_id) = (self.kv().clone(), job_id.to_string());
        Ok(reopening(
            "job.watch",
            WATCH_REOPEN_WINDOW,
            reconnects,
            first,
            move || {
                let (kv, job_id) = (kv.clone(), job_id.clone());
                async move { Ok(records(kv.watch_with_history(&job_id).await?)) }
            },
        ))
    }

    /// Every version of any record written from `lookback` ago on, then every new one. Older
    /// records are not replayed (a week of finished jobs would be): a reader that was down
    /// longer than `lookback` misses records that did not change since. Only opening the first
    /// watch can fail: after that the watch is opened again, for as long as it takes, whenever
    /// its consumer stops or NATS reconnects ([`reopening`]), and goes on after the last record
    /// it passed on (by stream sequence), so nothing is skipped or given twice.
    pub async fn watch_since(
        &self,
        lookback: Duration,
    ) -> Result<BoxStream<'static, Result<JobRecord, MeshError>>, MeshError> {
        let reconnects = Reconnects::from_now();
        let delivered = Arc::new(AtomicU64::new(0));
        let first = records_since(self.kv(), &self.client, lookback, delivered.clone()).await?;
        let (kv, client) = (self.kv().clone(), self.client.clone());
        Ok(reopening(
            "job.watch_since",
            Duration::MAX,
            reconnects,
            first,
            move || {
                let (kv, client, delivered) = (kv.clone(), client.clone(), delivered.clone());
                async move { records_since(&kv, &client, lookback, delivered).await }
            },
        ))
    }

    /// Read-modify-write with compare-and-set, retrying when another writer got in between.
    /// Returns the record as written, or as it is when `change` changed nothing but its time
    /// (a placement already recorded, a mark on an ended job): nothing is written then, which
    /// saves the write the gateway and the router would both make of a placement or an ending.
    pub async fn update<F>(&self, job_id: &str, mut change: F) -> Result<JobRecord, MeshError>
    where
        F: FnMut(&mut JobRecord),
    {
        let updated = self
            .change_record(job_id, |record| {
                let before = record.clone();
                change(record);
                record.updated_at_ms = before.updated_at_ms;
                *record != before
            })
            .await?;
        match updated {
            KvUpdated::Written(record, _) | KvUpdated::Declined(record, _) => Ok(record),
            KvUpdated::Missing => Err(MeshError::JobNotFound {
                job_id: job_id.to_string(),
            }),
        }
    }

    /// [`JobStore::update`] where `change` may decline (return false, leaving the record as it
    /// is): `None` then. The decision is made on the latest revision, so two writers racing
    /// for the same change (two routers adopting one job) cannot both make it.
    /// A write that failed otherwise than by a newer revision is tried again
    /// ([`transient::kv_update_json`]).
    pub async fn update_if<F>(
        &self,
        job_id: &str,
        change: F,
    ) -> Result<Option<JobRecord>, MeshError>
    where
        F: FnMut(&mut JobRecord) -> bool,
    {
        match self.change_record(job_id, change).await? {
            KvUpdated::Written(record, _) => Ok(Some(record)),
            KvUpdated::Declined(..) => Ok(None),
            KvUpdated::Missing => Err(MeshError::JobNotFound {
                job_id: job_id.to_string(),
            }),
        }
    }

    /// Compare-and-set of `job_id`'s record with `change` (declining when it returns false),
    /// stamping the update time of what it writes; starting from the known revision, if any.
    async fn change_record<F>(
        &self,
        job_id: &str,
        mut change: F,
    ) -> Result<KvUpdated<JobRecord>, MeshError>
    where
        F: FnMut(&mut JobRecord) -> bool,
    {
        let guess = self.known.as_ref().and_then(|known| known.get(job_id));
        let updated = self
            .records
            .update(job_id, guess, |record: &mut JobRecord| {
                if !change(record) {
                    return false;
                }
                record.updated_at_ms = now_ms();
                true
            })
            .await;
        if let Some(known) = &self.known {
            match &updated {
                Ok(
                    KvUpdated::Written(record, revision) | KvUpdated::Declined(record, revision),
                ) => self.remember(record, *revision),
                _ => known.invalidate(job_id),
            }
        }
        updated
    }
}

/// One watch of every record written from `lookback` ago on, or, once `delivered` holds the
/// stream sequence of a record passed on (a reopening), of every record after that one: a
/// reopened watch replays nothing it already gave (see [`JobStore::watch_since`]).
async fn records_since(
    kv: &kv::Store,
    client: &async_nats::Client,
    lookback: Duration,
    delivered: Arc<AtomicU64>,
) -> Result<BoxStream<'static, Result<JobRecord, MeshError>>, MeshError> {
    let watch_error = |e: &dyn std::fmt::Display| MeshError::RecordWatch(e.to_string());
    let deliver_policy = match delivered.load(Ordering::Acquire) {
        0 => consumer::DeliverPolicy::ByStartTime {
            start_time: time::OffsetDateTime::now_utc() - lookback,
        },
        last => consumer::DeliverPolicy::ByStartSequence {
            start_sequence: last + 1,
        },
    };
    let consumer = kv
        .stream
        .create_consumer(consumer::push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            description: Some("job records since a start time".to_string()),
            filter_subject: format!("{}>", kv.prefix),
            replay_policy: consumer::ReplayPolicy::Instant,
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| watch_error(&e))?;
    let messages = consumer.messages().await.map_err(|e| watch_error(&e))?;
    Ok(messages
        .filter_map(move |message| {
            // Taken when the message is read: a stream's items are passed on in order, so the
            // last one read was given to the reader unless the whole stream was dropped.
            if let Ok(Ok(info)) = message.as_ref().map(|m| m.info()) {
                delivered.store(info.stream_sequence, Ordering::Release);
            }
            async move {
                match message {
                    // An empty payload is a deletion marker (records only expire, but be safe).
                    Ok(m) if m.payload.is_empty() => None,
                    Ok(m) => Some(
                        serde_json::from_slice::<JobRecord>(&m.payload).map_err(MeshError::from),
                    ),
                    Err(err) => Some(Err(MeshError::RecordWatch(err.to_string()))),
                }
            }
        })
        .boxed())
}

/// The records a KV watch delivers (deletions skipped).
fn records(watch: kv::Watch) -> BoxStream<'static, Result<JobRecord, MeshError>> {
    watch
        .filter_map(|entry| async move {
            match entry {
                Ok(e) if e.operation == kv::Operation::Put => {
                    Some(serde_json::from_slice::<JobRecord>(&e.value).map_err(MeshError::from))
                }
                Ok(_) => None,
                Err(err) => Some(Err(MeshError::RecordWatch(err.to_string()))),
            }
        })
        .boxed()
}
