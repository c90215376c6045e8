//! The engine's mask-aware steps and template captures (FlashPS §4.2-4.3).
//!
//! Every step, states whose template cache is resident run in mask-aware mode: the loader thread
//! streams their step's blocks while the batch computes, and a planner picks how many leading
//! blocks to compute over all tokens instead (those need no load). The planner is FlashPS
//! Algorithm 1 restricted to prefixes (`diffmesh_sched::three_way::plan_prefix_kv`); where the
//! caches hold K/V and the hidden stream (`CacheLayout::KvAndHidden`), the three-way planner
//! (`plan_three_way`) also picks, per block after the prefix, which of the two to load. Both
//! are fed per-block costs this module keeps up to date from its own measurements: compute
//! time per token-block (from step timings; a Flux double and single block cost the same
//! 12 d^2 per token, so the blocks differ by the tokens they compute) and load bandwidth
//! (from the loader) over each block's own encoded bytes.
use crate::templates::{CacheLayout, GpuCopy, KvLoader, StreamedKv, TemplateEntry};
use diffmesh_model::flux::kv_codec::{encode_block, CacheDtype};
use diffmesh_model::flux::{ControlResiduals, KvFormat, KvSink};
use diffmesh_model::pipeline::stepper::{step_batch_controlled, DenoiseState, StepMode};
use diffmesh_model::pipeline::FluxPipeline;
use diffmesh_model::tch::Tensor;
use diffmesh_model::{ModelError, Result};
use diffmesh_sched::three_way::{plan_prefix_kv, plan_three_way, BlockChoice, ThreeWayCosts};
use diffmesh_shared::wire::templates::{pack_step, CacheMeta};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The template cache of a queued edit: filled by the NATS side once fetched (`None` inside:
/// unavailable, the edit runs in full compute). The engine admits the edit once it is set, so
/// fetching overlaps queueing.
pub type TemplateSlot = Arc<OnceLock<Option<Arc<TemplateEntry>>>>;

/// How the blocks of a mask-aware step run: how many leading ones over every token, and
/// which of K/V or Y the others read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixPolicy {
    /// Planned every step from measured costs.
    Auto,
    /// This many leading blocks in full, the others K/V.
    Fixed(usize),
    /// The same plan every step (benches and tests).
    Blocks(FixedPlan),
}

/// A per-block plan written `f` (full), `k` (K/V), `y` (Y) per block, full blocks first;
/// blocks past it read K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedPlan {
    full: usize,
    /// Bit `b` set: block `b` reads Y.
    y: u128,
}

impl FixedPlan {
    fn choice(&self, block: usize) -> BlockChoice {
        match block {
            b if b < self.full => BlockChoice::Full,
            b if b < 128 && self.y >> b & 1 == 1 => BlockChoice::Y,
            _ => BlockChoice::Kv,
        }
    }
}

impl PrefixPolicy {
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let expected = "`auto`, a block count, or a plan of `f`, `k`, `y` per block";
        if s == "auto" {
            return Ok(PrefixPolicy::Auto);
        }
        if let Ok(n) = s.parse() {
            return Ok(PrefixPolicy::Fixed(n));
        }
        let full = s.chars().take_while(|&c| c == 'f').count();
        let mut y = 0u128;
        for (b, c) in s.chars().enumerate().skip(full) {
            match (c, b < 128) {
                ('k', true) => {}
                ('y', true) => y |= 1 << b,
                ('f', _) => {
                    return Err(format!(
                        "block {b} of `{s}` computes in full after a cached block: full blocks come first"
                    ))
                }
                _ => return Err(format!("expected {expected} (at most 128), got `{s}`")),
            }
        }
        match s.is_empty() {
            true => Err(format!("expected {expected}, got an empty value")),
            false => Ok(PrefixPolicy::Blocks(FixedPlan { full, y })),
        }
    }

    /// This step's choice for each of `n_blocks` blocks, or `None` where it is planned.
    fn fixed_plan(&self, n_blocks: usize) -> Option<Vec<BlockChoice>> {
        let choice = |b: usize| match self {
            PrefixPolicy::Auto => None,
            PrefixPolicy::Fixed(k) if b < *k => Some(BlockChoice::Full),
            PrefixPolicy::Fixed(_) => Some(BlockChoice::Kv),
            PrefixPolicy::Blocks(plan) => Some(plan.choice(b)),
        };
        (0..n_blocks).map(choice).collect()
    }
}

