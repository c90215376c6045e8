//! Text encoding on the engine's step loop against on the denoiser's prompt stage: how much a
//! running job's steps are held up while new prompts arrive.
//!
//! The tiny model's own text encoder costs next to nothing, so each encode also runs a T5
//! encoder of `--prompt-encoder-layers` random layers (T5-small widths) over
//! `--prompt-encoder-tokens` tokens, its output dropped: the cost of a real T5 encode, relative
//! to the tiny model's step, set by flags and measured here alone first. Both modes run the
//! same jobs: long-running jobs stepping while short jobs with new prompts arrive one by one.
//! The figure is the gap between two consecutive steps of a long-running job; a third run
//! without the T5 cost gives the gaps the batch's own growth causes.
use crate::driver::BenchModel;
use crate::report::{Latencies, Report};
use anyhow::{bail, Context, Result};
use diffmesh_denoiser::engine::{spawn_engine, EngineConfig, EngineEvent, EngineJob};
use diffmesh_denoiser::model::job_prompts;
use diffmesh_denoiser::prompt_stage::{PromptSlot, PromptStageHandle};
use diffmesh_model::components::{TextEmbeddings, TextEncoder};
use diffmesh_model::tch::{nn, Device, Kind, Tensor};
use diffmesh_model::text::{T5Config, T5EncoderModel};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::Span;

#[derive(Debug, Clone)]
pub struct PromptStageOptions {
    pub model: BenchModel,
    /// Layers and tokens of the T5 encode each prompt pays for.
    pub encoder_layers: i64,
    pub encoder_tokens: i64,
    /// Jobs stepping all along, and their steps.
    pub long_jobs: usize,
    pub long_steps: u32,
    /// Short jobs with a new prompt each, submitted `arrival_gap` apart.
    pub short_jobs: usize,
    pub short_steps: u32,
    pub arrival_gap: Duration,
    pub max_batch: usize,
}

/// The tiny encoder's embeddings, after paying for a T5 encode of its own.
struct CostlyEncoder {
    inner: Box<dyn TextEncoder>,
    t5: T5EncoderModel,
    _weights: nn::VarStore,
    tokens: i64,
}

impl CostlyEncoder {
    fn new(inner: Box<dyn TextEncoder>, layers: i64, tokens: i64) -> Result<Self> {
        let config = T5Config {
            vocab_size: 32128,
            d_model: 512,
            d_kv: 64,
            d_ff: 1024,
            num_layers: layers,
            num_heads: 8,
            feed_forward_proj: "gated-gelu".into(),
            ..T5Config::default()
        };
        let vs = nn::VarStore::new(Device::Cpu);
        let t5 = T5EncoderModel::new(&vs.root(), config)?;
        Ok(Self {
            inner,
            t5,
            _weights: vs,
            tokens,
        })
    }

    fn pay(&self, prompts: usize) -> diffmesh_model::Result<()> {
        let ids = Tensor::f_zeros([prompts as i64, self.tokens], (Kind::Int64, Device::Cpu))?;
        // The hidden states are dropped: only the time spent counts.
        let _hidden = diffmesh_model::tch::no_grad(|| self.t5.forward(&ids))?;
        Ok(())
    }
}

impl TextEncoder for CostlyEncoder {
    fn encode(&self, prompts: &[String]) -> diffmesh_model::Result<TextEmbeddings> {
        self.pay(prompts.len())?;
        self.inner.encode(prompts)
    }

    fn max_tokens(&self) -> i64 {
        self.inner.max_tokens()
    }
}

/// What a model holds while its encoder is being wrapped.
struct Taken;

impl TextEncoder for Taken {
    fn encode(&self, _: &[String]) -> diffmesh_model::Result<TextEmbeddings> {
        Err(diffmesh_model::ModelError::input(
            "prompt",
            "the encoder was taken",
        ))
    }

    fn max_tokens(&self) -> i64 {
        0
    }
}

fn job(id: &str, prompt: String, steps: u32) -> diffmesh_shared::wire::messages::DenoiseJob {
    diffmesh_shared::testing::generation_job(id, &prompt, 1, steps)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The tiny encoder alone, inline: the gaps the batch's own growth causes (the baseline).
    Free,
    /// The costly encoder on the step loop.
    Inline,
    /// The costly encoder on the prompt stage.
    Stage,
}

