//! The API handlers' shared state ([`ApiState`]): the mesh the jobs run through, the request
//! limits and defaults, API keys and per-key limits, templates, LoRAs and ControlNets.
use std::sync::Arc;

use actix_web::http::header::AUTHORIZATION;
use actix_web::HttpRequest;

use crate::auth::{ApiKeys, Caller};
use crate::error::ApiError;
use crate::job_driver::Mesh;
use crate::limits::KeyLimiter;
use crate::request_limits::{Defaults, Limits};

/// Shared state of the API handlers.
pub struct ApiState {
    pub mesh: Mesh,
    pub limits: Limits,
    pub defaults: Defaults,
    /// Largest request body (all multipart parts together), bytes.
    pub max_body_bytes: usize,
    pub keys: ApiKeys,
    pub key_limits: Arc<KeyLimiter>,
    /// The OpenAPI document served at `/openapi.json` (`openapi::document`).
    pub openapi: String,
    /// Registered templates (`templates`).
    pub templates: crate::templates::Templates,
    /// Registered LoRAs (`loras`).
    pub loras: crate::loras::store::LoraStore,
    /// Largest LoRA weights file (`POST /v1/loras`), bytes.
    pub max_lora_bytes: usize,
    /// Per-key storage quotas (`quotas`).
    pub quotas: crate::quotas::StorageQuotas,
    /// LoRA uploads read at once (`--lora-uploads-at-once`): each spools up to max_lora_bytes.
    pub lora_uploads: Arc<tokio::sync::Semaphore>,
    /// Longest a LoRA upload may take to arrive (`--lora-upload-timeout`).
    pub lora_upload_timeout: std::time::Duration,
    /// Where LoRA uploads are streamed while they arrive (`--upload-spool-dir`).
    pub upload_spool_dir: std::path::PathBuf,
    /// The workers' last heartbeats: which denoisers hold a template's cache, the ControlNets
    /// the mesh steers with now (`GET /v1/controlnets`).
    pub directory: crate::directory::MeshDirectory,
    /// The model of requests that name none (`--default-model`).
    pub default_model: Option<String>,
    /// `--default-size`, which overrides the models' own default sizes.
    pub default_size: Option<(u32, u32)>,
    /// Signs and checks result URLs (`response_format: "url"`).
    pub result_urls: crate::result_urls::ResultUrls,
    /// `--public-url`, the base of result URLs (None: each request's scheme and Host).
    pub public_url: Option<String>,
    /// What a request's `callback_url` may be (`webhooks`).
    pub webhooks: crate::webhooks::callback_url::WebhookGate,
}

impl ApiState {
    /// Who sent `req` (401 when keys are configured and it carries no valid one).
    pub fn caller(&self, req: &HttpRequest) -> Result<Caller, ApiError> {
        self.keys.authenticate(req.headers().get(AUTHORIZATION))
    }

    /// Where clients reach this gateway: `--public-url`, else `req`'s scheme and Host.
    pub fn base_url(&self, req: &HttpRequest) -> String {
        match &self.public_url {
            Some(url) => url.clone(),
            None => {
                let info = req.connection_info();
                format!("{}://{}", info.scheme(), info.host())
            }
        }
    }
}
