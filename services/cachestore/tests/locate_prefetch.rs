//! Locate and prefetch over a real nats-server: locate reports every tier holding a key without
//! counting a use; a prefetch (published fire and forget, as the router does) promotes keys from
//! disk and from the cluster tier into memory, so the next get is a memory hit.
use diffmesh_cachestore::{start, CachestoreConfig};
use diffmesh_shared::nats::request_msgpack;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::cachestore::{
    get_subject, locate_subject, prefetch_subject, put_subject, stats_subject, CacheGet,
    CacheGetReply, CacheLocate, CacheLocateReply, CachePrefetch, CachePrefetchReply, CachePut,
    CachePutReply, CacheStatsReply, CacheTier, KeyLocation, MAX_KEYS_PER_REQUEST,
};
use diffmesh_shared::wire::messages::encode;
use std::time::Duration;

const T: Duration = Duration::from_secs(5);

async fn put(c: &async_nats::Client, key: &str, value: Vec<u8>) {
    let reply: CachePutReply = request_msgpack(
        c,
        &put_subject(),
        &CachePut {
            key: key.into(),
            value: Some(value),
        },
        T,
    )
    .await
    .unwrap();
    assert!(matches!(reply, CachePutReply::Stored { .. }), "{reply:?}");
}

async fn locate(c: &async_nats::Client, keys: &[&str]) -> CacheLocateReply {
    let req = CacheLocate {
        keys: keys.iter().map(|k| k.to_string()).collect(),
    };
    request_msgpack(c, &locate_subject(), &req, T)
        .await
        .unwrap()
}

async fn located(c: &async_nats::Client, key: &str) -> KeyLocation {
    match locate(c, &[key]).await {
        CacheLocateReply::Located { mut keys } => keys.remove(0),
        other => panic!("locate {key}: {other:?}"),
    }
}

async fn get_tier(c: &async_nats::Client, key: &str) -> Option<CacheTier> {
    let reply: CacheGetReply = request_msgpack(
        c,
        &get_subject(),
        &CacheGet {
            key: key.into(),
            ranged: false,
        },
        T,
    )
    .await
    .unwrap();
    match reply {
        CacheGetReply::Inline { tier, .. }
        | CacheGetReply::InObjectStore { tier, .. }
        | CacheGetReply::Ranged { tier, .. } => Some(tier),
        CacheGetReply::Missing => None,
        CacheGetReply::Failed { message } => panic!("get {key}: {message}"),
    }
}

async fn stats(c: &async_nats::Client) -> CacheStatsReply {
    request_msgpack(c, &stats_subject(), &(), T).await.unwrap()
}

