//! A denoiser engine on elastic ranks (`--ranks`, issue 47): its images equal the one-device
//! engine's, its policy shrinks a running job to admit others (visible in the step events and
//! the metrics), edits step mask-aware on groups of ranks, and it refuses what ranks do not
//! run with an error naming the field.
mod common;

use common::engine::{
    harness_of, harness_on, load_model, max_abs_diff, submit, write_random_model, Harness,
};
use diffmesh_denoiser::cached_step::TemplateSlot;
use diffmesh_denoiser::engine::EngineJob;
use diffmesh_denoiser::engine::{EngineConfig, EngineEvent};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use diffmesh_denoiser::model::EditInputs;
use diffmesh_denoiser::ranks::ElasticSettings;
use diffmesh_denoiser::templates::TemplateEntry;
use diffmesh_sched::elastic::cost::{DegreeCost, MeasuredClass, MeasuredTable};
use diffmesh_shared::wire::lora::LoraRef;
use diffmesh_shared::wire::messages::{DenoiseJob, JobKind, TemplateRef, TrueCfg};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tracing::Span;

/// Each test runs four rank threads beside the engine: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A table in which more ranks always make a step faster (so a job alone takes them all).
fn more_is_faster() -> MeasuredTable {
    let per_degree = [(1, 0.008), (2, 0.005), (4, 0.003)]
        .into_iter()
        .map(|(degree, step_s)| DegreeCost {
            degree,
            step_s,
            by_busy_ranks: Vec::new(),
        })
        .collect();
    MeasuredTable {
        label: "test".into(),
        classes: vec![MeasuredClass {
            name: "64px".into(),
            image_tokens: 16.0,
            steps: 0,
            per_degree,
        }],
    }
}

fn ranked(dir: &Path, policy: &str, metrics: Option<DenoiserMetrics>) -> Harness {
    let mut model = load_model(dir);
    let settings = ElasticSettings {
        ranks: 4,
        policy: policy.into(),
        sizes: vec![64],
        threads_per_rank: 1,
        calibration_repeats: 1,
        table: Some(more_is_faster()),
    };
    model.start_ranks(dir, &settings).unwrap();
    let config = EngineConfig {
        max_batch: 8,
        ..Default::default()
    };
    harness_of(model, config, metrics)
}

fn job(id: &str, seed: u64, steps: u32) -> DenoiseJob {
    diffmesh_shared::testing::generation_job(id, "a red circle", seed, steps)
}

