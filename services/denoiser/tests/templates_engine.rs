//! Template captures and mask-aware edits in the engine (random tiny model, no NATS): a capture
//! job yields a cache; edits reading it at different steps of one continuous batch each read their
//! own step and end as they do alone; an edit whose cache is still being fetched waits without
//! holding up other jobs.
use diffmesh_denoiser::cached_step::{CacheSettings, PrefixPolicy, TemplateSlot};
use diffmesh_denoiser::engine::{spawn_engine, EngineConfig, EngineEvent, EngineHandle, EngineJob};
use diffmesh_denoiser::model::{EditInputs, EngineModel};
use diffmesh_denoiser::templates::{CacheLayout, TemplateEntry};
use diffmesh_model::flux::KvFormat;
use diffmesh_model::tch::{Device, Kind};
use diffmesh_model::tiny::model::TinyModel;
use diffmesh_shared::wire::messages::{BlockPlan, DenoiseJob, JobKind, TemplateRef, TrueCfg};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Span;

const STEPS: u32 = 4;

struct Harness {
    engine: EngineHandle,
    events: mpsc::Receiver<EngineEvent>,
    /// The model's directory (shared with another harness of the same weights).
    dir: Arc<tempfile::TempDir>,
}

fn harness() -> Harness {
    let dir = tempfile::tempdir().unwrap();
    TinyModel::random_for_tests(13, Device::Cpu)
        .unwrap()
        .save(dir.path(), None)
        .unwrap();
    harness_with(Arc::new(dir), CacheSettings::default())
}

/// An engine with cache settings `cache` over the model saved in `dir`: two harnesses of one
/// directory have the same weights whatever other tests draw from torch's global RNG meanwhile.
fn harness_with(dir: Arc<tempfile::TempDir>, cache: CacheSettings) -> Harness {
    harness_of(
        dir,
        EngineConfig {
            cache,
            ..Default::default()
        },
    )
}

/// An engine of `config` (its batch and queue sizes those of every harness here).
fn harness_of(dir: Arc<tempfile::TempDir>, config: EngineConfig) -> Harness {
    let model = EngineModel::load(
        dir.path(),
        Device::Cpu,
        Kind::Float,
        "tiny".into(),
        Some(64),
    )
    .unwrap();
    let (tx, events) = mpsc::channel(256);
    let config = EngineConfig {
        max_batch: 4,
        max_queue: 8,
        ..config
    };
    let (engine, _drained) = spawn_engine(model, config, 16, tx, None).unwrap();
    Harness {
        engine,
        events,
        dir,
    }
}

fn template_ref() -> TemplateRef {
    TemplateRef {
        template_id: "tpl".into(),
        prompt: "a blue background".into(),
        seed: 77,
        steps: STEPS,
        guidance_scale: 1.0,
        cache_key: "key".into(),
    }
}

fn template_rgb() -> Vec<u8> {
    (0..64 * 64 * 3).map(|i| ((i * 7) % 253) as u8).collect()
}

fn job(id: &str, kind: JobKind, prompt: &str, seed: u64) -> DenoiseJob {
    let mut j = diffmesh_shared::testing::generation_job(id, prompt, seed, STEPS);
    j.kind = kind;
    if kind != JobKind::Generate {
        j.template = Some(template_ref());
    }
    j
}

/// A token mask repainting the token rectangle `rows x cols` at (r0, c0) of the 16x16 grid.
fn mask(r0: usize, c0: usize, rows: usize, cols: usize) -> Vec<u8> {
    let mut m = vec![0u8; 256];
    for r in r0..r0 + rows {
        m[r * 16 + c0..r * 16 + c0 + cols].fill(1);
    }
    m
}

fn ready(entry: &Arc<TemplateEntry>) -> TemplateSlot {
    let slot = TemplateSlot::default();
    slot.set(Some(entry.clone())).unwrap();
    slot
}

async fn submit_edit(h: &Harness, id: &str, seed: u64, m: Vec<u8>, slot: TemplateSlot) {
    submit_edit_with(h, id, seed, m, slot, None, EDIT_PROMPT).await
}

