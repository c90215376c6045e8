//! Capture broadcasts over the whole mesh with three denoisers: the one that captures a new
//! template announces it, the others of the same settings load the cache into their local tiers
//! before any edit reaches them (and show in the template's `cache.denoisers`), one started with
//! `warm_on_capture = false` loads nothing, and broadcasts for another model or too big for the
//! tier are skipped. Edits placed on a warmed denoiser then find the cache in its local tier.
//! A fourth denoiser started afterwards replays the announcements and warms itself the same way.
use std::collections::BTreeMap;
use std::time::Duration;

use diffmesh_shared::nats::publish_msgpack;
use diffmesh_shared::wire::messages::{decode, TemplateCaptured};
use diffmesh_shared::wire::subjects::{template_captured, TEMPLATES_CAPTURED_ALL};
use diffmesh_tests::harness::{
    metric_sample, post_form, scrape_metrics, start_denoiser, tiny_model_dir,
};
use diffmesh_tests::images::{png_bytes, rect_mask, template};
use diffmesh_tests::mesh::MeshBuilder;
use futures::StreamExt;
use reqwest::multipart::{Form, Part};
use serde_json::Value;

const DENOISERS: [&str; 3] = ["d1", "d2", "d3"];
/// Started with `warm_on_capture = false`.
const COLD: &str = "d3";
const EDITS: u32 = 4;
/// Started after the capture and the edits.
const LATE: &str = "d4";

fn warmups(metrics: &str, outcome: &str) -> f64 {
    metric_sample(
        metrics,
        &format!("diffmesh_denoiser_capture_warmups_total{{outcome=\"{outcome}\"}}"),
    )
}

fn lookups(metrics: &str, result: &str) -> f64 {
    metric_sample(
        metrics,
        &format!("diffmesh_denoiser_local_cache_lookups_total{{result=\"{result}\"}}"),
    )
}

