//! The captures' quality guard over the whole mesh: a denoiser started with
//! `--cache-quality-floor` measures each capture's typical edit from the cache against full
//! compute. Below the floor the template is still ready, its record shows the figure and the
//! fallback, its cache holds no steps (nothing to load, in any tier), and its edits compute in
//! full without asking for a re-capture; above it the cache is kept, with its figure.
use std::time::Duration;

use diffmesh_tests::harness::{metric_sample, post_form, scrape_metrics};
use diffmesh_tests::images::{png_bytes, rect_mask, template};
use diffmesh_tests::mesh::MeshBuilder;
use reqwest::multipart::{Form, Part};
use serde_json::Value;

const STEPS: &str = "4";

/// Register a template on `api`: the created record.
async fn register(http: &reqwest::Client, api: &str, (w, h): (u32, u32)) -> Value {
    let form = Form::new()
        .part(
            "image",
            Part::bytes(png_bytes(&template(w, h))).file_name("template.png"),
        )
        .text("prompt", "a blue background")
        .text("seed", "7")
        .text("num_inference_steps", STEPS);
    let (status, created) = post_form(http, &format!("{api}/v1/templates"), form).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["status"], "ready", "{created}");
    created
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_template_below_the_quality_floor_is_edited_in_full_compute() {
    for floor in [1.0, 0.0] {
        let mesh = MeshBuilder::new()
            .cachestore(|c| c.memory_bytes = 64 << 20)
            .denoiser(move |_, c| c.cache_quality_floor = Some(floor))
            .gateway(|g| g.job_timeout = Duration::from_secs_f64(180.0))
            .start()
            .await;
        let http = reqwest::Client::new();
        let api = mesh.url("");
        let api = api.trim_end_matches('/');
        let (w, h) = (96, 64);
        let created = register(&http, api, (w, h)).await;
        let quality = &created["cache_quality"];
        let ssim = quality["box_ssim"]
            .as_f64()
            .unwrap_or_else(|| panic!("no box_ssim: {created}"));
        println!("floor {floor}: {quality}");
        assert!((0.0..1.0).contains(&ssim), "{created}");
        assert_eq!(quality["floor"].as_f64(), Some(floor), "{created}");
        let fallback = floor == 1.0;
        assert_eq!(
            quality["full_compute"].as_bool(),
            Some(fallback),
            "{created}"
        );
        assert_eq!(
            created["cache_bytes"].as_u64() == Some(0),
            fallback,
            "{created}"
        );

        let id = created["id"].as_str().unwrap();
        let form = Form::new()
            .text("template_id", id.to_string())
            .part(
                "mask",
                Part::bytes(png_bytes(&rect_mask(w, h, 8, 8, 40, 32))).file_name("mask.png"),
            )
            .text("prompt", "a yellow square");
        let (status, body) = post_form(&http, &format!("{api}/v1/images/edits"), form).await;
        assert_eq!(status, 200, "{body}");
        let metrics = scrape_metrics(mesh.denoisers[0].addrs.health)
            .await
            .unwrap();
        let sample = |name: &str| metric_sample(&metrics, name);
        // Kept: the edit read the cache from the local tier. Fallen back: the edit named no
        // cache (the router priced it in full), computed in full, and asked for no re-capture.
        let lookups = |result: &str| {
            sample(&format!(
                "diffmesh_denoiser_local_cache_lookups_total{{result=\"{result}\"}}"
            ))
        };
        let (hits, unavailable) = (lookups("hit"), lookups("unavailable"));
        assert_eq!(
            (hits, unavailable),
            (f64::from(!fallback), f64::from(fallback)),
            "{metrics}"
        );
        let url = format!("{api}/v1/templates/{id}");
        let got: Value = http.get(url).send().await.unwrap().json().await.unwrap();
        assert_eq!(got["cache_quality"], *quality, "{got}");
        // Every entry its cache holds is stored: the fallback's is its metadata alone.
        let cache = &got["cache"];
        assert_eq!(cache["stored_entries"], cache["expected_entries"], "{got}");
        let mask_aware = sample("diffmesh_denoiser_step_rows_total{mode=\"mask_aware\"}");
        assert_eq!(
            mask_aware == 0.0,
            fallback,
            "floor {floor}: {mask_aware}\n{metrics}"
        );
        let recaptures: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("diffmesh_denoiser_template_recaptures_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(recaptures, 0.0, "{metrics}");
    }
}