const EDIT_PROMPT: &str = "a red circle";

async fn submit_edit_with(
    h: &Harness,
    id: &str,
    seed: u64,
    m: Vec<u8>,
    slot: TemplateSlot,
    true_cfg: Option<TrueCfg>,
    prompt: &str,
) {
    let mut j = job(id, JobKind::Edit, prompt, seed);
    j.params.true_cfg = true_cfg;
    // What the codec sets: the repainted fraction of the token grid.
    j.inputs.mask_ratio = m.iter().filter(|&&t| t != 0).count() as f32 / m.len() as f32;
    let mut ej = EngineJob::new(
        j,
        Some(EditInputs {
            template_rgb: template_rgb(),
            token_mask: m,
        }),
    );
    ej.template = Some(slot);
    h.engine.submit(ej, Span::none()).await.unwrap();
}

/// Events until `until` returns true; finished images by job id, and the log.
async fn events_until(
    h: &mut Harness,
    images: &mut HashMap<String, Vec<u8>>,
    log: &mut Vec<String>,
    until: impl Fn(&[String]) -> bool,
) -> Option<Arc<TemplateEntry>> {
    let mut captured = None;
    while !until(log) {
        let event = tokio::time::timeout(Duration::from_secs(120), h.events.recv())
            .await
            .expect("engine stalled")
            .unwrap();
        match event {
            EngineEvent::Started { job_id } => log.push(format!("started {job_id}")),
            EngineEvent::Step { job_id, step, .. } => log.push(format!("step {job_id} {step}")),
            EngineEvent::Finished {
                job,
                images: mut imgs,
                ..
            } => {
                log.push(format!("finished {}", job.job_id));
                images.insert(job.job_id, imgs.remove(0));
            }
            EngineEvent::Captured {
                job,
                entry,
                quality,
                ..
            } => {
                log.push(format!("captured {}", job.job_id));
                if let Some(q) = quality {
                    log.push(format!(
                        "quality {} {} {}",
                        q.box_ssim, q.floor, q.full_compute
                    ));
                }
                captured = Some(entry);
            }
            EngineEvent::Failed { job, error, .. } => panic!("{} failed: {error}", job.job_id),
            EngineEvent::Cancelled { job_id } => log.push(format!("cancelled {job_id}")),
            EngineEvent::Preview { job_id, step, .. } => {
                log.push(format!("preview {job_id} {step}"))
            }
        }
    }
    captured
}

fn has(log: &[String], line: &str) -> bool {
    log.iter().any(|l| l == line)
}

async fn capture(h: &mut Harness) -> Arc<TemplateEntry> {
    let (entry, _) = capture_logged(h).await;
    assert_eq!(entry.steps(), STEPS as usize);
    entry
}

/// A capture's entry and its event log.
async fn capture_logged(h: &mut Harness) -> (Arc<TemplateEntry>, Vec<String>) {
    let mut ej = EngineJob::new(
        job("capture", JobKind::Capture, "", 0),
        Some(EditInputs {
            template_rgb: template_rgb(),
            token_mask: Vec::new(),
        }),
    );
    ej.capture_key = Some("key".into());
    h.engine.submit(ej, Span::none()).await.unwrap();
    let (mut images, mut log) = (HashMap::new(), Vec::new());
    let entry = events_until(h, &mut images, &mut log, |l| has(l, "captured capture"))
        .await
        .expect("capture event");
    assert_eq!(entry.meta.cache_key, "key");
    (entry, log)
}

/// The block plans of the mask-aware steps sampled since the last call (at least one).
fn block_plans(h: &Harness) -> Vec<BlockPlan> {
    let plans: Vec<BlockPlan> = h
        .engine
        .take_step_samples()
        .into_iter()
        .filter_map(|s| s.block_plan)
        .collect();
    assert!(!plans.is_empty(), "no step sample carried its block plan");
    plans
}

