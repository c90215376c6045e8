//! The mesh's JetStream layout (`shared::stores::jetstream_layout`) against real servers: what start-up
//! creates on one server, and replica counts on a three-node cluster.
use std::time::{Duration, Instant};

use async_nats::jetstream;
use diffmesh_shared::stores::blob_store::BlobStore;
use diffmesh_shared::stores::idempotency::{Claim, IdempotencyRecord, IdempotencyStore};
use diffmesh_shared::stores::jetstream_layout::{self, ensure_all, Ensured, Layout, ALL};
use diffmesh_shared::stores::job::{JobRecord, JobStore};
use diffmesh_shared::stores::transient;
use diffmesh_shared::testing::{NatsCluster, NatsServer};
use diffmesh_shared::wire::messages::JobKind;

/// The storage budget of these tests' streams (`JS_MAX_BYTES`).
const BUDGET: u64 = 1 << 30;

async fn stream_config(js: &jetstream::Context, name: &str) -> jetstream::stream::Config {
    js.get_stream(name)
        .await
        .unwrap_or_else(|e| panic!("stream {name}: {e}"))
        .cached_info()
        .config
        .clone()
}

#[tokio::test]
async fn start_up_creates_every_bucket_once_with_its_settings() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);

    let first = ensure_all(&js, 1, BUDGET, &[]).await.unwrap();
    assert_eq!(first.len(), ALL.len());
    assert!(
        first
            .iter()
            .all(|(_, e)| *e == Ensured::Created { replicas: 1 }),
        "{first:?}"
    );
    let again = ensure_all(&js, 1, BUDGET, &[]).await.unwrap();
    assert!(
        again
            .iter()
            .all(|(_, e)| *e == Ensured::Existed { replicas: 1 }),
        "{again:?}"
    );

    for spec in ALL {
        let config = stream_config(&js, &spec.stream_name()).await;
        assert_eq!(config.max_age, spec.max_age, "{}", spec.name);
        assert_eq!(config.num_replicas, 1, "{}", spec.name);
        match spec.layout {
            Layout::Kv => {
                assert!(!config.allow_direct, "{}", spec.name);
                js.get_key_value(spec.name.as_ref()).await.unwrap();
            }
            Layout::Objects => assert!(!config.allow_direct, "{}", spec.name),
            Layout::LastPerSubject { .. } => {}
        }
    }
    // The object stores open as such, and the services' opens find what start-up made.
    for spec in [
        jetstream_layout::BLOBS,
        jetstream_layout::CACHES,
        jetstream_layout::TEMPLATE_IMAGES,
    ] {
        let store = BlobStore::open_with(&js, &spec).await.unwrap();
        store.put("k", b"v").await.unwrap();
    }
    let records = jetstream_layout::TEMPLATE_RECORDS
        .open_kv(&js)
        .await
        .unwrap();
    records.put("t", "x".into()).await.unwrap();
    assert_eq!(records.get("t").await.unwrap().as_deref(), Some(&b"x"[..]));
}

