//! Two templates of the same pixels and capture settings share one activation cache (its key
//! hashes the content, not the template id). Deleting one must leave the cache to the other:
//! its entries stay in the cachestore, its capture announcement stays for denoisers that start
//! later, and the other's edits still run mask-aware from it. Deleting the last one removes
//! everything. And a cache gone from every tier (the cachestore's cluster tier drops the
//! least recently used) is captured again by the denoiser whose edit found it gone.
use std::time::Duration;

use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::wire::cachestore::{
    delete_subject, locate_subject, template_keys, CacheDelete, CacheDeleteReply, CacheLocate,
    CacheLocateReply,
};
use diffmesh_tests::harness::{
    capture_announced, metric_sample, post_form, scrape_metrics, start_denoiser, tiny_model_dir,
};
use diffmesh_tests::images::{png_bytes, rect_mask, template};
use diffmesh_tests::mesh::{MeshBuilder, TestMesh};
use reqwest::multipart::{Form, Part};
use serde_json::Value;

const STEPS: u32 = 4;

/// Register the example template: its id and cache key.
async fn register(mesh: &TestMesh, png: &[u8]) -> (String, String) {
    let form = Form::new()
        .part("image", Part::bytes(png.to_vec()).file_name("template.png"))
        .text("prompt", "a blue background")
        .text("seed", "7")
        .text("num_inference_steps", STEPS.to_string());
    let (status, created) =
        post_form(&reqwest::Client::new(), &mesh.url("/v1/templates"), form).await;
    assert_eq!(
        (status, &created["status"]),
        (201, &Value::from("ready")),
        "{created}"
    );
    let field = |f: &str| created[f].as_str().unwrap().to_string();
    (field("id"), field("cache_key"))
}

async fn delete(mesh: &TestMesh, id: &str) -> Value {
    let r = reqwest::Client::new()
        .delete(mesh.url(&format!("/v1/templates/{id}")))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(r.status().as_u16(), 200);
    r.json().await.expect("JSON body")
}

/// How many of the cache's entries the cachestore holds in some tier.
async fn entries_held(client: &async_nats::Client, cache_key: &str) -> usize {
    let req = CacheLocate {
        keys: template_keys(cache_key, STEPS),
    };
    let reply: CacheLocateReply =
        request_msgpack(client, &locate_subject(), &req, Duration::from_secs(5))
            .await
            .expect("locate");
    match reply {
        CacheLocateReply::Located { keys } => keys.iter().filter(|k| !k.tiers.is_empty()).count(),
        CacheLocateReply::Failed { message } => panic!("locate failed: {message}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cache_two_templates_share_outlives_the_delete_of_one() {
    let mesh = MeshBuilder::new()
        .cachestore(|c| c.memory_bytes = 64 << 20)
        .gateway(|g| g.job_timeout = Duration::from_secs_f64(180.0))
        .start()
        .await;
    let client = async_nats::connect(mesh.nats.url()).await.expect("NATS");
    let (w, h) = (96, 64);
    let png = png_bytes(&template(w, h));
    let (first, key) = register(&mesh, &png).await;
    let (second, second_key) = register(&mesh, &png).await;
    assert_ne!(first, second);
    assert_eq!(key, second_key, "same pixels and settings, same cache");
    let all = STEPS as usize + 1;
    assert_eq!(entries_held(&client, &key).await, all);

    let deleted = delete(&mesh, &first).await;
    assert_eq!(deleted["cache_entries_deleted"], 0, "{deleted}");
    assert_eq!(
        entries_held(&client, &key).await,
        all,
        "the shared cache went"
    );
    assert!(
        capture_announced(&client, &key).await,
        "the shared cache's announcement went"
    );

    // The second template's edit still reads the cache.
    let health = mesh.denoiser("d1").addrs.health;
    let rows = |m: &str, mode: &str| {
        metric_sample(
            m,
            &format!("diffmesh_denoiser_step_rows_total{{mode=\"{mode}\"}}"),
        )
    };
    let before = scrape_metrics(health).await.unwrap();
    let form = Form::new()
        .text("template_id", second.clone())
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(w, h, 8, 8, 40, 32))).file_name("mask.png"),
        )
        .text("prompt", "a yellow square");
    let (status, body) =
        post_form(&reqwest::Client::new(), &mesh.url("/v1/images/edits"), form).await;
    assert_eq!(status, 200, "{body}");
    let after = scrape_metrics(health).await.unwrap();
    assert_eq!(
        rows(&after, "full"),
        rows(&before, "full"),
        "the edit fell back to full compute\n{after}"
    );
    assert!(
        rows(&after, "mask_aware") >= rows(&before, "mask_aware") + f64::from(STEPS),
        "the edit did not step mask-aware\n{after}"
    );

    // The last user's delete removes the cache and its announcement.
    let deleted = delete(&mesh, &second).await;
    assert_eq!(deleted["cache_entries_deleted"], all, "{deleted}");
    assert_eq!(entries_held(&client, &key).await, 0);
    assert!(
        !capture_announced(&client, &key).await,
        "the announcement outlived the cache"
    );
}

