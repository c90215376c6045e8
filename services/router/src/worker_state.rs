//! What a policy sees: a live worker as `diffmesh_sched::WorkerState` (from its last heartbeat
//! and this router's placements) and a job as `RequestInfo`, the same types the simulator
//! builds, so a policy compared offline runs here unchanged.
use crate::registry::LiveWorker;
use diffmesh_sched::batching::BatchLimits;
use diffmesh_sched::cost_model::BatchTotals;
use diffmesh_sched::policy::{
    controlnet_step_s, template_key, ActiveRequest, Footprint, NameKeys, RequestInfo, WorkerState,
};
use diffmesh_sched::{CostModels, ModelShape};
use diffmesh_shared::wire::messages::{DenoiseJob, JobKind, RunningJob};
use std::time::Instant;

/// The cache key of the template whose activations a job reads: the captured template's
/// `cache_key` (what denoisers list in `cached_templates`), else the prepared image's content
/// hash (`inputs.template_id`).
pub fn template_cache_key(job: &DenoiseJob) -> Option<&str> {
    match &job.template {
        Some(t) if !t.cache_key.is_empty() => Some(&t.cache_key),
        _ => job.inputs.template_id.as_deref(),
    }
}

/// Image tokens each of a job's rows computes per block in the cost model's grid. Only an edit
/// of a captured template runs mask-aware (its masked tokens, taken from the mask ratio so a
/// profile measured at another resolution still ranks workers by relative cost); every other
/// job (generation, capture, edit of an uploaded image) computes all image tokens.
pub fn job_masked_tokens(job: &DenoiseJob, shape: &ModelShape) -> u32 {
    let mask_aware = job.kind == JobKind::Edit
        && job
            .template
            .as_ref()
            .is_some_and(|t| !t.cache_key.is_empty());
    if mask_aware {
        shape.masked_tokens(job.inputs.mask_ratio as f64)
    } else {
        shape.image_tokens
    }
}

/// A job's batch rows (as the engine counts them) and cache streams (one per image); its
/// ControlNet's cost depends on the worker (`WorkerState::footprint_of`).
pub fn job_footprint(job: &DenoiseJob) -> Footprint {
    Footprint {
        rows: job.params.batch_rows(),
        cache_streams: job.params.n.max(1),
        control_s: 0.0,
    }
}

/// A job another router placed, as its denoiser reports it.
fn reported_footprint(r: &RunningJob) -> Footprint {
    Footprint {
        rows: r.rows.max(1),
        cache_streams: r.images.max(1),
        control_s: 0.0,
    }
    .with_control_s(r.control_s)
}

/// The policy's view of a job to place.
pub fn request_info(job: &DenoiseJob, shape: &ModelShape) -> RequestInfo {
    RequestInfo {
        masked_tokens: job_masked_tokens(job, shape),
        footprint: job_footprint(job),
        steps: job.params.num_inference_steps.max(1),
        template: template_cache_key(job).map(template_key),
        loras: NameKeys::of(job.params.loras.iter().map(|l| l.id.as_str())),
        controlnets: NameKeys::of(job.params.controlnets().map(|c| c.name.as_str())),
        waiting_behind: None,
    }
}

