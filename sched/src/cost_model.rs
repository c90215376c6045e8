//! Cost models: per-block compute latency linear in the batch's FLOPs, cache-load latency linear
//! in bytes, least-squares fitted from a profile file.
//!
//! FLOPs follow FlashPS Table 1 for one DiT block: the linear layers (QKV, output projection, a
//! 4x MLP) cost `24 H^2` FLOPs per computed token and attention costs `4 a H` per computed token
//! that attends to `a` tokens. A mask-aware edit computes only text + masked image tokens
//! (attending to all tokens); a full pass computes every token. Both costs and the cache size
//! scale linearly with the mask ratio, which is why linear models fit (FlashPS reports R^2 0.99).
use crate::compute_fit::ComputeFit;
use crate::error::SchedError;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The served model's shape: what turns a mask into FLOPs and bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Transformer blocks per denoising step (Flux: 19 double + 38 single = 57).
    pub blocks: u32,
    /// Hidden size H.
    pub hidden: u32,
    /// Image tokens at the model resolution (Flux at 1024x1024: 4096).
    pub image_tokens: u32,
    /// Text tokens that every pass computes.
    pub text_tokens: u32,
    /// Bytes of cached K/V per unmasked image token per block, as profiled (the profiler's
    /// f32 raw K and V: 8*H); the `y` and `kv_and_y` layouts price the hidden stream (FlashPS's
    /// Y) at half of it.
    pub cache_bytes_per_token: u64,
    /// Default denoising steps per request.
    pub steps: u32,
    /// What the workers' template caches hold, which decides the planner the steps are
    /// predicted under (absent from older profiles: K/V).
    #[serde(default)]
    pub cache_layout: ShapeLayout,
}

/// A worker's template-cache layout as the cost model prices it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShapeLayout {
    /// K/V: the prefix planner over [`CostModels::block_costs`].
    #[default]
    Kv,
    /// The hidden stream alone: half the bytes, K/V re-projected for the unmasked tokens.
    Y,
    /// Both: the three-way planner picks K/V or Y per block.
    KvAndY,
}

impl ModelShape {
    pub fn validate(&self) -> Result<(), SchedError> {
        let checks: [(&str, u64); 5] = [
            ("shape.blocks", self.blocks as u64),
            ("shape.hidden", self.hidden as u64),
            ("shape.image_tokens", self.image_tokens as u64),
            ("shape.cache_bytes_per_token", self.cache_bytes_per_token),
            ("shape.steps", self.steps as u64),
        ];
        for (field, v) in checks {
            if v == 0 {
                return Err(SchedError::field(field, "must be > 0"));
            }
        }
        Ok(())
    }

    /// Masked image tokens for a mask ratio (rounded up, so any mask computes at least a token).
    pub fn masked_tokens(&self, mask_ratio: f64) -> u32 {
        let r = mask_ratio.clamp(0.0, 1.0);
        ((r * self.image_tokens as f64).ceil() as u32).min(self.image_tokens)
    }

    /// All tokens one request attends to.
    pub fn total_tokens(&self) -> u64 {
        self.image_tokens as u64 + self.text_tokens as u64
    }

    /// Tokens a mask-aware pass computes for one request.
    pub fn computed_tokens(&self, masked: u32) -> u64 {
        self.text_tokens as u64 + masked.min(self.image_tokens) as u64
    }

    /// Tokens a request of `footprint` computes per block (what the engine's token budget counts).
    pub fn request_tokens(&self, masked: u32, footprint: Footprint) -> u64 {
        self.computed_tokens(masked) * u64::from(footprint.rows)
    }

    /// FLOPs of one block for one request using the cache (masked + text tokens computed).
    pub fn flops_cached(&self, masked: u32) -> f64 {
        block_flops(
            self.hidden,
            self.computed_tokens(masked),
            self.total_tokens(),
        )
    }

