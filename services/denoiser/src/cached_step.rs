//! The engine's mask-aware steps and template captures (FlashPS §4.2-4.3).
//!
//! Every step, states whose template cache is resident run in mask-aware mode: the loader thread
//! streams their step's blocks while the batch computes, and a planner picks how many leading
//! blocks to compute over all tokens instead (those need no load). The planner is FlashPS
//! Algorithm 1 restricted to prefixes (`diffmesh_sched::planner::plan_prefix`), fed by cost
//! estimates this module keeps up to date from its own measurements: compute time per
//! token-block (from step timings) and load bandwidth (from the loader).
use crate::templates::{GpuCopy, KvLoader, StreamedKv, TemplateEntry};
use diffmesh_model::flux::kv_codec::{encode_block, CacheDtype};
use diffmesh_model::flux::{ControlResiduals, KvFormat, KvSink};
use diffmesh_model::pipeline::stepper::{step_batch_controlled, DenoiseState, StepMode};
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::tch::Tensor;
use diffmesh_model::{ModelError, Result};
use diffmesh_sched::cost_model::BlockCosts;
use diffmesh_sched::planner::plan_prefix;
use diffmesh_shared::wire::templates::{pack_step, CacheMeta};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The template cache of a queued edit: filled by the NATS side once fetched (`None` inside:
/// unavailable, the edit runs in full compute). The engine admits the edit once it is set, so
/// fetching overlaps queueing.
pub type TemplateSlot = Arc<OnceLock<Option<Arc<TemplateEntry>>>>;

/// How many leading blocks of a mask-aware step run over every token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixPolicy {
    /// Planned every step from measured costs.
    Auto,
    Fixed(usize),
}

impl PrefixPolicy {
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(PrefixPolicy::Auto),
            n => n
                .parse()
                .map(PrefixPolicy::Fixed)
                .map_err(|_| format!("expected `auto` or a block count, got `{n}`")),
        }
    }
}

/// Cache settings of an engine.
#[derive(Debug, Clone, Copy)]
pub struct CacheSettings {
    pub format: KvFormat,
    pub dtype: CacheDtype,
    /// Blocks the loader decodes ahead of the compute, per request.
    pub lookahead: usize,
    pub prefix: PrefixPolicy,
}

impl Default for CacheSettings {
    fn default() -> Self {
        Self {
            format: KvFormat::Prepared,
            dtype: CacheDtype::Bf16,
            lookahead: 2,
            prefix: PrefixPolicy::Auto,
        }
    }
}

/// What one step did (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepReport {
    /// Batch rows stepped in mask-aware mode (two per guided state).
    pub cached: usize,
    /// Leading blocks computed over all tokens.
    pub prefix: usize,
    /// The model's blocks (those after `prefix` read the cache where `cached` > 0).
    pub blocks: usize,
    /// Seconds the compute waited for the loader.
    pub load_wait_s: f64,
    /// Batch rows whose step reused their last computed step's residual (step caching):
    /// they ran no block (TeaCache) or the first block only (first-block caching).
    pub reused: usize,
}

/// Seconds per (computed token x block), smoothed; a first guess until a step is measured.
struct ComputeEstimate {
    per_token_block_s: f64,
    measured: bool,
}

pub struct CachedStepper {
    loader: KvLoader,
    settings: CacheSettings,
    compute: ComputeEstimate,
}

/// A state's token counts for the cost model, over all its rows (two with true CFG): (text,
/// computed image tokens when cached, all).
fn tokens(s: &DenoiseState) -> (f64, f64, f64) {
    let rows = s.rows() as f64;
    let t = s.text_tokens() as f64;
    let n = s.image_tokens() as f64;
    let m = s.masked_tokens().map_or(n, |m| m as f64);
    (rows * t, rows * m, rows * n)
}

/// A cached state's compute per block in computed-token units: its text and masked tokens,
/// plus what rebuilding K/V from a cache in `format` costs over the image tokens it rebuilds
/// (a hidden cache: the unmasked ones; a raw one rotates all N keys).
fn cached_block_tokens(s: &DenoiseState, format: KvFormat) -> f64 {
    let (t, m, n) = tokens(s);
    let rebuilt = match format {
        KvFormat::Hidden => n - m,
        _ => n,
    };
    t + m + rebuilt * format.read_compute_per_token()
}

impl CachedStepper {
    /// `gpu`: the copy stream of the model's GPU (none on CPU).
    pub fn new(settings: CacheSettings, gpu: Option<Arc<GpuCopy>>) -> std::io::Result<Self> {
        Ok(Self {
            loader: KvLoader::spawn(settings.lookahead, gpu)?,
            settings,
            compute: ComputeEstimate {
                per_token_block_s: 1e-6,
                measured: false,
            },
        })
    }

