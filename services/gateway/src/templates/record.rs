//! Template records (JSON in the KV bucket `subjects::TEMPLATE_BUCKET`) and template images (the
//! object store of the same name, kept until the template is deleted, unlike the 24 h blobs).
use std::time::Duration;

use async_nats::jetstream;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::jetstream_layout::{TEMPLATE_IMAGES, TEMPLATE_RECORDS};
use diffmesh_shared::stores::job::{now_ms, CaptureReport, JobStore};
use diffmesh_shared::stores::record::{Record, RecordStore};
use diffmesh_shared::stores::transient::KvUpdated;
use diffmesh_shared::wire::messages::{PreparedTemplate, TemplateImage, TemplateRef};
use diffmesh_shared::wire::templates::{image_key, prepared_image_key, CacheQuality};
use diffmesh_shared::MeshError;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;

/// Where a template is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TemplateState {
    /// The capture pass is running; edits are refused (409) until it is ready.
    Capturing,
    /// The activation cache is stored; edits read it.
    Ready,
    /// The capture failed (`error` says why); the template can only be deleted.
    Failed,
    /// Deleted: edits are refused (409); its objects go once the edits in flight end.
    Deleting,
}

impl TemplateState {
    pub fn as_str(self) -> &'static str {
        match self {
            TemplateState::Capturing => "capturing",
            TemplateState::Ready => "ready",
            TemplateState::Failed => "failed",
            TemplateState::Deleting => "deleting",
        }
    }
}

/// One registered template, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateRecord {
    pub id: String,
    pub state: TemplateState,
    /// Unix milliseconds.
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// The API key that registered it (`None` with authentication off).
    pub owner: Option<String>,
    /// What the capture ran with (the `TemplateRef` fields; edits must match `steps`).
    pub prompt: String,
    pub seed: u64,
    pub steps: u32,
    pub guidance_scale: f32,
    /// The model it was captured with (its edits run on it); empty in records written before
    /// models were named: the gateway's default model.
    #[serde(default)]
    pub model: String,
    /// Size of the uploaded image (every edit's output size).
    pub width: u32,
    pub height: u32,
    pub image_bytes: u64,
    /// SHA-256 of the model-resolution template pixels (the codec's `template_id`), once
    /// prepared.
    pub content_hash: Option<String>,
    /// Template-bucket key of those pixels, which the codec keeps for the template's edits
    /// (`None` for a template captured before they were kept: its edits prepare them anew).
    #[serde(default)]
    pub prepared_image_key: Option<String>,
    /// The capture job (`/v1/jobs/{id}`).
    pub capture_job_id: Option<String>,
    /// What the capturing denoiser reported (`JobEvent::Captured`), once ready.
    pub cache_key: Option<String>,
    pub cache_bytes: u64,
    pub blocks: u32,
    /// The capture's quality guard, where it ran: below its floor the cache holds no steps
    /// and the template's edits compute in full.
    #[serde(default)]
    pub cache_quality: Option<CacheQuality>,
    pub error: Option<String>,
}

impl TemplateRecord {
    pub fn new(id: String, owner: Option<String>, template: &TemplateRef) -> Self {
        let now = now_ms();
        Self {
            id,
            state: TemplateState::Capturing,
            created_at_ms: now,
            updated_at_ms: now,
            owner,
            prompt: template.prompt.clone(),
            seed: template.seed,
            steps: template.steps,
            guidance_scale: template.guidance_scale,
            model: String::new(),
            width: 0,
            height: 0,
            image_bytes: 0,
            content_hash: None,
            prepared_image_key: None,
            capture_job_id: None,
            cache_key: None,
            cache_bytes: 0,
            blocks: 0,
            cache_quality: None,
            error: None,
        }
    }

    /// What a capture records and an edit reads (`cache_key` empty until captured, and for a
    /// template the quality guard put on full compute: its edits read no cache, the router
    /// prices them so and prefetches nothing).
    pub fn template_ref(&self) -> TemplateRef {
        let cache_key = match self.full_compute() {
            true => String::new(),
            false => self.cache_key.clone().unwrap_or_default(),
        };
        TemplateRef {
            template_id: self.id.clone(),
            prompt: self.prompt.clone(),
            seed: self.seed,
            steps: self.steps,
            guidance_scale: self.guidance_scale,
            cache_key,
        }
    }

