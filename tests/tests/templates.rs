//! Templates over the whole mesh (NATS, codec, router, a denoiser with the tiny model,
//! cachestore, gateway): register `docs/examples/template.png`, see its cache in the cachestore's
//! tiers, run 20 edits with different masks at once by `template_id` (each at the template's
//! size with its unmasked pixels exactly the template's, the cache read rather than recomputed,
//! no copy of the template's image made), and delete it (record, images and every cache entry
//! gone).
use std::path::Path;
use std::time::Duration;

use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::stores::job::{JobState, JobStore};
use diffmesh_shared::wire::cachestore::{
    locate_subject, template_keys, CacheLocate, CacheLocateReply, KeyLocation,
};
use diffmesh_shared::wire::subjects::{
    template_uses_of, BLOB_BUCKET, TEMPLATE_BUCKET, TEMPLATE_USES_STREAM,
};
use diffmesh_shared::wire::templates::{image_key, prepared_image_key};
use diffmesh_tests::harness::{
    capture_announced, metric_sample, post_form, scrape_metrics, start_denoiser, tiny_model_dir,
};
use diffmesh_tests::images::{decode_b64_images, png_bytes};
use diffmesh_tests::mesh::{MeshBuilder, TestMesh};
use futures::future::join_all;
use futures::{StreamExt, TryStreamExt};
use image::{DynamicImage, GenericImageView, GrayImage, Luma, RgbImage};
use reqwest::multipart::{Form, Part};
use serde_json::Value;

const STEPS: u32 = 4;
const EDITS: usize = 20;

struct Mesh {
    api: std::net::SocketAddr,
    cachestore_health: std::net::SocketAddr,
    /// The denoiser serving now.
    denoiser_health: std::net::SocketAddr,
    http: reqwest::Client,
    services: TestMesh,
}

fn denoiser_tweak(c: &mut diffmesh_denoiser::DenoiserConfig) {
    c.max_batch = 8;
    c.max_queue = 32;
}

/// One edit at a time and one waiting: further edits wait in the router, not yet reading
/// their inputs (so a template deleted under them would be missed).
fn serial_denoiser(c: &mut diffmesh_denoiser::DenoiserConfig) {
    c.max_batch = 1;
    c.max_queue = 1;
}

async fn start_mesh() -> Mesh {
    start_mesh_with(denoiser_tweak).await
}

async fn start_mesh_with(tweak: fn(&mut diffmesh_denoiser::DenoiserConfig)) -> Mesh {
    let mesh = MeshBuilder::new()
        .cachestore(|c| c.memory_bytes = 64 << 20)
        .router(|c| {
            // Twenty edits at once: let them wait for a slot instead of being turned away.
            c.max_queue = 64;
            c.admission_wait = Duration::from_secs(3);
        })
        .denoiser(move |_, c| tweak(c))
        .gateway(|c| {
            c.router_timeout = Duration::from_secs_f64(5.0);
            c.submit_wait = Duration::from_secs_f64(60.0);
            c.job_timeout = Duration::from_secs_f64(180.0);
        })
        .start()
        .await;
    Mesh {
        api: mesh.api(),
        cachestore_health: mesh.cachestore().addrs.health,
        denoiser_health: mesh.denoiser("d1").addrs.health,
        http: reqwest::Client::new(),
        services: mesh,
    }
}