fn max_abs_diff(a: &[u8], b: &[u8]) -> u8 {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_at_different_steps_each_read_their_own_steps_cache() {
    let mut h = harness();
    let entry = capture(&mut h).await;
    let (ma, mb) = (mask(0, 0, 6, 6), mask(8, 4, 5, 10));
    let (mut images, mut log) = (HashMap::new(), Vec::new());
    submit_edit(&h, "a-alone", 1, ma.clone(), ready(&entry)).await;
    submit_edit(&h, "b-alone", 2, mb.clone(), ready(&entry)).await;
    events_until(&mut h, &mut images, &mut log, |l| {
        has(l, "finished a-alone") && has(l, "finished b-alone")
    })
    .await;
    // Now b joins while a is two steps in: one batch, two different steps, two cache steps.
    submit_edit(&h, "a", 1, ma, ready(&entry)).await;
    events_until(&mut h, &mut images, &mut log, |l| has(l, "step a 2")).await;
    submit_edit(&h, "b", 2, mb, ready(&entry)).await;
    events_until(&mut h, &mut images, &mut log, |l| {
        has(l, "finished a") && has(l, "finished b")
    })
    .await;
    let a_done = log.iter().position(|l| l == "finished a").unwrap();
    assert!(
        log[..a_done].iter().any(|l| l.starts_with("step b")),
        "{log:?}"
    );
    assert!(max_abs_diff(&images["a"], &images["a-alone"]) <= 1);
    assert!(max_abs_diff(&images["b"], &images["b-alone"]) <= 1);
    assert!(max_abs_diff(&images["a"], &images["b"]) > 10);

    // The heartbeat's step samples: the capture's steps are left out; every edit row reports
    // its mask ratio, and the shared steps have both rows.
    let samples = h.engine.take_step_samples();
    let (ra, rb) = (36.0 / 256.0, 50.0 / 256.0);
    assert!(!samples.is_empty());
    assert!(
        samples
            .iter()
            .all(|s| s.seconds > 0.0 && s.row_ratios.iter().all(|&r| r == ra || r == rb)),
        "{samples:?}"
    );
    assert!(
        samples.iter().any(|s| s.row_ratios.len() == 2),
        "{samples:?}"
    );
}

/// A guided edit's two rows read one streamed cache (each block handed out once): it runs
/// mask-aware, steers the masked region, and batched with a plain edit ends as it ends alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guided_edit_reads_its_streamed_cache_in_both_rows() {
    let mut h = harness();
    let entry = capture(&mut h).await;
    let (ma, mb) = (mask(0, 0, 6, 6), mask(8, 4, 5, 10));
    let cfg = || {
        Some(TrueCfg {
            scale: 4.0,
            negative_prompt: String::new(),
        })
    };
    let (mut images, mut log) = (HashMap::new(), Vec::new());
    submit_edit_with(
        &h,
        "g-alone",
        1,
        ma.clone(),
        ready(&entry),
        cfg(),
        EDIT_PROMPT,
    )
    .await;
    submit_edit(&h, "plain", 1, ma.clone(), ready(&entry)).await;
    events_until(&mut h, &mut images, &mut log, |l| {
        has(l, "finished g-alone") && has(l, "finished plain")
    })
    .await;
    assert!(max_abs_diff(&images["g-alone"], &images["plain"]) > 10);
    submit_edit_with(&h, "g", 1, ma, ready(&entry), cfg(), EDIT_PROMPT).await;
    submit_edit(&h, "other", 2, mb, ready(&entry)).await;
    events_until(&mut h, &mut images, &mut log, |l| {
        has(l, "finished g") && has(l, "finished other")
    })
    .await;
    assert!(max_abs_diff(&images["g"], &images["g-alone"]) <= 1);
    // Every guided step ran two mask-aware rows (ratio 36/256), none in full compute.
    let samples = h.engine.take_step_samples();
    assert!(
        samples
            .iter()
            .all(|s| s.row_ratios.iter().all(|&r| r < 1.0)),
        "{samples:?}"
    );
    assert!(
        samples.iter().any(|s| s.row_ratios.len() == 3),
        "{samples:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_waiting_for_its_cache_lets_other_jobs_pass_then_runs() {
    let mut h = harness();
    let entry = capture(&mut h).await;
    let pending = TemplateSlot::default();
    submit_edit(&h, "waiting", 3, mask(2, 2, 4, 4), pending.clone()).await;
    let generation = job("gen", JobKind::Generate, "a green square", 4);
    h.engine
        .submit(EngineJob::new(generation, None), Span::none())
        .await
        .unwrap();
    let (mut images, mut log) = (HashMap::new(), Vec::new());
    events_until(&mut h, &mut images, &mut log, |l| has(l, "finished gen")).await;
    assert!(!has(&log, "started waiting"), "{log:?}");
    // The fetch completes: the edit is admitted and runs mask-aware.
    pending.set(Some(entry)).unwrap();
    events_until(&mut h, &mut images, &mut log, |l| {
        has(l, "finished waiting")
    })
    .await;

    // An unavailable cache (fetch failed) runs the edit in full compute instead.
    let unavailable = TemplateSlot::default();
    unavailable.set(None).unwrap();
    submit_edit(&h, "no-cache", 3, mask(2, 2, 4, 4), unavailable).await;
    events_until(&mut h, &mut images, &mut log, |l| {
        has(l, "finished no-cache")
    })
    .await;
    // Same edit, cached vs full compute: the cache approximates, so the bytes differ (identical
    // bytes would mean the first run did not read the cache).
    let d = max_abs_diff(&images["waiting"], &images["no-cache"]);
    assert!(d > 0, "mask-aware and full compute gave identical bytes");
}

/// An engine capturing FlashPS's Y cache (each block's input hidden stream) keeps half the
/// bytes of a K/V engine's, and its streamed edits rebuild the K/V: with the template's own
/// prompt they end as the K/V engine's edits end; with another prompt they differ (the K/V are
/// projected under the edit's conditioning); and a guided edit's two rows, each under its own
/// prompt's conditioning, batched with a plain edit end as they do alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hidden_stream_cache_serves_edits_at_half_the_bytes() {
    let mut kv = harness();
    let kv_entry = capture(&mut kv).await;
    let mut y = harness_with(
        kv.dir.clone(),
        CacheSettings {
            layout: CacheLayout::One(KvFormat::Hidden),
            ..Default::default()
        },
    );
    let y_entry = capture(&mut y).await;
    assert_eq!(
        (kv_entry.layout.kv(), y_entry.layout.kv()),
        (KvFormat::Prepared, KvFormat::Hidden)
    );
    let ratio = y_entry.bytes() as f64 / kv_entry.bytes() as f64;
    assert!((0.49..0.51).contains(&ratio), "Y over K/V bytes {ratio}");

    let m = mask(2, 3, 6, 5);
    let template_prompt = template_ref().prompt;
    let (mut images, mut log, mut y_log) = (HashMap::new(), Vec::new(), Vec::new());
    for (h, entry, log) in [
        (&mut kv, &kv_entry, &mut log),
        (&mut y, &y_entry, &mut y_log),
    ] {
        // One at a time: a batch's GEMMs may round differently from a lone edit's.
        let prompt = template_prompt.as_str();
        submit_edit_with(h, "same", 3, m.clone(), ready(entry), None, prompt).await;
        events_until(h, &mut images, log, |l| has(l, "finished same")).await;
        submit_edit_with(h, "other", 3, m.clone(), ready(entry), None, EDIT_PROMPT).await;
        events_until(h, &mut images, log, |l| has(l, "finished other")).await;
        for id in ["same", "other"] {
            let image = images.remove(id).unwrap();
            images.insert(format!("{id} {:?}", entry.layout.kv()), image);
        }
    }
    let diff =
        |images: &HashMap<String, Vec<u8>>, a: &str, b: &str| max_abs_diff(&images[a], &images[b]);
    let same = diff(&images, "same Prepared", "same Hidden");
    let other = diff(&images, "other Prepared", "other Hidden");
    println!("K/V against Y cache: with the template's prompt {same}, with another {other}");
    assert!(same <= 1 && other > 2, "{same} {other}");

    let cfg = || {
        Some(TrueCfg {
            negative_prompt: "a green square".into(),
            scale: 4.0,
        })
    };
    let mb = mask(9, 1, 4, 12);
    submit_edit_with(
        &y,
        "g-alone",
        1,
        m.clone(),
        ready(&y_entry),
        cfg(),
        EDIT_PROMPT,
    )
    .await;
    events_until(&mut y, &mut images, &mut y_log, |l| {
        has(l, "finished g-alone")
    })
    .await;
    submit_edit(&y, "p-alone", 2, mb.clone(), ready(&y_entry)).await;
    events_until(&mut y, &mut images, &mut y_log, |l| {
        has(l, "finished p-alone")
    })
    .await;
    submit_edit(&y, "p", 2, mb, ready(&y_entry)).await;
    submit_edit_with(&y, "g", 1, m, ready(&y_entry), cfg(), EDIT_PROMPT).await;
    events_until(&mut y, &mut images, &mut y_log, |l| {
        has(l, "finished g") && has(l, "finished p")
    })
    .await;
    assert!(diff(&images, "g", "g-alone") <= 1);
    assert!(diff(&images, "p", "p-alone") <= 1);
    assert!(diff(&images, "g", "p") > 10);
}

