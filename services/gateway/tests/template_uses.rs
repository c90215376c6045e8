//! `TemplateUses` against a real JetStream: a use counts while its job record has not ended,
//! uses of ended (or unknown) jobs are dropped when counted, and a use begun after the
//! template was marked `deleting` is refused and leaves nothing behind.
use diffmesh_gateway::error::ApiError;
use diffmesh_gateway::templates::record::{TemplateRecord, TemplateState, TemplateStore};
use diffmesh_gateway::templates::uses::TemplateUses;
use diffmesh_shared::stores::job::{JobRecord, JobStore};
use diffmesh_shared::testing::NatsServer;
use diffmesh_shared::wire::messages::{JobKind, TemplateRef};
use diffmesh_shared::wire::subjects::TEMPLATE_USES_STREAM;

const TEMPLATE: &str = "7f0c3a52-1d2e-4b8a-9c3d-2a1b0c9d8e7f";

fn job_id(n: u8) -> String {
    format!("00000000-0000-4000-8000-0000000000{n:02}")
}

async fn messages(js: &async_nats::jetstream::Context) -> u64 {
    let mut stream = js.get_stream(TEMPLATE_USES_STREAM).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// A fresh JetStream with the stores and one `ready` template, `TEMPLATE`.
struct Setup {
    _nats: NatsServer,
    js: async_nats::jetstream::Context,
    records: TemplateStore,
    jobs: JobStore,
    uses: TemplateUses,
}

async fn setup() -> Setup {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let records = TemplateStore::open(&js).await.unwrap();
    let jobs = JobStore::open(&js).await.unwrap();
    let uses = TemplateUses::open(&js, records.clone(), jobs.clone())
        .await
        .unwrap();
    let template = TemplateRef {
        template_id: TEMPLATE.into(),
        prompt: String::new(),
        seed: 1,
        steps: 4,
        guidance_scale: 1.0,
        cache_key: "tpl-k".into(),
    };
    let mut record = TemplateRecord::new(TEMPLATE.into(), None, &template);
    record.state = TemplateState::Ready;
    records.create(&record).await.unwrap();
    Setup {
        _nats: nats,
        js,
        records,
        jobs,
        uses,
    }
}

#[tokio::test]
async fn uses_count_until_their_jobs_end_and_a_deleting_template_takes_none() {
    let Setup {
        _nats,
        js,
        records,
        jobs,
        uses,
    } = setup().await;
    for n in 1..=3 {
        jobs.create(&JobRecord::new(job_id(n), JobKind::Edit))
            .await
            .unwrap();
    }

    assert!(uses.in_flight(TEMPLATE).await.unwrap().is_empty());
    uses.begin(TEMPLATE, &job_id(1)).await.unwrap();
    uses.begin(TEMPLATE, &job_id(2)).await.unwrap();
    // A use whose job record does not exist (expired) does not count.
    uses.begin(TEMPLATE, &job_id(9)).await.unwrap();
    assert_eq!(
        uses.in_flight(TEMPLATE).await.unwrap(),
        vec![job_id(1), job_id(2)]
    );
    assert_eq!(messages(&js).await, 2, "the unknown job's use was dropped");

    // Job 1 ends: it no longer counts, and counting drops its use.
    jobs.update(&job_id(1), |r| r.mark_done(vec![]))
        .await
        .unwrap();
    assert_eq!(uses.in_flight(TEMPLATE).await.unwrap(), vec![job_id(2)]);
    assert_eq!(messages(&js).await, 1);

    // Once the template is deleting, a new use is refused (409) and leaves nothing.
    records
        .update(TEMPLATE, |r| r.state = TemplateState::Deleting)
        .await
        .unwrap();
    match uses.begin(TEMPLATE, &job_id(3)).await {
        Err(ApiError::Conflict { message }) => assert!(message.contains("being deleted")),
        other => panic!("expected 409, got {other:?}"),
    }
    assert_eq!(uses.in_flight(TEMPLATE).await.unwrap(), vec![job_id(2)]);
    // Another template's count does not include this one's uses.
    assert!(uses
        .in_flight("7f0c3a52-1d2e-4b8a-9c3d-2a1b0c9d8e70")
        .await
        .unwrap()
        .is_empty());

    // Its driver ends the last use.
    uses.end(TEMPLATE, &job_id(2)).await;
    assert!(uses.in_flight(TEMPLATE).await.unwrap().is_empty());
    assert_eq!(messages(&js).await, 0);
}

/// What a use adds to each edit: begin (publish + record read) and end (purge), timed against
/// a local nats-server. A measurement, not a check: `cargo test --release -p diffmesh-gateway
/// --test template_uses -- --ignored --nocapture`.
#[tokio::test]
#[ignore = "measurement; run by hand"]
async fn time_a_use() {
    const N: u32 = 500;
    let Setup { _nats, uses, .. } = setup().await;
    let (mut begin, mut end) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
    for i in 0..N {
        let job = format!("00000000-0000-4000-8000-{i:012}");
        let t = std::time::Instant::now();
        uses.begin(TEMPLATE, &job).await.unwrap();
        begin += t.elapsed();
        let t = std::time::Instant::now();
        uses.end(TEMPLATE, &job).await;
        end += t.elapsed();
    }
    println!(
        "template use over {N}: begin {:.3} ms, end {:.3} ms (mean)",
        begin.as_secs_f64() * 1e3 / f64::from(N),
        end.as_secs_f64() * 1e3 / f64::from(N)
    );
}
