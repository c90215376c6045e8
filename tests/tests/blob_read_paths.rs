//! Which path a blob read takes. In a test binary of its own: a blob read that NATS reconnects
//! under goes on from the stream leader (`shared::nats::reconnects` is process-wide), and the crash
//! and restart tests beside it in `jetstream_layout.rs` would send it there.
use async_nats::jetstream;
use diffmesh_shared::stores::blob_store::{BlobStore, SMALL_BLOB_CHUNKS};
use diffmesh_shared::testing::NatsServer;

#[tokio::test]
async fn small_blobs_are_read_without_a_consumer() {
    let nats = NatsServer::start();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let blobs = BlobStore::open(&js).await.unwrap();
    let consumers = || async {
        let mut stream = js.get_stream("OBJ_diffmesh-blobs").await.unwrap();
        stream.info().await.unwrap().state.consumer_count
    };
    let chunk = 128 << 10;
    let limit = SMALL_BLOB_CHUNKS * chunk;
    for size in [0usize, 5, limit] {
        let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        blobs.put(&format!("small/{size}"), &data).await.unwrap();
        assert!(blobs.get(&format!("small/{size}")).await.unwrap() == data);
    }
    assert_eq!(consumers().await, 0, "a small read left a consumer");
    // One byte over the limit: one chunk more, read through a consumer.
    let data: Vec<u8> = (0..limit + 1).map(|i| (i % 249) as u8).collect();
    blobs.put("large", &data).await.unwrap();
    assert!(blobs.get("large").await.unwrap() == data);
    assert!(consumers().await >= 1, "a large read used no consumer");
    // Not found and too large are told apart on the small path as on the other.
    assert!(matches!(
        blobs.get("missing").await,
        Err(diffmesh_shared::MeshError::BlobNotFound { .. })
    ));
    assert!(matches!(
        blobs
            .get_limited(&format!("small/{chunk}"), chunk - 1)
            .await,
        Err(diffmesh_shared::MeshError::BlobTooLarge { .. })
    ));
}
