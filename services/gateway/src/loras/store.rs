//! Registered LoRAs in JetStream: the records (JSON, KV bucket `LORA_RECORDS`, key = id, in the
//! shared record store) and their weights files (object store `LORA_WEIGHTS`, key
//! `lora::weights_key(id)`), neither of which expires. Every call is tried again while its
//! stream has no leader, as every record store's are.
use async_nats::jetstream;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::jetstream_layout::{LORA_RECORDS, LORA_WEIGHTS};
use diffmesh_shared::stores::job::now_ms;
use diffmesh_shared::stores::record::RecordStore;
use diffmesh_shared::wire::lora::{weights_key, LoraRecord};
use diffmesh_shared::MeshError;

use crate::error::ApiError;
use crate::loras::form::LoraUpload;

/// LoRA ids are UUIDs, which also keeps KV and object-store keys well-formed; anything else
/// cannot name a LoRA.
pub fn is_lora_id(id: &str) -> bool {
    uuid::Uuid::parse_str(id).is_ok_and(|u| u.to_string() == id)
}

/// `unix_ms` as RFC 3339 in UTC with milliseconds (`2025-01-31T12:00:00.123Z`). Always the same
/// width (years 1970-9999), so records sort by it as strings.
pub fn rfc3339_utc(unix_ms: u64) -> String {
    use time::format_description::BorrowedFormatItem;
    const FORMAT: &[BorrowedFormatItem<'static>] = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(unix_ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(FORMAT).ok())
        // Past year 9999 (no clock says so): the latest time of the format.
        .unwrap_or_else(|| "9999-12-31T23:59:59.999Z".into())
}

/// Records and weights of registered LoRAs.
#[derive(Clone)]
pub struct LoraStore {
    records: RecordStore<LoraRecord>,
    weights: BlobStore,
}

impl LoraStore {
    /// Open (creating when missing) the record bucket and the weights bucket.
    pub async fn open(js: &jetstream::Context) -> Result<Self, MeshError> {
        let records = RecordStore::open(js, &LORA_RECORDS).await?;
        let weights = BlobStore::open_with(js, &LORA_WEIGHTS).await?;
        Ok(Self { records, weights })
    }

    /// Store a checked upload under a new id, owned by `owner` (the registering API key): the
    /// weights first, then the record, so a record never names weights that are not there. A
    /// record that cannot be written takes its weights with it.
    pub async fn register(
        &self,
        upload: LoraUpload,
        owner: Option<&str>,
    ) -> Result<LoraRecord, ApiError> {
        let id = uuid::Uuid::new_v4().to_string();
        let record = upload.record(id.clone(), owner.map(str::to_string), rfc3339_utc(now_ms()));
        let spooled = &upload.weights;
        self.weights
            .put_file(&weights_key(&id), spooled.path(), spooled.len())
            .await?;
        if let Err(err) = self.records.create(&id, &record).await {
            if let Err(cleanup) = self.weights.delete(&weights_key(&id)).await {
                tracing::warn!(
                    lora_id = %id,
                    error = %cleanup,
                    "could not remove the weights of a LoRA whose record failed"
                );
            }
            return Err(err.into());
        }
        Ok(record)
    }

    /// The record of `id`; `None` when there is none (or `id` cannot be one).
    pub async fn get(&self, id: &str) -> Result<Option<LoraRecord>, ApiError> {
        if !is_lora_id(id) {
            return Ok(None);
        }
        Ok(self.records.get(id).await?)
    }

    /// Remove `id`: the record first (requests naming it are refused from then on), then its
    /// weights. `false` when there was no such LoRA. Weights that cannot be removed once the
    /// record is gone are only logged: the LoRA is deleted either way, and nothing reads them.
    pub async fn remove(&self, id: &str) -> Result<bool, ApiError> {
        if self.get(id).await?.is_none() {
            return Ok(false);
        }
        self.records.delete(id).await?;
        if let Err(err) = self.weights.delete(&weights_key(id)).await {
            tracing::warn!(
                lora_id = %id,
                error = %err,
                "LoRA deleted, but its weights could not be removed"
            );
        }
        Ok(true)
    }

    /// Every record, oldest first (then by id), whoever owns it (the handlers filter by caller).
    pub async fn list(&self) -> Result<Vec<LoraRecord>, ApiError> {
        let mut records = self.records.list().await?;
        sort_by_creation(&mut records);
        Ok(records)
    }
}

/// Oldest first: `created_at` has one width (`rfc3339_utc`), so string order is time order.
fn sort_by_creation(records: &mut [LoraRecord]) {
    records.sort_by(|a, b| (&a.created_at, &a.id).cmp(&(&b.created_at, &b.id)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_uuids_only() {
        let id = uuid::Uuid::new_v4().to_string();
        assert!(is_lora_id(&id));
        assert!(!is_lora_id(&id.to_uppercase()));
        for bad in ["", "x", "../etc", "a.b", "lora-1", "*", ">"] {
            assert!(!is_lora_id(bad), "{bad}");
        }
    }

    #[test]
    fn timestamps_are_rfc_3339_utc_of_one_width() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a century leap year) 12:34:56.789.
        assert_eq!(rfc3339_utc(951_827_696_789), "2000-02-29T12:34:56.789Z");
        assert_eq!(rfc3339_utc(1_735_689_599_999), "2024-12-31T23:59:59.999Z");
        assert_eq!(rfc3339_utc(1_735_689_600_000), "2025-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_utc(4_107_542_400_000), "2100-03-01T00:00:00.000Z");
    }

    #[test]
    fn records_list_oldest_first() {
        let record = |id: &str, ms| LoraRecord {
            id: id.into(),
            name: None,
            owner: None,
            bytes: 1,
            parameters: 1,
            modules: 1,
            max_rank: 1,
            dtype: "F32".into(),
            sha256: String::new(),
            created_at: rfc3339_utc(ms),
            target: Default::default(),
            text_encoder_keys: 0,
        };
        // 9 s sorts before 10 s only because the width is fixed.
        let mut records = vec![record("b", 10_000), record("c", 9_000), record("a", 10_000)];
        sort_by_creation(&mut records);
        let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["c", "a", "b"]);
    }
}