    /// The quality guard put the template on full compute: its cache holds no steps.
    pub fn full_compute(&self) -> bool {
        self.cache_quality.is_some_and(|q| q.full_compute)
    }

    /// Steps its stored cache holds.
    pub fn cached_steps(&self) -> u32 {
        match self.full_compute() {
            true => 0,
            false => self.steps,
        }
    }

    /// How a job on this template names its image (it stays in the template bucket).
    pub fn template_image(&self) -> TemplateImage {
        let prepared = match (&self.prepared_image_key, &self.content_hash) {
            (Some(key), Some(hash)) => Some(PreparedTemplate {
                key: key.clone(),
                content_hash: hash.clone(),
            }),
            _ => None,
        };
        TemplateImage {
            template_id: self.id.clone(),
            prepared,
        }
    }

    /// Still `capturing` with no write for longer than `limit`: the gateway registering it
    /// stopped (a live one records the outcome by the job deadline).
    pub fn capture_abandoned(&self, now_ms: u64, limit: Duration) -> bool {
        self.state == TemplateState::Capturing
            && now_ms.saturating_sub(self.updated_at_ms) > limit.as_millis() as u64
    }

    /// Why `report` cannot be this template's cache; `None` when it can.
    pub fn capture_mismatch(&self, report: &CaptureReport) -> Option<String> {
        if report.cache_key.is_empty() {
            return Some("the denoiser reported an empty cache key".into());
        }
        // The quality guard's fallback: a cache of no steps, every edit in full compute.
        let full_compute = report.quality.is_some_and(|q| q.full_compute) && report.steps == 0;
        (report.steps != self.steps && !full_compute).then(|| {
            format!(
                "the denoiser captured {} steps, the template has {}",
                report.steps, self.steps
            )
        })
    }

    /// The capture stored `report` (checked with `capture_mismatch`): edits may read it.
    pub fn mark_ready(&mut self, report: &CaptureReport) {
        self.state = TemplateState::Ready;
        self.cache_key = Some(report.cache_key.clone());
        self.cache_bytes = report.bytes;
        self.blocks = report.blocks;
        self.cache_quality = report.quality;
        self.error = None;
    }

    /// Record why the capture failed (a template being deleted stays `deleting`).
    pub fn mark_failed(&mut self, error: impl Into<String>) {
        if self.state != TemplateState::Deleting {
            self.state = TemplateState::Failed;
        }
        self.error = Some(error.into());
    }
}

/// Template ids are UUIDs, which also keeps KV and object-store keys well-formed; anything else
/// cannot name a template.
pub fn is_template_id(id: &str) -> bool {
    uuid::Uuid::parse_str(id).is_ok_and(|u| u.to_string() == id)
}

/// Why a registration whose gateway stopped mid-capture failed.
const ABANDONED: &str = "the registration was interrupted (the gateway registering it stopped \
                         before the capture was recorded); delete it and register again";

/// Records and images of templates.
#[derive(Clone)]
pub struct TemplateStore {
    records: RecordStore<TemplateRecord>,
    images: BlobStore,
}

impl Record for TemplateRecord {
    const KIND: &'static str = "template";
}

fn internal(what: &str, err: impl std::fmt::Display) -> ApiError {
    ApiError::Internal(format!("template store: {what}: {err}"))
}

impl TemplateStore {
    /// Open (creating when missing) the record bucket and the image bucket; neither expires.
    pub async fn open(js: &jetstream::Context) -> Result<Self, MeshError> {
        let records = RecordStore::open(js, &TEMPLATE_RECORDS).await?;
        let images = BlobStore::open_with(js, &TEMPLATE_IMAGES).await?;
        Ok(Self { records, images })
    }

    pub async fn put_image(&self, template_id: &str, bytes: &[u8]) -> Result<(), ApiError> {
        Ok(self.images.put(&image_key(template_id), bytes).await?)
    }

    pub async fn image(&self, template_id: &str) -> Result<Vec<u8>, ApiError> {
        Ok(self.images.get(&image_key(template_id)).await?)
    }

