//! Engine-level tests on a random-weights tiny model (no NATS): batching does not change a job's
//! images, cancellation frees the slot, a bad job fails alone.
mod common;

use common::engine::*;
use diffmesh_denoiser::engine::{Batching, EngineConfig, EngineEvent, EngineJob};
use diffmesh_denoiser::metrics::{DenoiserMetrics, ENGINE_PHASES};
use diffmesh_denoiser::model::EditInputs;
use diffmesh_sched::QueueOrder;
use diffmesh_shared::wire::messages::{DenoiseJob, JobKind, TrueCfg};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use tracing::Span;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_of_two_equals_each_alone() {
    let mut h = harness(4, 8);
    submit(&h, job("a", "a red circle", 1, 4), None).await;
    let (alone_a, _) = drain(&mut h, &["a"]).await;
    submit(&h, job("b", "a blue square", 2, 6), None).await;
    let (alone_b, _) = drain(&mut h, &["b"]).await;
    assert!(
        max_abs_diff(&alone_a["a"], &alone_b["b"]) > 10,
        "different prompts/seeds must give different images"
    );

    submit(&h, job("a2", "a red circle", 1, 4), None).await;
    submit(&h, job("b2", "a blue square", 2, 6), None).await;
    let (batched, log) = drain(&mut h, &["a2", "b2"]).await;
    // They shared steps at different step indices: b2 stepped before a2 finished.
    let a_done = log.iter().position(|l| l == "finished a2").unwrap();
    assert!(
        log[..a_done].iter().any(|l| l.starts_with("step b2")),
        "{log:?}"
    );
    // Float reductions may order differently in a batch: allow one level of rounding.
    assert!(max_abs_diff(&batched["a2"], &alone_a["a"]) <= 1);
    assert!(max_abs_diff(&batched["b2"], &alone_b["b"]) <= 1);
    // Every step went into the heartbeat's samples, one row per job and step: 4 + 6 alone,
    // 4 + 6 for the pair (how many of those shared a step depends on when b2 joined, at
    // least one did); full compute, so each row reports ratio 1.
    let samples = h.engine.take_step_samples();
    let rows: Vec<usize> = samples.iter().map(|s| s.row_ratios.len()).collect();
    assert_eq!(rows.iter().sum::<usize>(), 20, "{rows:?}");
    assert!(rows.contains(&2), "{rows:?}");
    assert!(samples
        .iter()
        .all(|s| s.seconds > 0.0 && s.row_ratios.iter().all(|&r| r == 1.0)));
    assert!(h.engine.take_step_samples().is_empty(), "handed out once");
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
}

/// Previews go out after exactly the steps a job names, each after its step's event, at the
/// image's size, and change no pixel of the image; their cost is on `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previews_go_out_after_the_named_steps_and_change_no_pixel() {
    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry).unwrap();
    let mut h = harness_with_metrics(
        EngineConfig {
            max_batch: 4,
            max_queue: 8,
            ..Default::default()
        },
        Some(metrics.clone()),
    );
    submit(&h, job("plain", "a red circle", 1, 6), None).await;
    let (plain, _) = drain(&mut h, &["plain"]).await;
    let mut previewed = job("seen", "a red circle", 1, 6);
    previewed.params.preview_steps = vec![1, 3, 5, 6];
    submit(&h, previewed, None).await;
    let (seen, log) = drain(&mut h, &["seen"]).await;
    assert_eq!(seen["seen"], plain["plain"], "previews changed the image");
    let previews: Vec<&String> = log.iter().filter(|l| l.starts_with("preview")).collect();
    // Never after the last step: the image itself ends the job.
    assert_eq!(
        previews,
        [
            "preview seen 1 64x64",
            "preview seen 3 64x64",
            "preview seen 5 64x64"
        ],
        "{log:?}"
    );
    let step_1 = log.iter().position(|l| l == "step seen 1/6").unwrap();
    assert_eq!(log[step_1 + 1], "preview seen 1 64x64", "{log:?}");
    let (previews_n, previews_s) = (
        metrics.preview_seconds.get_sample_count(),
        metrics.preview_seconds.get_sample_sum(),
    );
    let (steps_n, steps_s) = (
        metrics.step_seconds.get_sample_count(),
        metrics.step_seconds.get_sample_sum(),
    );
    assert_eq!(previews_n, 3);
    eprintln!(
        "preview {:.3} ms mean over {previews_n}; step {:.3} ms mean over {steps_n}",
        previews_s / previews_n as f64 * 1e3,
        steps_s / steps_n as f64 * 1e3
    );
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
}