    /// FLOPs of one block for one request computing every token.
    pub fn flops_full(&self) -> f64 {
        block_flops(self.hidden, self.total_tokens(), self.total_tokens())
    }

    /// Bytes of one block's cached activations for one request (the unmasked image tokens).
    pub fn cache_bytes(&self, masked: u32) -> f64 {
        (self.image_tokens - masked.min(self.image_tokens)) as f64
            * self.cache_bytes_per_token as f64
    }

    /// FLOPs of one block for one request reading the hidden stream: [`Self::flops_cached`]
    /// plus `to_k` and `to_v` over the unmasked tokens (2 of a token's 12 `H x H` products).
    pub fn flops_hidden(&self, masked: u32) -> f64 {
        let unmasked = (self.image_tokens - masked.min(self.image_tokens)) as f64;
        let h = self.hidden as f64;
        self.flops_cached(masked) + 4.0 * h * h * unmasked
    }
}

/// FLOPs of one DiT block (FlashPS Table 1): `computed` tokens through the linear layers and
/// attention over `attended` keys.
pub fn block_flops(hidden: u32, computed: u64, attended: u64) -> f64 {
    let h = hidden as f64;
    let c = computed as f64;
    24.0 * h * h * c + 4.0 * c * attended as f64 * h
}

/// One profiled block forward of a batch. A full pass computes every token it attends to
/// (`tokens == attended`); a mask-aware pass computes fewer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ComputeSample {
    /// Computed tokens summed over the batch.
    pub tokens: u64,
    /// Requests in the batch.
    pub batch: u32,
    /// Attended (key) tokens summed over the batch.
    pub attended: u64,
    /// FLOPs of the block for the whole batch (sum of [`block_flops`] per request).
    pub flops: f64,
    pub latency_s: f64,
}

impl ComputeSample {
    /// A full pass (every attended token computed), not a mask-aware one.
    pub fn is_full(&self) -> bool {
        self.tokens == self.attended
    }
}

/// One profiled load of a block's cached activations (host to device).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadSample {
    pub bytes: u64,
    pub latency_s: f64,
}

/// One measured step of the whole engine (the denoiser's batched step with its scheduler,
/// blends and cache loading, not the transformer blocks alone) over a batch of mask-aware edit
/// rows, `masked[i]` masked tokens each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineStepSample {
    pub masked: Vec<u32>,
    pub latency_s: f64,
}

/// What a denoiser's step loop spends on each job besides its steps (median per job, s): preparing
/// it when admitted (prompt encoding, template latents, noise) and decoding its latents when it
/// finishes. The loop runs nothing else meanwhile, so every job in the batch waits for it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineJobWork {
    pub admit_s: f64,
    pub retire_s: f64,
}

impl EngineJobWork {
    fn validate(&self) -> Result<(), SchedError> {
        for (field, v) in [
            ("engine_jobs.admit_s", self.admit_s),
            ("engine_jobs.retire_s", self.retire_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(SchedError::field(
                    field,
                    format!("must be a finite number of seconds >= 0, got {v}"),
                ));
            }
        }
        Ok(())
    }
}

/// The profile file the denoiser's profiler writes and the router/simulator fit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Where the numbers come from (device, model, command).
    pub label: String,
    /// True when the samples were generated, not measured.
    #[serde(default)]
    pub synthetic: bool,
    pub shape: ModelShape,
    pub compute: Vec<ComputeSample>,
    /// Loads from the fast tier the planner overlaps with compute (host to device on a GPU, a
    /// memory copy into the compute tensors on a CPU).
    pub load: Vec<LoadSample>,
    /// Loads from the slower tier a template's cache comes from when the worker does not hold
    /// it (a file read into tensors); empty when not measured.
    #[serde(default)]
    pub disk_load: Vec<LoadSample>,
    /// Whole engine steps (`diffmesh-engine-bench --parts engine-steps`); empty when not
    /// measured. What they take beyond the blocks' predicted latency is fitted against the
    /// batch's rows ([`CostModels::step_overhead`]).
    #[serde(default)]
    pub engine_steps: Vec<EngineStepSample>,
    /// Where the engine steps come from (command, machine).
    #[serde(default)]
    pub engine_label: String,
    /// Per-job work of the step loop, measured with the engine steps; absent in older profiles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_jobs: Option<EngineJobWork>,
}