/// Poll until `key` is in the memory tier (prefetches run after they are acknowledged).
async fn wait_in_memory(c: &async_nats::Client, key: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if located(c, key).await.tiers.first() == Some(&CacheTier::Memory) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} never reached the memory tier"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locate_and_prefetch_over_nats() {
    let nats = NatsServer::start();
    let disk = tempfile::tempdir().unwrap();
    let mut config = CachestoreConfig::for_tests(nats.url(), disk.path().to_path_buf());
    // Room for three 1000-byte values in memory, so older ones spill to disk.
    config.memory_bytes = 3100;
    let store = start(config.clone()).await.unwrap();
    let c = async_nats::connect(nats.url()).await.unwrap();

    for i in 0..5u8 {
        put(&c, &format!("tpl-a/s{i}"), vec![i; 1000]).await;
    }
    store.store.stats(); // settle moka's pending evictions
    let before = stats(&c).await;

    // s0 was pushed out to disk; s4 is in memory; both are in the cluster tier (write-through).
    let s0 = located(&c, "tpl-a/s0").await;
    assert_eq!(
        s0.tiers,
        vec![CacheTier::Disk, CacheTier::Cluster],
        "{s0:?}"
    );
    assert_eq!(s0.size, Some(1000));
    let s4 = located(&c, "tpl-a/s4").await;
    assert_eq!(
        s4.tiers,
        vec![CacheTier::Memory, CacheTier::Cluster],
        "{s4:?}"
    );
    let none = located(&c, "tpl-a/meta").await;
    assert!(none.tiers.is_empty() && none.size.is_none(), "{none:?}");
    // Locating is not a use: no hit or miss was counted.
    let after = stats(&c).await;
    assert_eq!(
        (before.memory.hits, before.memory.misses, before.disk.hits),
        (after.memory.hits, after.memory.misses, after.disk.hits)
    );

    // Requested prefetch: acknowledged with the number of keys queued, then promoted.
    let reply: CachePrefetchReply = request_msgpack(
        &c,
        &prefetch_subject(),
        &CachePrefetch {
            keys: vec!["tpl-a/s0".into(), "tpl-a/missing".into()],
        },
        T,
    )
    .await
    .unwrap();
    assert_eq!(reply, CachePrefetchReply::Scheduled { keys: 2 });
    wait_in_memory(&c, "tpl-a/s0").await;
    assert_eq!(get_tier(&c, "tpl-a/s0").await, Some(CacheTier::Memory));

    // Bad requests name the field and change nothing.
    let reply: CachePrefetchReply = request_msgpack(
        &c,
        &prefetch_subject(),
        &CachePrefetch {
            keys: vec!["tpl-a/s1".into(), "bad key".into()],
        },
        T,
    )
    .await
    .unwrap();
    assert!(
        matches!(reply, CachePrefetchReply::Failed { ref message } if message.contains("`key`")),
        "{reply:?}"
    );
    let too_many: Vec<String> = (0..=MAX_KEYS_PER_REQUEST)
        .map(|i| format!("k{i}"))
        .collect();
    let reply: CacheLocateReply =
        request_msgpack(&c, &locate_subject(), &CacheLocate { keys: too_many }, T)
            .await
            .unwrap();
    assert!(
        matches!(reply, CacheLocateReply::Failed { ref message } if message.contains("`keys`")),
        "{reply:?}"
    );
    store.shutdown().await.unwrap();

    // A fresh instance with an empty disk: the values are only in the cluster tier. A prefetch
    // published without a reply subject (fire and forget) still promotes them.
    let disk2 = tempfile::tempdir().unwrap();
    let mut config2 = config;
    config2.disk_dir = disk2.path().to_path_buf();
    config2.memory_bytes = 1 << 20;
    let store2 = start(config2).await.unwrap();
    assert_eq!(
        located(&c, "tpl-a/s2").await.tiers,
        vec![CacheTier::Cluster]
    );
    let keys: Vec<String> = (0..5).map(|i| format!("tpl-a/s{i}")).collect();
    c.publish(
        prefetch_subject(),
        encode(&CachePrefetch { keys: keys.clone() })
            .unwrap()
            .into(),
    )
    .await
    .unwrap();
    for key in &keys {
        wait_in_memory(&c, key).await;
    }
    let before = stats(&c).await;
    for key in &keys {
        assert_eq!(get_tier(&c, key).await, Some(CacheTier::Memory), "{key}");
    }
    let after = stats(&c).await;
    assert_eq!(after.memory.hits - before.memory.hits, 5);
    assert_eq!(after.cluster.hits, before.cluster.hits);

    let metrics = fetch_metrics(store2.health_addr).await;
    assert!(
        metrics.contains("diffmesh_cachestore_prefetches_total{outcome=\"from_cluster\"} 5"),
        "{metrics}"
    );
    assert!(
        metrics.contains("diffmesh_cachestore_read_bytes_total{tier=\"memory\"} 5000"),
        "{metrics}"
    );
    store2.shutdown().await.unwrap();
}

/// An `EvictTemplate` (published to every replica) drops this replica's memory and disk copies
/// of that cache only; the shared cluster tier is left to `CacheDelete`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_eviction_drops_local_copies() {
    let nats = NatsServer::start();
    let disk = tempfile::tempdir().unwrap();
    let mut config = CachestoreConfig::for_tests(nats.url(), disk.path().to_path_buf());
    config.memory_bytes = 2100; // two 1000-byte values: a third pushes one to disk
    let store = start(config).await.unwrap();
    let c = async_nats::connect(nats.url()).await.unwrap();
    for key in ["tpl-e/s0", "tpl-e/s1", "tpl-keep/s0"] {
        put(&c, key, vec![1; 1000]).await;
    }
    store.store.stats();
    let tiers = |loc: KeyLocation| loc.tiers;
    assert_eq!(
        tiers(located(&c, "tpl-e/s0").await),
        vec![CacheTier::Disk, CacheTier::Cluster]
    );
    let evict = diffmesh_shared::wire::messages::EvictTemplate {
        template_id: "t".into(),
        cache_key: "tpl-e".into(),
    };
    c.publish(
        diffmesh_shared::wire::subjects::TEMPLATES_EVICT,
        encode(&evict).unwrap().into(),
    )
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while located(&c, "tpl-e/s1").await.tiers != vec![CacheTier::Cluster] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "tpl-e/s1 was not evicted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        tiers(located(&c, "tpl-e/s0").await),
        vec![CacheTier::Cluster]
    );
    assert_eq!(
        tiers(located(&c, "tpl-keep/s0").await),
        vec![CacheTier::Memory, CacheTier::Cluster]
    );
    store.shutdown().await.unwrap();
}

/// The text of `/metrics` (plain HTTP/1.0 over a TCP stream: no HTTP client in this crate).
async fn fetch_metrics(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body
}
