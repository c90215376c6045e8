//! Two templates of the same pixels and capture settings share one activation cache (its key
//! hashes the content, not the template id). Deleting one must leave the cache to the other:
//! its entries stay in the cachestore, its capture announcement stays for denoisers that start
//! later, and the other's edits still run mask-aware from it. Deleting the last one removes
//! everything.
use std::time::Duration;

use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::wire::cachestore::{
    locate_subject, template_keys, CacheLocate, CacheLocateReply,
};
use diffmesh_tests::harness::{capture_announced, metric_sample, post_form, scrape_metrics};
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