/// Cache settings of an engine.
#[derive(Debug, Clone, Copy)]
pub struct CacheSettings {
    pub layout: CacheLayout,
    pub dtype: CacheDtype,
    /// Blocks the loader decodes ahead of the compute, per request.
    pub lookahead: usize,
    pub prefix: PrefixPolicy,
}

impl Default for CacheSettings {
    fn default() -> Self {
        Self {
            layout: CacheLayout::One(KvFormat::Prepared),
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
    /// Of the blocks after `prefix`, those that read the hidden stream (the rest read K/V).
    pub hidden_blocks: usize,
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
        let plan: Vec<BlockChoice> = match self.settings.prefix.fixed_plan(n_blocks) {
            _ if cached.is_empty() => vec![BlockChoice::Kv; n_blocks],
            Some(plan) => plan,
            None => self.plan(states, &cached, &reused, n_blocks),
        };
        let prefix = plan.iter().take_while(|&&c| c == BlockChoice::Full).count();
        // What block `b` of a cache in `layout` is read as under the plan.
        let read_as = |layout: CacheLayout, b: usize| match plan[b] {
            BlockChoice::Y => layout.y(),
            BlockChoice::Full | BlockChoice::Kv => layout.kv(),
        };
        let formats_of = |layout: CacheLayout| -> Vec<KvFormat> {
            (0..n_blocks).map(|b| read_as(layout, b)).collect()
        };
        let parts = cached
            .iter()
            .map(|(i, c)| (c.clone(), states[*i].step_index(), formats_of(c.layout)))
            .collect();
        let streams: Vec<StreamedKv> = if prefix < n_blocks {
            self.loader.load_step_as(parts, prefix, kind, device)
        } else {
            Vec::new()
        };
        let empty = diffmesh_model::flux::CapturedKv::new(self.settings.layout.kv());
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
                let entry = cached.iter().find(|(j, _)| *j == i).map(|(_, c)| c);
                match entry {
                    Some(c) if matches!(modes[i], StepMode::Cached(_)) => {
                        let read: f64 = (prefix..n_blocks)
                            .map(|b| cached_block_tokens(s, read_as(c.layout, b)))
                            .sum();
                        read + (t + n) * prefix as f64
                    }
                    _ => (t + n) * n_blocks as f64,
                }
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
        let hidden_blocks = match cached.is_empty() {
            true => 0,
            false => (prefix..n_blocks)
                .filter(|&b| read_as(self.settings.layout, b) == KvFormat::Hidden)
                .count(),
        };
        Ok(StepReport {
            cached: cached.iter().map(|(i, _)| states[*i].rows()).sum(),
            prefix,
            blocks: n_blocks,
            hidden_blocks,
            load_wait_s,
            reused: (0..states.len())
                .filter(|&i| states[i].skipped_steps() > skipped_before[i])
                .map(|i| states[i].rows())
                .sum(),
        })
    }

    /// Per-block costs of this batch, and the best plan for them: the three-way planner's
    /// where every cache read holds K/V and the hidden stream, the K/V prefix planner's
    /// otherwise.
    fn plan(
        &self,
        states: &[&mut DenoiseState],
        cached: &[(usize, Arc<TemplateEntry>)],
        reused: &[bool],
        n_blocks: usize,
    ) -> Vec<BlockChoice> {
        let costs = self.block_costs(states, cached, reused, n_blocks);
        match cached.iter().all(|(_, c)| c.layout.three_way()) {
            true => plan_three_way(&costs).choices,
            false => plan_prefix_kv(&costs).choices,
        }
    }

    /// Each block's costs for this batch: compute from the measured seconds per token-block
    /// and the tokens the block computes under each choice, loads from the block's own
    /// encoded bytes in each format over the loader's measured bandwidth.
    fn block_costs(
        &self,
        states: &[&mut DenoiseState],
        cached: &[(usize, Arc<TemplateEntry>)],
        reused: &[bool],
        n_blocks: usize,
    ) -> Vec<ThreeWayCosts> {
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
        let (mut all, mut kv_tokens, mut y_tokens) = (0.0, 0.0, 0.0);
        for (i, cache) in cached {
            let (t, _, n) = tokens(states[*i]);
            all += t + n;
            kv_tokens += cached_block_tokens(states[*i], cache.layout.kv());
            y_tokens += cached_block_tokens(states[*i], cache.layout.y());
        }
        // Before the loader has measured anything, assume loads are cheap (memory speed).
        let bandwidth = self.loader.stats().bytes_per_second().unwrap_or(4e9);
        let load = |b: usize, read: fn(CacheLayout) -> KvFormat| -> f64 {
            let bytes: usize = cached
                .iter()
                .map(|(_, e)| e.block_len(b, read(e.layout)))
                .sum();
            bytes as f64 / bandwidth
        };
        (0..n_blocks)
            .map(|b| ThreeWayCosts {
                full_s: c * (full_rows + all),
                kv_compute_s: c * (full_rows + kv_tokens),
                kv_load_s: load(b, CacheLayout::kv),
                y_compute_s: c * (full_rows + y_tokens),
                y_load_s: load(b, CacheLayout::y),
            })
            .collect()
    }

    pub fn load_stats(&self) -> crate::templates::LoadStats {
        self.loader.stats()
    }
}

/// Encodes a capture's K/V block by block, step by step, into a [`TemplateEntry`]: every
/// block once per format of the layout, each format's blocks together.
pub struct CaptureSink {
    layout: CacheLayout,
    dtype: CacheDtype,
    /// This step's encoded blocks, one list per format of the layout.
    layers: Vec<Vec<Vec<u8>>>,
    steps: Vec<bytes::Bytes>,
}

impl CaptureSink {
    pub fn new(layout: CacheLayout, dtype: CacheDtype) -> Self {
        Self {
            layout,
            dtype,
            layers: vec![Vec::new(); layout.formats().len()],
            steps: Vec::new(),
        }
    }