/// A KV bucket as earlier versions (and `nats kv add`) made it: direct reads on.
async fn direct_read_bucket(
    js: &jetstream::Context,
    bucket: &str,
    replicas: usize,
) -> jetstream::kv::Store {
    js.create_stream(jetstream::stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: jetstream::stream::DiscardPolicy::New,
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .unwrap();
    js.get_key_value(bucket).await.unwrap()
}

/// Every stream is bounded by its share of the budget, and a new budget re-bounds them at the
/// next start. Full, a bucket of templates, LoRAs or caches refuses a new object (none is
/// dropped to make room) while job blobs and job records drop their oldest.
#[tokio::test]
async fn every_stream_is_bounded_by_its_share_of_the_budget() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    ensure_all(&js, 1, BUDGET, &[]).await.unwrap();
    for spec in ALL {
        let config = stream_config(&js, &spec.stream_name()).await;
        assert_eq!(config.max_bytes, spec.max_bytes(BUDGET), "{}", spec.name);
        assert!(config.max_bytes >= 8 << 20, "{}", spec.name);
    }

    // The smallest budget: every stream at its floor of 8 MiB.
    let small = 1 << 20;
    let done = ensure_all(&js, 1, small, &[]).await.unwrap();
    assert!(
        done.iter()
            .all(|(_, e)| matches!(e, Ensured::Updated { .. })),
        "{done:?}"
    );
    for spec in ALL {
        let config = stream_config(&js, &spec.stream_name()).await;
        assert_eq!(config.max_bytes, 8 << 20, "{}", spec.name);
    }

    // LoRA weights refuse when full: a 6 MiB object fits; a second is refused before a chunk
    // of it is written, and the first stays whole.
    let loras = BlobStore::open_with(&js, &jetstream_layout::LORA_WEIGHTS)
        .await
        .unwrap();
    let six = vec![7u8; 6 << 20];
    loras.put("first", &six).await.unwrap();
    let mut stream = js
        .get_stream(jetstream_layout::LORA_WEIGHTS.stream_name())
        .await
        .unwrap();
    let stored = stream.info().await.unwrap().state.bytes;
    let refused = loras.put("second", &six).await.unwrap_err();
    assert!(
        matches!(refused, diffmesh_shared::MeshError::StoreFull { .. }),
        "{refused}"
    );
    assert_eq!(
        stream.info().await.unwrap().state.bytes,
        stored,
        "chunks were written"
    );
    assert_eq!(loras.get("first").await.unwrap().len(), six.len());

    // Job blobs are a ring: a newer object pushes out the oldest, nothing is refused.
    let blobs = BlobStore::open(&js).await.unwrap();
    for i in 0..3 {
        blobs.put(&format!("blob-{i}"), &six).await.unwrap();
    }
    assert!(blobs.get("blob-2").await.is_ok(), "the newest blob went");

    // Job records: 24 of 512 KiB (12 MiB) into 8 MiB: the oldest went, the newest are there.
    let jobs = js
        .get_key_value(jetstream_layout::JOBS.name.as_ref())
        .await
        .unwrap();
    let record = vec![b'x'; 512 << 10];
    for i in 0..24 {
        jobs.put(format!("job-{i}"), record.clone().into())
            .await
            .unwrap();
    }
    assert!(
        jobs.get("job-0").await.unwrap().is_none(),
        "the oldest record stayed"
    );
    assert!(
        jobs.get("job-23").await.unwrap().is_some(),
        "the newest record went"
    );
}

#[tokio::test]
async fn start_up_turns_off_direct_reads_of_an_older_bucket() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    let records = jetstream_layout::TEMPLATE_RECORDS;
    let older = direct_read_bucket(&js, &records.name, 1).await;
    older.put("t", "kept".into()).await.unwrap();
    // An object store as earlier versions made it (async-nats' layout: direct reads on).
    let blobs = jetstream_layout::BLOBS;
    js.create_object_store(jetstream::object_store::Config {
        bucket: blobs.name.to_string(),
        max_age: blobs.max_age,
        ..Default::default()
    })
    .await
    .unwrap();
    let older_blobs = BlobStore::open(&js).await.unwrap();
    older_blobs.put("b", b"kept").await.unwrap();
    for name in [records.stream_name(), blobs.stream_name()] {
        assert!(stream_config(&js, &name).await.allow_direct, "{name}");
    }

    let done = ensure_all(&js, 1, BUDGET, &[]).await.unwrap();
    for name in [records.stream_name(), blobs.stream_name()] {
        let ensured = &done.iter().find(|(n, _)| *n == name).unwrap().1;
        assert_eq!(
            *ensured,
            Ensured::Updated {
                replicas_before: 1,
                replicas: 1
            },
            "{name}"
        );
        assert!(!stream_config(&js, &name).await.allow_direct, "{name}");
    }
    let blobs = BlobStore::open(&js).await.unwrap();
    assert_eq!(blobs.get("b").await.unwrap(), b"kept");
    let records = jetstream_layout::TEMPLATE_RECORDS
        .open_kv(&js)
        .await
        .unwrap();
    assert_eq!(
        records.get("t").await.unwrap().as_deref(),
        Some(&b"kept"[..])
    );
}

/// One cluster test at a time: three servers per test already load a 2-core machine, and
/// leader elections slow down with every server beside them.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `attempt`'s result once it succeeds: a fresh cluster accepts JetStream requests only once
/// it has elected its meta leader.
async fn when_ready<T, F>(mut attempt: impl FnMut() -> F) -> T
where
    F: std::future::Future<Output = Result<T, diffmesh_shared::MeshError>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match attempt().await {
            Ok(done) => return done,
            Err(err) if Instant::now() < deadline => {
                eprintln!("cluster not ready yet: {err}");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(err) => panic!("the cluster was not ready within 30 s: {err}"),
        }
    }
}