impl Profile {
    pub fn read(path: &Path) -> Result<Self, SchedError> {
        let text = std::fs::read_to_string(path).map_err(|source| SchedError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| SchedError::Json {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn write(&self, path: &Path) -> Result<(), SchedError> {
        let text = serde_json::to_string_pretty(self).map_err(|source| SchedError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        std::fs::write(path, text).map_err(|source| SchedError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

pub use crate::linear_fit::LinearFit;

/// Per-block latencies of one batch, the planner's inputs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BlockCosts {
    /// Compute with cached activations (masked + text tokens only).
    pub cached_s: f64,
    /// Compute of every token (no cache needed).
    pub full_s: f64,
    /// Loading the block's cached activations for the whole batch.
    pub load_s: f64,
}

/// What one request takes of every step it runs in: its batch rows (one per image, two under
/// true CFG, where the negative prompt's row runs beside the prompt's), the template-cache
/// streams those rows read (one per image: both rows of a guided image read the same stream),
/// and the seconds the worker's step loop spends on it outside the batched forward (its
/// ControlNet's forward, or the wait for a ControlNet worker's residuals), as the worker
/// measured it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Footprint {
    pub rows: u32,
    pub cache_streams: u32,
    pub control_s: f64,
}

impl Footprint {
    /// One image, no guidance.
    pub const ONE_ROW: Footprint = Footprint {
        rows: 1,
        cache_streams: 1,
        control_s: 0.0,
    };

    /// `images` images (at least one), each one row or, `guided`, two.
    pub fn new(images: u32, guided: bool) -> Self {
        let images = images.max(1);
        Footprint {
            rows: images.saturating_mul(1 + u32::from(guided)),
            cache_streams: images,
            control_s: 0.0,
        }
    }

    /// The same with `control_s` seconds a step outside the batched forward.
    pub fn with_control_s(self, control_s: f64) -> Self {
        Footprint {
            control_s: if control_s.is_finite() {
                control_s.max(0.0)
            } else {
                0.0
            },
            ..self
        }
    }
}

/// Per-row sums a batch's block costs are linear in; add and remove requests cheaply.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BatchTotals {
    /// Batch rows (what the compute model's per-request term counts: the engine runs a row's
    /// masked attention on its own).
    pub requests: u32,
    pub flops_cached: f64,
    pub flops_full: f64,
    pub bytes: f64,
    /// FLOPs and bytes of the batch's blocks where they read the hidden stream (Y).
    pub flops_hidden: f64,
    pub bytes_hidden: f64,
    /// Seconds a step spends on its requests outside the batched forward ([`Footprint::control_s`]).
    pub control_s: f64,
}

impl BatchTotals {
    pub fn add(&mut self, shape: &ModelShape, masked: u32) {
        self.add_row(&RowCost::of(shape, masked));
    }

    /// A request of `footprint` whose rows each compute `masked` image tokens.
    pub fn add_request(&mut self, shape: &ModelShape, masked: u32, footprint: Footprint) {
        self.add_row(&RowCost::of_request(shape, masked, footprint));
    }

    /// [`BatchTotals::add`] with the row's sums already computed (same arithmetic, same result).
    pub fn add_row(&mut self, row: &RowCost) {
        self.requests += row.rows;
        self.flops_cached += row.flops_cached;
        self.flops_full += row.flops_full;
        self.bytes += row.bytes;
        self.flops_hidden += row.flops_hidden;
        self.bytes_hidden += row.bytes_hidden;
        self.control_s += row.control_s;
    }
}

/// One request's share of [`BatchTotals`], computed once for a forecast that adds the same row
/// to every phase it runs in.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowCost {
    pub rows: u32,
    pub flops_cached: f64,
    pub flops_full: f64,
    pub bytes: f64,
    pub flops_hidden: f64,
    pub bytes_hidden: f64,
    pub control_s: f64,
}

impl RowCost {
    /// One row computing `masked` image tokens.
    pub fn of(shape: &ModelShape, masked: u32) -> Self {
        Self::of_request(shape, masked, Footprint::ONE_ROW)
    }

    /// A request of `footprint`: FLOPs per row, cache bytes per stream.
    pub fn of_request(shape: &ModelShape, masked: u32, footprint: Footprint) -> Self {
        let rows = f64::from(footprint.rows);
        RowCost {
            rows: footprint.rows,
            flops_cached: shape.flops_cached(masked) * rows,
            flops_full: shape.flops_full() * rows,
            bytes: shape.cache_bytes(masked) * f64::from(footprint.cache_streams),
            flops_hidden: shape.flops_hidden(masked) * rows,
            bytes_hidden: shape.cache_bytes(masked) / 2.0 * f64::from(footprint.cache_streams),
            control_s: footprint.control_s,
        }
    }
}

/// The fitted models plus the shape they apply to.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModels {
    pub label: String,
    pub synthetic: bool,
    pub shape: ModelShape,
    /// Block compute latency (s) against block FLOPs and requests of the batch.
    pub compute: ComputeFit,
    /// Block cache-load latency (s) against bytes of the batch.
    pub load: LinearFit,
    /// Slow-tier read latency (s) against bytes, when the profile measured it.
    pub disk_load: Option<LinearFit>,
    /// What a whole engine step takes beyond its blocks (s) against the batch's rows, when the
    /// profile measured engine steps; added to every predicted step.
    pub step_overhead: Option<LinearFit>,
    /// The step loop's per-job work, when the profile measured it (the simulator charges it to
    /// the step that admits or follows the job).
    pub job_work: Option<EngineJobWork>,
}

impl CostModels {
    pub fn fit(profile: &Profile) -> Result<Self, SchedError> {
        profile.shape.validate()?;
        let lx: Vec<f64> = profile.load.iter().map(|s| s.bytes as f64).collect();
        let ly: Vec<f64> = profile.load.iter().map(|s| s.latency_s).collect();
        let mut models = CostModels {
            label: profile.label.clone(),
            synthetic: profile.synthetic,
            shape: profile.shape.clone(),
            compute: ComputeFit::fit("compute (profile.compute)", &profile.compute)?,
            load: LinearFit::fit("load (profile.load)", &lx, &ly)?,
            disk_load: if profile.disk_load.is_empty() {
                None
            } else {
                let dx: Vec<f64> = profile.disk_load.iter().map(|s| s.bytes as f64).collect();
                let dy: Vec<f64> = profile.disk_load.iter().map(|s| s.latency_s).collect();
                Some(LinearFit::fit("disk load (profile.disk_load)", &dx, &dy)?)
            },
            step_overhead: None,
            job_work: profile.engine_jobs,
        };
        if let Some(work) = &profile.engine_jobs {
            work.validate()?;
        }
        if !profile.engine_steps.is_empty() {
            // The blocks' share of each measured step, as the models without overhead predict.
            let (rows, extra): (Vec<f64>, Vec<f64>) = profile
                .engine_steps
                .iter()
                .map(|s| {
                    let mut totals = BatchTotals::default();
                    for &m in &s.masked {
                        totals.add(&models.shape, m);
                    }
                    (
                        s.masked.len() as f64,
                        s.latency_s - models.step_latency(&totals),
                    )
                })
                .unzip();
            models.step_overhead = Some(LinearFit::fit(
                "engine step overhead (profile.engine_steps)",
                &rows,
                &extra,
            )?);
        }
        Ok(models)
    }

    /// Compute fits of the full-pass and of the mask-aware samples alone (diagnostics: the
    /// joint fit hides a kind that the FLOPs count mispredicts). `None` for a kind with fewer
    /// than 2 samples or equal FLOPs.
    pub fn fit_by_kind(profile: &Profile) -> (Option<LinearFit>, Option<LinearFit>) {
        let fit = |full: bool| {
            let (xs, ys): (Vec<f64>, Vec<f64>) = profile
                .compute
                .iter()
                .filter(|s| s.is_full() == full)
                .map(|s| (s.flops, s.latency_s))
                .unzip();
            LinearFit::fit("compute by kind", &xs, &ys).ok()
        };
        (fit(true), fit(false))
    }

    /// Seconds to bring one template's whole cache (every block of every step) from the slow
    /// tier into a worker, from the disk-load fit; 0 when the profile did not measure one.
    pub fn cold_fetch_s(&self) -> f64 {
        let Some(fit) = &self.disk_load else {
            return 0.0;
        };
        let s = &self.shape;
        let bytes = s.image_tokens as f64
            * s.cache_bytes_per_token as f64
            * s.blocks as f64
            * s.steps as f64;
        fit.predict(bytes)
    }

    /// One line per fit for logs and reports.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "compute: {:.4e} s/FLOP + {:.3e} s/request (+{:.3e} mask-aware) + {:.3e} s, R^2 {:.4} ({} samples); load: {:.4e} s/B + {:.3e} s, R^2 {:.4} ({} samples)",
            self.compute.slope,
            self.compute.per_request,
            self.compute.per_cached_request,
            self.compute.intercept,
            self.compute.r2,
            self.compute.samples,
            self.load.slope,
            self.load.intercept,
            self.load.r2,
            self.load.samples
        );
        if let Some(d) = &self.disk_load {
            out.push_str(&format!(
                "; disk load: {:.4e} s/B + {:.3e} s, R^2 {:.4} ({} samples)",
                d.slope, d.intercept, d.r2, d.samples
            ));
        }
        if let Some(o) = &self.step_overhead {
            out.push_str(&format!(
                "; engine step overhead: {:.3e} s/row + {:.3e} s, R^2 {:.4} ({} samples)",
                o.slope, o.intercept, o.r2, o.samples
            ));
        }
        out
    }