impl Mesh {
    /// Drain the serving denoiser (its heartbeats say so: nothing new is placed there) and start
    /// a fresh one, with an empty local tier, in its place.
    async fn replace_denoiser(&mut self, worker_id: &str) {
        if let Some(old) = self.services.denoisers.pop() {
            tokio::task::spawn_blocking(move || drop(old))
                .await
                .expect("stop the old denoiser");
        }
        let model = tiny_model_dir().expect("weights/tiny");
        // Warm-up off: the new denoiser must not replay earlier capture announcements at start
        // (capture_warmup.rs tests that), so what it holds comes from its own edits.
        let new = start_denoiser(&self.services.nats, &model, worker_id, |c| {
            denoiser_tweak(c);
            c.warm_on_capture = false;
        })
        .expect("denoiser");
        new.wait_ready(Duration::from_secs(30))
            .await
            .expect("ready");
        self.denoiser_health = new.addrs.health;
        self.services.denoisers.push(new);
        // Let the router hear the new denoiser's heartbeat before anything is placed.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    /// Register `png` as a template (captured with `STEPS` steps): its id and cache key.
    async fn register(&self, png: &[u8], (w, h): (u32, u32)) -> (String, String) {
        let form = Form::new()
            .part("image", Part::bytes(png.to_vec()).file_name("template.png"))
            .text("prompt", "a blue background")
            .text("seed", "7")
            .text("num_inference_steps", STEPS.to_string())
            .text("guidance_scale", "1.0");
        let (status, created) = self.post_form("/v1/templates", form).await;
        assert_eq!(status, 201, "{created}");
        assert_eq!(created["status"], "ready", "{created}");
        let id = created["id"].as_str().unwrap().to_string();
        let cache_key = created["cache_key"].as_str().unwrap().to_string();
        assert!(cache_key.starts_with("tpl-"), "{created}");
        assert!(created["cache_bytes"].as_u64().unwrap() > 0, "{created}");
        assert!(created["blocks"].as_u64().unwrap() > 0, "{created}");
        assert_eq!(
            (created["width"].as_u64(), created["height"].as_u64()),
            (Some(w.into()), Some(h.into()))
        );
        (id, cache_key)
    }

    /// The router keeps a capture's report on its job record (what lets another gateway finish
    /// a registration whose gateway stopped); it writes it in the background, so wait a little.
    async fn assert_capture_report_kept(&self, job_id: &str, cache_key: &str) {
        let client = async_nats::connect(self.services.nats.url()).await.unwrap();
        let jobs = JobStore::open(&async_nats::jetstream::new(client))
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let record = jobs.get(job_id).await.unwrap().expect("capture job record");
            if let Some(report) = record.captured {
                assert_eq!(
                    (report.cache_key.as_str(), report.steps),
                    (cache_key, STEPS)
                );
                assert!(report.bytes > 0 && report.blocks > 0, "{report:?}");
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the capture job's record has no report: {record:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Names of the objects in a bucket (listing an empty bucket never ends: each next name is
    /// waited for at most 5 s).
    async fn object_names(&self, bucket: &str) -> Vec<String> {
        let client = async_nats::connect(self.services.nats.url()).await.unwrap();
        let store = async_nats::jetstream::new(client)
            .get_object_store(bucket)
            .await
            .unwrap();
        let mut list = store.list().await.unwrap();
        let mut names = Vec::new();
        while let Ok(Some(info)) = tokio::time::timeout(Duration::from_secs(5), list.next()).await {
            names.push(info.unwrap().name);
        }
        names
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.api)
    }

    async fn get_json(&self, path: &str) -> (u16, Value) {
        let r = self.http.get(self.url(path)).send().await.expect("GET");
        let status = r.status().as_u16();
        (status, r.json().await.expect("JSON body"))
    }

    /// `DELETE /v1/templates/{id}`: status and JSON body.
    async fn delete_template(&self, id: &str) -> (u16, Value) {
        let r = self
            .http
            .delete(self.url(&format!("/v1/templates/{id}")))
            .send()
            .await
            .expect("DELETE");
        let status = r.status().as_u16();
        (status, r.json().await.expect("JSON body"))
    }

    async fn edit(&self, form: Form) -> (u16, Value) {
        self.post_form("/v1/images/edits", form).await
    }

    async fn post_form(&self, path: &str, form: Form) -> (u16, Value) {
        post_form(&self.http, &self.url(path), form).await
    }

    /// The first result PNG of async job `job_id`, once it is done (it must not fail).
    async fn result_when_done(&self, job_id: &str) -> Vec<u8> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let (status, job) = self.get_json(&format!("/v1/jobs/{job_id}")).await;
            assert_eq!(status, 200, "{job}");
            match job["status"].as_str().unwrap() {
                "done" => {
                    let url = job["results"][0]["url"].as_str().unwrap();
                    let r = self.http.get(self.url(url)).send().await.unwrap();
                    assert_eq!(r.status().as_u16(), 200);
                    return r.bytes().await.unwrap().to_vec();
                }
                "queued" | "running" => {}
                other => panic!("job {job_id} ended {other}: {job}"),
            }
            assert!(tokio::time::Instant::now() < deadline, "{job}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A deleted template left no object in the template bucket and no cache entry in any
    /// cachestore tier.
    async fn assert_objects_gone(&self, id: &str, cache_key: &str) {
        let left: Vec<_> = self
            .object_names(TEMPLATE_BUCKET)
            .await
            .into_iter()
            .filter(|n| n.starts_with(&format!("{id}/")))
            .collect();
        assert!(left.is_empty(), "the deleted template left {left:?}");
        for loc in self.locate(cache_key).await {
            assert!(
                loc.tiers.is_empty(),
                "{} is still in {:?}",
                loc.key,
                loc.tiers
            );
        }
        assert!(
            !self.capture_announced(cache_key).await,
            "the deleted cache's capture announcement is still kept for replay"
        );
    }

    /// Whether the captures stream keeps an announcement of `cache_key` (for denoisers that
    /// start later to replay).
    async fn capture_announced(&self, cache_key: &str) -> bool {
        let client = async_nats::connect(self.services.nats.url())
            .await
            .expect("NATS");
        capture_announced(&client, cache_key).await
    }

    /// Where the cachestore holds each entry of a cache.
    async fn locate(&self, cache_key: &str) -> Vec<KeyLocation> {
        let client = async_nats::connect(self.services.nats.url())
            .await
            .expect("NATS");
        let req = CacheLocate {
            keys: template_keys(cache_key, STEPS),
        };
        let reply: CacheLocateReply =
            request_msgpack(&client, &locate_subject(), &req, Duration::from_secs(5))
                .await
                .expect("locate");
        match reply {
            CacheLocateReply::Located { keys } => keys,
            CacheLocateReply::Failed { message } => panic!("locate failed: {message}"),
        }
    }
}

fn example(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/examples")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Mask `i` of the twenty: rectangles, discs and stripes of different sizes and places, so
/// masked ratios range from a few percent to about half the image (white = repaint).
fn mask(i: usize, w: u32, h: u32) -> GrayImage {
    let k = i as i64;
    GrayImage::from_fn(w, h, |x, y| {
        let (x, y) = (i64::from(x), i64::from(y));
        let (w, h) = (i64::from(w), i64::from(h));
        let inside = match i % 4 {
            // Rectangles growing with i, moving across the image.
            0 => {
                let (x0, y0) = ((k * 11) % (w / 2), (k * 7) % (h / 2));
                let (rw, rh) = (w / 8 + k * 6, h / 10 + k * 4);
                (x0..x0 + rw).contains(&x) && (y0..y0 + rh).contains(&y)
            }
            // Discs of radius 10 to 60 pixels.
            1 => {
                let (cx, cy, r) = (w / 4 + k * 7, h / 3 + k * 5, 10 + k * 3);
                (x - cx).pow(2) + (y - cy).pow(2) <= r * r
            }
            // Narrow vertical stripes, further apart as i grows.
            2 => x % (64 + 8 * k) < 8,
            // A thin horizontal band.
            _ => (y - (h / 2 + k)).abs() < 2 + k / 2,
        };
        Luma([if inside { 255 } else { 0 }])
    })
}

fn edit_form(template_id: &str, mask: &GrayImage, seed: usize) -> Form {
    Form::new()
        .text("template_id", template_id.to_string())
        .part(
            "mask",
            Part::bytes(png_bytes(&DynamicImage::ImageLuma8(mask.clone()))).file_name("mask.png"),
        )
        .text(
            "prompt",
            "a yellow square on the right on a blue background",
        )
        .text("seed", seed.to_string())
}

/// Every edit answered 200 with one image at the template's size whose unmasked pixels are
/// exactly the template's, and each mask repaints something.
fn assert_unmasked_exact(results: &[(u16, Value)], masks: &[GrayImage], template: &RgbImage) {
    for (i, ((status, body), m)) in results.iter().zip(masks).enumerate() {
        assert_eq!(*status, 200, "edit {i}: {body}");
        let images = decode_b64_images(body).unwrap();
        let out = &images[0];
        assert_eq!(out.dimensions(), template.dimensions(), "edit {i}");
        let out = out.to_rgb8();
        let mut masked = 0;
        for (x, y, p) in out.enumerate_pixels() {
            if m.get_pixel(x, y).0[0] >= 128 {
                masked += 1;
            } else {
                assert_eq!(
                    p,
                    template.get_pixel(x, y),
                    "edit {i}: unmasked ({x},{y}) differs"
                );
            }
        }
        assert!(masked > 0, "mask {i} repaints nothing");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn register_edit_concurrently_and_delete_a_template() {
    let mesh = start_mesh().await;
    let template_png = example("template.png");
    let template = image::load_from_memory(&template_png).expect("template.png");
    let (w, h) = template.dimensions();
    let template_rgb = template.to_rgb8();

    // A registration that is not an image leaves nothing behind.
    let not_an_image = Form::new().part("image", Part::bytes(b"GIF89a...".to_vec()));
    let (status, body) = mesh.post_form("/v1/templates", not_an_image).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["field"], "image");

    let (id, cache_key) = mesh.register(&template_png, (w, h)).await;
    // The template keeps its image and the model-resolution pixels its capture prepared.
    let kept = mesh.object_names(TEMPLATE_BUCKET).await;
    for key in [image_key(&id), prepared_image_key(&id)] {
        assert!(kept.contains(&key), "{key} not in {kept:?}");
    }

    // GET: ready, every entry (meta + one per step) in the cachestore, at least in the cluster
    // tier (writes go through to it).
    let (status, got) = mesh.get_json(&format!("/v1/templates/{id}")).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["status"], "ready");
    let cache = &got["cache"];
    assert_eq!(cache["expected_entries"], STEPS + 1, "{got}");
    assert_eq!(cache["stored_entries"], STEPS + 1, "{got}");
    assert_eq!(cache["by_tier"]["cluster"], STEPS + 1, "{got}");
    assert_eq!(cache["error"], Value::Null, "{got}");
    let (_, list) = mesh.get_json("/v1/templates").await;
    assert!(
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["id"] == id.as_str()),
        "{list}"
    );
    mesh.assert_capture_report_kept(got["capture_job_id"].as_str().unwrap(), &cache_key)
        .await;

    // Bad edits by template name the field.
    let masks: Vec<GrayImage> = (0..EDITS).map(|i| mask(i, w, h)).collect();
    let both = edit_form(&id, &masks[0], 1).part(
        "image",
        Part::bytes(template_png.clone()).file_name("t.png"),
    );
    let (status, body) = mesh.edit(both).await;
    assert_eq!(
        (status, &body["error"]["field"]),
        (400, &Value::from("template_id")),
        "{body}"
    );
    let (status, body) = mesh
        .edit(edit_form(&id, &masks[0], 1).text("num_inference_steps", "8"))
        .await;
    assert_eq!(
        (status, &body["error"]["field"]),
        (400, &Value::from("num_inference_steps")),
        "{body}"
    );
    let unknown = uuid_like();
    let (status, body) = mesh.edit(edit_form(&unknown, &masks[0], 1)).await;
    assert_eq!(
        (status, &body["error"]["field"]),
        (404, &Value::from("template_id")),
        "{body}"
    );

    let cachestore_before = scrape_metrics(mesh.cachestore_health).await.unwrap();

    // Twenty edits at once, each with its own mask.
    let edits = masks
        .iter()
        .enumerate()
        .map(|(i, m)| mesh.edit(edit_form(&id, m, 100 + i)));
    let results = join_all(edits).await;
    assert_unmasked_exact(&results, &masks, &template_rgb);
    // They named the template's image: no job copied it (or its pixels) into the job blobs.
    let blobs = mesh.object_names(BLOB_BUCKET).await;
    assert!(
        blobs.iter().any(|n| n.ends_with("/token-mask.u8")),
        "the listing found the edits' blobs: {blobs:?}"
    );
    let copies: Vec<_> = blobs
        .iter()
        .filter(|n| n.ends_with("/image") || n.ends_with("/prepared-image.rgb"))
        .collect();
    assert!(copies.is_empty(), "copies of the template: {copies:?}");

    // The cache was read, not recomputed: the denoiser stepped rows mask-aware, and the cache
    // came from its local tier or the cachestore (which the router asked to prefetch it).
    let denoiser = scrape_metrics(mesh.denoiser_health).await.unwrap();
    let cachestore = scrape_metrics(mesh.cachestore_health).await.unwrap();
    let mask_aware = metric_sample(
        &denoiser,
        "diffmesh_denoiser_step_rows_total{mode=\"mask_aware\"}",
    );
    assert!(
        mask_aware >= (EDITS as f64) * f64::from(STEPS),
        "{denoiser}"
    );
    // The template's pixels were read from the store once (by the capture) and then held.
    let pixels = |result: &str| {
        metric_sample(
            &denoiser,
            &format!("diffmesh_denoiser_template_pixels_lookups_total{{result=\"{result}\"}}"),
        )
    };
    assert_eq!(pixels("miss"), 1.0, "{denoiser}");
    assert!(pixels("hit") >= EDITS as f64, "{denoiser}");
    let local_hits = metric_sample(
        &denoiser,
        "diffmesh_denoiser_local_cache_lookups_total{result=\"hit\"}",
    );
    let store_hits: f64 = ["memory", "disk", "cluster"]
        .iter()
        .map(|t| {
            let series = format!("diffmesh_cachestore_hits_total{{tier=\"{t}\"}}");
            metric_sample(&cachestore, &series) - metric_sample(&cachestore_before, &series)
        })
        .sum();
    assert!(
        local_hits + store_hits > 0.0,
        "no cache hit\n{denoiser}\n{cachestore}"
    );
    let prefetched: f64 = ["already_in_memory", "from_disk", "from_cluster", "missing"]
        .iter()
        .map(|o| {
            metric_sample(
                &cachestore,
                &format!("diffmesh_cachestore_prefetches_total{{outcome=\"{o}\"}}"),
            )
        })
        .sum();
    assert!(
        prefetched >= f64::from(STEPS + 1),
        "the router sent no prefetch\n{cachestore}"
    );
    eprintln!(
        "templates: {EDITS} edits: mask-aware rows {mask_aware}, local-tier hits {local_hits}, \
         cachestore hits {store_hits}, prefetched keys {prefetched}"
    );

    // After edits the denoiser holds the cache in its local tier, and says so in heartbeats.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, got) = mesh.get_json(&format!("/v1/templates/{id}")).await;
        if got["cache"]["denoisers"]
            .as_array()
            .is_some_and(|d| d.iter().any(|w| w == "d1"))
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no denoiser reports the cache: {got}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Delete: the record, the image, every cache entry and the capture's announcement go.
    assert!(
        mesh.capture_announced(&cache_key).await,
        "the capture was not announced"
    );
    let (status, deleted) = mesh.delete_template(&id).await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["cache_entries_deleted"], STEPS + 1, "{deleted}");
    let (status, body) = mesh.get_json(&format!("/v1/templates/{id}")).await;
    assert_eq!(
        (status, &body["error"]["field"]),
        (404, &Value::from("template_id")),
        "{body}"
    );
    mesh.assert_objects_gone(&id, &cache_key).await;
    // The denoiser heard the EvictTemplate and dropped its local copy.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let denoiser = scrape_metrics(mesh.denoiser_health).await.unwrap();
        if metric_sample(&denoiser, "diffmesh_denoiser_local_cache_bytes") == 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the denoiser kept the deleted template's cache\n{denoiser}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, _) = mesh.edit(edit_form(&id, &masks[0], 1)).await;
    assert_eq!(status, 404);
    assert_eq!(mesh.delete_template(&id).await.0, 404);
}

/// A template captured on one denoiser serves edits on another that never saw it: the second
/// denoiser reads the cache from the cachestore (the copy every denoiser shares) instead of
/// recomputing it, and its edits keep the template's unmasked pixels exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_denoiser_edits_from_the_shared_cache() {
    const EDITS_ON_D2: usize = 4;
    let mut mesh = start_mesh().await;
    let template_png = example("template.png");
    let template = image::load_from_memory(&template_png).expect("template.png");
    let (w, h) = template.dimensions();
    let (id, _) = mesh.register(&template_png, (w, h)).await;

    // d1 (which captured the template and holds it locally) drains; d2 starts empty.
    mesh.replace_denoiser("d2").await;
    let cachestore_before = scrape_metrics(mesh.cachestore_health).await.unwrap();

    let masks: Vec<GrayImage> = (0..EDITS_ON_D2).map(|i| mask(i, w, h)).collect();
    let edits = masks
        .iter()
        .enumerate()
        .map(|(i, m)| mesh.edit(edit_form(&id, m, 300 + i)));
    let results = join_all(edits).await;
    assert_unmasked_exact(&results, &masks, &template.to_rgb8());

    // Everything ran on d2, mask-aware: no full-compute fallback and no second capture.
    let d2 = scrape_metrics(mesh.denoiser_health).await.unwrap();
    let series = |mode: &str| format!("diffmesh_denoiser_step_rows_total{{mode=\"{mode}\"}}");
    let mask_aware = metric_sample(&d2, &series("mask_aware"));
    assert!(
        mask_aware >= (EDITS_ON_D2 as f64) * f64::from(STEPS),
        "d2 stepped too few rows mask-aware\n{d2}"
    );
    assert_eq!(
        metric_sample(&d2, &series("full")),
        0.0,
        "d2 fell back to full compute\n{d2}"
    );
    assert_eq!(
        metric_sample(&d2, "diffmesh_denoiser_capture_duration_seconds_count"),
        0.0,
        "d2 captured the template again\n{d2}"
    );
    // d2's local tier started empty, so the cache came out of the cachestore.
    let cachestore = scrape_metrics(mesh.cachestore_health).await.unwrap();
    let store_hits: f64 = ["memory", "disk", "cluster"]
        .iter()
        .map(|t| {
            let series = format!("diffmesh_cachestore_hits_total{{tier=\"{t}\"}}");
            metric_sample(&cachestore, &series) - metric_sample(&cachestore_before, &series)
        })
        .sum();
    assert!(
        store_hits >= f64::from(STEPS + 1),
        "d2 did not read the cache from the cachestore ({store_hits} hits)\n{cachestore}"
    );
    // Every step entry is above the inline limit and came in ranges, none by the object store.
    let served = |path: &str| {
        let series = format!("diffmesh_cachestore_served_total{{path=\"{path}\"}}");
        metric_sample(&cachestore, &series) - metric_sample(&cachestore_before, &series)
    };
    assert_eq!(
        (served("ranged"), served("object_store")),
        (f64::from(STEPS), 0.0),
        "{cachestore}"
    );
    assert!(
        metric_sample(
            &d2,
            "diffmesh_denoiser_local_cache_lookups_total{result=\"miss\"}"
        ) > 0.0,
        "d2's empty local tier reported no miss\n{d2}"
    );
}

/// Deleting a template while edits of it run loses none of them: the delete answers 202
/// (`deleting`, with the edits in flight), new edits get 409, every accepted edit ends `done`
/// with its unmasked pixels exactly the template's, and then everything of the template goes.
/// (Before, the delete removed the image and cache at once and running edits failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_a_template_lets_its_accepted_edits_finish() {
    const QUEUED: usize = 6;
    let mesh = start_mesh_with(serial_denoiser).await;
    let template_png = example("template.png");
    let template = image::load_from_memory(&template_png).expect("template.png");
    let (w, h) = template.dimensions();
    let (id, cache_key) = mesh.register(&template_png, (w, h)).await;