/// Step gaps of the long-running jobs, in seconds, and the run's wall time.
async fn run_mode(opts: &PromptStageOptions, mode: Mode) -> Result<(Vec<f64>, f64)> {
    let mut model = opts.model.load()?;
    if mode != Mode::Free {
        let inner = std::mem::replace(&mut model.model.text_encoder, Box::new(Taken));
        model.model.text_encoder = Box::new(CostlyEncoder::new(
            inner,
            opts.encoder_layers,
            opts.encoder_tokens,
        )?);
    }
    let staged = mode == Mode::Stage;
    let stage =
        staged.then(|| PromptStageHandle::start(model.split_text_encoder(), "bench".into(), 0));
    let (tx, mut events) = mpsc::channel(4096);
    let config = EngineConfig {
        max_batch: opts.max_batch,
        ..EngineConfig::default()
    };
    let (engine, drained) = spawn_engine(model, config, 4096, tx, None)?;
    let submit = |j: diffmesh_shared::wire::messages::DenoiseJob| {
        let mut ej = EngineJob::new(j.clone(), None);
        let stage = stage.clone();
        let engine = engine.clone();
        async move {
            if let Some(stage) = &stage {
                let slot = PromptSlot::default();
                ej.prompts = Some(slot.clone());
                engine.submit(ej, Span::none()).await?;
                stage.encode(job_prompts(&j), slot);
            } else {
                engine.submit(ej, Span::none()).await?;
            }
            anyhow::Ok(())
        }
    };
    let long: Vec<String> = (0..opts.long_jobs).map(|i| format!("long-{i}")).collect();
    for (i, id) in long.iter().enumerate() {
        submit(job(id, format!("a long job number {i}"), opts.long_steps)).await?;
    }
    let start = Instant::now();
    let mut last_step: Vec<Option<Instant>> = vec![None; long.len()];
    let mut gaps = Vec::new();
    let mut submitted = 0;
    let mut next_arrival = Instant::now() + opts.arrival_gap;
    let mut left = long.len() + opts.short_jobs;
    while left > 0 {
        let wait = if submitted < opts.short_jobs {
            next_arrival.saturating_duration_since(Instant::now())
        } else {
            Duration::from_secs(120)
        };
        match tokio::time::timeout(wait, events.recv()).await {
            Err(_) => {
                let prompt = format!("a new prompt number {submitted} of the bench");
                submit(job(&format!("short-{submitted}"), prompt, opts.short_steps)).await?;
                submitted += 1;
                next_arrival += opts.arrival_gap;
            }
            Ok(None) => bail!("the engine stopped"),
            Ok(Some(event)) => match event {
                EngineEvent::Step { job_id, .. } => {
                    if let Some(i) = long.iter().position(|l| *l == job_id) {
                        let now = Instant::now();
                        // Only while short jobs still arrive or run: the regime measured.
                        if let Some(before) = last_step[i].replace(now) {
                            if left > long.len() || submitted < opts.short_jobs {
                                gaps.push((now - before).as_secs_f64());
                            }
                        }
                    }
                }
                EngineEvent::Finished { job, .. } => {
                    left -= 1;
                    if long.contains(&job.job_id) && submitted < opts.short_jobs {
                        bail!(
                            "{} finished before every short job arrived: raise --prompt-stage-long-steps",
                            job.job_id
                        );
                    }
                }
                EngineEvent::Failed { job, error, .. } => {
                    bail!("{} failed: {error}", job.job_id)
                }
                _ => {}
            },
        }
    }
    let wall = start.elapsed().as_secs_f64();
    engine.begin_shutdown().await;
    drop(events);
    drained.wait().await;
    Ok((gaps, wall))
}

/// Time one encode of the T5 stand-in alone (median of 5).
fn encode_cost_s(opts: &PromptStageOptions) -> Result<f64> {
    let mut model = opts.model.load()?;
    let inner = std::mem::replace(&mut model.model.text_encoder, Box::new(Taken));
    let costly = CostlyEncoder::new(inner, opts.encoder_layers, opts.encoder_tokens)?;
    let mut times = Vec::new();
    for i in 0..6 {
        let t = Instant::now();
        costly.encode(&[format!("prompt {i}")])?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

pub async fn run(opts: &PromptStageOptions, report: &mut Report) -> Result<()> {
    let encode_s = encode_cost_s(opts).context("timing the encoder")?;
    report.say(format!(
        "prompt-stage: one encode (T5, {} layers, {} tokens) takes {:.1} ms alone",
        opts.encoder_layers,
        opts.encoder_tokens,
        encode_s * 1e3
    ));
    report.insert("prompt_stage_encode_ms", encode_s * 1e3);
    for (name, mode) in [
        ("free", Mode::Free),
        ("inline", Mode::Inline),
        ("stage", Mode::Stage),
    ] {
        let (gaps, wall) = run_mode(opts, mode).await?;
        let lat = Latencies::of(&gaps).context("no step gaps were measured")?;
        let max = gaps.iter().copied().fold(0.0, f64::max);
        report.say(format!(
            "prompt-stage {name}: gap between a long job's steps: p50 {:.1} ms, p95 {:.1} ms, \
             max {:.1} ms ({} gaps); run {wall:.1} s",
            lat.p50_s * 1e3,
            lat.p95_s * 1e3,
            max * 1e3,
            lat.count
        ));
        report.insert(
            &format!("prompt_stage_{name}_step_gap_s"),
            json!({"latencies": lat.to_json(), "max": max, "wall_s": wall}),
        );
    }
    Ok(())
}
