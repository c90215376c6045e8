//! `cargo xtask bench controlnet-service`: steered generations through the engine with the
//! ControlNet on the engine thread (`off`), on a ControlNet worker for the step about to run
//! (`sync`), and on a worker one step behind (`pipelined`), over a real NATS server; the
//! latency per image, throughput with several images at once, and what each does to the image
//! (PSNR against `off`, silhouette IoU with the trained ControlNet).
use diffmesh_controlnet::{self as worker, WorkerConfig, WorkerHandle};
use diffmesh_denoiser::controlnet_service::{
    ControlNetWorkers, Network, RemoteControlNets, RemoteMode, RemoteSettings,
};
use diffmesh_denoiser::engine::{spawn_engine, EngineConfig, EngineEvent, EngineHandle, EngineJob};
use diffmesh_denoiser::metrics::DenoiserMetrics;
use diffmesh_denoiser::model::EngineModel;
use diffmesh_model::tch::{Device, Kind};
use diffmesh_shared::wire::controlnet::ControlNetRef;
use diffmesh_shared::wire::messages::DenoiseJob;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Span;

/// An engine whose steered steps follow `mode` (`Off`: its own ControlNets only).
pub struct SteeredEngine {
    pub handle: EngineHandle,
    pub events: mpsc::Receiver<EngineEvent>,
    pub metrics: DenoiserMetrics,
    pub workers: ControlNetWorkers,
    stop: CancellationToken,
}

impl Drop for SteeredEngine {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The engine of `model_dir` with `controlnet_dir` as its own ControlNets, following the
/// ControlNet workers on the NATS server at `url`.
pub async fn steered_engine(
    url: &str,
    model_dir: &Path,
    controlnet_dir: &Path,
    mode: RemoteMode,
    max_batch: usize,
) -> anyhow::Result<SteeredEngine> {
    let mut model =
        EngineModel::load(model_dir, Device::Cpu, Kind::Float, "tiny".into(), Some(64))?;
    model.controlnet_dir = Some(controlnet_dir.to_path_buf());
    let client = async_nats::connect(url).await?;
    let workers = ControlNetWorkers::new(4, Network::Flux);
    let stop = CancellationToken::new();
    tokio::spawn(workers.clone().listen(client.clone(), stop.clone()));
    model.controlnet_service = Some(RemoteControlNets::new(
        client,
        tokio::runtime::Handle::current(),
        workers.clone(),
        RemoteSettings {
            mode,
            timeout: Duration::from_secs(5),
            attempts: 3,
            max_reply_bytes: 256 << 20,
        },
    ));
    let registry = prometheus::Registry::new();
    let metrics = DenoiserMetrics::new(&registry)?;
    let (tx, events) = mpsc::channel(1024);
    let config = EngineConfig {
        max_batch,
        ..Default::default()
    };
    let (handle, _drained) = spawn_engine(model, config, 64, tx, Some(metrics.clone()))?;
    Ok(SteeredEngine {
        handle,
        events,
        metrics,
        workers,
        stop,
    })
}

impl SteeredEngine {
    /// Wait until the workers serving `name` are known (or, `false`, gone).
    pub async fn wait_for_workers(&self, name: &str, serving: bool) -> anyhow::Result<()> {
        for _ in 0..500 {
            if self.workers.serves(name) == serving {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        anyhow::bail!("workers serving `{name}` never became {serving}")
    }

    /// Run `jobs` at once; each image by job id, and the time from submit to the last image.
    pub async fn run(
        &mut self,
        jobs: Vec<EngineJob>,
    ) -> anyhow::Result<(HashMap<String, Vec<u8>>, f64)> {
        let started = Instant::now();
        let mut left = jobs.len();
        for j in jobs {
            self.handle.submit(j, Span::none()).await?;
        }
        let mut images = HashMap::new();
        while left > 0 {
            let event = tokio::time::timeout(Duration::from_secs(300), self.events.recv())
                .await?
                .ok_or_else(|| anyhow::anyhow!("engine stopped"))?;
            match event {
                EngineEvent::Finished {
                    job,
                    images: mut out,
                    ..
                } => {
                    images.insert(job.job_id, out.remove(0));
                    left -= 1;
                }
                EngineEvent::Failed { job, error, .. } => {
                    anyhow::bail!("job {} failed: {error}", job.job_id)
                }
                _ => {}
            }
        }
        Ok((images, started.elapsed().as_secs_f64()))
    }

    pub fn remote(&self, outcome: &str) -> u64 {
        self.metrics
            .controlnet
            .remote
            .with_label_values(&[outcome])
            .get()
    }

    /// Mean wait of the engine thread for remote residuals per step (ms).
    pub fn mean_wait_ms(&self) -> f64 {
        let h = &self.metrics.controlnet.remote_wait_seconds;
        1e3 * h.get_sample_sum() / (h.get_sample_count().max(1) as f64)
    }
}

/// A ControlNet worker serving `controlnet_dir`, in this process.
pub async fn start_worker(
    url: &str,
    controlnet_dir: &Path,
    id: &str,
) -> anyhow::Result<WorkerHandle> {
    Ok(worker::start(WorkerConfig::for_tests(
        url,
        controlnet_dir.to_path_buf(),
        id,
    ))
    .await?)
}

/// A steered generation of `prompt` at the tiny model's 64x64, control image `control_rgb`.
pub fn steered_job(
    id: &str,
    prompt: &str,
    seed: u64,
    steps: u32,
    controlnet: &str,
    control_rgb: Vec<u8>,
) -> EngineJob {
    let mut j: DenoiseJob = diffmesh_shared::testing::generation_job(id, prompt, seed, steps);
    j.params.controlnet = Some(ControlNetRef {
        name: controlnet.into(),
        scale: 1.0,
    });
    let mut e = EngineJob::new(j, None);
    e.control_rgb = vec![control_rgb];
    e
}

/// PSNR (dB) of two RGB images of one size.
pub fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let mse = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum::<f64>()
        / a.len().max(1) as f64;
    10.0 * (255.0f64.powi(2) / mse.max(1e-12)).log10()
}