    /// Close the current step (after `capture_step`).
    pub fn end_step(&mut self) {
        let blocks: Vec<Vec<u8>> = self.layers.iter_mut().flat_map(std::mem::take).collect();
        self.steps.push(bytes::Bytes::from(pack_step(&blocks)));
    }

    /// The last closed step's entry.
    pub fn last_step(&self) -> Option<&bytes::Bytes> {
        self.steps.last()
    }

    /// A cache of no steps in place of the captured one: every edit of the template computes
    /// in full (the quality guard's fallback). Nothing is loaded for it, in any tier.
    pub fn finish_full_compute(
        mut self,
        cache_key: String,
        blocks: usize,
    ) -> std::result::Result<TemplateEntry, String> {
        self.steps.clear();
        self.finish(cache_key, blocks)
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
            format: self.layout.as_str().into(),
            dtype: self.dtype.as_str().into(),
        };
        TemplateEntry::new(meta, self.steps)
    }
}

impl KvSink for CaptureSink {
    fn put(&mut self, block: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.put_as(block, self.layout.kv(), k, v)
    }

    fn format(&self) -> KvFormat {
        self.layout.kv()
    }

    fn formats(&self) -> Vec<KvFormat> {
        self.layout.formats()
    }

    fn put_as(&mut self, _block: usize, format: KvFormat, k: &Tensor, v: &Tensor) -> Result<()> {
        let layer = self
            .layout
            .formats()
            .iter()
            .position(|&f| f == format)
            .ok_or_else(|| {
                ModelError::input(
                    "cache",
                    format!(
                        "a {} capture given {}",
                        self.layout.as_str(),
                        format.as_str()
                    ),
                )
            })?;
        self.layers[layer].push(encode_block(k, v, format, self.dtype)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_policies_parse_and_name_the_block_at_fault() {
        assert_eq!(PrefixPolicy::parse("auto"), Ok(PrefixPolicy::Auto));
        assert_eq!(PrefixPolicy::parse("3"), Ok(PrefixPolicy::Fixed(3)));
        let plan = PrefixPolicy::parse("ffkyk").unwrap();
        use BlockChoice::{Full as F, Kv as K, Y};
        assert_eq!(plan.fixed_plan(6), Some(vec![F, F, K, Y, K, K]));
        assert_eq!(PrefixPolicy::Fixed(2).fixed_plan(3), Some(vec![F, F, K]));
        assert_eq!(PrefixPolicy::Auto.fixed_plan(3), None);
        let err = PrefixPolicy::parse("fkf").unwrap_err();
        assert!(err.contains("block 2"), "{err}");
        for bad in ["", "fkx", "-1"] {
            assert!(PrefixPolicy::parse(bad).is_err(), "{bad}");
        }
    }
}
