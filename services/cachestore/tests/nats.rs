//! The cachestore over a real nats-server: inline and object-store values, tier fall-through to
//! the cluster tier from a fresh instance, stats and delete.
use diffmesh_cachestore::{start, CachestoreConfig};
use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::jetstream_layout::CACHES;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::cachestore::{
    delete_subject, get_subject, put_subject, stats_subject, CacheDelete, CacheDeleteReply,
    CacheGet, CacheGetReply, CachePut, CachePutReply, CacheStatsReply, CacheTier,
};
use std::time::Duration;

const T: Duration = Duration::from_secs(5);

/// The tests one at a time: each expects to be the only cachestore traffic on its machine's
/// cores while it checks which tier answered.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn get(c: &async_nats::Client, key: &str) -> CacheGetReply {
    request_msgpack(
        c,
        &get_subject(),
        &CacheGet {
            key: key.into(),
            ranged: false,
        },
        T,
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_over_nats() {
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start();
    let disk1 = tempfile::tempdir().unwrap();
    let mut config = CachestoreConfig::for_tests(nats.url(), disk1.path().to_path_buf());
    config.inline_limit = 1024;
    let store = start(config.clone()).await.unwrap();
    let c = async_nats::connect(nats.url()).await.unwrap();

    // Small value: inline both ways.
    let put: CachePutReply = request_msgpack(
        &c,
        &put_subject(),
        &CachePut {
            key: "tpl/a/0".into(),
            value: Some(vec![7; 100]),
        },
        T,
    )
    .await
    .unwrap();
    assert_eq!(put, CachePutReply::Stored { size: 100 });
    assert_eq!(
        get(&c, "tpl/a/0").await,
        CacheGetReply::Inline {
            tier: CacheTier::Memory,
            value: vec![7; 100]
        }
    );

    // Too large to be inline: refused with the limit named.
    let big = vec![3u8; 5000];
    let put: CachePutReply = request_msgpack(
        &c,
        &put_subject(),
        &CachePut {
            key: "tpl/b/0".into(),
            value: Some(big.clone()),
        },
        T,
    )
    .await
    .unwrap();
    assert!(
        matches!(put, CachePutReply::Failed { ref message } if message.contains("inline limit")),
        "{put:?}"
    );

    // Large value through the object store: the caller writes it, then announces it.
    let js = async_nats::jetstream::new(c.clone());
    let bucket = BlobStore::open_with(&js, &CACHES).await.unwrap();
    bucket.put("tpl/b/0", &big).await.unwrap();
    let put: CachePutReply = request_msgpack(
        &c,
        &put_subject(),
        &CachePut {
            key: "tpl/b/0".into(),
            value: None,
        },
        T,
    )
    .await
    .unwrap();
    assert_eq!(put, CachePutReply::Stored { size: 5000 });
    assert_eq!(
        get(&c, "tpl/b/0").await,
        CacheGetReply::InObjectStore {
            tier: CacheTier::Memory,
            size: 5000
        }
    );

    assert_eq!(get(&c, "tpl/none").await, CacheGetReply::Missing);
    assert!(
        matches!(get(&c, "bad key").await, CacheGetReply::Failed { ref message } if message.contains("`key`"))
    );

    let stats: CacheStatsReply = request_msgpack(&c, &stats_subject(), &(), T).await.unwrap();
    assert_eq!(stats.memory.entries, 2);
    assert!(
        stats.memory.hits >= 2 && stats.cluster.misses >= 1,
        "{stats:?}"
    );
    store.shutdown().await.unwrap();

    // A fresh instance with an empty disk finds the written-through value in the cluster tier.
    let disk2 = tempfile::tempdir().unwrap();
    let mut config2 = config;
    config2.disk_dir = disk2.path().to_path_buf();
    let store2 = start(config2).await.unwrap();
    assert_eq!(
        get(&c, "tpl/a/0").await,
        CacheGetReply::Inline {
            tier: CacheTier::Cluster,
            value: vec![7; 100]
        }
    );
    assert_eq!(
        get(&c, "tpl/a/0").await,
        CacheGetReply::Inline {
            tier: CacheTier::Memory,
            value: vec![7; 100]
        }
    );

    let del: CacheDeleteReply = request_msgpack(
        &c,
        &delete_subject(),
        &CacheDelete {
            key: "tpl/a/0".into(),
        },
        T,
    )
    .await
    .unwrap();
    assert_eq!(del, CacheDeleteReply::Deleted { existed: true });
    assert_eq!(get(&c, "tpl/a/0").await, CacheGetReply::Missing);
    store2.shutdown().await.unwrap();
}

async fn put_inline(c: &async_nats::Client, key: &str, len: usize) {
    let put: CachePutReply = request_msgpack(
        c,
        &put_subject(),
        &CachePut {
            key: key.into(),
            value: Some(vec![1; len]),
        },
        T,
    )
    .await
    .unwrap();
    assert_eq!(put, CachePutReply::Stored { size: len as u64 });
}

/// The cluster tier keeps to `--cluster-bytes`: a write past it deletes the least recently
/// used cache (every key of it) from the object store, never the one being written; a fresh
/// instance orders what the bucket holds by write time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_tier_drops_its_least_recently_used_caches() {
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start();
    let disk = tempfile::tempdir().unwrap();
    let mut config = CachestoreConfig::for_tests(nats.url(), disk.path().to_path_buf());
    config.cluster_bytes = 3000;
    let store = start(config.clone()).await.unwrap();
    let c = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(c.clone());
    let bucket = BlobStore::open_with(&js, &CACHES).await.unwrap();
    let in_cluster = |key: &'static str| {
        let bucket = bucket.clone();
        async move { bucket.get_limited(key, 1 << 20).await.is_ok() }
    };

    for cache in ["tpl-a", "tpl-b"] {
        put_inline(&c, &format!("{cache}/s0"), 1000).await;
        put_inline(&c, &format!("{cache}/meta"), 10).await;
    }
    // a is read (from memory): b is now the least recently used.
    assert!(matches!(
        get(&c, "tpl-a/s0").await,
        CacheGetReply::Inline { .. }
    ));
    put_inline(&c, "tpl-c/s0", 1000).await;
    assert!(!in_cluster("tpl-b/s0").await && !in_cluster("tpl-b/meta").await);
    for key in ["tpl-a/s0", "tpl-a/meta", "tpl-c/s0"] {
        assert!(in_cluster(key).await, "{key}");
    }
    let stats: CacheStatsReply = request_msgpack(&c, &stats_subject(), &(), T).await.unwrap();
    assert_eq!((stats.cluster.entries, stats.cluster.bytes), (3, 2010));
    let metrics = metrics_text(store.health_addr).await;
    assert!(
        metrics.contains("diffmesh_cachestore_cluster_evictions_total 1"),
        "{metrics}"
    );
    store.shutdown().await.unwrap();

    // A fresh instance saw no reads: a (written first) is the oldest now.
    let disk2 = tempfile::tempdir().unwrap();
    config.disk_dir = disk2.path().to_path_buf();
    let store2 = start(config).await.unwrap();
    put_inline(&c, "tpl-d/s0", 1000).await;
    assert!(!in_cluster("tpl-a/s0").await && !in_cluster("tpl-a/meta").await);
    assert!(in_cluster("tpl-c/s0").await && in_cluster("tpl-d/s0").await);
    store2.shutdown().await.unwrap();
}

/// `/metrics` of the health server, read with a bare HTTP/1.0 request.
async fn metrics_text(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body
}
