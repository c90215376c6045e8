//! `cargo xtask bench engine`: the engine measured in-process (real engine thread, tiny model,
//! CPU, no NATS). Each part adds its figures to one [`report::Report`], printed as one JSON
//! line last.
//!
//! - [`batching`]: continuous against static batching under Poisson arrivals;
//! - [`disaggregation`]: pre/post-processing inline in the step loop against on codec workers;
//! - [`engine_steps`]: whole engine steps by batch size, written into a scheduler profile;
//! - [`mask_aware`]: FlashPS step latency with streamed cache loading, throughput at batch 8 and
//!   quality (SSIM/PSNR) of mask-aware edits against full compute, with [`step_caching`]
//!   (TeaCache) as their baseline and beside them;
//! - [`prompt_stage`]: text encoding on the step loop against on the denoiser's prompt stage;
//! - [`elastic`]: a live run on elastic ranks against the simulator on the same arrivals;
//! - [`lora`] (its own binary, `diffmesh-lora-bench`): LoRA switch costs and what bounded
//!   asynchronous loading gives up in quality;
//! - [`controlnet_service`] (its own binary, `diffmesh-controlnet-service-bench`): steered
//!   generations with the ControlNet on the engine thread against on ControlNet workers.
//!
//! [`workload`] draws the requests, [`driver`] runs the engine and measures its step cost,
//! [`codec_work`] is the codec's image work per request, [`template_caches`] captures the
//! templates the batching part's edits read.
pub mod batching;
pub mod codec_work;
pub mod controlnet_service;
pub mod disaggregation;
pub mod driver;
pub(crate) mod edit_quality;
pub mod elastic;
pub mod engine_steps;
pub mod lora;
pub mod mask_aware;
pub mod prompt_stage;
pub mod report;
pub mod step_caching;
pub mod template_caches;
pub mod workload;