/// The denoisers whose heartbeats list the template's cache (`url`: `GET /v1/templates/{id}`), and
/// the whole answer.
async fn cache_holders(http: &reqwest::Client, url: &str) -> (Vec<String>, Value) {
    let got: Value = http.get(url).send().await.unwrap().json().await.unwrap();
    let holders = got["cache"]["denoisers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|d| d.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    (holders, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_capture_warms_the_other_denoisers_local_tiers() {
    let mesh = MeshBuilder::new()
        .cachestore(|c| c.memory_bytes = 64 << 20)
        .denoisers(&DENOISERS)
        .denoiser(|id, c| c.warm_on_capture = id != COLD)
        .gateway(|g| g.job_timeout = Duration::from_secs_f64(180.0))
        .start()
        .await;
    let denoisers = &mesh.denoisers;
    tokio::time::sleep(Duration::from_millis(500)).await; // every heartbeat heard
    let client = async_nats::connect(&mesh.nats.url()).await.unwrap();
    let mut broadcasts = client.subscribe(TEMPLATES_CAPTURED_ALL).await.unwrap();
    client.flush().await.unwrap();

    let http = reqwest::Client::new();
    let api = |path: &str| mesh.url(path);
    let (w, h) = (96, 64);
    let form = Form::new()
        .part(
            "image",
            Part::bytes(png_bytes(&template(w, h))).file_name("template.png"),
        )
        .text("prompt", "a blue background")
        .text("num_inference_steps", "4");
    let (status, created) = post_form(&http, &api("/v1/templates"), form).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let cache_key = created["cache_key"].as_str().unwrap().to_string();

    // The capturing denoiser announced the stored cache.
    let msg = tokio::time::timeout(Duration::from_secs(10), broadcasts.next())
        .await
        .expect("no capture broadcast")
        .unwrap();
    let announced: TemplateCaptured = decode(&msg.payload).unwrap();
    let capturer = announced.worker_id.clone();
    assert_eq!(announced.cache_key, cache_key, "{announced:?}");
    assert_eq!(
        Some(announced.bytes),
        created["cache_bytes"].as_u64(),
        "{announced:?}"
    );
    assert!(announced.template_image_key.is_some(), "{announced:?}");
    let warm: Vec<&str> = DENOISERS
        .iter()
        .copied()
        .filter(|&d| d != COLD && d != capturer)
        .collect();
    assert!(!warm.is_empty());

    // Every warm denoiser reports the cache in its heartbeats without having run an edit.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let template_url = api(&format!("/v1/templates/{id}"));
    let holders = loop {
        let (holders, got) = cache_holders(&http, &template_url).await;
        if warm.iter().all(|d| holders.iter().any(|h| h == d)) {
            break holders;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "warm denoisers {warm:?} do not all hold the cache: {got}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if capturer != COLD {
        assert!(
            !holders.iter().any(|h| h == COLD),
            "{COLD} warmed: {holders:?}"
        );
    }

    // Broadcasts this denoiser's edits would never read, or that do not fit, are skipped.
    let other_model = TemplateCaptured {
        worker_id: "elsewhere".into(),
        cache_key: format!("{cache_key}-other"),
        model: format!("another-{}", announced.model),
        ..announced.clone()
    };
    let too_big = TemplateCaptured {
        worker_id: "elsewhere".into(),
        cache_key: format!("{cache_key}-huge"),
        bytes: u64::MAX / 4,
        ..announced.clone()
    };
    for b in [&other_model, &too_big] {
        publish_msgpack(&client, &template_captured(&b.cache_key), None, b)
            .await
            .unwrap();
    }
    client.flush().await.unwrap();

    let scrape_all = || async {
        let mut all = BTreeMap::new();
        for (id, d) in DENOISERS.iter().zip(denoisers) {
            all.insert(*id, scrape_metrics(d.addrs.health).await.unwrap());
        }
        all
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let all = scrape_all().await;
        // The capturer hears the hand-made broadcasts too: wait for every denoiser that listens.
        let settled = DENOISERS
            .iter()
            .filter(|&&d| d != COLD)
            .all(|d| warmups(&all[d], "other_settings") + warmups(&all[d], "no_room") == 2.0);
        if settled {
            break all;
        }
        assert!(tokio::time::Instant::now() < deadline, "{all:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for (d, m) in &metrics {
        let captures = metric_sample(m, "diffmesh_denoiser_capture_duration_seconds_count");
        assert_eq!(captures, f64::from(*d == capturer), "{d}\n{m}");
        let expect = |outcome: &str| -> f64 {
            let heard = *d != COLD;
            match outcome {
                "loaded" => f64::from(heard && *d != capturer),
                "own" => f64::from(heard && *d == capturer),
                "other_settings" | "no_room" => f64::from(heard),
                _ => 0.0,
            }
        };
        for outcome in [
            "loaded",
            "own",
            "held",
            "other_settings",
            "no_room",
            "missing",
            "failed",
        ] {
            assert_eq!(warmups(m, outcome), expect(outcome), "{d} {outcome}\n{m}");
        }
    }

    // Edits: a warmed denoiser finds the cache in its local tier (no miss).
    let mask = png_bytes(&rect_mask(w, h, 8, 8, 40, 32));
    for seed in 0..EDITS {
        let form = Form::new()
            .text("template_id", id.clone())
            .part("mask", Part::bytes(mask.clone()).file_name("mask.png"))
            .text("prompt", "a yellow square")
            .text("seed", seed.to_string());
        let (status, body) = post_form(&http, &api("/v1/images/edits"), form).await;
        assert_eq!(status, 200, "{body}");
    }
    let metrics = scrape_all().await;
    let mut looked_up = 0.0;
    for (d, m) in &metrics {
        looked_up += lookups(m, "hit") + lookups(m, "miss") + lookups(m, "unavailable");
        if warm.contains(d) || *d == capturer {
            assert_eq!(lookups(m, "miss"), 0.0, "{d} missed a held cache\n{m}");
        }
    }
    assert_eq!(looked_up, f64::from(EDITS), "{metrics:#?}");

    // A denoiser added now heard none of it: it replays the stored announcements at start.
    let model = tiny_model_dir().expect("weights/tiny");
    let late = start_denoiser(&mesh.nats, &model, LATE, |_| {}).expect("late denoiser");
    late.wait_ready(Duration::from_secs(30))
        .await
        .expect("ready");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m = scrape_metrics(late.addrs.health).await.unwrap();
        let heard: f64 = ["loaded", "other_settings", "no_room", "missing", "failed"]
            .iter()
            .map(|o| warmups(&m, o))
            .sum();
        if heard == 3.0 {
            break m;
        }
        assert!(tokio::time::Instant::now() < deadline, "{m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for (outcome, expected) in [("loaded", 1.0), ("other_settings", 1.0), ("no_room", 1.0)] {
        assert_eq!(warmups(&m, outcome), expected, "{LATE} {outcome}\n{m}");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (holders, got) = cache_holders(&http, &template_url).await;
        if holders.iter().any(|h| h == LATE) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{LATE} does not hold the cache: {got}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
