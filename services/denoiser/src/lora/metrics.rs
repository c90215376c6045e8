//! LoRA metrics of the denoiser: the adapter cache, fetches, in-place patches and how the
//! engine stepped jobs with adapters (bounded asynchronous loading).
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};

/// How a job with adapters stepped, as metric labels: `base_while_loading` (on the base model
/// while its adapters load, within its bound), `patched`.
pub const LORA_STEP_MODES: [&str; 2] = ["base_while_loading", "patched"];

#[derive(Clone)]
pub struct LoraMetrics {
    /// Adapter lookups by result (`hit`, `miss`: read from the LoRA store, `failed`).
    pub lora_cache_lookups: IntCounterVec,
    pub lora_cache_bytes: IntGauge,
    /// One adapter read from the LoRA store into memory.
    pub lora_fetch_seconds: Histogram,
    /// One switch of the weights (restore and/or patch).
    pub lora_patch_seconds: Histogram,
    /// Job-steps of jobs with adapters, by mode ([`LORA_STEP_MODES`]).
    pub lora_steps: IntCounterVec,
    /// Per job that reached its bound before its adapters: how long it sat steps out.
    pub lora_wait_seconds: Histogram,
}

impl LoraMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let lora_cache_lookups = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_lora_cache_lookups_total",
                "LoRA adapters looked up in the denoiser's memory, by result (miss: read from the LoRA store)",
            ),
            &["result"],
        )?;
        for result in ["hit", "miss", "failed"] {
            lora_cache_lookups.with_label_values(&[result]);
        }
        let lora_cache_bytes = IntGauge::new(
            "diffmesh_denoiser_lora_cache_bytes",
            "Bytes of LoRA adapters held in the denoiser's memory",
        )?;
        let lora_fetch_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_lora_fetch_duration_seconds",
                "One LoRA adapter read from the LoRA store and parsed",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        )?;
        let lora_patch_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_lora_patch_duration_seconds",
                "One in-place switch of the model's weights to another LoRA set (or back to the base)",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0,
            ]),
        )?;
        let lora_steps = IntCounterVec::new(
            Opts::new(
                "diffmesh_denoiser_lora_steps_total",
                "Steps of jobs with LoRAs, by mode (base_while_loading, patched)",
            ),
            &["mode"],
        )?;
        for mode in LORA_STEP_MODES {
            lora_steps.with_label_values(&[mode]);
        }
        let lora_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "diffmesh_denoiser_lora_wait_duration_seconds",
                "Time a job sat steps out waiting for its LoRA adapters after its asynchronous bound",
            )
            .buckets(diffmesh_shared::process::metrics::LATENCY_BUCKETS_SECONDS.to_vec()),
        )?;
        registry.register(Box::new(lora_wait_seconds.clone()))?;
        registry.register(Box::new(lora_cache_lookups.clone()))?;
        registry.register(Box::new(lora_cache_bytes.clone()))?;
        registry.register(Box::new(lora_fetch_seconds.clone()))?;
        registry.register(Box::new(lora_patch_seconds.clone()))?;
        registry.register(Box::new(lora_steps.clone()))?;
        Ok(Self {
            lora_cache_lookups,
            lora_cache_bytes,
            lora_fetch_seconds,
            lora_patch_seconds,
            lora_steps,
            lora_wait_seconds,
        })
    }
}