/// Fill `out` with the policy's view of one live worker at `now` (reusing its buffers).
///
/// - running: the heartbeat's batch less the jobs that ended since it was sent, each advanced
///   by the steps its batch is predicted to have run since the heartbeat arrived (a heartbeat
///   can be older than a whole small job; without this a worker that reported last looks
///   busier than one whose report is stale); the time left in the step in flight is not
///   reported, so `step_remaining_s` is 0.
/// - queued: the worker's queue as its heartbeat lists it (jobs of other routers as reported),
///   then this router's placements the heartbeat does not list yet, in placement order; an
///   older denoiser reports only a count, and its jobs beyond those known are assumed to be
///   one row masking half the image.
pub fn fill_worker_state(
    w: LiveWorker,
    models: &CostModels,
    step_time_factor: f64,
    now: Instant,
    out: &mut WorkerState,
) {
    let shape = &models.shape;
    let hb = w.heartbeat;
    // A node with elastic ranks steps its jobs side by side on them: costed as one device
    // that many times as fast (how it spreads them over its ranks is its own policy's call).
    let step_time_factor = step_time_factor / f64::from(hb.ranks.max(1));
    out.alive = !hb.draining;
    out.limits = BatchLimits {
        max_batch: hb.max_batch,
        // The denoiser batches by rows only.
        token_budget: u64::MAX,
        queue_capacity: hb.queue_capacity,
    };
    out.step_remaining_s = 0.0;
    out.step_time_factor = step_time_factor;
    // What the worker measured a step of a job's ControlNet to cost its step loop (the table
    // moves into `out` at the end).
    let mut controlnets = std::mem::take(&mut out.controlnet_step_s);
    controlnets.clear();
    controlnets.extend(
        hb.controlnet_step_s
            .iter()
            .map(|c| (template_key(&c.name), c.seconds)),
    );
    let controlnet_s = |job: &DenoiseJob| {
        let keys = NameKeys::of(job.params.controlnets().map(|c| c.name.as_str()));
        controlnet_step_s(&controlnets, keys)
    };
    let queued_job = |job: &DenoiseJob| ActiveRequest {
        masked_tokens: job_masked_tokens(job, shape),
        footprint: job_footprint(job).with_control_s(controlnet_s(job)),
        remaining_steps: job.params.num_inference_steps.max(1),
    };
    // Placement numbers of this router's jobs in the batch: the rest of its placements wait.
    // (Comparing numbers, not job ids: this runs for every worker on every decision.)
    let mut running_seqs: Vec<u64> = Vec::with_capacity(hb.running.len());
    out.running.clear();
    for r in w.running() {
        let (masked_tokens, footprint) = match w.placed.get(&r.job_id) {
            Some((seq, job)) => {
                running_seqs.push(*seq);
                // Its ControlNet as measured on its own steps, until then as the worker's figure.
                let control_s = if r.control_s > 0.0 {
                    r.control_s
                } else {
                    controlnet_s(job)
                };
                let footprint = job_footprint(job).with_control_s(control_s);
                (job_masked_tokens(job, shape), footprint)
            }
            // Placed by another router: as its denoiser reports it.
            None => (
                r.masked_tokens.min(shape.image_tokens),
                reported_footprint(r),
            ),
        };
        out.running.push(ActiveRequest {
            masked_tokens,
            footprint,
            remaining_steps: r.remaining_steps,
        });
    }
    let elapsed = steps_since(
        &out.running,
        models,
        step_time_factor,
        now.saturating_duration_since(w.last_seen),
    );
    for r in &mut out.running {
        r.remaining_steps = r.remaining_steps.saturating_sub(elapsed);
    }
    // The worker's queue as it reported it (this router's jobs costed from the job itself),
    // then this router's placements it did not list yet, then jobs it only counted.
    out.queued.clear();
    let mut queued_seqs: Vec<u64> = Vec::with_capacity(hb.waiting.len());
    for r in hb
        .waiting
        .iter()
        .filter(|r| !w.finished.contains(&r.job_id))
    {
        let queued = match w.placed.get(&r.job_id) {
            Some((seq, _)) if running_seqs.contains(seq) => continue,
            Some((seq, job)) => {
                queued_seqs.push(*seq);
                queued_job(job)
            }
            None => ActiveRequest {
                masked_tokens: r.masked_tokens.min(shape.image_tokens),
                footprint: reported_footprint(r),
                remaining_steps: r.remaining_steps.max(1),
            },
        };
        out.queued.push(queued);
    }
    let mut unlisted: Vec<&(u64, DenoiseJob)> = w
        .placed
        .values()
        .filter(|(seq, _)| !running_seqs.contains(seq) && !queued_seqs.contains(seq))
        .collect();
    unlisted.sort_unstable_by_key(|(seq, _)| *seq);
    out.queued
        .extend(unlisted.iter().map(|(_, job)| queued_job(job)));
    // An older denoiser reports a count only: its jobs beyond those known are assumed to mask
    // half the image.
    let unknown = (hb.queued as usize).saturating_sub(hb.waiting.len() + unlisted.len());
    out.queued.extend((0..unknown).map(|_| ActiveRequest {
        masked_tokens: shape.image_tokens / 2,
        footprint: Footprint::ONE_ROW,
        remaining_steps: shape.steps,
    }));
    out.controlnet_step_s = controlnets;
    out.resident_templates.clear();
    out.resident_templates
        .extend(hb.cached_templates.iter().map(|t| template_key(t)));
    out.resident_loras.clear();
    out.resident_loras
        .extend(hb.cached_loras.iter().map(|l| template_key(l)));
}

