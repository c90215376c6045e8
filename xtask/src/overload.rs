//! `cargo xtask overload`: drive the live mesh past its capacity and check the admission
//! contract. First the capacity is measured (closed loop: `--probe-concurrency` synchronous
//! generations back to back for `--probe-s`; capacity = jobs answered 200 per second), then
//! for each factor in `--factors` and each mode in `--modes`, Poisson arrivals at factor x
//! capacity for `--duration` seconds:
//! - `sync`: each request is answered 200, or 429 with `Retry-After` (anything else is counted
//!   as a failure); the 429s' answer time and the accepted requests' latency are reported;
//! - `async`: each is answered 202 (then followed to its end through `GET /v1/jobs/{id}`: it
//!   must end `done`) or 429; the accepted jobs' latency is from acceptance to their end.
//!
//! One JSON line per run (mode, factor), and a table. The contract holds when no accepted job
//! failed, no request was answered other than 200/202/429, and every 429 had `Retry-After`.
use anyhow::Context;
use diffmesh_sched::sim::metrics::percentile;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct OverloadArgs {
    /// Gateway base URL.
    #[arg(
        long,
        env = "DIFFMESH_LOAD_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    url: String,
    /// Multiples of the measured capacity to offer, comma-separated.
    #[arg(long, default_value = "1.5,2,3", value_delimiter = ',')]
    factors: Vec<f64>,
    /// `sync`, `async` or both, comma-separated.
    #[arg(long, default_value = "sync,async", value_delimiter = ',')]
    modes: Vec<String>,
    /// Seconds of arrivals per run.
    #[arg(long, default_value_t = 30.0)]
    duration: f64,
    /// Seconds of the closed-loop capacity probe.
    #[arg(long, default_value_t = 20.0)]
    probe_s: f64,
    /// Requests in flight during the probe (enough to fill every denoiser's batch).
    #[arg(long, default_value_t = 8)]
    probe_concurrency: usize,
    /// Use this capacity (jobs/s) instead of probing.
    #[arg(long)]
    capacity: Option<f64>,
    /// Denoising steps per generation.
    #[arg(long, default_value_t = 20)]
    steps: u32,
    /// Pause between runs so the previous run's queue drains (s).
    #[arg(long, default_value_t = 10.0)]
    settle_s: f64,
    /// Deadline of one HTTP request, and of following one async job (s).
    #[arg(long, default_value_t = 600.0)]
    timeout_s: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// What one request came to.
#[derive(Debug, Clone, Default)]
struct Outcome {
    /// HTTP status of the submit (200, 202, 429, other).
    status: u16,
    /// Seconds to the submit's answer.
    answered_s: f64,
    retry_after: bool,
    /// For an accepted job: how it ended (`done`, `failed: ...`) and its latency (sync: the
    /// request; async: acceptance to end).
    ended: Option<String>,
    latency_s: f64,
}

pub fn overload(args: OverloadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.duration > 0.0, "--duration must be > 0");
    anyhow::ensure!(!args.factors.is_empty(), "--factors is empty");
    for m in &args.modes {
        anyhow::ensure!(
            m == "sync" || m == "async",
            "--modes: `{m}` is neither sync nor async"
        );
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(run(args))
}

fn body(i: u64, steps: u32) -> Value {
    json!({"prompt": format!("a red circle on a blue background {i}"), "num_inference_steps": steps, "seed": i})
}

async fn run(args: OverloadArgs) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(args.timeout_s))
        .pool_max_idle_per_host(1024)
        .build()?;
    let base = args.url.trim_end_matches('/').to_string();
    let capacity = match args.capacity {
        Some(c) => c,
        None => probe(&client, &base, &args).await?,
    };
    anyhow::ensure!(capacity > 0.0, "measured capacity is 0: is a denoiser up?");
    println!("capacity: {capacity:.2} jobs/s");
    let mut rows = Vec::new();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    for mode in &args.modes {
        for &factor in &args.factors {
            tokio::time::sleep(Duration::from_secs_f64(args.settle_s)).await;
            let rate = factor * capacity;
            let outcomes = offer(&client, &base, mode == "async", rate, &args, &mut rng).await;
            let row = summarize(mode, factor, rate, &outcomes);
            println!("{row}");
            rows.push(row);
        }
    }
    println!();
    println!("| mode | load | sent | accepted | 429 | other | accepted failed | 429 answer p50 / p95 / max (ms) | Retry-After on all 429 | accepted latency p50 / p95 / p99 (s) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {}x | {} | {} | {} | {} | {} | {:.1} / {:.1} / {:.1} | {} | {:.2} / {:.2} / {:.2} |",
            r["mode"].as_str().unwrap_or(""),
            r["factor"],
            r["sent"],
            r["accepted"],
            r["refused_429"],
            r["other"],
            r["accepted_failed"],
            r["refusal_ms_p50"].as_f64().unwrap_or(0.0),
            r["refusal_ms_p95"].as_f64().unwrap_or(0.0),
            r["refusal_ms_max"].as_f64().unwrap_or(0.0),
            if r["all_429_retry_after"].as_bool().unwrap_or(false) { "yes" } else { "NO" },
            r["latency_s_p50"].as_f64().unwrap_or(0.0),
            r["latency_s_p95"].as_f64().unwrap_or(0.0),
            r["latency_s_p99"].as_f64().unwrap_or(0.0),
        );
    }
    let broken = rows.iter().any(|r| {
        r["accepted_failed"].as_u64() != Some(0)
            || r["other"].as_u64() != Some(0)
            || r["all_429_retry_after"] != true
    });
    anyhow::ensure!(!broken, "the admission contract was broken (see the table)");
    Ok(())
}