    /// Remove a template's image and the pixels its capture prepared (if any).
    pub async fn delete_image(&self, template_id: &str) -> Result<(), ApiError> {
        self.images.delete(&prepared_image_key(template_id)).await?;
        Ok(self.images.delete(&image_key(template_id)).await?)
    }

    /// Store a new record; fails if the id exists (a create that landed but whose reply was
    /// lost finds this record stored, which counts as created).
    pub async fn create(&self, record: &TemplateRecord) -> Result<(), ApiError> {
        self.records.create(&record.id, record).await?;
        Ok(())
    }

    /// The record of `template_id`; `None` when there is none (or the id cannot be one).
    pub async fn get(&self, template_id: &str) -> Result<Option<TemplateRecord>, ApiError> {
        if !is_template_id(template_id) {
            return Ok(None);
        }
        Ok(self.records.get(template_id).await?)
    }

    /// Read-modify-write with compare-and-set. `Ok(None)` when the record is gone (deleted
    /// meanwhile).
    pub async fn update<F>(
        &self,
        template_id: &str,
        mut change: F,
    ) -> Result<Option<TemplateRecord>, ApiError>
    where
        F: FnMut(&mut TemplateRecord),
    {
        let updated = self
            .records
            .update(template_id, None, |record: &mut TemplateRecord| {
                change(record);
                record.updated_at_ms = now_ms();
                true
            })
            .await;
        match updated {
            Ok(KvUpdated::Written(record, _)) => Ok(Some(record)),
            Ok(KvUpdated::Declined(..) | KvUpdated::Missing) => Ok(None),
            Err(err @ MeshError::KvContention { .. }) => Err(internal("update", err)),
            Err(err) => Err(err.into()),
        }
    }

    /// `record` as it stands, after settling it if its registration was abandoned (see
    /// `TemplateRecord::capture_abandoned`; `limit` is the job deadline plus a margin):
    /// `ready` when its capture job's record reports a stored cache that fits (`captured`),
    /// else `failed`.
    pub async fn settle(
        &self,
        record: TemplateRecord,
        limit: Duration,
        captured: Option<&CaptureReport>,
    ) -> Result<TemplateRecord, ApiError> {
        if !record.capture_abandoned(now_ms(), limit) {
            return Ok(record);
        }
        let settled = self
            .update(&record.id, |r| {
                if !r.capture_abandoned(now_ms(), limit) {
                    return;
                }
                match captured.map(|c| (c, r.capture_mismatch(c))) {
                    Some((c, None)) => r.mark_ready(c),
                    Some((_, Some(problem))) => r.mark_failed(problem),
                    None => r.mark_failed(ABANDONED),
                }
            })
            .await?;
        Ok(settled.unwrap_or(record))
    }

    pub async fn delete(&self, template_id: &str) -> Result<(), ApiError> {
        Ok(self.records.delete(template_id).await?)
    }

    /// Every record, oldest first.
    pub async fn list(&self) -> Result<Vec<TemplateRecord>, ApiError> {
        let mut records = self.records.list().await?;
        records.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(records)
    }
}

/// The 404 for a template that does not exist or belongs to another API key (the same answer,
/// so ids of other keys cannot be confirmed).
pub fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        field: "template_id".into(),
        message: format!("no template {id:?} for this API key"),
    }
}

/// 409 unless the template's cache is ready.
pub fn ready(record: &TemplateRecord) -> Result<(), ApiError> {
    match record.state {
        TemplateState::Ready => Ok(()),
        TemplateState::Capturing => Err(ApiError::Conflict {
            message: format!(
                "template {} is still being captured; retry when GET /v1/templates/{} says ready",
                record.id, record.id
            ),
        }),
        TemplateState::Failed => Err(ApiError::Conflict {
            message: format!(
                "template {} failed to capture ({}); delete it and register it again",
                record.id,
                record.error.as_deref().unwrap_or("no reason recorded")
            ),
        }),
        TemplateState::Deleting => Err(ApiError::Conflict {
            message: format!("template {} is being deleted", record.id),
        }),
    }
}