/// True CFG: a guided job takes two batch rows per image (its prompt's and its negative
/// prompt's), steers the image, and batched with others ends as it ends alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guided_job_takes_two_rows_and_batches_like_alone() {
    let mut h = harness(3, 8);
    let guided = |id: &str, seed: u64| {
        let mut j = job(id, "a red circle", seed, 4);
        j.params.true_cfg = Some(TrueCfg {
            scale: 4.0,
            negative_prompt: String::new(),
        });
        j
    };
    submit(&h, guided("g", 1), None).await;
    let (alone, _) = drain(&mut h, &["g"]).await;
    let samples = h.engine.take_step_samples();
    let rows: Vec<usize> = samples.iter().map(|s| s.row_ratios.len()).collect();
    assert_eq!(rows, [2, 2, 2, 2]);
    // One job of two rows reading one cache stream (the router costs its bytes once).
    assert!(samples
        .iter()
        .all(|s| s.jobs.len() == 1 && (s.jobs[0].rows, s.jobs[0].cache_streams) == (2, 1)));
    submit(&h, job("u", "a red circle", 1, 4), None).await;
    let (plain, _) = drain(&mut h, &["u"]).await;
    let steered = max_abs_diff(&alone["g"], &plain["u"]);
    assert!(steered > 10, "guidance changed the image by only {steered}");

    // Three rows: the guided job and a plain one fit together; a second guided job waits
    // for the first (after the plain one leaves, 2 + 2 rows are still too many).
    submit(&h, guided("g2", 1), None).await;
    submit(&h, job("p", "a blue square", 2, 4), None).await;
    submit(&h, guided("g3", 3), None).await;
    let (batched, log) = drain(&mut h, &["g2", "p", "g3"]).await;
    let at = |line: &str| log.iter().position(|l| l == line).expect(line);
    assert!(at("started p") < at("finished g2"), "{log:?}");
    assert!(at("started g3") > at("finished g2"), "{log:?}");
    assert!(max_abs_diff(&batched["g2"], &alone["g"]) <= 1);
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_busy_time_is_split_by_loop_phase() {
    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry).unwrap();
    let busy = |phase: &str| {
        metrics
            .engine_busy_seconds
            .with_label_values(&[phase])
            .get()
    };
    // Every phase is exported from the start, at 0.
    let families = registry.gather();
    let family = families
        .iter()
        .find(|f| f.name() == "diffmesh_denoiser_engine_busy_seconds_total")
        .expect("exported");
    assert_eq!(family.get_metric().len(), ENGINE_PHASES.len());
    assert!(ENGINE_PHASES.iter().all(|p| busy(p) == 0.0));

    let mut h = harness_with_metrics(
        EngineConfig {
            max_batch: 4,
            max_queue: 8,
            ..Default::default()
        },
        Some(metrics.clone()),
    );
    submit(&h, job("a", "a red circle", 1, 4), None).await;
    submit(&h, job("b", "a blue square", 2, 6), None).await;
    drain(&mut h, &["a", "b"]).await;
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
    // Preparing and decoding jobs take real work; the step phase holds every step's compute.
    assert!(busy("admit") > 0.0 && busy("retire") > 0.0);
    let step_compute = metrics.step_seconds.get_sample_sum();
    assert!(step_compute > 0.0);
    assert!(
        busy("step") >= step_compute,
        "{} < {step_compute}",
        busy("step")
    );
}

