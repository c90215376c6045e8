//! Large values read in ranges straight from the cachestore instance that holds them
//! (`shared::stores::cache_read`), over a real nats-server: several ranges make up the exact value, a
//! get that does not ask for ranges still gets the object store, bad or expired ranges are
//! refused with a status, and a ranged read that fails falls back to the object store.
use diffmesh_cachestore::{start, CachestoreConfig};
use diffmesh_shared::nats::{reply_msgpack, request_msgpack};
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::cache_read::{CacheReader, ReadPath};
use diffmesh_shared::stores::jetstream_layout::CACHES;
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::cachestore::{
    get_subject, put_subject, range_subject, CacheGet, CacheGetReply, CachePut, CachePutReply,
    CacheRange, CacheTier, RANGE_GONE, RANGE_STATUS_HEADER,
};
use diffmesh_shared::wire::messages::{decode, encode};
use futures::StreamExt;
use std::time::Duration;

const T: Duration = Duration::from_secs(5);
/// Over three ranges at the default 1 MiB message limit, with a short last one.
const SIZE: usize = 3 * (1 << 20) + 12_345;

fn value() -> Vec<u8> {
    (0..SIZE).map(|i| (i % 251) as u8).collect()
}

async fn bucket(c: &async_nats::Client) -> BlobStore {
    BlobStore::open_with(&async_nats::jetstream::new(c.clone()), &CACHES)
        .await
        .unwrap()
}

/// Write `value` under `key` as a denoiser does: the bucket first, then a put that names it.
async fn store_large(c: &async_nats::Client, key: &str, value: &[u8]) {
    bucket(c).await.put(key, value).await.unwrap();
    let put: CachePutReply = request_msgpack(
        c,
        &put_subject(),
        &CachePut {
            key: key.into(),
            value: None,
        },
        T,
    )
    .await
    .unwrap();
    assert_eq!(put, CachePutReply::Stored { size: SIZE as u64 });
}

async fn reader(c: &async_nats::Client) -> CacheReader {
    CacheReader {
        client: c.clone(),
        bucket: bucket(c).await,
        timeout: T,
        max_bytes: 64 << 20,
    }
}

/// A raw range request: the reply's status header (if any) and payload length.
async fn ask_range(
    c: &async_nats::Client,
    subject: &str,
    range: &CacheRange,
) -> (Option<String>, usize) {
    let msg = c
        .request(subject.to_string(), encode(range).unwrap().into())
        .await
        .unwrap();
    let status = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(RANGE_STATUS_HEADER))
        .map(|v| v.to_string());
    (status, msg.payload.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_values_come_in_ranges_from_the_instance_holding_them() {
    let nats = NatsServer::start();
    let disk = tempfile::tempdir().unwrap();
    let mut config = CachestoreConfig::for_tests(nats.url(), disk.path().to_path_buf());
    config.memory_bytes = 64 << 20;
    let store = start(config).await.unwrap();
    let c = async_nats::connect(nats.url()).await.unwrap();
    let expected = value();
    store_large(&c, "tpl-r/s0", &expected).await;

    let (got, path) = reader(&c).await.read("tpl-r/s0").await.unwrap().unwrap();
    assert_eq!(path, ReadPath::Ranged);
    assert!(got == expected, "the ranges do not make up the value");
    let metrics = store.store.metrics();
    assert_eq!(metrics.served_of("ranged"), 1);
    assert_eq!(metrics.served_of("object_store"), 0);

    // A client that does not read ranges is told to use the object store, as before.
    let old: CacheGetReply = request_msgpack(
        &c,
        &get_subject(),
        &CacheGet {
            key: "tpl-r/s0".into(),
            ranged: false,
        },
        T,
    )
    .await
    .unwrap();
    assert_eq!(
        old,
        CacheGetReply::InObjectStore {
            tier: CacheTier::Memory,
            size: SIZE as u64
        }
    );

    // Ranges of a live transfer; outside it, and of an unknown one, a status and no bytes.
    let offer: CacheGetReply = request_msgpack(
        &c,
        &get_subject(),
        &CacheGet {
            key: "tpl-r/s0".into(),
            ranged: true,
        },
        T,
    )
    .await
    .unwrap();
    let CacheGetReply::Ranged {
        subject, transfer, ..
    } = offer
    else {
        panic!("no ranges offered: {offer:?}");
    };
    let range = |offset, len| CacheRange {
        transfer: transfer.clone(),
        offset,
        len,
    };
    assert_eq!(ask_range(&c, &subject, &range(10, 100)).await, (None, 100));
    for bad in [range(SIZE as u64 - 5, 10), range(0, SIZE as u64)] {
        let (status, len) = ask_range(&c, &subject, &bad).await;
        assert!(
            status.as_deref().is_some_and(|s| s.starts_with("failed:")) && len == 0,
            "{bad:?}: {status:?}"
        );
    }
    let gone = CacheRange {
        transfer: "no-such-transfer".into(),
        offset: 0,
        len: 1,
    };
    assert_eq!(
        ask_range(&c, &subject, &gone).await,
        (Some(RANGE_GONE.to_string()), 0)
    );
    store.shutdown().await.unwrap();
}

/// A cachestore stand-in that offers ranges on a subject nobody answers, then (asked without
/// ranges) points to the object store: the reader must end up with the value from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_ranged_read_falls_back_to_the_object_store() {
    let nats = NatsServer::start();
    let c = async_nats::connect(nats.url()).await.unwrap();
    let expected = value();
    bucket(&c).await.put("tpl-f/s0", &expected).await.unwrap();
    let mut sub = c.subscribe(get_subject()).await.unwrap();
    c.flush().await.unwrap();
    let responder = c.clone();
    let fake = tokio::spawn(async move {
        let mut asked = Vec::new();
        while let Some(msg) = sub.next().await {
            let get: CacheGet = decode(&msg.payload).unwrap();
            asked.push(get.ranged);
            let reply = if get.ranged {
                CacheGetReply::Ranged {
                    tier: CacheTier::Memory,
                    size: SIZE as u64,
                    subject: range_subject("stopped-instance"),
                    transfer: "0".into(),
                }
            } else {
                CacheGetReply::InObjectStore {
                    tier: CacheTier::Memory,
                    size: SIZE as u64,
                }
            };
            reply_msgpack(&responder, &msg, &reply).await.unwrap();
            if asked.len() == 2 {
                return asked;
            }
        }
        asked
    });
    let (got, path) = reader(&c).await.read("tpl-f/s0").await.unwrap().unwrap();
    assert_eq!(path, ReadPath::ObjectStore);
    assert!(got == expected);
    assert_eq!(fake.await.unwrap(), vec![true, false]);
}