async fn ensure_all_when_ready(js: &jetstream::Context, replicas: usize) -> Vec<(String, Ensured)> {
    when_ready(|| ensure_all(js, replicas, BUDGET, &[])).await
}

#[tokio::test]
async fn a_cluster_gets_every_bucket_with_the_configured_replicas() {
    let _one = ONE_CLUSTER.lock().await;
    let cluster = NatsCluster::start(3);
    let client = async_nats::connect(cluster.nodes[0].url()).await.unwrap();
    let js = jetstream::new(client);
    // A service started without JS_REPLICAS made the job bucket first, with one replica.
    let jobs = when_ready(|| jetstream_layout::JOBS.open_kv(&js)).await;
    jobs.put("j", "before".into()).await.unwrap();

    let done = ensure_all_when_ready(&js, 3).await;
    for (name, ensured) in &done {
        let expected = if *name == jetstream_layout::JOBS.stream_name() {
            Ensured::Updated {
                replicas_before: 1,
                replicas: 3,
            }
        } else {
            Ensured::Created { replicas: 3 }
        };
        assert_eq!(*ensured, expected, "{name}");
        assert_eq!(stream_config(&js, name).await.num_replicas, 3, "{name}");
    }
    // The scaled bucket kept its entry, and a service started later with one replica scales
    // nothing down.
    let jobs = jetstream_layout::JOBS.open_kv(&js).await.unwrap();
    assert_eq!(
        jobs.get("j").await.unwrap().as_deref(),
        Some(&b"before"[..])
    );
    let later = ensure_all_when_ready(&js, 1).await;
    assert!(
        later
            .iter()
            .all(|(_, e)| *e == Ensured::Existed { replicas: 3 }),
        "{later:?}"
    );

    // Through another node, a mesh bucket reads every acknowledged write at once; a bucket
    // taking direct reads (the KV default) does not always.
    let other = jetstream::new(async_nats::connect(cluster.nodes[2].url()).await.unwrap());
    let direct = direct_read_bucket(&js, "direct-reads", 3).await;
    let direct_other = other.get_key_value("direct-reads").await.unwrap();
    let records = jetstream_layout::TEMPLATE_RECORDS
        .open_kv(&js)
        .await
        .unwrap();
    let other_records = jetstream_layout::TEMPLATE_RECORDS
        .open_kv(&other)
        .await
        .unwrap();
    let (writes, mut stale_direct) = (200u32, 0);
    for i in 0..writes {
        let value = i.to_string();
        records.put("t", value.clone().into()).await.unwrap();
        let seen = other_records.get("t").await.unwrap();
        assert_eq!(seen.as_deref(), Some(value.as_bytes()), "write {i}");
        direct.put("t", value.clone().into()).await.unwrap();
        if direct_other.get("t").await.unwrap().as_deref() != Some(value.as_bytes()) {
            stale_direct += 1;
        }
    }
    eprintln!("direct reads through another node: {stale_direct} of {writes} stale");

    // The same for objects: one service stores a capture's cache, another reads it by key at
    // once (the cachestore's cluster tier). Through another node the mesh's object store finds
    // every object; one made in async-nats' layout (direct reads) answers "not found" at times.
    let blobs = BlobStore::open(&js).await.unwrap();
    let other_blobs = BlobStore::open(&other).await.unwrap();
    let direct_objects = js
        .create_object_store(jetstream::object_store::Config {
            bucket: "direct-objects".to_string(),
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .unwrap();
    let direct_objects_other = other.get_object_store("direct-objects").await.unwrap();
    let (puts, mut missing_direct) = (100u32, 0);
    for i in 0..puts {
        let key = format!("cache/{i}");
        blobs.put(&key, key.as_bytes()).await.unwrap();
        let seen = other_blobs.get(&key).await;
        assert_eq!(
            seen.unwrap_or_else(|e| panic!("{key}: {e}")),
            key.as_bytes()
        );
        direct_objects
            .put(key.as_str(), &mut key.as_bytes())
            .await
            .unwrap();
        if direct_objects_other.info(&key).await.is_err() {
            missing_direct += 1;
        }
    }
    eprintln!("direct object reads through another node: {missing_direct} of {puts} not found");
}

/// p50 / p99 of `get` after a `put` of the same key, in microseconds.
async fn read_latency_us(kv: &jetstream::kv::Store, rounds: usize) -> (f64, f64) {
    let mut us = Vec::with_capacity(rounds);
    for i in 0..rounds {
        kv.put("k", i.to_string().into()).await.unwrap();
        let start = Instant::now();
        kv.get("k").await.unwrap().unwrap();
        us.push(start.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    (us[rounds / 2], us[rounds * 99 / 100])
}

/// What leader reads cost against direct gets (a measurement, not a check):
/// `cargo test --release -p diffmesh-tests --test jetstream_layout -- --ignored --nocapture`.
#[tokio::test]
#[ignore]
async fn kv_read_latency_leader_against_direct() {
    let rounds = 2000;
    let nats = NatsServer::start();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    print_read_latencies(&js, "one server", 1, rounds).await;
    let _one = ONE_CLUSTER.lock().await;
    let cluster = NatsCluster::start(3);
    let js = jetstream::new(async_nats::connect(cluster.nodes[0].url()).await.unwrap());
    ensure_all_when_ready(&js, 3).await;
    print_read_latencies(&js, "3-node cluster", 3, rounds).await;
}

/// Print [`read_latency_us`] of the job bucket (leader reads) and of a direct-read bucket.
async fn print_read_latencies(
    js: &jetstream::Context,
    place: &str,
    replicas: usize,
    rounds: usize,
) {
    let leader = jetstream_layout::JOBS.open_kv(js).await.unwrap();
    let direct = direct_read_bucket(js, "direct-reads", replicas).await;
    for (how, kv) in [("leader", &leader), ("direct", &direct)] {
        let (p50, p99) = read_latency_us(kv, rounds).await;
        println!("{place}, {how}: p50 {p50:.0} us, p99 {p99:.0} us");
    }
}

#[tokio::test]
async fn blob_reads_survive_the_loss_of_a_node() {
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster = NatsCluster::start(3);
    let client = async_nats::ConnectOptions::new()
        .connect(
            cluster.nodes[..2]
                .iter()
                .map(|n| n.url().parse::<async_nats::ServerAddr>().unwrap())
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    let js = jetstream::new(client);
    ensure_all_when_ready(&js, 3).await;
    let blobs = BlobStore::open(&js).await.unwrap();
    let data = vec![7u8; 300_000];
    for i in 0..4 {
        blobs.put(&format!("job/{i}"), &data).await.unwrap();
    }
    // The client stays connected to a live node; the lost node still holds replicas, and
    // reads' consumers were placed on it for a while (about half the attempts here: each such
    // read failed after 10 s before reads were tried again).
    drop(cluster.nodes.pop());
    let fallbacks = || transient::retries().with_label_values(&["blob.get"]).get();
    let fallbacks_before = fallbacks();
    let start = Instant::now();
    for round in 0..2 {
        for i in 0..4 {
            let key = format!("job/{i}");
            let read = blobs.get(&key).await;
            let read = read.unwrap_or_else(|e| panic!("round {round}, {key}: {e}"));
            assert_eq!(read, data);
        }
    }
    eprintln!("8 reads in {:.1?}", start.elapsed());
    // Once a read fell back to the leader, the store's later reads go there straight away.
    assert!(fallbacks() - fallbacks_before <= 1);
}

/// A crash (SIGKILL) of the node that leads the job records' stream: the survivors elect a
/// new leader only after their election timeout (seconds), and requests sent meanwhile get no
/// answer at all. Reads and writes through a client on the surviving nodes must still succeed.
#[tokio::test]
async fn job_records_survive_a_crash_of_their_streams_leader() {
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster = NatsCluster::start(3);
    let setup = diffmesh_shared::nats::connect(&cluster.url(), "setup", Duration::from_secs(5))
        .await
        .unwrap();
    let setup_js = jetstream::new(setup);
    ensure_all_when_ready(&setup_js, 3).await;
    let not_yet = |reason: String| diffmesh_shared::MeshError::JetStreamLayout {
        name: "KV_diffmesh-jobs".into(),
        reason,
    };
    let leader = when_ready(|| async {
        let mut stream = setup_js
            .get_stream("KV_diffmesh-jobs")
            .await
            .map_err(|e| not_yet(e.to_string()))?;
        let info = stream.info().await.map_err(|e| not_yet(e.to_string()))?;
        (info.cluster.as_ref().and_then(|c| c.leader.clone()))
            .ok_or_else(|| not_yet("no leader yet".into()))
    })
    .await;
    // NatsCluster names its nodes n0, n1, ...
    let leader_index: usize = leader.trim_start_matches('n').parse().unwrap();
    // The client lives on the other nodes: no reconnect, only a lost leader.
    let survivors: Vec<String> = (0..3)
        .filter(|i| *i != leader_index)
        .map(|i| cluster.nodes[i].url())
        .collect();
    let client =
        diffmesh_shared::nats::connect(&survivors.join(","), "crash", Duration::from_secs(5))
            .await
            .unwrap();
    let jobs = JobStore::open(&jetstream::new(client)).await.unwrap();
    for i in 0..3 {
        jobs.create(&JobRecord::new(format!("before-{i}"), JobKind::Edit))
            .await
            .unwrap();
    }
    cluster.nodes[leader_index].kill();
    let start = Instant::now();
    for i in 0..3 {
        let id = format!("before-{i}");
        let read = jobs.get(&id).await;
        assert!(
            matches!(read, Ok(Some(_))),
            "{id}: read {:.1?} after the crash: {read:?}",
            start.elapsed()
        );
        jobs.update(&id, |r| r.mark_running("w1"))
            .await
            .unwrap_or_else(|e| {
                panic!("{id}: update {:.1?} after the crash: {e}", start.elapsed())
            });
    }
    eprintln!(
        "reads and updates went on {:.1?} after the crash",
        start.elapsed()
    );
}

/// Every store's writes during an outage: each would fail (503, no leader) without
/// `shared::stores::transient`; each must land once a node returns.
#[tokio::test]
async fn writes_made_while_the_cluster_has_no_quorum_land_once_it_returns() {
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster = NatsCluster::start(3);
    let client = async_nats::connect(cluster.nodes[0].url()).await.unwrap();
    let js = jetstream::new(client);
    ensure_all_when_ready(&js, 3).await;
    // A loaded machine (CI) can take longer than the default window to elect leaders again.
    let window = Duration::from_secs(60);
    let jobs = JobStore::open(&js).await.unwrap().with_retry_window(window);
    let keys = IdempotencyStore::open(&js)
        .await
        .unwrap()
        .with_retry_window(window);
    let blobs = BlobStore::open(&js)
        .await
        .unwrap()
        .with_retry_window(window);
    jobs.create(&JobRecord::new("before", JobKind::Generate))
        .await
        .unwrap();
    blobs.put("before/input", b"old").await.unwrap();

    // Two of three nodes down: no bucket has a leader, every write fails (503) until one
    // comes back.
    cluster.nodes[1].kill();
    cluster.nodes[2].kill();
    let record = JobRecord::new("during", JobKind::Generate);
    let claim = IdempotencyRecord {
        job_id: "during".to_string(),
        fingerprint: "f".to_string(),
        created_at_ms: 1,
    };
    let writes = {
        let (jobs, keys, blobs, record, claim) = (
            jobs.clone(),
            keys.clone(),
            blobs.clone(),
            record.clone(),
            claim.clone(),
        );
        tokio::spawn(async move {
            let (created, updated, claimed, put, deleted) = tokio::join!(
                jobs.create(&record),
                jobs.update("before", |r| r.mark_running("w1")),
                keys.claim("k1", &claim),
                blobs.put("during/result", b"png"),
                blobs.delete("before/input"),
            );
            created.expect("job create");
            updated.expect("job update");
            assert_eq!(claimed.expect("idempotency claim"), Claim::Created);
            put.expect("blob put");
            deleted.expect("blob delete");
        })
    };
    // Longer than a JetStream request's own timeout (5 s): a write not tried again has failed
    // by then (some fail at once with 503, others time out).
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(!writes.is_finished(), "a write gave up during the outage");
    cluster.nodes[1].restart();
    writes
        .await
        .expect("every write landed once the quorum returned");
    // The creates met the outage (a stream without a leader answers them 503 at once) and
    // were tried again. Other calls may instead wait out the outage inside one attempt (an
    // object put whose chunks the new leader acknowledges), so they are not counted here.
    let retried = |call| transient::retries().with_label_values(&[call]).get();
    for call in ["job.create", "idempotency.create"] {
        assert!(retried(call) > 0, "{call} was not tried again");
    }

    assert_eq!(jobs.get("during").await.unwrap(), Some(record));
    let before = jobs.get("before").await.unwrap().unwrap();
    assert_eq!(before.worker_id.as_deref(), Some("w1"));
    assert_eq!(keys.get("k1").await.unwrap(), Some(claim));
    assert_eq!(blobs.get("during/result").await.unwrap(), b"png");
    assert!(matches!(
        blobs.get("before/input").await,
        Err(diffmesh_shared::MeshError::BlobNotFound { .. })
    ));
}

#[tokio::test]
async fn blobs_read_from_the_leader_whole_and_checked() {
    let nats = NatsServer::start();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let blobs = BlobStore::open(&js).await.unwrap();
    // Empty, one partial chunk, exactly two chunks (128 KiB each), several and a bit.
    for size in [0usize, 5, 256 << 10, (1 << 20) + 3] {
        let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let key = format!("obj/{size}");
        blobs.put(&key, &data).await.unwrap();
        // Another object's chunks in between, as concurrent writers leave them.
        blobs.put("other", &[9u8; 300_000]).await.unwrap();
        let read = blobs.read_from_leader(&key, usize::MAX).await.unwrap();
        assert!(read == data, "{size} bytes read back differently");
    }
    // Replaced: the new bytes, not the old chunks.
    blobs.put("obj/5", b"replaced").await.unwrap();
    assert_eq!(
        blobs.read_from_leader("obj/5", usize::MAX).await.unwrap(),
        b"replaced"
    );
    assert!(matches!(
        blobs.read_from_leader("obj/1048579", 1 << 20).await,
        Err(diffmesh_shared::MeshError::BlobTooLarge { size: 1048579, .. })
    ));
    blobs.delete("obj/5").await.unwrap();
    assert!(matches!(
        blobs.read_from_leader("obj/5", usize::MAX).await,
        Err(diffmesh_shared::MeshError::BlobNotFound { .. })
    ));
}

/// CPU seconds the process `pid` has used (user + system), from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit(") ").next().unwrap().split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// What the two read paths cost, client wall time and server CPU per read (a measurement, not
/// a check): `cargo test --release -p diffmesh-tests --test jetstream_layout blob_read_paths --
/// --ignored --nocapture`. Server CPU includes deleting the consumers once idle.
#[tokio::test]
#[ignore]
async fn blob_read_paths_consumer_against_leader() {
    let nats = NatsServer::start();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    ensure_all(&js, 1, BUDGET, &[]).await.unwrap();
    let by_consumer = BlobStore::open(&js)
        .await
        .unwrap()
        .with_small_blob_chunks(0);
    let by_gets = BlobStore::open(&js)
        .await
        .unwrap()
        .with_small_blob_chunks(usize::MAX);
    // 200 MiB of other objects first: the leader path looks chunks up from sequence 1.
    let filler = vec![3u8; 1 << 20];
    for i in 0..200 {
        by_gets.put(&format!("fill/{i}"), &filler).await.unwrap();
    }
    let idle_consumers = || async {
        let mut stream = js.get_stream("OBJ_diffmesh-blobs").await.unwrap();
        for _ in 0..120 {
            if stream.info().await.unwrap().state.consumer_count == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    for size in [4 << 10, 128 << 10, 512 << 10, 640 << 10, 1 << 20, 16 << 20] {
        let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        by_gets.put("obj", &data).await.unwrap();
        let rounds = if size > 1 << 20 { 10 } else { 200 };
        for (path, store) in [("consumer", &by_consumer), ("message gets", &by_gets)] {
            idle_consumers().await;
            let (cpu, t) = (cpu_seconds(nats.pid()), Instant::now());
            for _ in 0..rounds {
                assert!(store.get("obj").await.unwrap() == data);
            }
            let wall = t.elapsed() / rounds;
            idle_consumers().await;
            let server_ms = (cpu_seconds(nats.pid()) - cpu) * 1e3 / rounds as f64;
            eprintln!("{size} bytes by {path}: {wall:.2?} a read, server {server_ms:.2} ms CPU");
        }
    }
}

/// What a job-record update costs, read first or written on the known revision (a
/// measurement, not a check): `cargo test --release -p diffmesh-tests --test jetstream_layout
/// job_update_known_revisions -- --ignored --nocapture`. Each job is created, then updated
/// ten times (a step each), as the gateway driving it does.
#[tokio::test]
#[ignore]
async fn job_update_known_revisions_against_reads() {
    let nats = NatsServer::start();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    ensure_all(&js, 1, BUDGET, &[]).await.unwrap();
    let reading = JobStore::open(&js).await.unwrap();
    let knowing = JobStore::open(&js)
        .await
        .unwrap()
        .with_known_revisions(10_000);
    let (jobs, updates) = (200, 10);
    for round in 0..3 {
        for (path, store) in [("read first", &reading), ("known revision", &knowing)] {
            let ids: Vec<String> = (0..jobs)
                .map(|j| format!("{path}-{round}-{j}").replace(' ', "-"))
                .collect();
            for id in &ids {
                store
                    .create(&JobRecord::new(id.as_str(), JobKind::Edit))
                    .await
                    .unwrap();
            }
            let (cpu, t) = (cpu_seconds(nats.pid()), Instant::now());
            for id in &ids {
                for step in 1..=updates {
                    store
                        .update(id, |r| r.mark_step(step, updates))
                        .await
                        .unwrap();
                }
            }
            let n = jobs * updates;
            let wall = t.elapsed() / n;
            let server_ms = (cpu_seconds(nats.pid()) - cpu) * 1e3 / f64::from(n);
            eprintln!("round {round}, {path}: {wall:.2?} an update, server {server_ms:.3} ms CPU");
        }
    }
}

/// How long job-record watches (one per SSE client or idempotent replay) take to deliver again
/// after a server restart, when all of them reopen at once on the reconnect (a measurement,
/// not a check): `cargo test --release -p diffmesh-tests --test jetstream_layout
/// record_watches_after_a_restart -- --ignored --nocapture`. Every job is updated right after
/// the restart; the figure is the time from the restart until each watch has its update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn record_watches_after_a_restart() {
    use diffmesh_shared::stores::job::JobState;
    use futures::{stream, StreamExt};
    for watches in [100usize, 1000, 3000] {
        let mut nats = NatsServer::start();
        // The mesh's connect: it tells the watches of the reconnect.
        let client = diffmesh_shared::nats::connect(&nats.url(), "watches", Duration::from_secs(5))
            .await
            .unwrap();
        let js = jetstream::new(client);
        ensure_all(&js, 1, BUDGET, &[]).await.unwrap();
        let jobs = JobStore::open(&js).await.unwrap();
        let ids: Vec<String> = (0..watches).map(|i| format!("w{i}")).collect();
        stream::iter(&ids)
            .for_each_concurrent(64, |id| {
                let jobs = jobs.clone();
                async move {
                    jobs.create(&JobRecord::new(id.as_str(), JobKind::Edit))
                        .await
                        .unwrap()
                }
            })
            .await;
        let (ran_tx, mut ran_rx) = tokio::sync::mpsc::unbounded_channel();
        for id in &ids {
            let mut records = jobs.watch(id).await.unwrap();
            assert!(records.next().await.unwrap().is_ok());
            let ran_tx = ran_tx.clone();
            tokio::spawn(async move {
                while let Some(Ok(record)) = records.next().await {
                    if record.state == JobState::Running {
                        let _ = ran_tx.send(Instant::now());
                        return;
                    }
                }
            });
        }
        drop(ran_tx);
        nats.restart();
        let restarted = Instant::now();
        let cpu = cpu_seconds(nats.pid());
        stream::iter(&ids)
            .for_each_concurrent(64, |id| {
                let jobs = jobs.clone();
                async move {
                    jobs.update(id, |r| r.mark_running("w")).await.unwrap();
                }
            })
            .await;
        let updated = restarted.elapsed();
        let mut delays = Vec::with_capacity(watches);
        while let Ok(Some(at)) = tokio::time::timeout(Duration::from_secs(30), ran_rx.recv()).await
        {
            delays.push(at - restarted);
        }
        delays.sort();
        let server_s = cpu_seconds(nats.pid()) - cpu;
        let pick = |q: f64| {
            delays.get(((delays.len() as f64 * q) as usize).min(delays.len().saturating_sub(1)))
        };
        eprintln!(
            "{watches} watches: {} of them delivered again; after the restart p50 {:?}, p99 {:?}, \
             last {:?} (every update written by {updated:?}); server {server_s:.2} s CPU",
            delays.len(),
            pick(0.5),
            pick(0.99),
            delays.last(),
        );
    }
}