/// Edits of one template (named by its content hash) with the template's noise, plus a
/// generation, under `config`, one job at a time (a batch's forward may round differently);
/// returns every job's image and the metrics.
async fn template_edits(
    model: &Path,
    config: EngineConfig,
) -> (HashMap<String, Vec<u8>>, DenoiserMetrics) {
    let metrics = DenoiserMetrics::new(&prometheus::Registry::new()).unwrap();
    let mut h = harness_on(model, config, Some(metrics.clone()));
    let template: Vec<u8> = (0..64 * 64 * 3).map(|i| (i % 251) as u8).collect();
    let ids = ["e1", "e2", "e3", "gen"];
    for (i, id) in ids.iter().enumerate() {
        let prompt = if i == 2 {
            "a blue square"
        } else {
            "a red circle"
        };
        let mut j = job(id, prompt, 10 + i as u64, 3);
        let mut edit = None;
        if *id != "gen" {
            j.kind = JobKind::Edit;
            j.inputs.template_id = Some("content-hash-1".into());
            j.template = Some(diffmesh_shared::wire::messages::TemplateRef {
                template_id: "t1".into(),
                prompt: "a red circle".into(),
                seed: 99,
                steps: 3,
                guidance_scale: 1.0,
                cache_key: String::new(),
            });
            let mut mask = vec![0u8; 256];
            mask[i * 16..(i + 2) * 16].fill(1);
            edit = Some(EditInputs {
                template_rgb: template.clone(),
                token_mask: mask,
            });
        }
        submit(&h, j, edit).await;
    }
    let (images, log) = drain(&mut h, &ids).await;
    assert_eq!(images.len(), ids.len(), "{log:?}");
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
    (images, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admitted_jobs_reuse_prompt_template_latents_and_noise_without_changing_images() {
    let model = tempfile::tempdir().unwrap();
    write_random_model(model.path());
    let (cached, m) = template_edits(
        model.path(),
        EngineConfig {
            max_batch: 1,
            ..Default::default()
        },
    )
    .await;
    let lookups = |kind: &str, result: &str| {
        m.conditioning_lookups
            .with_label_values(&[kind, result])
            .get()
    };
    // "a red circle" three times (two edits and the generation), "a blue square" once.
    assert_eq!(
        (lookups("prompt", "hit"), lookups("prompt", "miss")),
        (2, 2)
    );
    for kind in ["template_latents", "template_noise"] {
        assert_eq!(
            (lookups(kind, "hit"), lookups(kind, "miss")),
            (2, 1),
            "{kind}"
        );
        assert!(m.conditioning_bytes.with_label_values(&[kind]).get() > 0);
    }
    let (fresh, m) = template_edits(
        model.path(),
        EngineConfig {
            max_batch: 1,
            conditioning_cache_bytes: 0,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        m.conditioning_lookups
            .with_label_values(&["prompt", "hit"])
            .get(),
        0
    );
    for (id, image) in &fresh {
        assert!(
            image == &cached[id],
            "{id}: cached preparation changed the image"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_frees_the_slot() {
    let mut h = harness(1, 8);
    submit(&h, job("long", "a red circle", 1, 50), None).await;
    submit(&h, job("next", "a blue square", 2, 2), None).await;
    // Wait until the long job is running, then cancel it.
    loop {
        match h.events.recv().await.unwrap() {
            EngineEvent::Step { job_id, step, .. } if job_id == "long" && step >= 1 => break,
            EngineEvent::Step { job_id, .. } => {
                assert_eq!(job_id, "long", "batch budget is one job")
            }
            _ => {}
        }
    }
    // The waiting job is listed for the heartbeat as it will run (all its steps, one row),
    // once a status snapshot taken after its submit is out.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let status = loop {
        let status = h.engine.status();
        if status.queued > 0 || std::time::Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let waiting: Vec<(&str, u32, u32)> = status
        .waiting
        .iter()
        .map(|w| (w.job_id.as_str(), w.remaining_steps, w.rows))
        .collect();
    assert_eq!(waiting, [("next", 2, 1)], "{status:?}");
    assert_eq!(status.queued, 1);
    h.engine.cancel("long".into(), Span::none()).await;
    let (images, log) = drain(&mut h, &["long", "next"]).await;
    assert!(log.contains(&"cancelled long".to_string()), "{log:?}");
    assert!(images.contains_key("next"), "{log:?}");
    let steps_of_long = log.iter().filter(|l| l.starts_with("step long")).count();
    assert!(steps_of_long < 10, "cancel took {steps_of_long} more steps");
    // The status snapshot is refreshed at the end of the engine iteration that retired `next`.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !h.engine.status().running.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "slot not freed: {:?}",
            h.engine.status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_edit_fails_alone_and_engine_lives_on() {
    let mut h = harness(4, 8);
    let mut bad = job("bad", "a red circle", 1, 3);
    bad.kind = JobKind::Edit;
    // Template of the wrong size: the error names the field.
    let edit = EditInputs {
        template_rgb: vec![0; 10],
        token_mask: vec![1; 256],
    };
    submit(&h, bad, Some(edit)).await;
    let mut bad_mask = job("bad-mask", "a red circle", 1, 3);
    bad_mask.kind = JobKind::Edit;
    let edit = EditInputs {
        template_rgb: vec![128; 64 * 64 * 3],
        token_mask: vec![1; 7],
    };
    submit(&h, bad_mask, Some(edit)).await;
    let mut good_edit = job("edit", "a green triangle", 3, 3);
    good_edit.kind = JobKind::Edit;
    let mut mask = vec![0u8; 256];
    mask[..16].fill(1); // repaint the top token row only
    let template: Vec<u8> = (0..64 * 64 * 3).map(|i| (i % 251) as u8).collect();
    submit(
        &h,
        good_edit,
        Some(EditInputs {
            template_rgb: template.clone(),
            token_mask: mask,
        }),
    )
    .await;
    submit(&h, job("ok", "a blue square", 2, 3), None).await;
    let (images, log) = drain(&mut h, &["bad", "bad-mask", "edit", "ok"]).await;
    let failed: Vec<&String> = log.iter().filter(|l| l.starts_with("failed")).collect();
    assert_eq!(failed.len(), 2, "{log:?}");
    assert!(
        failed
            .iter()
            .any(|l| l.contains("bad:") && l.contains("inputs.image_key")),
        "{failed:?}"
    );
    assert!(
        failed
            .iter()
            .any(|l| l.contains("bad-mask:") && l.contains("token_mask")),
        "{failed:?}"
    );
    assert!(images.contains_key("ok"));
    // Outside the repainted top 4 pixel rows, the edit reproduces the template exactly.
    let out = &images["edit"];
    assert_eq!(&out[4 * 64 * 3..], &template[4 * 64 * 3..]);
    assert_ne!(&out[..4 * 64 * 3], &template[..4 * 64 * 3]);
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_hands_back_queued_and_finishes_running() {
    let mut h = harness(1, 8);
    submit(&h, job("run", "a red circle", 1, 3), None).await;
    submit(&h, job("queued", "a blue square", 2, 3), None).await;
    loop {
        if let EngineEvent::Started { job_id } = h.events.recv().await.unwrap() {
            assert_eq!(job_id, "run");
            break;
        }
    }
    let handed = h.engine.begin_shutdown().await;
    assert_eq!(
        handed.iter().map(|j| j.job_id.as_str()).collect::<Vec<_>>(),
        vec!["queued"]
    );
    let (images, _) = drain(&mut h, &["run"]).await;
    assert!(images.contains_key("run"));
    let refused = h
        .engine
        .submit(EngineJob::new(job("late", "x", 1, 1), None), Span::none())
        .await;
    assert!(refused.is_err());
    h.drained.wait().await;
}

/// Rough timing, not a check: images/s of 8 jobs run one at a time vs all in one batch.
/// `cargo test -p diffmesh-denoiser --test engine -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn throughput_batch_1_vs_8() {
    let steps = 20;
    for max_batch in [1usize, 8] {
        let mut h = harness(max_batch, 16);
        let ids: Vec<String> = (0..8).map(|i| format!("t{i}")).collect();
        let started = std::time::Instant::now();
        for (i, id) in ids.iter().enumerate() {
            submit(&h, job(id, "a red circle", i as u64, steps), None).await;
        }
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        drain(&mut h, &refs).await;
        let secs = started.elapsed().as_secs_f64();
        println!(
            "max_batch {max_batch}: 8 jobs x {steps} steps in {secs:.2} s = {:.2} images/s, {:.1} ms per job-step",
            8.0 / secs,
            secs * 1000.0 / (8.0 * steps as f64)
        );
        h.engine.begin_shutdown().await;
        h.drained.wait().await;
    }
}

/// Wait until `id` has run at least one step (it is in the running batch).
async fn until_stepping(h: &mut Harness, id: &str, log: &mut Vec<String>) {
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), h.events.recv())
            .await
            .expect("engine stalled")
            .unwrap();
        match event {
            EngineEvent::Started { job_id } => log.push(format!("started {job_id}")),
            EngineEvent::Step { job_id, .. } if job_id == id => return,
            _ => {}
        }
    }
}

fn position(log: &[String], line: &str) -> usize {
    log.iter()
        .position(|l| l == line)
        .unwrap_or_else(|| panic!("no `{line}` in {log:?}"))
}

/// Static batching admits only into an empty engine (the whole batch then forms at once);
/// continuous batching admits at the next step boundary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_batching_waits_for_the_batch_continuous_does_not() {
    for batching in [Batching::Static, Batching::Continuous] {
        let mut h = harness_with(EngineConfig {
            max_batch: 4,
            max_queue: 8,
            batching,
            ..Default::default()
        });
        submit(&h, job("long", "a red circle", 1, 40), None).await;
        let mut log = Vec::new();
        until_stepping(&mut h, "long", &mut log).await;
        submit(&h, job("b", "a blue square", 2, 2), None).await;
        submit(&h, job("c", "a green triangle", 3, 2), None).await;
        let (images, rest) = drain(&mut h, &["long", "b", "c"]).await;
        log.extend(rest);
        assert_eq!(images.len(), 3, "{log:?}");
        let long_done = position(&log, "finished long");
        let (b, c) = (position(&log, "started b"), position(&log, "started c"));
        match batching {
            Batching::Static => {
                assert!(b > long_done && c > long_done, "{batching:?}: {log:?}");
                // b and c formed one batch: both started before either stepped.
                let first_step = log.iter().position(|l| l.starts_with("step b")).unwrap();
                assert!(b < first_step && c < first_step, "{log:?}");
            }
            Batching::Continuous => {
                assert!(b < long_done && c < long_done, "{batching:?}: {log:?}")
            }
        }
        h.engine.begin_shutdown().await;
        h.drained.wait().await;
    }
}

/// The token budget counts each job's masked tokens: a small edit joins a running generation,
/// a second generation waits for the first to finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_budget_limits_admission() {
    let mut h = harness_with(EngineConfig {
        max_batch: 4,
        max_queue: 8,
        token_budget: Some(300),
        ..Default::default()
    });
    submit(&h, job("gen", "a red circle", 1, 40), None).await;
    let mut log = Vec::new();
    until_stepping(&mut h, "gen", &mut log).await;
    let mut edit = job("edit", "a green triangle", 3, 3);
    edit.kind = JobKind::Edit;
    edit.inputs.masked_tokens = 16;
    let mut mask = vec![0u8; 256];
    mask[..16].fill(1);
    let inputs = EditInputs {
        template_rgb: vec![90; 64 * 64 * 3],
        token_mask: mask,
    };
    submit(&h, edit, Some(inputs)).await;
    submit(&h, job("gen2", "a blue square", 2, 3), None).await;
    let (images, rest) = drain(&mut h, &["gen", "edit", "gen2"]).await;
    log.extend(rest);
    assert_eq!(images.len(), 3, "{log:?}");
    let gen_done = position(&log, "finished gen");
    // 256 + 16 tokens fit in 300; 256 + 256 do not.
    assert!(position(&log, "started edit") < gen_done, "{log:?}");
    assert!(position(&log, "started gen2") > gen_done, "{log:?}");
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
}

/// The queue order picks which waiting job takes a freed slot: arrival (FCFS), least image
/// tokens x steps (SRTF), earliest deadline with best effort last (EDF).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_order_picks_the_next_job() {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let with_deadline = |mut j: DenoiseJob, in_ms: Option<u64>| {
        j.params.deadline_unix_ms = in_ms.map(|ms| now_ms + ms);
        j
    };
    for (order, want) in [
        (QueueOrder::Fcfs, ["p", "q", "r"]),
        (QueueOrder::Srtf, ["r", "p", "q"]),
        (QueueOrder::Edf, ["q", "r", "p"]),
    ] {
        let mut h = harness_with(EngineConfig {
            max_batch: 1,
            max_queue: 8,
            queue_order: order,
            ..Default::default()
        });
        submit(&h, job("long", "a red circle", 1, 10), None).await;
        let mut log = Vec::new();
        until_stepping(&mut h, "long", &mut log).await;
        // Queued while `long` holds the only slot, in this order.
        let p = with_deadline(job("p", "a blue square", 2, 6), None);
        let q = with_deadline(job("q", "a green triangle", 3, 12), Some(30_000));
        let r = with_deadline(job("r", "a red square", 4, 2), Some(60_000));
        for j in [p, q, r] {
            submit(&h, j, None).await;
        }
        let (images, rest) = drain(&mut h, &["long", "p", "q", "r"]).await;
        log.extend(rest);
        assert_eq!(images.len(), 4, "{log:?}");
        let mut started: Vec<(usize, &str)> = want
            .iter()
            .map(|id| (position(&log, &format!("started {id}")), *id))
            .collect();
        started.sort();
        let got: Vec<&str> = started.into_iter().map(|(_, id)| id).collect();
        assert_eq!(got, want, "{order:?}: {log:?}");
        h.engine.begin_shutdown().await;
        h.drained.wait().await;
    }
}