/// Images and step events (job, step, ranks) until every job in `ids` ended.
async fn run(
    h: &mut Harness,
    ids: &[&str],
) -> (
    HashMap<String, Vec<Vec<u8>>>,
    Vec<(String, u32, Option<u32>)>,
) {
    let (mut images, mut steps, mut left) = (HashMap::new(), Vec::new(), ids.len());
    while left > 0 {
        let event = tokio::time::timeout(Duration::from_secs(120), h.events.recv())
            .await
            .expect("engine stalled")
            .expect("events open");
        match event {
            EngineEvent::Step {
                job_id,
                step,
                ranks,
                ..
            } => steps.push((job_id, step, ranks)),
            EngineEvent::Finished { job, images: i, .. } => {
                images.insert(job.job_id, i);
                left -= 1;
            }
            EngineEvent::Failed { job, error, .. } => panic!("{} failed: {error}", job.job_id),
            _ => {}
        }
    }
    (images, steps)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_on_ranks_equal_images_on_one_device() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    write_random_model(dir.path());
    let mut guided = job("guided", 2, 3);
    guided.params.true_cfg = Some(TrueCfg {
        scale: 3.0,
        negative_prompt: "blue".into(),
    });
    let mut two = job("two", 3, 3);
    two.params.n = 2;
    let jobs = [job("plain", 1, 4), guided, two];
    let ids = ["plain", "guided", "two"];
    let mut one = harness_on(dir.path(), EngineConfig::default(), None);
    for j in &jobs {
        submit(&one, j.clone(), None).await;
    }
    let (expected, _) = run(&mut one, &ids).await;
    for policy in ["static-sp4", "static-sp2", "fcfs-elastic"] {
        let mut h = ranked(dir.path(), policy, None);
        for j in &jobs {
            submit(&h, j.clone(), None).await;
        }
        let (got, steps) = run(&mut h, &ids).await;
        assert!(
            steps.iter().all(|(_, _, r)| r.is_some()),
            "{policy}: {steps:?}"
        );
        if policy == "static-sp4" {
            assert!(steps.iter().all(|(_, _, r)| *r == Some(4)), "{steps:?}");
        }
        for id in ids {
            assert_eq!(got[id].len(), expected[id].len(), "{policy} {id}");
            for (a, b) in got[id].iter().zip(&expected[id]) {
                let diff = max_abs_diff(a, b);
                assert!(diff <= 1, "{policy} {id}: pixels differ by {diff}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_shrinks_a_running_job_to_admit_others() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    write_random_model(dir.path());
    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry).unwrap();
    let mut h = ranked(dir.path(), "fcfs-elastic", Some(metrics.clone()));
    submit(&h, job("long", 1, 40), None).await;
    // Once it runs alone (on every rank), three more arrive.
    loop {
        match h.events.recv().await.expect("events open") {
            EngineEvent::Step { job_id, ranks, .. } => {
                assert_eq!(
                    (job_id.as_str(), ranks),
                    ("long", Some(4)),
                    "alone it takes all ranks"
                );
                break;
            }
            EngineEvent::Failed { error, .. } => panic!("{error}"),
            _ => {}
        }
    }
    for id in ["b", "c", "d"] {
        submit(&h, job(id, 2, 6), None).await;
    }
    let (_, steps) = run(&mut h, &["long", "b", "c", "d"]).await;
    let long: Vec<Option<u32>> = steps
        .iter()
        .filter(|s| s.0 == "long")
        .map(|s| s.2)
        .collect();
    assert!(
        long.contains(&Some(1)),
        "it shrank to admit the others: {long:?}"
    );
    assert_eq!(
        long.last(),
        Some(&Some(4)),
        "and grew back once alone: {long:?}"
    );
    assert!(metrics.elastic.degree_changes.get() >= 2);
    for degree in ["1", "4"] {
        assert!(
            metrics.elastic.steps.with_label_values(&[degree]).get() > 0,
            "degree {degree}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_refuse_what_they_do_not_run_naming_the_field() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    write_random_model(dir.path());
    let mut h = ranked(dir.path(), "slo-elastic", None);
    let mut with_lora = job("lora", 1, 2);
    with_lora.params.loras = vec![LoraRef {
        id: "style".into(),
        scale: 1.0,
    }];
    submit(&h, with_lora, None).await;
    let event = tokio::time::timeout(Duration::from_secs(60), h.events.recv())
        .await
        .unwrap()
        .unwrap();
    match event {
        EngineEvent::Failed { error, .. } => {
            assert!(error.to_string().starts_with("params.loras:"), "{error}");
            assert_eq!(error.reason(), "invalid_input");
        }
        other => panic!("{other:?}"),
    }
    // A plain generation still runs.
    submit(&h, job("plain", 1, 2), None).await;
    let (images, _) = run(&mut h, &["plain"]).await;
    assert_eq!(images["plain"].len(), 1);
    // Previews come after the ranks' steps as after the engine's own.
    let mut seen = job("seen", 2, 3);
    seen.params.preview_steps = vec![1, 2];
    submit(&h, seen, None).await;
    let mut previews = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), h.events.recv())
            .await
            .unwrap()
            .unwrap();
        match event {
            EngineEvent::Preview {
                step,
                width,
                height,
                rgb,
                ..
            } => {
                assert_eq!(rgb.len(), (width * height * 3) as usize);
                previews.push(step);
            }
            EngineEvent::Finished { .. } => break,
            EngineEvent::Failed { error, .. } => panic!("{error}"),
            _ => {}
        }
    }
    assert_eq!(previews, [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guided_step_runs_its_rows_on_the_two_halves_of_an_even_group() {
    use diffmesh_denoiser::ranks::pool::RankPool;
    use diffmesh_model::pipeline::stepper::{DenoiseState, StepRequest, TrueCfg as Guidance};
    use diffmesh_model::tch::{Device, Kind};
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    write_random_model(dir.path());
    let model = load_model(dir.path());
    let p = model.pipeline();
    let request = StepRequest {
        prompt: "a red circle".into(),
        seed: 3,
        height: 64,
        width: 64,
        steps: 2,
        guidance_scale: 1.0,
        edit: None,
        control: None,
        cache_threshold: None,
        cache_method: Default::default(),
        true_cfg: Some(Guidance {
            negative_prompt: "blue".into(),
            scale: 3.0,
        }),
    };
    let rows = DenoiseState::new(&p, &request)
        .unwrap()
        .step_inputs()
        .unwrap();
    assert_eq!(rows.len(), 2);
    let expected: Vec<_> = rows
        .iter()
        .map(|x| diffmesh_model::tch::no_grad(|| p.transformer.forward(x)).unwrap())
        .collect();
    let transformer = dir.path().join("transformer");
    let mut pool = RankPool::start(&transformer, 4, Device::Cpu, Kind::Float, 1).unwrap();
    for (task, members) in [vec![0, 1], vec![3, 1, 2, 0], vec![2], vec![0, 1, 2]]
        .into_iter()
        .enumerate()
    {
        pool.dispatch(task as u64, &members, &rows).unwrap();
        let done = loop {
            if let Some(done) = pool.poll(Duration::from_secs(60)).pop() {
                break done;
            }
        };
        let velocities = done.outcome.unwrap();
        for (got, want) in velocities.iter().zip(&expected) {
            let diff = got.f_sub(want).unwrap().abs().max().double_value(&[]);
            assert!(diff < 1e-4, "ranks {members:?}: {diff}");
        }
        assert_eq!(pool.free().len(), 4, "every rank is free again");
    }
    assert_eq!(
        pool.cfg_split_tasks(),
        2,
        "the groups of 2 and 4 ranks split the rows"
    );
}

/// The template every edit below reads.
fn template_job(id: &str, kind: JobKind, seed: u64) -> DenoiseJob {
    let mut j = job(id, seed, 3);
    j.kind = kind;
    j.template = Some(TemplateRef {
        template_id: "tpl".into(),
        prompt: "a blue background".into(),
        seed: 77,
        steps: 3,
        guidance_scale: 1.0,
        cache_key: "key".into(),
    });
    j
}

fn template_rgb() -> Vec<u8> {
    (0..64 * 64 * 3).map(|i| ((i * 7) % 253) as u8).collect()
}

/// Run a capture of the template; its cache.
async fn capture(h: &mut Harness) -> Arc<TemplateEntry> {
    let inputs = EditInputs {
        template_rgb: template_rgb(),
        token_mask: Vec::new(),
    };
    let mut ej = EngineJob::new(template_job("capture", JobKind::Capture, 0), Some(inputs));
    ej.capture_key = Some("key".into());
    h.engine.submit(ej, Span::none()).await.unwrap();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), h.events.recv())
            .await
            .expect("engine stalled")
            .expect("events open");
        match event {
            EngineEvent::Captured { entry, .. } => return entry,
            EngineEvent::Failed { error, .. } => panic!("capture failed: {error}"),
            _ => {}
        }
    }
}

/// An edit repainting the token rectangle `rows x cols` at (r0, c0) of the 16x16 grid.
async fn submit_edit(
    h: &Harness,
    id: &str,
    (r0, c0, rows, cols): (usize, usize, usize, usize),
    true_cfg: Option<TrueCfg>,
    entry: &Arc<TemplateEntry>,
) {
    let mut token_mask = vec![0u8; 256];
    for r in r0..r0 + rows {
        token_mask[r * 16 + c0..r * 16 + c0 + cols].fill(1);
    }
    let mut j = template_job(id, JobKind::Edit, 5);
    j.params.true_cfg = true_cfg;
    j.inputs.mask_ratio = (rows * cols) as f32 / 256.0;
    let inputs = EditInputs {
        template_rgb: template_rgb(),
        token_mask,
    };
    let mut ej = EngineJob::new(j, Some(inputs));
    let slot = TemplateSlot::default();
    slot.set(Some(entry.clone())).unwrap();
    ej.template = Some(slot);
    h.engine.submit(ej, Span::none()).await.unwrap();
}

/// Edits read a template cache on ranks as on one device: the capture runs on the engine's
/// own transformer, each edit step mask-aware on a group of ranks (every member a share of
/// the masked tokens), and the images equal the one-device engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_on_ranks_equal_edits_on_one_device() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    write_random_model(dir.path());
    let guided = Some(TrueCfg {
        scale: 3.0,
        negative_prompt: "blue".into(),
    });
    let edits = [
        ("small", (2, 3, 6, 5), None),
        ("guided", (8, 0, 4, 16), guided),
    ];
    let ids = ["small", "guided"];
    let mut one = harness_on(dir.path(), EngineConfig::default(), None);
    let entry = capture(&mut one).await;
    for (id, rect, cfg) in &edits {
        submit_edit(&one, id, *rect, cfg.clone(), &entry).await;
    }
    let (expected, _) = run(&mut one, &ids).await;

    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry).unwrap();
    let mut h = ranked(dir.path(), "static-sp2", Some(metrics.clone()));
    let captured = capture(&mut h).await;
    assert_eq!(
        (captured.steps(), captured.blocks(), captured.bytes()),
        (entry.steps(), entry.blocks(), entry.bytes())
    );
    for (id, rect, cfg) in &edits {
        submit_edit(&h, id, *rect, cfg.clone(), &captured).await;
    }
    let (got, steps) = run(&mut h, &ids).await;
    assert!(steps.iter().all(|(_, _, r)| *r == Some(2)), "{steps:?}");
    for id in ids {
        let diff = max_abs_diff(&got[id][0], &expected[id][0]);
        assert!(diff <= 1, "{id}: pixels differ by {diff}");
    }
    let rows = |mode: &str| metrics.step_rows.with_label_values(&[mode]).get();
    // 3 steps of one plain and one guided edit, every one mask-aware.
    assert_eq!((rows("mask_aware"), rows("full")), (9, 0));
}
