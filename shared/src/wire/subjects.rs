//! Every NATS subject, bucket and header name the mesh uses, in one place.

/// Gateway -> codec: decode and validate inputs, resize to model resolution (request/reply).
pub const CODEC_PRE: &str = "diffmesh.codec.pre";
/// Denoiser -> codec: decode the model output, composite, encode PNG at the input size (request/reply).
pub const CODEC_POST: &str = "diffmesh.codec.post";
/// Queue group shared by codec workers so each request goes to one of them.
pub const CODEC_QUEUE: &str = "codec";
/// Gateway -> router: place a prepared job on a denoiser (request/reply: accepted or rejected).
pub const ROUTER_SUBMIT: &str = "diffmesh.router.submit";
/// Gateway -> router: cancel a job (fire-and-forget).
pub const ROUTER_CANCEL: &str = "diffmesh.router.cancel";
/// Denoisers -> router: periodic heartbeat with load and capacity.
pub const DENOISER_HEARTBEAT: &str = "diffmesh.denoiser.heartbeat";
/// Cachestore requests (get/put/prefetch of activation caches).
pub const CACHESTORE_PREFIX: &str = "diffmesh.cachestore";
/// gateway -> every denoiser (publish): drop a deleted template's cache from local tiers
/// (`messages::EvictTemplate`).
pub const TEMPLATES_EVICT: &str = "diffmesh.templates.evict";
/// denoiser -> every denoiser (publish on `template_captured(cache_key)`): a template cache
/// was captured and stored (`messages::TemplateCaptured`), so the others can load it into
/// their local tiers before its first edit reaches them. The stream
/// `TEMPLATE_CAPTURES_STREAM` keeps the last announcement per cache, so a denoiser that
/// starts later catches up on them.
pub const TEMPLATES_CAPTURED: &str = "diffmesh.templates.captured";
/// Every capture announcement (a subscription filter).
pub const TEMPLATES_CAPTURED_ALL: &str = "diffmesh.templates.captured.>";
/// JetStream stream of capture announcements, one per cache key.
pub const TEMPLATE_CAPTURES_STREAM: &str = "DIFFMESH_TEMPLATE_CAPTURES";

/// The capture announcement of cache `cache_key` (`tpl-` + hex: a single subject token).
pub fn template_captured(cache_key: &str) -> String {
    format!("{TEMPLATES_CAPTURED}.{cache_key}")
}
/// JetStream KV bucket of template records (JSON), and the object store of template images
/// (kept until the template is deleted, unlike `BLOB_BUCKET`'s 24 h).
pub const TEMPLATE_BUCKET: &str = "diffmesh-templates";
/// JetStream stream of edits that read a template (one message per edit in flight), so a
/// delete waits for them; its subjects start with `TEMPLATE_USES_PREFIX`.
pub const TEMPLATE_USES_STREAM: &str = "DIFFMESH_TEMPLATE_USES";
pub const TEMPLATE_USES_PREFIX: &str = "diffmesh.template-uses";

/// The use of template `template_id` by job `job_id` (template and job ids are UUIDs).
pub fn template_use(template_id: &str, job_id: &str) -> String {
    format!("{TEMPLATE_USES_PREFIX}.{template_id}.{job_id}")
}
/// Every use of template `template_id` (a subject filter).
pub fn template_uses_of(template_id: &str) -> String {
    format!("{TEMPLATE_USES_PREFIX}.{template_id}.*")
}

/// JetStream KV bucket of LoRA records (JSON), and the object store of their weights (kept
/// until the LoRA is deleted).
pub const LORA_BUCKET: &str = "diffmesh-loras";

/// Router -> one denoiser: run this job (request/reply: accepted or busy).
pub fn denoiser_submit(worker_id: &str) -> String {
    format!("diffmesh.denoiser.{worker_id}.submit")
}
/// Router -> one denoiser: cancel a job at the next step boundary.
pub fn denoiser_cancel(worker_id: &str) -> String {
    format!("diffmesh.denoiser.{worker_id}.cancel")
}
/// Gateway -> every denoiser (request, `messages::OutcomeQuery`): the terminal event
/// (`JobEvent::Done` or `Failed`) or capture report (`Captured`) of a job that ended lately, for
/// a gateway whose copy of the event was lost (core NATS publishes are lost while a subscription
/// is away, as on a server restart). Only the denoiser that ended the job answers; the others
/// stay silent.
pub const DENOISER_OUTCOME: &str = "diffmesh.denoiser.outcome";
/// Progress and terminal events of one job (queued, started, step k/N, done, failed).
pub fn job_events(job_id: &str) -> String {
    format!("diffmesh.job.{job_id}.events")
}

/// Previews of one job (`JobEvent::Preview`: images, so apart from the events every router
/// follows).
pub fn job_previews(job_id: &str) -> String {
    format!("diffmesh.job.{job_id}.preview")
}

/// One job's events and previews, for a subscriber that wants both in their order.
pub fn job_updates(job_id: &str) -> String {
    format!("diffmesh.job.{job_id}.*")
}

/// JetStream object store bucket for images, masks, prepared tensors and results.
pub const BLOB_BUCKET: &str = "diffmesh-blobs";
/// JetStream KV bucket for job records.
pub const JOB_BUCKET: &str = "diffmesh-jobs";
/// JetStream KV bucket mapping an API key's `Idempotency-Key` to the job it created.
pub const IDEMPOTENCY_BUCKET: &str = "diffmesh-idempotency";

/// W3C trace context header carried on every NATS message.
pub const TRACEPARENT_HEADER: &str = "traceparent";
pub const TRACESTATE_HEADER: &str = "tracestate";
/// Job id header, so logs and traces can be joined without decoding the payload.
pub const JOB_ID_HEADER: &str = "diffmesh-job-id";
/// How long the caller waits for the answer to this send of a request (ms, as sent): a
/// responder may give up work past it, since no one reads the answer then.
pub const ANSWER_WITHIN_HEADER: &str = "diffmesh-answer-within-ms";