/// The planner's choice shows in the step samples the heartbeat carries: a mask-aware edit's
/// steps say how many blocks ran over every token and how many read the cache, in its format.
#[tokio::test]
async fn step_samples_carry_the_planners_block_choices() {
    let dir = harness().dir;
    let mut y = harness_with(
        dir,
        CacheSettings {
            layout: CacheLayout::One(KvFormat::Hidden),
            ..Default::default()
        },
    );
    let entry = capture(&mut y).await;
    let before = y.engine.take_step_samples();
    assert!(
        before.iter().all(|s| s.block_plan.is_none()),
        "a capture reads no cache"
    );
    submit_edit(&y, "e", 3, mask(2, 3, 6, 5), ready(&entry)).await;
    let (mut images, mut log) = (HashMap::new(), Vec::new());
    events_until(&mut y, &mut images, &mut log, |l| has(l, "finished e")).await;
    let plans = block_plans(&y);
    let blocks = plans[0].full + plans[0].cached;
    for p in &plans {
        assert_eq!(p.format, "hidden");
        assert_eq!(p.full + p.cached, blocks);
        assert!(p.cached > 0, "{p:?}");
    }
}

/// A cache holding K/V and the hidden stream (the three-way planner's layout) holds 1.5x the
/// bytes of K/V alone. A fixed plan mixing full, K/V and Y blocks, and the live planner's own
/// plans, end as the K/V engine's edit does with the template's prompt; the step samples say
/// how many blocks read Y.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_mixing_kv_and_hidden_blocks_serve_edits() {
    let mut kv = harness();
    let kv_entry = capture(&mut kv).await;
    let blocks = kv_entry.blocks();
    assert!(blocks >= 3, "the tiny model has {blocks} blocks");
    // One block in full, then Y and K/V in turn.
    let plan: String = (0..blocks)
        .map(|b| match b {
            0 => 'f',
            b if b % 2 == 1 => 'y',
            _ => 'k',
        })
        .collect();
    let y_blocks = plan.chars().filter(|&c| c == 'y').count() as u32;
    let layout = CacheLayout::KvAndHidden(KvFormat::Prepared);
    let settings = |prefix| CacheSettings {
        layout,
        prefix,
        ..Default::default()
    };
    let mut fixed = harness_with(
        kv.dir.clone(),
        settings(PrefixPolicy::parse(&plan).unwrap()),
    );
    let both = capture(&mut fixed).await;
    assert_eq!(both.layout, layout);
    let ratio = both.bytes() as f64 / kv_entry.bytes() as f64;
    assert!(
        (1.49..1.51).contains(&ratio),
        "K/V + Y over K/V bytes {ratio}"
    );
    let mut planned = harness_with(kv.dir.clone(), settings(PrefixPolicy::Auto));

    let m = mask(2, 3, 6, 5);
    let prompt = template_ref().prompt;
    let mut images = HashMap::new();
    for (h, entry, id) in [
        (&mut kv, &kv_entry, "kv"),
        (&mut fixed, &both, "fixed"),
        (&mut planned, &both, "planned"),
    ] {
        let mut log = Vec::new();
        submit_edit_with(h, id, 3, m.clone(), ready(entry), None, &prompt).await;
        events_until(h, &mut images, &mut log, |l| {
            has(l, &format!("finished {id}"))
        })
        .await;
    }
    for id in ["fixed", "planned"] {
        let d = max_abs_diff(&images["kv"], &images[id]);
        println!("K/V against {id}: {d}");
        assert!(d <= 1, "{id}: {d}");
    }
    // Under another prompt the Y blocks follow the edit's conditioning: the fixed plan's
    // image departs from the K/V engine's, so its Y blocks were read as Y.
    for (h, entry, id) in [
        (&mut kv, &kv_entry, "kv other"),
        (&mut fixed, &both, "fixed other"),
    ] {
        let mut log = Vec::new();
        submit_edit_with(h, id, 3, m.clone(), ready(entry), None, EDIT_PROMPT).await;
        events_until(h, &mut images, &mut log, |l| {
            has(l, &format!("finished {id}"))
        })
        .await;
    }
    let d = max_abs_diff(&images["kv other"], &images["fixed other"]);
    println!("K/V against the fixed plan under another prompt: {d}");
    assert!(d > 2, "{d}");
    let plans = block_plans(&fixed);
    for p in &plans {
        assert_eq!(p.format, "prepared+hidden");
        assert_eq!(
            (p.full, p.cached, p.hidden),
            (1, blocks as u32 - 1, y_blocks)
        );
    }
    for p in block_plans(&planned) {
        assert_eq!(p.full + p.cached, blocks as u32);
        assert!(p.hidden <= p.cached, "{p:?}");
    }
}