    /// Block costs of a batch from its totals; an empty batch costs nothing.
    pub fn block_costs(&self, totals: &BatchTotals) -> BlockCosts {
        if totals.requests == 0 {
            return BlockCosts::default();
        }
        BlockCosts {
            cached_s: self
                .compute
                .predict(totals.flops_cached, totals.requests, true),
            full_s: self
                .compute
                .predict(totals.flops_full, totals.requests, false),
            load_s: self.load.predict(totals.bytes),
        }
    }

    /// [`Self::block_costs`] where the blocks read the hidden stream (Y).
    pub fn block_costs_hidden(&self, totals: &BatchTotals) -> BlockCosts {
        if totals.requests == 0 {
            return BlockCosts::default();
        }
        BlockCosts {
            cached_s: self
                .compute
                .predict(totals.flops_hidden, totals.requests, true),
            load_s: self.load.predict(totals.bytes_hidden),
            ..self.block_costs(totals)
        }
    }

    /// Latency of a step's blocks under the shape's cache layout and its planner.
    pub fn blocks_latency(&self, totals: &BatchTotals) -> f64 {
        let n = self.shape.blocks;
        match self.shape.cache_layout {
            ShapeLayout::Kv => crate::planner::uniform_latency(n, self.block_costs(totals)),
            ShapeLayout::Y => crate::planner::uniform_latency(n, self.block_costs_hidden(totals)),
            ShapeLayout::KvAndY => crate::three_way::uniform_three_way_latency(
                n,
                self.block_costs(totals),
                self.block_costs_hidden(totals),
            ),
        }
    }

