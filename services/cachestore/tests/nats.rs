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
