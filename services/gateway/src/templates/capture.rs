//! Registering a template: store its image durably, create its record (`capturing`), have the
//! codec prepare it (kind `Capture`: no mask, every token computed), run the capture job through
//! the router and a denoiser like any job (`job_driver::Mesh::prepare` / `complete`), and record
//! what the denoiser's `Captured` event reports (`ready`) or why it failed (`failed`). The
//! router keeps the same report on the capture job's record, from which another gateway
//! finishes a registration whose gateway stopped (`reported_capture`).
use std::time::Duration;

use diffmesh_shared::stores::job::CaptureReport;
use diffmesh_shared::wire::messages::{decode, JobEvent, JobKind, TemplateRef};
use diffmesh_shared::wire::models::ModelGeometry;
use diffmesh_shared::wire::subjects::job_events;
use diffmesh_shared::MeshError;
use futures::StreamExt;
use tracing::Instrument;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::job_driver::{InputImage, JobInput, Mesh};
use crate::lost_events;
use crate::templates::form::TemplateForm;
use crate::templates::record::{TemplateRecord, TemplateState, TemplateStore};
use crate::templates::Templates;
use crate::validate::{ResponseFormat, ValidParams};

/// How long after the capture job's `Done` its `Captured` event may still be on the way (it is
/// sent first, on the same connection, so it is normally there already).
const CAPTURED_GRACE: Duration = Duration::from_secs(2);

/// Marks the record failed if the registration is dropped before it finished (the client went
/// away; the capture job itself is cancelled by the job driver's own guard).
struct AbandonGuard {
    mesh: Mesh,
    store: TemplateStore,
    id: String,
    armed: bool,
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, id) = (self.store.clone(), self.id.clone());
        self.mesh.spawn_background(async move {
            let message = "the registration was abandoned: the client closed the connection \
                           before the capture finished";
            let written = store
                .update(&id, |r| {
                    if r.state == TemplateState::Capturing {
                        r.mark_failed(message)
                    }
                })
                .await;
            if let Err(err) = written {
                tracing::warn!(template_id = %id, error = %err, "could not record the abandon");
            }
        });
    }
}

/// Register a template and wait for its capture; returns the record as it ended (`ready`).
pub async fn register(
    mesh: &Mesh,
    templates: &Templates,
    caller: &Caller,
    form: TemplateForm,
    geometry: Option<ModelGeometry>,
) -> Result<TemplateRecord, ApiError> {
    let id = uuid::Uuid::new_v4().to_string();
    let params = form.params;
    let template = TemplateRef {
        template_id: id.clone(),
        prompt: params.prompt.clone(),
        seed: params.seed,
        steps: params.num_inference_steps,
        guidance_scale: params.guidance_scale,
        cache_key: String::new(),
    };
    let mut record = TemplateRecord::new(id.clone(), caller.owner().map(str::to_string), &template);
    (record.width, record.height) = (params.width, params.height);
    record.model = params.model.clone();
    record.image_bytes = form.image.len() as u64;

    let store = &templates.store;
    store.put_image(&id, &form.image).await?;
    if let Err(err) = store.create(&record).await {
        forget(store, &id).await;
        return Err(err);
    }
    let mut guard = AbandonGuard {
        mesh: mesh.clone(),
        store: store.clone(),
        id: id.clone(),
        armed: true,
    };
    let span = tracing::info_span!("template", template_id = %id);
    let result = capture(mesh, store, caller, &record, params, template, geometry)
        .instrument(span)
        .await;
    guard.armed = false;
    match result {
        Ok(captured) => finish(templates, &id, captured).await,
        // The request itself was bad (the codec could not read the image): no template exists.
        Err(err @ (ApiError::Invalid(_) | ApiError::TooLarge { .. })) => {
            forget(store, &id).await;
            Err(err)
        }
        Err(err) => {
            let message = err.to_string();
            if let Err(e) = store.update(&id, |r| r.mark_failed(&message)).await {
                tracing::warn!(template_id = %id, error = %e, "could not record the failure");
            }
            Err(err)
        }
    }
}