    // Accepted at once (Prefer: respond-async); one denoiser running one edit at a time.
    let masks: Vec<GrayImage> = (0..QUEUED).map(|i| mask(i, w, h)).collect();
    let (mesh_ref, id_ref) = (&mesh, &id);
    let accepted = join_all(masks.iter().enumerate().map(|(i, m)| async move {
        let (mesh, id) = (mesh_ref, id_ref);
        let r = mesh
            .http
            .post(mesh.url("/v1/images/edits"))
            .header("Prefer", "respond-async")
            .multipart(edit_form(id, m, 500 + i))
            .send()
            .await
            .expect("POST edit");
        let status = r.status().as_u16();
        let body: Value = r.json().await.expect("JSON");
        assert_eq!(status, 202, "{body}");
        body["id"].as_str().unwrap().to_string()
    }))
    .await;

    let (status, pending) = mesh.delete_template(&id).await;
    assert_eq!(status, 202, "{pending}");
    assert_eq!(pending["status"], "deleting", "{pending}");
    assert_eq!(pending["deleted"], false, "{pending}");
    let in_flight = pending["edits_in_flight"].as_u64().unwrap();
    assert!((1..=QUEUED as u64).contains(&in_flight), "{pending}");

    // No new edit starts on it; GET shows it going.
    let (status, body) = mesh.edit(edit_form(&id, &masks[0], 1)).await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("being deleted"),
        "{body}"
    );
    let (status, got) = mesh.get_json(&format!("/v1/templates/{id}")).await;
    // (It may be gone already if the last edit ended meanwhile.)
    assert!(
        (status == 200 && got["status"] == "deleting") || status == 404,
        "{status} {got}"
    );

    // Every accepted edit ends done, with the template's unmasked pixels.
    let template_rgb = template.to_rgb8();
    for (job_id, m) in accepted.iter().zip(&masks) {
        let png = mesh.result_when_done(job_id).await;
        let out = image::load_from_memory(&png).unwrap().to_rgb8();
        assert_eq!(out.dimensions(), (w, h));
        for (x, y, p) in out.enumerate_pixels() {
            if m.get_pixel(x, y).0[0] < 128 {
                assert_eq!(p, template_rgb.get_pixel(x, y), "{job_id}: ({x},{y})");
            }
        }
    }

    // Then the template goes: record, objects, cache entries.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, got) = mesh.get_json(&format!("/v1/templates/{id}")).await;
        if status == 404 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still there after its edits ended: {got}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    mesh.assert_objects_gone(&id, &cache_key).await;
}