/// Closed loop: `probe_concurrency` clients send generations back to back.
async fn probe(client: &reqwest::Client, base: &str, args: &OverloadArgs) -> anyhow::Result<f64> {
    let url = format!("{base}/v1/images/generations");
    // Warm: the first request loads prompts and teaches the router the job time.
    let r = client.post(&url).json(&body(0, args.steps)).send().await?;
    anyhow::ensure!(r.status().is_success(), "warm-up request: {}", r.status());
    let until = Instant::now() + Duration::from_secs_f64(args.probe_s);
    let started = Instant::now();
    let workers = (0..args.probe_concurrency.max(1)).map(|w| {
        let (client, url) = (client.clone(), url.clone());
        let steps = args.steps;
        tokio::spawn(async move {
            let mut done = 0u64;
            let mut i = 1_000_000 * (w as u64 + 1);
            while Instant::now() < until {
                i += 1;
                match client.post(&url).json(&body(i, steps)).send().await {
                    Ok(r) if r.status().is_success() => done += 1,
                    Ok(r) if r.status().as_u16() == 429 => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    _ => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
            done
        })
    });
    let mut done = 0;
    for w in futures::future::join_all(workers).await {
        done += w.context("probe worker")?;
    }
    Ok(done as f64 / started.elapsed().as_secs_f64())
}

/// Poisson arrivals at `rate` for `--duration`; answers every request's outcome.
async fn offer(
    client: &reqwest::Client,
    base: &str,
    async_: bool,
    rate: f64,
    args: &OverloadArgs,
    rng: &mut ChaCha8Rng,
) -> Vec<Outcome> {
    let mut arrivals = Vec::new();
    let mut t = 0.0;
    loop {
        let u: f64 = 1.0 - rng.random::<f64>();
        t += -u.ln() / rate;
        if t >= args.duration {
            break;
        }
        arrivals.push(t);
    }
    let base = Arc::new(base.to_string());
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(arrivals.len());
    for (i, at) in arrivals.into_iter().enumerate() {
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        let (client, base) = (client.clone(), base.clone());
        let seed = rng.random::<u32>() as u64;
        let steps = args.steps;
        let follow_for = Duration::from_secs_f64(args.timeout_s);
        tasks.push(tokio::spawn(async move {
            one(
                &client,
                &base,
                async_,
                body(seed + i as u64, steps),
                follow_for,
            )
            .await
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap_or_default());
    }
    outcomes
}

async fn one(
    client: &reqwest::Client,
    base: &str,
    async_: bool,
    body: Value,
    follow_for: Duration,
) -> Outcome {
    let sent = Instant::now();
    let mut request = client
        .post(format!("{base}/v1/images/generations"))
        .json(&body);
    if async_ {
        request = request.header("Prefer", "respond-async");
    }
    let answer = match request.send().await {
        Ok(a) => a,
        Err(_) => return Outcome::default(),
    };
    let status = answer.status().as_u16();
    let retry_after = answer.headers().contains_key("retry-after");
    let json: Value = answer.json().await.unwrap_or(Value::Null);
    let answered_s = sent.elapsed().as_secs_f64();
    let mut outcome = Outcome {
        status,
        answered_s,
        retry_after,
        ended: None,
        latency_s: answered_s,
    };
    match status {
        200 => outcome.ended = Some("done".into()),
        202 => {
            let id = json["id"].as_str().unwrap_or_default().to_string();
            let accepted_at = Instant::now();
            let until = accepted_at + follow_for;
            let ended = loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let view: Value = match client.get(format!("{base}/v1/jobs/{id}")).send().await {
                    Ok(r) => r.json().await.unwrap_or(Value::Null),
                    Err(_) => Value::Null,
                };
                match view["status"].as_str() {
                    Some("done") => break "done".to_string(),
                    Some("queued" | "running") | None if Instant::now() < until => continue,
                    Some(other) => {
                        break format!(
                            "{other}: {}",
                            view["error"]["message"].as_str().unwrap_or("")
                        )
                    }
                    None => break "never ended".to_string(),
                }
            };
            outcome.ended = Some(ended);
            outcome.latency_s = accepted_at.elapsed().as_secs_f64();
        }
        _ => {}
    }
    outcome
}

fn summarize(mode: &str, factor: f64, rate: f64, outcomes: &[Outcome]) -> Value {
    let accepted: Vec<&Outcome> = outcomes.iter().filter(|o| o.ended.is_some()).collect();
    let refused: Vec<&Outcome> = outcomes.iter().filter(|o| o.status == 429).collect();
    let other = outcomes.len() - accepted.len() - refused.len();
    let failed = accepted
        .iter()
        .filter(|o| o.ended.as_deref() != Some("done"))
        .count();
    let mut refusal_ms: Vec<f64> = refused.iter().map(|o| o.answered_s * 1e3).collect();
    refusal_ms.sort_by(f64::total_cmp);
    let mut latency: Vec<f64> = accepted.iter().map(|o| o.latency_s).collect();
    latency.sort_by(f64::total_cmp);
    let pick = |v: &[f64], q: f64| if v.is_empty() { 0.0 } else { percentile(v, q) };
    let first_failure = accepted
        .iter()
        .find_map(|o| o.ended.as_deref().filter(|e| *e != "done"));
    json!({
        "mode": mode,
        "factor": factor,
        "offered_rps": rate,
        "sent": outcomes.len(),
        "accepted": accepted.len(),
        "refused_429": refused.len(),
        "other": other,
        "accepted_failed": failed,
        "first_failure": first_failure,
        "all_429_retry_after": refused.iter().all(|o| o.retry_after),
        "refusal_ms_p50": pick(&refusal_ms, 50.0),
        "refusal_ms_p95": pick(&refusal_ms, 95.0),
        "refusal_ms_max": refusal_ms.last().copied().unwrap_or(0.0),
        "latency_s_p50": pick(&latency, 50.0),
        "latency_s_p95": pick(&latency, 95.0),
        "latency_s_p99": pick(&latency, 99.0),
    })
}