    pub fn settings(&self) -> CacheSettings {
        self.settings
    }

    /// The cache a state reads this step, if it can run mask-aware: an edit with a resident
    /// cache that covers its step, with at least one unmasked token, that does not cache its
    /// steps by their first block (which runs every token; the gateway refuses that pairing,
    /// so only a job from an older gateway computes in full here).
    pub fn usable<'e>(
        s: &DenoiseState,
        cache: Option<&'e Arc<TemplateEntry>>,
    ) -> Option<&'e Arc<TemplateEntry>> {
        let cache = cache.filter(|_| !s.caches_first_block())?;
        let m = s.masked_tokens()?;
        (m < s.image_tokens() && s.step_index() < cache.steps()).then_some(cache)
    }

    /// One step for every unfinished state; `caches[i]` is state i's template cache (if any).
    pub fn step(
        &mut self,
        p: &FluxPipeline<'_>,
        states: &mut [&mut DenoiseState],
        caches: &[Option<Arc<TemplateEntry>>],
    ) -> Result<StepReport> {
        let none: Vec<Option<ControlResiduals>> = states.iter().map(|_| None).collect();
        self.step_controlled(p, states, caches, &none)
    }

    /// [`Self::step`] with each state's ControlNet residuals (`None` for unsteered states).
    pub fn step_controlled(
        &mut self,
        p: &FluxPipeline<'_>,
        states: &mut [&mut DenoiseState],
        caches: &[Option<Arc<TemplateEntry>>],
        residuals: &[Option<ControlResiduals>],
    ) -> Result<StepReport> {
        if caches.len() != states.len() {
            return Err(ModelError::input("caches", "one entry per state"));
        }
        let (device, kind) = p.transformer.device_kind();
        let n_blocks = p.transformer.num_blocks();
        // Step caching decides first: a step that reuses its residual loads nothing and
        // computes no block (mask-aware or full).
        let mut reused = vec![false; states.len()];
        for (i, s) in states.iter_mut().enumerate().filter(|(_, s)| !s.is_done()) {
            if s.caches_steps() {
                let masked = Self::usable(s, caches[i].as_ref()).is_some();
                reused[i] = s.plan_step(p, masked)?;
            }
        }
        let cached: Vec<(usize, Arc<TemplateEntry>)> = states
            .iter()
            .zip(caches)
            .enumerate()
            .filter(|(i, (s, _))| !s.is_done() && !reused[*i])
            .filter_map(|(i, (s, c))| Self::usable(s, c.as_ref()).map(|c| (i, c.clone())))
            .collect();
        let prefix = match self.settings.prefix {
            _ if cached.is_empty() => 0,
            PrefixPolicy::Fixed(k) => k.min(n_blocks),
            PrefixPolicy::Auto => self.plan(states, &cached, &reused, n_blocks),
        };
        let parts = cached
            .iter()
            .map(|(i, c)| (c.clone(), states[*i].step_index()))
            .collect();
        let streams: Vec<StreamedKv> = if prefix < n_blocks {
            self.loader.load_step(parts, prefix, kind, device)
        } else {
            Vec::new()
        };
        let empty = diffmesh_model::flux::CapturedKv::new(self.settings.format);
        let mut modes = vec![StepMode::Full; states.len()];
        for (j, (i, _)) in cached.iter().enumerate() {
            modes[*i] = StepMode::Cached(streams.get(j).map_or(&empty as _, |s| s as _));
        }
        for (i, s) in states.iter().enumerate().filter(|&(i, _)| reused[i]) {
            if Self::usable(s, caches[i].as_ref()).is_some() {
                modes[i] = StepMode::Cached(&empty);
            }
        }
        let work: f64 = states
            .iter()
            .enumerate()
            .filter(|(i, s)| !s.is_done() && !reused[*i])
            .map(|(i, s)| {
                let (t, _, n) = tokens(s);
                let cached_here = matches!(modes[i], StepMode::Cached(_));
                let per_block = if cached_here {
                    cached_block_tokens(s, self.settings.format)
                } else {
                    t + n
                };
                let full_blocks = if cached_here {
                    prefix as f64
                } else {
                    n_blocks as f64
                };
                per_block * (n_blocks as f64 - full_blocks) + (t + n) * full_blocks
            })
            .sum();
        // First-block caching decides inside the step: count what each state skipped.
        let skipped_before: Vec<usize> = states.iter().map(|s| s.skipped_steps()).collect();
        let started = Instant::now();
        step_batch_controlled(p, states, &modes, prefix, residuals)?;
        let elapsed = started.elapsed().as_secs_f64();
        let load_wait_s: f64 = streams.iter().map(|s| s.waited().as_secs_f64()).sum();
        // A first-block-cached state that reused its step ran less than `work` counts for it.
        let skipped_inside =
            (0..states.len()).any(|i| !reused[i] && states[i].skipped_steps() > skipped_before[i]);
        if work > 0.0 && !skipped_inside {
            // Compute only: time spent waiting for loads is not compute. Step-caching probes
            // and reused steps' final layers count in `elapsed` but not in `work`: an
            // overestimate of up to the probe's cost (about 7% of a tiny-model step).
            let sample = (elapsed - load_wait_s).max(0.0) / work;
            let e = &mut self.compute;
            e.per_token_block_s = if e.measured {
                0.8 * e.per_token_block_s + 0.2 * sample
            } else {
                sample
            };
            e.measured = true;
        }
        Ok(StepReport {
            cached: cached.iter().map(|(i, _)| states[*i].rows()).sum(),
            prefix,
            blocks: n_blocks,
            load_wait_s,
            reused: (0..states.len())
                .filter(|&i| states[i].skipped_steps() > skipped_before[i])
                .map(|i| states[i].rows())
                .sum(),
        })
    }

    /// Per-block costs of this batch and the best prefix for them.
    fn plan(
        &self,
        states: &[&mut DenoiseState],
        cached: &[(usize, Arc<TemplateEntry>)],
        reused: &[bool],
        n_blocks: usize,
    ) -> usize {
        let c = self.compute.per_token_block_s;
        let full_rows: f64 = states
            .iter()
            .enumerate()
            .filter(|(i, s)| !s.is_done() && !reused[*i] && !cached.iter().any(|(j, _)| j == i))
            .map(|(_, s)| {
                let (t, _, n) = tokens(s);
                t + n
            })
            .sum();
        let (mut all, mut masked, mut bytes) = (0.0, 0.0, 0.0);
        for (i, cache) in cached {
            let (t, _, n) = tokens(states[*i]);
            all += t + n;
            masked += cached_block_tokens(states[*i], cache.format);
            bytes += cache.bytes() as f64 / (cache.steps() * cache.blocks()).max(1) as f64;
        }
        // Before the loader has measured anything, assume loads are cheap (memory speed).
        let bandwidth = self.loader.stats().bytes_per_second().unwrap_or(4e9);
        let costs = vec![
            BlockCosts {
                cached_s: c * (full_rows + masked),
                full_s: c * (full_rows + all),
                load_s: bytes / bandwidth,
            };
            n_blocks
        ];
        plan_prefix(&costs)
            .blocks
            .iter()
            .take_while(|b| !b.use_cache)
            .count()
    }

    pub fn load_stats(&self) -> crate::templates::LoadStats {
        self.loader.stats()
    }
}