/// Whole steps a batch is predicted to have run in `age` (the batch held still meanwhile).
fn steps_since(
    running: &[ActiveRequest],
    models: &CostModels,
    step_time_factor: f64,
    age: std::time::Duration,
) -> u32 {
    let mut totals = BatchTotals::default();
    for r in running.iter().filter(|r| r.remaining_steps > 0) {
        totals.add_request(&models.shape, r.masked_tokens, r.footprint);
    }
    let step = models.step_latency(&totals) * step_time_factor;
    if step <= 0.0 {
        return 0;
    }
    (age.as_secs_f64() / step).floor().min(u32::MAX as f64) as u32
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::registry::tests::{heartbeat, job, policy};
    use crate::registry::WorkerRegistry;
    use diffmesh_shared::wire::messages::{RunningJob, TemplateRef};
    use std::time::Instant;

    /// Every block takes 1 ms whatever the batch, loads are free: 4 ms a step.
    pub(crate) fn models() -> CostModels {
        let fit = |intercept| diffmesh_sched::LinearFit {
            slope: 0.0,
            intercept,
            r2: 1.0,
            samples: 0,
        };
        CostModels {
            label: "test".into(),
            synthetic: true,
            shape: shape(),
            compute: diffmesh_sched::ComputeFit::from_line(fit(1e-3)),
            load: fit(0.0),
            disk_load: None,
            step_overhead: None,
            job_work: None,
        }
    }

    fn shape() -> ModelShape {
        ModelShape {
            blocks: 4,
            hidden: 128,
            image_tokens: 256,
            text_tokens: 16,
            cache_bytes_per_token: 1024,
            steps: 20,
            cache_layout: Default::default(),
        }
    }

    /// An edit of a captured template (cache key `template`).
    pub(crate) fn edit(id: &str, ratio: f32, steps: u32, template: &str) -> DenoiseJob {
        let mut j = job(id);
        j.kind = JobKind::Edit;
        j.inputs.mask_ratio = ratio;
        j.inputs.template_id = Some("content-hash".into());
        j.params.num_inference_steps = steps;
        j.template = Some(TemplateRef {
            template_id: "public-id".into(),
            prompt: String::new(),
            seed: 1,
            steps,
            guidance_scale: 1.0,
            cache_key: template.into(),
        });
        j
    }

    #[test]
    fn request_info_uses_the_ratio_in_the_model_grid() {
        let r = request_info(&edit("a", 0.25, 7, "t"), &shape());
        assert_eq!(r.masked_tokens, 64);
        assert_eq!(r.steps, 7);
        assert_eq!(r.template, Some(template_key("t")));
        assert_eq!(r.footprint, Footprint::ONE_ROW);
        // Two images: two rows of the same mask, each reading its own cache stream.
        let mut two = edit("b", 0.25, 7, "t");
        two.params.n = 2;
        let r = request_info(&two, &shape());
        assert_eq!(r.masked_tokens, 64);
        let footprint = |rows, cache_streams| Footprint {
            rows,
            cache_streams,
            control_s: 0.0,
        };
        assert_eq!(r.footprint, footprint(2, 2));
        // True CFG runs every image as two rows that share the image's stream.
        two.params.true_cfg = Some(diffmesh_shared::wire::messages::TrueCfg {
            scale: 4.0,
            negative_prompt: String::new(),
        });
        let r = request_info(&two, &shape());
        assert_eq!((r.masked_tokens, r.footprint), (64, footprint(4, 2)));
    }

    #[test]
    fn only_edits_of_captured_templates_are_mask_aware() {
        // An uploaded image (no captured cache) is edited in full compute, keyed by its hash.
        let mut uploaded = edit("a", 0.25, 7, "t");
        uploaded.template = None;
        let r = request_info(&uploaded, &shape());
        assert_eq!(r.masked_tokens, 256);
        assert_eq!(r.template, Some(template_key("content-hash")));
        // Not captured yet: no cache key either.
        let mut capturing = edit("b", 0.25, 7, "");
        capturing.template.as_mut().unwrap().cache_key.clear();
        assert_eq!(request_info(&capturing, &shape()).masked_tokens, 256);
        let generation = job("g");
        let r = request_info(&generation, &shape());
        assert_eq!((r.masked_tokens, r.template), (256, None));
    }

    #[test]
    fn worker_state_from_heartbeat_and_placements() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        let mut hb = heartbeat("a", 4, 0);
        hb.queue_capacity = 3;
        reg.observe(hb.clone(), t0);
        reg.record_placement("a", edit("j1", 0.5, 10, "t"));
        reg.record_placement("a", edit("j2", 0.125, 8, "t"));
        reg.record_placement("a", edit("j3", 0.25, 6, "t"));
        // The worker runs j1 and a job of another router, and reports 3 queued: j2, j3 and one
        // unknown.
        hb.running = vec![
            RunningJob {
                job_id: "j1".into(),
                masked_tokens: 9999,
                remaining_steps: 4,
                rows: 1,
                images: 1,
                control_s: 0.0,
            },
            // Another router's guided job: two rows of 30 masked tokens.
            RunningJob {
                job_id: "foreign".into(),
                masked_tokens: 30,
                remaining_steps: 2,
                rows: 2,
                images: 1,
                control_s: 0.0,
            },
        ];
        hb.queued = 3;
        hb.cached_templates = vec!["t".into()];
        hb.cached_loras = vec!["style".into()];
        let observed = hb.clone();
        reg.observe(hb, t0);
        let mut ws = WorkerState::idle(BatchLimits::default());
        fill_worker_state(reg.live().next().unwrap(), &models(), 1.0, t0, &mut ws);
        let masked: Vec<(u32, u32)> = ws
            .running
            .iter()
            .map(|r| (r.masked_tokens, r.remaining_steps))
            .collect();
        assert_eq!(masked, vec![(128, 4), (30, 2)]);
        let rows: Vec<u32> = ws.running.iter().map(|r| r.footprint.rows).collect();
        assert_eq!(rows, vec![1, 2]);
        let queued: Vec<(u32, u32)> = ws
            .queued
            .iter()
            .map(|r| (r.masked_tokens, r.remaining_steps))
            .collect();
        assert_eq!(queued, vec![(32, 8), (64, 6), (128, 20)]);
        assert!(ws.alive && ws.holds(Some(template_key("t"))));
        let mut job = edit("j4", 0.5, 10, "t");
        job.params.loras = vec![diffmesh_shared::wire::lora::LoraRef {
            id: "style".into(),
            scale: 1.0,
        }];
        assert!(ws.holds_all(&request_info(&job, &models().shape)));
        job.params.loras[0].id = "other".into();
        assert!(!ws.holds_all(&request_info(&job, &models().shape)));
        assert_eq!(ws.limits.max_batch, 4);
        assert_eq!(ws.limits.queue_capacity, 3);
        // A batch of 4 rows takes j1, the foreign job and j2; j3 and the unknown job wait in a
        // queue of 3.
        assert!(ws.accepts());
        // 10 ms after the heartbeat, at 4 ms a step, the batch has run 2 more steps.
        let later = t0 + std::time::Duration::from_millis(10);
        fill_worker_state(reg.live().next().unwrap(), &models(), 1.0, later, &mut ws);
        let remaining: Vec<u32> = ws.running.iter().map(|r| r.remaining_steps).collect();
        assert_eq!(remaining, vec![2, 0]);
        // A worker known to step 2.5x slower than the profile (10 ms a step) ran only one.
        fill_worker_state(reg.live().next().unwrap(), &models(), 2.5, later, &mut ws);
        let remaining: Vec<u32> = ws.running.iter().map(|r| r.remaining_steps).collect();
        assert_eq!(remaining, vec![3, 1]);
        assert_eq!(ws.step_time_factor, 2.5);
        // The same worker with 4 elastic ranks runs its steps 4x as fast: 10 steps by now.
        let mut ranked = observed;
        ranked.ranks = 4;
        let mut reg4 = WorkerRegistry::new(policy());
        reg4.observe(ranked, t0);
        fill_worker_state(reg4.live().next().unwrap(), &models(), 1.0, later, &mut ws);
        assert_eq!(ws.step_time_factor, 0.25);
        let remaining: Vec<u32> = ws.running.iter().map(|r| r.remaining_steps).collect();
        assert_eq!(remaining, vec![0, 0]);
    }

    #[test]
    fn a_listed_queue_sizes_other_routers_jobs_and_keeps_its_order() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        let mut hb = heartbeat("a", 4, 0);
        reg.observe(hb.clone(), t0);
        reg.record_placement("a", edit("mine-1", 0.5, 10, "t"));
        reg.record_placement("a", edit("mine-2", 0.125, 8, "t"));
        let listed = |id: &str, masked, rows, images, steps| RunningJob {
            job_id: id.into(),
            masked_tokens: masked,
            remaining_steps: steps,
            rows,
            images,
            control_s: 0.0,
        };
        // The worker queued another router's guided pair of images between this router's jobs,
        // and has not seen mine-2 yet.
        hb.waiting = vec![
            listed("foreign", 40, 4, 2, 12),
            listed("mine-1", 9999, 1, 1, 10),
        ];
        hb.queued = 2;
        reg.observe(hb, t0);
        let mut ws = WorkerState::idle(BatchLimits::default());
        fill_worker_state(reg.live().next().unwrap(), &models(), 1.0, t0, &mut ws);
        let queued: Vec<(u32, u32, u32, u32)> = ws
            .queued
            .iter()
            .map(|r| {
                let f = r.footprint;
                (r.masked_tokens, f.rows, f.cache_streams, r.remaining_steps)
            })
            .collect();
        assert_eq!(queued, vec![(40, 4, 2, 12), (128, 1, 1, 10), (32, 1, 1, 8)]);
    }

    #[test]
    fn steered_jobs_cost_their_controlnet_as_the_worker_measured_it() {
        let t0 = Instant::now();
        let mut reg = WorkerRegistry::new(policy());
        let mut hb = heartbeat("a", 4, 0);
        reg.observe(hb.clone(), t0);
        let steered = |id: &str, name: &str| {
            let mut j = job(id);
            j.params.controlnet = Some(diffmesh_shared::wire::controlnet::ControlNetRef {
                name: name.into(),
                scale: 1.0,
            });
            j
        };
        reg.record_placement("a", steered("just-started", "edges"));
        reg.record_placement("a", steered("waiting", "edges"));
        let listed = |id: &str, control_s| RunningJob {
            job_id: id.into(),
            masked_tokens: 256,
            remaining_steps: 3,
            rows: 1,
            images: 1,
            control_s,
        };
        // The worker runs this router's job (not measured yet) and another router's steered
        // job (measured at 0.25 s a step); its figure for "edges" is 0.5 s.
        hb.running = vec![listed("just-started", 0.0), listed("foreign", 0.25)];
        hb.queued = 1;
        hb.controlnet_step_s = vec![diffmesh_shared::wire::messages::ControlNetStepCost {
            name: "edges".into(),
            seconds: 0.5,
        }];
        reg.observe(hb, t0);
        let mut ws = WorkerState::idle(BatchLimits::default());
        fill_worker_state(reg.live().next().unwrap(), &models(), 1.0, t0, &mut ws);
        let running: Vec<f64> = ws.running.iter().map(|r| r.footprint.control_s).collect();
        assert_eq!(running, vec![0.5, 0.25]);
        let queued: Vec<f64> = ws.queued.iter().map(|r| r.footprint.control_s).collect();
        assert_eq!(queued, vec![0.5]);
        // A new steered request costs its ControlNet's figure here; a plain one nothing, and
        // one steered by a ControlNet this worker has not measured nothing yet.
        let cost = |j: &DenoiseJob| ws.footprint_of(&request_info(j, &shape())).control_s;
        assert_eq!(cost(&steered("new", "edges")), 0.5);
        assert_eq!(cost(&job("plain")), 0.0);
        assert_eq!(cost(&steered("new", "depth")), 0.0);
        // Predicted steps carry it: 4 ms of blocks plus 0.5 s.
        let mut totals = BatchTotals::default();
        let r = &ws.queued[0];
        totals.add_request(&shape(), r.masked_tokens, r.footprint);
        assert!((models().step_latency(&totals) - 0.504).abs() < 1e-9);
    }
}