/// The cache a template's capture job reported on its job record (`None`: none reported, or
/// the record expired): what settles a registration whose gateway stopped before recording it.
pub async fn reported_capture(
    jobs: &JobStore,
    record: &TemplateRecord,
) -> Result<Option<CaptureReport>, ApiError> {
    let Some(job_id) = &record.capture_job_id else {
        return Ok(None);
    };
    Ok(jobs.get(job_id).await?.and_then(|job| job.captured))
}

impl crate::auth::Owned for TemplateRecord {
    fn owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh record of a 4-step template.
    fn capturing_record() -> TemplateRecord {
        let t = TemplateRef {
            template_id: "t".into(),
            prompt: String::new(),
            seed: 1,
            steps: 4,
            guidance_scale: 1.0,
            cache_key: String::new(),
        };
        TemplateRecord::new("t".into(), None, &t)
    }

    #[test]
    fn ids_are_uuids_only() {
        let id = uuid::Uuid::new_v4().to_string();
        assert!(is_template_id(&id));
        assert!(!is_template_id(&id.to_uppercase()));
        for bad in ["", "x", "../etc", "a.b", "tpl-1"] {
            assert!(!is_template_id(bad), "{bad}");
        }
    }

    #[test]
    fn only_a_capture_silent_past_the_limit_is_abandoned() {
        let mut r = capturing_record();
        let limit = Duration::from_secs(90);
        let at = r.updated_at_ms;
        assert!(!r.capture_abandoned(at + 90_000, limit));
        assert!(r.capture_abandoned(at + 90_001, limit));
        r.state = TemplateState::Ready;
        assert!(!r.capture_abandoned(at + 900_000, limit));
    }

    #[test]
    fn a_capture_fits_only_with_a_key_and_the_template_steps() {
        let mut r = capturing_record();
        let report = CaptureReport {
            cache_key: "tpl-abc".into(),
            steps: 4,
            blocks: 6,
            bytes: 512,
            quality: None,
        };
        assert_eq!(r.capture_mismatch(&report), None);
        // The quality guard's fallback stores a cache of no steps, and says so.
        let guarded = |full_compute| CaptureReport {
            steps: 0,
            bytes: 0,
            quality: Some(CacheQuality {
                box_ssim: 0.7,
                floor: 0.9,
                full_compute,
            }),
            ..report.clone()
        };
        assert_eq!(r.capture_mismatch(&guarded(true)), None);
        assert!(r.capture_mismatch(&guarded(false)).is_some());
        // Its edits name no cache: they read none, and the router prices them in full.
        let mut fallback = r.clone();
        fallback.mark_ready(&guarded(true));
        assert!(fallback.template_ref().cache_key.is_empty());
        assert_eq!(
            (fallback.full_compute(), fallback.cached_steps()),
            (true, 0)
        );
        let other_steps = CaptureReport {
            steps: 8,
            ..report.clone()
        };
        assert!(r
            .capture_mismatch(&other_steps)
            .unwrap()
            .contains("8 steps"));
        let no_key = CaptureReport {
            cache_key: String::new(),
            ..report.clone()
        };
        assert!(r
            .capture_mismatch(&no_key)
            .unwrap()
            .contains("empty cache key"));
        r.mark_failed("earlier");
        r.mark_ready(&report);
        assert_eq!(
            (
                r.state,
                r.cache_key.as_deref(),
                r.blocks,
                r.cache_bytes,
                r.error
            ),
            (TemplateState::Ready, Some("tpl-abc"), 6, 512, None)
        );
    }

    #[test]
    fn record_carries_the_template_ref() {
        let t = TemplateRef {
            template_id: "t".into(),
            prompt: "p".into(),
            seed: 3,
            steps: 4,
            guidance_scale: 1.5,
            cache_key: String::new(),
        };
        let mut r = TemplateRecord::new("t".into(), None, &t);
        assert_eq!(r.state, TemplateState::Capturing);
        assert_eq!(r.template_ref(), t);
        r.cache_key = Some("tpl-abc".into());
        assert_eq!(r.template_ref().cache_key, "tpl-abc");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["state"], "capturing");
        let back: TemplateRecord = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
    }
}