/// Encodes a capture's K/V block by block, step by step, into a [`TemplateEntry`].
pub struct CaptureSink {
    format: KvFormat,
    dtype: CacheDtype,
    blocks: Vec<Vec<u8>>,
    steps: Vec<bytes::Bytes>,
}

impl CaptureSink {
    pub fn new(format: KvFormat, dtype: CacheDtype) -> Self {
        Self {
            format,
            dtype,
            blocks: Vec::new(),
            steps: Vec::new(),
        }
    }

    /// Close the current step (after `capture_step`).
    pub fn end_step(&mut self) {
        let blocks = std::mem::take(&mut self.blocks);
        self.steps.push(bytes::Bytes::from(pack_step(&blocks)));
    }

    /// The finished cache.
    pub fn finish(
        self,
        cache_key: String,
        blocks: usize,
    ) -> std::result::Result<TemplateEntry, String> {
        let meta = CacheMeta {
            cache_key,
            steps: self.steps.len() as u32,
            blocks: blocks as u32,
            bytes: self.steps.iter().map(|s| s.len() as u64).sum(),
            format: self.format.as_str().into(),
            dtype: self.dtype.as_str().into(),
        };
        TemplateEntry::new(meta, self.steps)
    }
}

impl KvSink for CaptureSink {
    fn put(&mut self, _block: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.blocks
            .push(encode_block(k, v, self.format, self.dtype)?);
        Ok(())
    }

    fn format(&self) -> KvFormat {
        self.format
    }
}