/// An edit of template `id` (`w` x `h`) repainting one rectangle.
async fn edit(mesh: &TestMesh, id: &str, (w, h): (u32, u32), seed: u32) -> (u16, Value) {
    let form = Form::new()
        .text("template_id", id.to_string())
        .part(
            "mask",
            Part::bytes(png_bytes(&rect_mask(w, h, 8, 8, 40, 32))).file_name("mask.png"),
        )
        .text("prompt", "a yellow square")
        .text("seed", seed.to_string());
    post_form(&reqwest::Client::new(), &mesh.url("/v1/images/edits"), form).await
}

/// An edit whose template's cache is in no tier (evicted from the cluster tier, and on a
/// denoiser that never held it) runs in full compute, and that denoiser captures the template
/// again in the background: the cache is back in the cachestore and the next edit is
/// mask-aware. Before, such a template stayed on full compute for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_template_whose_cache_is_gone_is_captured_again() {
    let mut mesh = MeshBuilder::new()
        .cachestore(|c| c.memory_bytes = 64 << 20)
        .gateway(|g| g.job_timeout = Duration::from_secs_f64(180.0))
        .start()
        .await;
    let client = async_nats::connect(mesh.nats.url()).await.expect("NATS");
    let (w, h) = (96, 64);
    let (id, key) = register(&mesh, &png_bytes(&template(w, h))).await;
    let all = STEPS as usize + 1;
    assert_eq!(entries_held(&client, &key).await, all);

    // d1 (which holds the cache locally) goes; the cache leaves every cachestore tier.
    let d1 = mesh.denoisers.pop().expect("d1");
    tokio::task::spawn_blocking(move || drop(d1))
        .await
        .expect("stop d1");
    for k in template_keys(&key, STEPS) {
        let reply: CacheDeleteReply = request_msgpack(
            &client,
            &delete_subject(),
            &CacheDelete { key: k.clone() },
            Duration::from_secs(5),
        )
        .await
        .expect("delete");
        assert_eq!(reply, CacheDeleteReply::Deleted { existed: true }, "{k}");
    }
    assert_eq!(entries_held(&client, &key).await, 0);
    let model = tiny_model_dir().expect("weights/tiny");
    let d2 = start_denoiser(&mesh.nats, &model, "d2", |c| c.warm_on_capture = false).expect("d2");
    d2.wait_ready(Duration::from_secs(30)).await.expect("ready");
    let health = d2.addrs.health;
    mesh.denoisers.push(d2);
    tokio::time::sleep(Duration::from_millis(500)).await; // the router hears d2

    let rows = |m: &str, mode: &str| {
        metric_sample(
            m,
            &format!("diffmesh_denoiser_step_rows_total{{mode=\"{mode}\"}}"),
        )
    };
    let (status, body) = edit(&mesh, &id, (w, h), 1).await;
    assert_eq!(status, 200, "{body}");
    let after_first = scrape_metrics(health).await.unwrap();
    assert!(
        rows(&after_first, "full") >= f64::from(STEPS),
        "{after_first}"
    );

    // The capture runs after the edit was taken; wait for the cache to be back.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while entries_held(&client, &key).await < all {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cache was not captured again\n{}",
            scrape_metrics(health).await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let captured = scrape_metrics(health).await.unwrap();
    assert_eq!(
        metric_sample(
            &captured,
            "diffmesh_denoiser_template_recaptures_total{outcome=\"started\"}"
        ),
        1.0,
        "{captured}"
    );
    assert!(capture_announced(&client, &key).await);

    let (status, body) = edit(&mesh, &id, (w, h), 2).await;
    assert_eq!(status, 200, "{body}");
    let after = scrape_metrics(health).await.unwrap();
    assert_eq!(rows(&after, "full"), rows(&captured, "full"), "{after}");
    assert!(
        rows(&after, "mask_aware") >= rows(&captured, "mask_aware") + f64::from(STEPS),
        "the edit after the re-capture did not step mask-aware\n{after}"
    );
}
