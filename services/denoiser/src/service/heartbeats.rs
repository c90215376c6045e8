//! Heartbeats out: this denoiser's load, caches and step samples, every
//! `--heartbeat-interval`.
use super::Service;
use diffmesh_shared::nats::publish_msgpack;
use diffmesh_shared::wire::messages::Heartbeat;
use diffmesh_shared::{wire::subjects, MeshError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

impl Service {
    pub fn heartbeat(&self) -> Heartbeat {
        let status = self.engine.status();
        let controlnets = self.controlnets_served();
        let mut card = self.card.clone();
        card.features.controlnet = !controlnets.is_empty();
        Heartbeat {
            worker_id: self.worker_id.clone(),
            running: status.running,
            queued: status.queued,
            waiting: status.waiting,
            max_batch: self.config.max_batch as u32,
            model: self.model_id.clone(),
            card: Some(card),
            draining: status.draining
                || self.draining.load(Ordering::SeqCst)
                || self.sickness.is_sick(std::time::Instant::now()),
            queue_capacity: self.config.max_queue as u32,
            cached_templates: self.templates.local.keys(),
            cached_loras: self.loras.ids(),
            controlnets,
            recent_steps: self.engine.take_step_samples(),
            controlnet_step_s: status.controlnet_step_s,
            interval_ms: self
                .config
                .heartbeat_interval
                .as_millis()
                .min(u32::MAX.into()) as u32,
            ranks: status.ranks,
            free_ranks: status.free_ranks,
        }
    }

    pub async fn send_heartbeat(&self) {
        let sick = self.sickness.is_sick(std::time::Instant::now());
        self.metrics.sick.set(i64::from(sick));
        if let Some(memory) = self.device_memory.sample() {
            let gauge = &self.metrics.device_memory_bytes;
            gauge.with_label_values(&["used"]).set(memory.used as i64);
            gauge.with_label_values(&["free"]).set(memory.free as i64);
        }
        if let Err(err) = publish_msgpack(
            &self.client,
            subjects::DENOISER_HEARTBEAT,
            None,
            &self.heartbeat(),
        )
        .await
        {
            tracing::warn!(error = %err, "could not publish heartbeat");
        }
    }

    pub async fn heartbeats(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), MeshError> {
        let mut tick = tokio::time::interval(
            self.config
                .heartbeat_interval
                .max(Duration::from_millis(10)),
        );
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => self.send_heartbeat().await,
            }
        }
    }
}
