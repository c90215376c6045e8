//! `TemplatePixels` against a real object store: the first read of a template's pixels goes to
//! the store, later ones (and concurrent ones) do not, and an eviction drops what is held.
use diffmesh_denoiser::templates::pixels::Lookup;
use diffmesh_denoiser::templates::TemplatePixels;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::jetstream_layout::TEMPLATE_IMAGES;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::templates::prepared_image_key;
use futures::future::join_all;

const TEMPLATE: &str = "2c4e6a80-1b3d-4f5a-8c7e-9d0f1a2b3c4d";
const OTHER: &str = "2c4e6a80-1b3d-4f5a-8c7e-9d0f1a2b3c4e";

#[tokio::test]
async fn pixels_are_read_once_per_template_and_dropped_on_eviction() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let store = BlobStore::open_with(&js, &TEMPLATE_IMAGES).await.unwrap();
    let key = prepared_image_key(TEMPLATE);
    let rgb: Vec<u8> = (0..64 * 64 * 3).map(|i| (i % 251) as u8).collect();
    store.put(&key, &rgb).await.unwrap();
    let pixels = TemplatePixels::new(store.clone(), 1 << 20, 1 << 20);

    let (first, lookup) = pixels.get(&key).await.unwrap();
    assert_eq!((first.as_slice(), lookup), (rgb.as_slice(), Lookup::Miss));
    // Gone from the store: a hit proves the second read did not go there.
    store.delete(&key).await.unwrap();
    let (again, lookup) = pixels.get(&key).await.unwrap();
    assert_eq!((again.as_slice(), lookup), (rgb.as_slice(), Lookup::Hit));
    assert_eq!(pixels.bytes().await, rgb.len() as u64);

    // Evicting another template keeps this one; evicting this one drops it.
    pixels.evict(OTHER).await;
    assert_eq!(pixels.get(&key).await.unwrap().1, Lookup::Hit);
    pixels.evict(TEMPLATE).await;
    let err = pixels.get(&key).await.unwrap_err();
    assert!(err.to_string().contains(&key), "{err}");
    assert_eq!(pixels.bytes().await, 0);

    // Eight edits of a new template at once: one read.
    let other_key = prepared_image_key(OTHER);
    store.put(&other_key, &rgb).await.unwrap();
    let lookups = join_all((0..8).map(|_| pixels.get(&other_key))).await;
    let misses = lookups
        .iter()
        .filter(|r| r.as_ref().unwrap().1 == Lookup::Miss)
        .count();
    assert_eq!(misses, 1);
}

/// What holding the pixels saves per edit: a read from the object store against a hit, for the
/// tiny model's 64x64 pixels and for 1024x1024. A measurement, not a check: `cargo test
/// --release -p diffmesh-denoiser --test template_pixels -- --ignored --nocapture`.
#[tokio::test]
#[ignore = "measurement; run by hand"]
async fn time_a_read() {
    const N: u32 = 200;
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let store = BlobStore::open_with(&js, &TEMPLATE_IMAGES).await.unwrap();
    for side in [64usize, 1024] {
        let key = prepared_image_key(TEMPLATE);
        store.put(&key, &vec![7u8; side * side * 3]).await.unwrap();
        let held = TemplatePixels::new(store.clone(), 64 << 20, 64 << 20);
        let unheld = TemplatePixels::new(store.clone(), 0, 64 << 20);
        held.get(&key).await.unwrap();
        let mut times = Vec::new();
        for pixels in [&unheld, &held] {
            let t = std::time::Instant::now();
            for _ in 0..N {
                let (rgb, _) = pixels.get(&key).await.unwrap();
                std::hint::black_box(rgb.to_vec());
            }
            times.push(t.elapsed().as_secs_f64() * 1e3 / f64::from(N));
        }
        println!(
            "template pixels {side}x{side} ({} KB): read {:.3} ms, held {:.4} ms (mean of {N})",
            side * side * 3 / 1024,
            times[0],
            times[1]
        );
    }
}