/// A synchronous edit whose client goes away ends its template use along with its job (the
/// uses stream keeps nothing of it), instead of leaving it until a delete counts it or a day
/// passes. The edit waits behind a long generation on a serial denoiser, so the client leaves
/// while it is still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abandoned_edit_ends_its_template_use() {
    let mesh = start_mesh_with(serial_denoiser).await;
    let template_png = example("template.png");
    let template = image::load_from_memory(&template_png).expect("template.png");
    let (w, h) = template.dimensions();
    let (id, _) = mesh.register(&template_png, (w, h)).await;
    let r = mesh
        .http
        .post(mesh.url("/v1/images/generations"))
        .header("Prefer", "respond-async")
        .json(&serde_json::json!({"prompt": "a red circle", "num_inference_steps": 100, "n": 4}))
        .send()
        .await
        .expect("POST generation");
    assert_eq!(r.status().as_u16(), 202);

    let (http, url, form) = (
        mesh.http.clone(),
        mesh.url("/v1/images/edits"),
        edit_form(&id, &mask(0, w, h), 1),
    );
    let request = tokio::spawn(async move { http.post(url).multipart(form).send().await });
    let client = async_nats::connect(mesh.services.nats.url()).await.unwrap();
    let uses = async_nats::jetstream::new(client.clone())
        .get_stream(TEMPLATE_USES_STREAM)
        .await
        .unwrap();
    let uses_of = |id: String| {
        let uses = uses.clone();
        async move {
            let info = uses
                .info_with_subjects(template_uses_of(&id))
                .await
                .unwrap();
            let subjects: Vec<(String, usize)> = info.try_collect().await.unwrap();
            subjects
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let edit_job = loop {
        if let Some((subject, _)) = uses_of(id.clone()).await.pop() {
            break subject.rsplit('.').next().unwrap().to_string();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the edit noted no use"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    request.abort();

    let jobs = JobStore::open(&async_nats::jetstream::new(client))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = uses_of(id.clone()).await;
        let state = jobs.get(&edit_job).await.unwrap().map(|r| r.state);
        if left.is_empty() {
            // Ended by the abandon, not by finishing first.
            assert_eq!(state, Some(JobState::Cancelled), "{edit_job}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the abandoned edit's use is still there: {left:?}, job {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A well-formed template id that names nothing.
fn uuid_like() -> String {
    "00000000-0000-4000-8000-000000000000".to_string()
}
