//! Job-record retention (`--js-job-retention`, `jetstream_layout::configured`) against a real
//! server: the flag sets the job bucket's age limit at start, other buckets keep theirs.
use std::time::Duration;

use async_nats::jetstream;
use diffmesh_shared::stores::jetstream_layout::{self, ensure_all};
use diffmesh_shared::testing::NatsServer;

/// The storage budget of this test's streams (`JS_MAX_BYTES`).
const BUDGET: u64 = 1 << 30;

async fn max_age(js: &jetstream::Context, name: &str) -> Duration {
    js.get_stream(name)
        .await
        .unwrap_or_else(|e| panic!("stream {name}: {e}"))
        .cached_info()
        .config
        .max_age
}

/// `--js-job-retention` sets the job records' age limit at start, on a bucket made earlier with
/// another one too; too short a retention is refused as a flag.
#[tokio::test]
async fn job_retention_follows_the_flag() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    ensure_all(&js, 1, BUDGET, &[]).await.unwrap();
    let stream = jetstream_layout::JOBS.stream_name();
    assert_eq!(max_age(&js, &stream).await, jetstream_layout::JOBS.max_age);
    let mut config = diffmesh_shared::CommonConfig::for_tests(nats.url());
    config.js_job_retention = Duration::from_secs(2 * 24 * 3600);
    let specs = jetstream_layout::configured(
        diffmesh_shared::nats::auth::Role::Router.layout_specs(),
        &config,
    );
    assert_eq!(specs[0].max_age, Duration::from_secs(2 * 24 * 3600));
    jetstream_layout::context(
        &client,
        &config,
        diffmesh_shared::nats::auth::Role::Router,
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        max_age(&js, &stream).await,
        Duration::from_secs(2 * 24 * 3600)
    );
    // Other buckets keep their own limits.
    let blobs = jetstream_layout::BLOBS;
    assert_eq!(max_age(&js, &blobs.stream_name()).await, blobs.max_age);
    assert!(diffmesh_shared::process::config::job_retention("23h").is_err());
    assert_eq!(
        diffmesh_shared::process::config::job_retention("3days").unwrap(),
        Duration::from_secs(3 * 24 * 3600)
    );
}
