//! One store for every kind of JSON record the mesh keeps in JetStream KV (job records,
//! idempotency keys, LoRA and template records): get, create-if-absent, put, compare-and-set
//! update, delete and list, each call tried again while the bucket has no leader
//! ([`transient`]: a node loss on a cluster must not fail the requests of that moment).
//! JSON, so operators can read the records with the `nats` CLI. What is particular to a kind
//! (job watches, the idempotency claim, who owns a LoRA) is built on top of it by that kind.
use std::marker::PhantomData;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::TryStreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::MeshError;
use crate::stores::jetstream_layout::Spec;
use crate::stores::transient::{self, KvUpdated};
use crate::wire::lora::LoraRecord;

/// A kind of record: its JSON form, and the name its calls are counted under
/// (`diffmesh_jetstream_retries_total{call="<kind>.<op>"}`).
pub trait Record: Serialize + DeserializeOwned + Clone + PartialEq + Send + Sync + 'static {
    const KIND: &'static str;
}

impl Record for LoraRecord {
    const KIND: &'static str = "lora";
}

/// Records of one kind by key in one KV bucket (cheap to clone).
pub struct RecordStore<R> {
    kv: kv::Store,
    /// How long a failing call is tried again (default [`transient::ELECTION_WINDOW`]).
    retry_window: Duration,
    kind: PhantomData<fn() -> R>,
}

impl<R> Clone for RecordStore<R> {
    fn clone(&self) -> Self {
        Self {
            kv: self.kv.clone(),
            retry_window: self.retry_window,
            kind: PhantomData,
        }
    }
}

/// Compare-and-set attempts of [`RecordStore::update`] before it gives up under contention.
pub const MAX_UPDATE_ATTEMPTS: u32 = 16;

impl<R: Record> RecordStore<R> {
    /// Open `bucket` (created when missing, as the layout table says).
    pub async fn open(js: &jetstream::Context, bucket: &Spec) -> Result<Self, MeshError> {
        Ok(Self::over(bucket.open_kv(js).await?))
    }

    /// A store over an opened bucket.
    pub fn over(kv: kv::Store) -> Self {
        Self {
            kv,
            retry_window: transient::ELECTION_WINDOW,
            kind: PhantomData,
        }
    }

    /// Try failing calls again for `window` instead of [`transient::ELECTION_WINDOW`].
    pub fn with_retry_window(mut self, window: Duration) -> Self {
        self.retry_window = window;
        self
    }

    /// The bucket itself (for what is particular to a kind, e.g. watches).
    pub fn kv(&self) -> &kv::Store {
        &self.kv
    }

    pub fn retry_window(&self) -> Duration {
        self.retry_window
    }

    fn call(op: &str) -> String {
        format!("{}.{op}", R::KIND)
    }

    pub async fn get(&self, key: &str) -> Result<Option<R>, MeshError> {
        Ok(self.get_with_revision(key).await?.map(|(r, _)| r))
    }

    /// The record and its revision (for a compare-and-set of one's own).
    pub async fn get_with_revision(&self, key: &str) -> Result<Option<(R, u64)>, MeshError> {
        let call = Self::call("get");
        transient::kv_get_json(&self.kv, &call, self.retry_window, key).await
    }

    /// Store `record` under `key` unless the key exists (`MeshError::KvCreate` with
    /// `AlreadyExists` then); its revision. A create that landed but whose reply was lost
    /// finds `record` itself stored on the next attempt, which counts as created.
    pub async fn create(&self, key: &str, record: &R) -> Result<u64, MeshError> {
        let value = Bytes::from(serde_json::to_vec(record)?);
        let call = Self::call("create");
        transient::kv_create(&self.kv, &call, self.retry_window, key, value).await
    }

    /// Overwrite `key` with `record` unconditionally; its revision.
    pub async fn put(&self, key: &str, record: &R) -> Result<u64, MeshError> {
        self.put_bytes(key, Bytes::from(serde_json::to_vec(record)?))
            .await
    }

    /// Overwrite `key` with `value` as it is (not a record: an index entry beside the records),
    /// tried again as record writes are; its revision.
    pub async fn put_bytes(&self, key: &str, value: Bytes) -> Result<u64, MeshError> {
        let call = Self::call("put");
        transient::retried_bounded(
            &call,
            self.retry_window,
            Some(transient::REQUEST_ATTEMPT_TIMEOUT),
            transient::kv_put_settled,
            || self.kv.put(key, value.clone()),
        )
        .await
        .map_err(MeshError::from)
    }

