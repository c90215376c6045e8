//! Whole-cache fetches against a real nats-server and a fake cachestore that counts its gets:
//! two fetches of one cache at once share one read of every entry and get the same held
//! entry; the read leaves the in-flight map when it ends; a cache the cachestore lacks is
//! `Missing`; a fetch after a finished one gets the held entry, and reads afresh only once the
//! tier has let the cache go.
use diffmesh_denoiser::templates::store::CacheClient;
use diffmesh_denoiser::templates::{CacheFetcher, Fetched, LocalTier};
use diffmesh_model::flux::kv_codec::{encode_block, CacheDtype};
use diffmesh_model::flux::KvFormat;
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_shared::nats::reply_msgpack;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::cachestore::{get_subject, CacheGet, CacheGetReply, CacheTier};
use diffmesh_shared::wire::messages::decode;
use diffmesh_shared::wire::templates::{meta_key, pack_step, step_key, CacheMeta};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const STEPS: u32 = 3;
const BLOCKS: u32 = 2;

/// The stored entries of one cache `key`: its metadata and every step.
fn stored_cache(key: &str) -> HashMap<String, Vec<u8>> {
    let t = Tensor::ones([4, 8], (Kind::Float, Device::Cpu));
    let block = encode_block(&t, &t, KvFormat::Prepared, CacheDtype::Bf16).unwrap();
    let step = pack_step(&vec![block; BLOCKS as usize]);
    let meta = CacheMeta {
        cache_key: key.into(),
        steps: STEPS,
        blocks: BLOCKS,
        bytes: step.len() as u64 * u64::from(STEPS),
        format: "prepared".into(),
        dtype: "bf16".into(),
    };
    let mut values = HashMap::from([(meta_key(key), serde_json::to_vec(&meta).unwrap())]);
    for s in 0..STEPS {
        values.insert(step_key(key, s), step.clone());
    }
    values
}

/// Answers cachestore gets from `values` after a short delay (so a second fetch can join the
/// first), counting them.
async fn fake_cachestore(
    client: async_nats::Client,
    values: HashMap<String, Vec<u8>>,
) -> Arc<AtomicUsize> {
    let gets = Arc::new(AtomicUsize::new(0));
    let mut sub = client.subscribe(get_subject()).await.unwrap();
    client.flush().await.unwrap();
    let counted = gets.clone();
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let get: CacheGet = decode(&msg.payload).unwrap();
            let reply = match values.get(&get.key) {
                Some(value) => CacheGetReply::Inline {
                    tier: CacheTier::Memory,
                    value: value.clone(),
                },
                None => CacheGetReply::Missing,
            };
            let client = client.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                reply_msgpack(&client, &msg, &reply).await.unwrap();
            });
        }
    });
    gets
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_fetches_of_one_cache_share_one_read() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let bucket = BlobStore::open_with(&js, &diffmesh_shared::stores::jetstream_layout::CACHES)
        .await
        .unwrap();
    let gets = fake_cachestore(client.clone(), stored_cache("tpl-a")).await;
    let store = CacheClient::new(client, bucket, Duration::from_secs(5));
    let local = LocalTier::new(64 << 20, None);
    let fetcher = CacheFetcher::new(store, local.clone(), None);

    let ((first, first_joined), (second, second_joined)) =
        tokio::join!(fetcher.fetch("tpl-a"), fetcher.fetch("tpl-a"));
    let (Fetched::Entry(a), Fetched::Entry(b)) = (first, second) else {
        panic!("both fetches should find the cache");
    };
    assert!(
        !first_joined && second_joined,
        "the second fetch started its own read"
    );
    assert!(Arc::ptr_eq(&a, &b), "the two fetches got different entries");
    assert_eq!((a.steps(), a.blocks()), (STEPS as usize, BLOCKS as usize));
    let one_read = STEPS as usize + 1; // the metadata and every step
    assert_eq!(gets.load(Ordering::SeqCst), one_read);
    assert_eq!(fetcher.in_flight(), 0, "the finished read stayed in flight");
    assert!(local.contains("tpl-a"), "the fetched cache is not held");

    // A fetch after the first ended (a caller that looked in the tier just before the read
    // admitted the entry) gets the held entry without a read of its own.
    let (again, joined) = fetcher.fetch("tpl-a").await;
    let Fetched::Entry(held) = again else {
        panic!("the held cache was not found: {again:?}");
    };
    assert!(
        joined && Arc::ptr_eq(&held, &a),
        "a held cache was read again"
    );
    assert_eq!(gets.load(Ordering::SeqCst), one_read);

    // Once the tier has let it go, a fetch reads afresh.
    local.remove("tpl-a");
    let (again, joined) = fetcher.fetch("tpl-a").await;
    assert!(matches!(again, Fetched::Entry(_)) && !joined);
    assert_eq!(gets.load(Ordering::SeqCst), 2 * one_read);

    // A cache the cachestore does not have: one metadata get, nothing held.
    let (missing, _) = fetcher.fetch("tpl-none").await;
    assert!(matches!(missing, Fetched::Missing), "{missing:?}");
    assert_eq!(gets.load(Ordering::SeqCst), 2 * one_read + 1);
    assert!(!local.contains("tpl-none") && fetcher.in_flight() == 0);
}