/// Prepare and run the capture job; returns its `Captured` report.
async fn capture(
    mesh: &Mesh,
    store: &TemplateStore,
    caller: &Caller,
    record: &TemplateRecord,
    params: diffmesh_shared::wire::messages::GenerationParams,
    template: TemplateRef,
    geometry: Option<ModelGeometry>,
) -> Result<CaptureReport, ApiError> {
    let id = record.id.as_str();
    // The image is already in the template bucket: the capture reads it there.
    let input = JobInput {
        kind: JobKind::Capture,
        control_images: Vec::new(),
        controlnets_listed: false,
        valid: ValidParams {
            params,
            response_format: ResponseFormat::B64Json,
            output: Default::default(),
            stream: false,
            callback_url: None,
        },
        image: Some(InputImage::Template(record.template_image())),
        mask: None,
        template: Some(template),
        geometry,
    };
    let prepared = mesh.prepare(input, caller.owner()).await?;
    let job_id = prepared.job_id().to_string();
    let content_hash = prepared.job.inputs.template_id.clone();
    let prepared_image_key = prepared.job.inputs.template_image_key.clone();
    store
        .update(id, |r| {
            r.capture_job_id = Some(job_id.clone());
            r.content_hash = content_hash.clone();
            r.prepared_image_key = prepared_image_key.clone();
        })
        .await?;
    // The job driver waits for Done/Failed only; `Captured` comes before Done, so subscribe to
    // the job's events ourselves before it is submitted.
    let mut events = mesh
        .client
        .subscribe(job_events(&job_id))
        .await
        .map_err(MeshError::from)?;
    mesh.complete(prepared).await?;
    let deadline = tokio::time::Instant::now() + CAPTURED_GRACE;
    loop {
        let msg = match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(msg)) => msg,
            Ok(None) | Err(_) => {
                return lost_report(mesh, &job_id).await.ok_or_else(|| {
                    ApiError::Internal(format!(
                        "capture job {job_id} finished without reporting its cache (no Captured \
                         event, none on the job record, no denoiser remembers it)"
                    ))
                })
            }
        };
        let report = decode::<JobEvent>(&msg.payload)
            .ok()
            .and_then(|event| CaptureReport::from_event(&event));
        if let Some(report) = report {
            return Ok(report);
        }
    }
}

/// The report of a capture whose `Captured` event did not arrive here (a core publish, lost
/// while this gateway's subscription was away): the router's copy on the job record (it
/// subscribes on its own connection), else the capturing denoiser's (`lost_events`).
async fn lost_report(mesh: &Mesh, job_id: &str) -> Option<CaptureReport> {
    let on_record = match mesh.jobs.get(job_id).await {
        Ok(job) => job.and_then(|job| job.captured),
        Err(err) => {
            tracing::warn!(%job_id, error = %err, "could not read the capture job's record");
            None
        }
    };
    let report = match on_record {
        Some(report) => Some(report),
        None => lost_events::captured(&mesh.client, job_id).await,
    }?;
    tracing::warn!(%job_id, "the capture's Captured event was lost; learned from the mesh");
    mesh.metrics
        .recovered_outcomes
        .with_label_values(&["captured"])
        .inc();
    Some(report)
}

/// Record a finished capture (`ready`), after checking it is the cache edits will ask for.
async fn finish(
    templates: &Templates,
    id: &str,
    captured: CaptureReport,
) -> Result<TemplateRecord, ApiError> {
    let problem = match templates.store.get(id).await? {
        Some(record) => record.capture_mismatch(&captured),
        // Deleted meanwhile: the update below finds no record and removes the cache.
        None => None,
    };
    if let Some(problem) = problem {
        templates
            .store
            .update(id, |r| r.mark_failed(problem.clone()))
            .await?;
        return Err(ApiError::Internal(format!("template {id}: {problem}")));
    }
    let written = templates
        .store
        .update(id, |r| {
            // A template deleted meanwhile stays `deleting`: no edit may start on it.
            if r.state != TemplateState::Deleting {
                r.mark_ready(&captured);
            }
        })
        .await?;
    match written {
        Some(record) if record.state == TemplateState::Ready => Ok(record),
        _ => {
            // Deleted while it was being captured: the new cache belongs to nobody (the
            // delete may have purged before the capture was reported, removing none), unless
            // another template of the same pixels and settings uses it.
            let removed = templates
                .deleter
                .remove_cache(id, &captured.cache_key, captured.steps)
                .await;
            if let Err(err) = removed {
                tracing::warn!(template_id = %id, error = %err, "could not remove an orphaned cache");
            }
            Err(super::record::not_found(id))
        }
    }
}

/// Remove a template that never came to be (its record and image); best effort.
async fn forget(store: &TemplateStore, id: &str) {
    if let Err(err) = store.delete(id).await {
        tracing::warn!(template_id = %id, error = %err, "could not delete the record");
    }
    if let Err(err) = store.delete_image(id).await {
        tracing::warn!(template_id = %id, error = %err, "could not delete the image");
    }
}