    /// Predicted latency of one denoising step of a batch (every block alike, exact planner
    /// of the shape's layout),
    /// plus the engine's own work around the blocks when the profile measured it.
    ///
    /// The correction may be negative: where the block profile overpredicts whole engine steps
    /// (the profile's stand-alone block passes cost more than the engine's, as on the AMX Xeon
    /// in docs/BENCHMARKS.md, 1.6-1.9x), clamping it at zero would keep every prediction that
    /// far off. Only the sum is kept non-negative.
    pub fn step_latency(&self, totals: &BatchTotals) -> f64 {
        if totals.requests == 0 {
            return 0.0;
        }
        let overhead = self
            .step_overhead
            .map_or(0.0, |o| o.intercept + o.slope * totals.requests as f64);
        (self.blocks_latency(totals) + overhead).max(0.0) + totals.control_s
    }

    /// Standalone service time of one request: its steps alone on an idle worker.
    pub fn standalone_s(&self, masked: u32, steps: u32) -> f64 {
        self.standalone_request_s(masked, steps, Footprint::ONE_ROW)
    }

    /// [`CostModels::standalone_s`] of a request of `footprint`.
    pub fn standalone_request_s(&self, masked: u32, steps: u32, footprint: Footprint) -> f64 {
        let mut t = BatchTotals::default();
        t.add_request(&self.shape, masked, footprint);
        self.step_latency(&t) * steps as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_match_table1_scaling() {
        let s = ModelShape {
            blocks: 2,
            hidden: 8,
            image_tokens: 100,
            text_tokens: 0,
            cache_bytes_per_token: 16,
            steps: 4,
            cache_layout: Default::default(),
        };
        // No text tokens: cached FLOPs scale exactly with the mask ratio (Table 1: speedup 1/m).
        let ratio = s.flops_cached(25) / s.flops_full();
        assert!((ratio - 0.25).abs() < 1e-12, "{ratio}");
        assert_eq!(s.cache_bytes(25), 75.0 * 16.0);
        assert_eq!(block_flops(8, 1, 1), 24.0 * 64.0 + 32.0);
        assert_eq!(s.masked_tokens(0.011), 2);
    }

    /// The shape's cache layout picks the planner a step is predicted under: both formats
    /// (three-way) is never slower than either alone, and Y moves half the bytes.
    #[test]
    fn the_cache_layout_picks_the_steps_planner() {
        let mut models = CostModels::fit(&crate::synthetic::profile(0)).unwrap();
        let mut t = BatchTotals::default();
        for masked in [400, 800, 1200] {
            t.add(&models.shape, masked);
        }
        assert_eq!(t.bytes_hidden * 2.0, t.bytes);
        assert!(t.flops_hidden > t.flops_cached);
        let mut at = |layout| {
            models.shape.cache_layout = layout;
            models.step_latency(&t)
        };
        let (kv, y, both) = (
            at(ShapeLayout::Kv),
            at(ShapeLayout::Y),
            at(ShapeLayout::KvAndY),
        );
        assert!(both <= kv.min(y) + 1e-12, "{kv} {y} {both}");
        assert_ne!(kv, y);
    }

    #[test]
    fn engine_steps_add_their_overhead_over_the_blocks_to_every_step() {
        let mut p = crate::synthetic::profile(0);
        let bare = CostModels::fit(&p).unwrap();
        assert!(bare.step_overhead.is_none());
        let overhead = |rows: usize| 1e-3 + 2e-4 * rows as f64;
        p.engine_steps = (1..=6)
            .map(|rows| {
                let masked: Vec<u32> = (0..rows as u32).map(|i| 100 + 300 * i).collect();
                let mut t = BatchTotals::default();
                for &m in &masked {
                    t.add(&p.shape, m);
                }
                EngineStepSample {
                    latency_s: bare.step_latency(&t) + overhead(rows),
                    masked,
                }
            })
            .collect();
        let m = CostModels::fit(&p).unwrap();
        let o = m.step_overhead.unwrap();
        assert!(
            (o.slope - 2e-4).abs() < 1e-12 && (o.intercept - 1e-3).abs() < 1e-12,
            "{o:?}"
        );
        let mut t = BatchTotals::default();
        t.add(&p.shape, 500);
        t.add(&p.shape, 50);
        assert!((m.step_latency(&t) - bare.step_latency(&t) - overhead(2)).abs() < 1e-12);
        assert!(m.describe().contains("engine step overhead"));
        assert_eq!(m.step_latency(&BatchTotals::default()), 0.0);
    }

    #[test]
    fn engine_steps_faster_than_the_blocks_lower_every_step() {
        let mut p = crate::synthetic::profile(0);
        let bare = CostModels::fit(&p).unwrap();
        // Whole steps take 60% of what the blocks alone predict, a share that falls with rows
        // as a negative line: -(0.1 + 0.05 * rows) of a one-row step.
        let mut one = BatchTotals::default();
        one.add(&p.shape, 400);
        let unit = bare.step_latency(&one);
        let overhead = |rows: usize| -unit * (0.1 + 0.05 * rows as f64);
        p.engine_steps = (1..=6)
            .map(|rows| {
                let masked: Vec<u32> = (0..rows as u32).map(|i| 100 + 300 * i).collect();
                let mut t = BatchTotals::default();
                for &m in &masked {
                    t.add(&p.shape, m);
                }
                EngineStepSample {
                    latency_s: bare.step_latency(&t) + overhead(rows),
                    masked,
                }
            })
            .collect();
        let m = CostModels::fit(&p).unwrap();
        let o = m.step_overhead.unwrap();
        assert!(o.intercept < 0.0 && o.slope < 0.0, "{o:?}");
        for s in &p.engine_steps {
            let mut t = BatchTotals::default();
            for &k in &s.masked {
                t.add(&p.shape, k);
            }
            let got = m.step_latency(&t);
            assert!(
                (got - s.latency_s).abs() < 1e-9 * s.latency_s,
                "{got} vs {s:?}"
            );
            assert!(got < bare.step_latency(&t));
        }
    }

    #[test]
    fn profile_round_trips_and_fits() {
        let shape = ModelShape {
            blocks: 4,
            hidden: 64,
            image_tokens: 256,
            text_tokens: 16,
            cache_bytes_per_token: 128,
            steps: 10,
            cache_layout: Default::default(),
        };
        let compute = (1..6)
            .map(|b| ComputeSample {
                tokens: 100 * b,
                batch: b as u32,
                attended: 272 * b,
                flops: 1e9 * b as f64,
                latency_s: 1e-4 + 1e-12 * 1e9 * b as f64,
            })
            .collect();
        let load = (1..6)
            .map(|b| LoadSample {
                bytes: 1_000_000 * b,
                latency_s: 2e-5 + b as f64 * 1e-4,
            })
            .collect();
        let p = Profile {
            label: "test".into(),
            synthetic: true,
            shape,
            compute,
            load,
            disk_load: vec![],
            engine_steps: vec![],
            engine_label: String::new(),
            engine_jobs: None,
        };
        let dir = std::env::temp_dir().join(format!("diffmesh-sched-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("profile.json");
        p.write(&path).unwrap();
        let q = Profile::read(&path).unwrap();
        assert_eq!(p, q);
        let m = CostModels::fit(&q).unwrap();
        assert!((m.compute.slope - 1e-12).abs() < 1e-18);
        assert!((m.load.intercept - 2e-5).abs() < 1e-12);
        std::fs::remove_dir_all(&dir).ok();
    }
}