    /// Read-modify-write of `key` with compare-and-set (see [`transient::kv_update_json`]):
    /// `change` runs on the latest record (or first on `guess`, a record and revision the
    /// caller believes latest) and declines by returning false.
    pub async fn update<F>(
        &self,
        key: &str,
        guess: Option<(R, u64)>,
        change: F,
    ) -> Result<KvUpdated<R>, MeshError>
    where
        F: FnMut(&mut R) -> bool,
    {
        let call = Self::call("update");
        transient::kv_update_json(
            &self.kv,
            &call,
            self.retry_window,
            key,
            MAX_UPDATE_ATTEMPTS,
            guess,
            change,
        )
        .await
    }

    /// Remove `key` (a no-op when it is missing).
    pub async fn delete(&self, key: &str) -> Result<(), MeshError> {
        let call = Self::call("delete");
        // An invalid key is an answer about the key, not about the cluster.
        let settled = |e: &kv::DeleteError| e.kind() == kv::DeleteErrorKind::InvalidKey;
        transient::retried_bounded(
            &call,
            self.retry_window,
            Some(transient::REQUEST_ATTEMPT_TIMEOUT),
            settled,
            || self.kv.delete(key),
        )
        .await
        .map_err(MeshError::from)
    }

    /// Every record in the bucket (a record that fails to read or decode is skipped and
    /// logged: one bad record must not hide the others).
    pub async fn list(&self) -> Result<Vec<R>, MeshError> {
        let call = Self::call("list");
        let keys: Vec<String> = transient::retried_bounded(
            &call,
            self.retry_window,
            None,
            transient::no_error_settles,
            || async {
                let keys = self.kv.keys().await.map_err(MeshError::from)?;
                keys.try_collect::<Vec<String>>()
                    .await
                    .map_err(MeshError::from)
            },
        )
        .await?;
        let mut records = Vec::with_capacity(keys.len());
        for key in keys {
            match self.get(&key).await {
                Ok(Some(r)) => records.push(r),
                Ok(None) => {}
                Err(e) => tracing::warn!(kind = R::KIND, %key, error = %e, "skipped a record"),
            }
        }
        Ok(records)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stores::jetstream_layout::LORA_RECORDS;
    use serde::Deserialize;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Note {
        text: String,
        edits: u32,
    }

    impl Record for Note {
        // A kind whose calls are counted (`transient::CALLS`).
        const KIND: &'static str = "lora";
    }

    fn note(text: &str) -> Note {
        Note {
            text: text.into(),
            edits: 0,
        }
    }

    #[tokio::test]
    async fn records_are_created_once_updated_by_compare_and_set_listed_and_deleted() {
        let server = crate::testing::NatsServer::start();
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = jetstream::new(client);
        let store = RecordStore::<Note>::open(&js, &LORA_RECORDS).await.unwrap();

        assert_eq!(store.get("a").await.unwrap(), None);
        store.create("a", &note("first")).await.unwrap();
        let again = store.create("a", &note("second")).await;
        assert!(
            matches!(again, Err(MeshError::KvCreate(ref e)) if e.kind() == kv::CreateErrorKind::AlreadyExists),
            "{again:?}"
        );
        assert_eq!(store.get("a").await.unwrap(), Some(note("first")));

        // A guess that is stale (another writer got in) is read again before the change.
        let (stale, stale_revision) = store.get_with_revision("a").await.unwrap().unwrap();
        store
            .put(
                "a",
                &Note {
                    edits: 5,
                    ..note("first")
                },
            )
            .await
            .unwrap();
        let updated = store
            .update("a", Some((stale, stale_revision)), |n| {
                n.edits += 1;
                true
            })
            .await
            .unwrap();
        assert!(
            matches!(updated, KvUpdated::Written(ref n, _) if n.edits == 6),
            "{updated:?}"
        );
        let declined = store.update("a", None, |_| false).await.unwrap();
        assert!(matches!(declined, KvUpdated::Declined(ref n, _) if n.edits == 6));
        assert_eq!(
            store.update("missing", None, |_| true).await.unwrap(),
            KvUpdated::Missing
        );

        store.create("b", &note("other")).await.unwrap();
        let mut texts: Vec<String> = store
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|n| n.text)
            .collect();
        texts.sort();
        assert_eq!(texts, ["first", "other"]);
        store.delete("a").await.unwrap();
        store.delete("a").await.unwrap();
        assert_eq!(store.get("a").await.unwrap(), None);
        assert_eq!(store.list().await.unwrap(), vec![note("other")]);
    }
}