/// The captures' quality guard: each capture also runs a typical edit of its template in full
/// and from the cache being captured. At a floor the cache reaches, the cache is kept and its
/// figure reported; at a floor of 1 (no approximation reaches it) the cache stored holds no
/// steps, and an edit of the template then computes in full, as an edit without a cache does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quality_guard_keeps_a_cache_above_its_floor_and_falls_back_below() {
    let mut plain = harness();
    let guarded = |floor| EngineConfig {
        cache_quality_floor: Some(floor),
        ..Default::default()
    };
    let mut kept = harness_of(plain.dir.clone(), guarded(0.0));
    let mut dropped = harness_of(plain.dir.clone(), guarded(1.0));
    let verdict = |log: &[String]| -> (f64, f64, bool) {
        let line = log
            .iter()
            .find(|l| l.starts_with("quality "))
            .expect("no verdict");
        let v: Vec<&str> = line.split(' ').skip(1).collect();
        (v[0].parse().unwrap(), v[1].parse().unwrap(), v[2] == "true")
    };
    let (entry, log) = capture_logged(&mut kept).await;
    let (ssim, floor, full_compute) = verdict(&log);
    println!("typical edit from the cache: box SSIM {ssim}");
    assert!((0.0..1.0).contains(&ssim) && ssim > 0.2, "{ssim}");
    assert_eq!(
        (floor, full_compute, entry.steps()),
        (0.0, false, STEPS as usize)
    );

    let (empty, log) = capture_logged(&mut dropped).await;
    let (again, floor, full_compute) = verdict(&log);
    assert_eq!((again, floor, full_compute), (ssim, 1.0, true));
    assert_eq!((empty.steps(), empty.bytes()), (0, 0));
    // No verdict where no guard runs.
    let (_, log) = capture_logged(&mut plain).await;
    assert!(log.iter().all(|l| !l.starts_with("quality ")), "{log:?}");

    let m = mask(2, 3, 6, 5);
    let mut images = HashMap::new();
    let no_cache = TemplateSlot::default();
    no_cache.set(None).unwrap();
    for (slot, id) in [(ready(&empty), "fallback"), (no_cache, "no cache")] {
        let mut log = Vec::new();
        submit_edit(&dropped, id, 3, m.clone(), slot).await;
        events_until(&mut dropped, &mut images, &mut log, |l| {
            has(l, &format!("finished {id}"))
        })
        .await;
    }
    assert_eq!(max_abs_diff(&images["fallback"], &images["no cache"]), 0);
}
