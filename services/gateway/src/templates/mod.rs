//! Templates (FlashPS): an image registered once, whose activation cache a capture pass records,
//! so later edits of it compute only their masked tokens.
//!
//! The template domain: registration and capture (`capture`, `form`), the records (`record`),
//! where a cache is (`cache_view`), removal once no accepted edit reads a template (`delete`,
//! `uses`), and an edit that names a template with the `template_id` form field instead of
//! uploading `image` (`edit`). The endpoints are in the api layer (`api/templates.rs`).
pub mod cache_view;
pub mod capture;
pub mod delete;
pub mod edit;
pub mod form;
pub mod record;
pub mod uses;

use std::time::Duration;

use diffmesh_shared::stores::jetstream_layout::TEMPLATE_CAPTURES;
use diffmesh_shared::stores::job::{now_ms, JobStore};
use diffmesh_shared::MeshError;

use crate::error::ApiError;
use crate::job_driver::Mesh;
use delete::Deleter;
use record::{TemplateRecord, TemplateStore};
use uses::TemplateUses;

/// Deadline of one cachestore request (locate, delete) made for the template endpoints.
const CACHESTORE_TIMEOUT: Duration = Duration::from_secs(5);

/// The gateway's template state: records and images, and the edits reading them.
pub struct Templates {
    pub store: TemplateStore,
    pub uses: TemplateUses,
    pub deleter: Deleter,
    pub cachestore_timeout: Duration,
}

impl Templates {
    /// Open the template buckets and the uses stream. `jobs` and `job_timeout` tell a delete
    /// which edits may still be running.
    pub async fn open(
        client: &async_nats::Client,
        jobs: JobStore,
        job_timeout: Duration,
    ) -> Result<Self, MeshError> {
        let js = async_nats::jetstream::new(client.clone());
        let store = TemplateStore::open(&js).await?;
        let uses = TemplateUses::open(&js, store.clone(), jobs.clone()).await?;
        let deleter = Deleter {
            client: client.clone(),
            store: store.clone(),
            uses: uses.clone(),
            jobs,
            cachestore_timeout: CACHESTORE_TIMEOUT,
            job_timeout,
            draining: Default::default(),
            captures: TEMPLATE_CAPTURES.get_or_create(&js).await?,
        };
        Ok(Self {
            store,
            uses,
            deleter,
            cachestore_timeout: CACHESTORE_TIMEOUT,
        })
    }
}

/// How long a registration may stay `capturing` without a write before it counts as abandoned:
/// the job deadline (the registering gateway records the outcome by then) plus a margin.
fn capture_limit(mesh: &Mesh) -> Duration {
    mesh.flow.job_timeout + Duration::from_secs(30)
}

impl Templates {
    /// The record, settled if its registration was abandoned by a gateway that stopped: `ready`
    /// when its capture job reported a cache on its record, else `failed`.
    pub async fn settle(
        &self,
        mesh: &Mesh,
        record: TemplateRecord,
    ) -> Result<TemplateRecord, ApiError> {
        let limit = capture_limit(mesh);
        if !record.capture_abandoned(now_ms(), limit) {
            return Ok(record);
        }
        let captured = record::reported_capture(&mesh.jobs, &record).await?;
        self.store.settle(record, limit, captured.as_ref()).await
    }
}
