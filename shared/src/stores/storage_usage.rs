//! How full the mesh's JetStream streams are, for `/metrics` and the storage alerts:
//! `diffmesh_jetstream_stream_bytes{stream}` (stored now) and
//! `diffmesh_jetstream_stream_limit_bytes{stream, when_full}` (its byte bound, absent when
//! unbounded; `when_full` is `refuse` or `drop_oldest`: only the first kind fails writes when
//! full, so only it needs an alert before).
//! The router samples them (one active router: one reader of the stream infos, however many
//! gateways and denoisers run).
use std::time::Duration;

use async_nats::jetstream;
use prometheus::{IntGaugeVec, Opts, Registry};
use tokio_util::sync::CancellationToken;

use crate::stores::{async_queue, jetstream_layout, webhook_queue};

/// How often the streams are read: storage fills over minutes, and each read is one request
/// per stream.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(15);

#[derive(Clone)]
pub struct StorageGauges {
    bytes: IntGaugeVec,
    limit: IntGaugeVec,
}

impl StorageGauges {
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let bytes = IntGaugeVec::new(
            Opts::new(
                "diffmesh_jetstream_stream_bytes",
                "Bytes a JetStream stream of the mesh stores now (one replica's)",
            ),
            &["stream"],
        )?;
        let limit = IntGaugeVec::new(
            Opts::new(
                "diffmesh_jetstream_stream_limit_bytes",
                "The stream's byte bound (its share of JS_MAX_BYTES; the async and webhook queues' own)",
            ),
            &["stream", "when_full"],
        )?;
        registry.register(Box::new(bytes.clone()))?;
        registry.register(Box::new(limit.clone()))?;
        Ok(Self { bytes, limit })
    }

    /// Read every stream of the mesh once; one that cannot be read keeps its last values.
    pub async fn sample(&self, js: &jetstream::Context) {
        let mut names: Vec<String> = jetstream_layout::ALL
            .iter()
            .map(|spec| spec.stream_name())
            .collect();
        names.push(async_queue::STREAM.to_string());
        names.push(webhook_queue::STREAM.to_string());
        for name in names {
            // Getting the stream reads its info.
            let Ok(stream) = js.get_stream(&name).await else {
                continue;
            };
            let info = stream.cached_info();
            self.bytes
                .with_label_values(&[&name])
                .set(i64::try_from(info.state.bytes).unwrap_or(i64::MAX));
            if info.config.max_bytes > 0 {
                let when_full = match info.config.discard {
                    jetstream::stream::DiscardPolicy::Old => "drop_oldest",
                    _ => "refuse",
                };
                self.limit
                    .with_label_values(&[&name, when_full])
                    .set(info.config.max_bytes);
            }
        }
    }

    /// Sample every [`SAMPLE_EVERY`] until `shutdown`.
    pub async fn watch(self, js: jetstream::Context, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => self.sample(&js).await,
            }
        }
    }
}