/// Inline work and the event tap run on the engine thread; a job inline work returns is queued,
/// a panic in it is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_work_queues_its_job_and_survives_a_panic() {
    use diffmesh_denoiser::engine::SubmitError;
    let mut h = harness(4, 8);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let tap_seen = seen.clone();
    h.engine
        .set_event_tap(Some(Box::new(move |event| {
            let on_engine = std::thread::current().name() == Some("denoiser-engine");
            if let EngineEvent::Finished { job, .. } = event {
                let line = format!("finished {} on engine: {on_engine}", job.job_id);
                tap_seen.lock().unwrap().push(line);
            }
        })))
        .await
        .unwrap();
    let queued = h
        .engine
        .run_inline(
            Box::new(|| {
                let on_engine = std::thread::current().name() == Some("denoiser-engine");
                let id = if on_engine { "inline" } else { "wrong-thread" };
                Some(EngineJob::new(job(id, "a red circle", 1, 2), None))
            }),
            Span::none(),
        )
        .await;
    assert_eq!(queued, Ok(Some(1)));
    let (images, log) = drain(&mut h, &["inline"]).await;
    assert!(images.contains_key("inline"), "{log:?}");
    // The tap ran on the engine thread before the event reached the receiver.
    assert_eq!(
        *seen.lock().unwrap(),
        vec!["finished inline on engine: true"]
    );
    h.engine.set_event_tap(None).await.unwrap();
    let nothing = h.engine.run_inline(Box::new(|| None), Span::none()).await;
    assert_eq!(nothing, Ok(None));
    let panicked = h
        .engine
        .run_inline(Box::new(|| panic!("boom")), Span::none())
        .await;
    assert!(matches!(panicked, Err(SubmitError::InlinePanic(m)) if m.contains("boom")));
    submit(&h, job("after", "a blue square", 2, 2), None).await;
    assert!(drain(&mut h, &["after"]).await.0.contains_key("after"));
    h.engine.begin_shutdown().await;
    h.drained.wait().await;
}
