//! `cargo xtask load`: a load generator for the live mesh. Sends real multipart edit requests
//! (`POST /v1/images/edits`) to the gateway with Poisson arrivals and masks of ratios drawn from
//! a mask-ratio file, and reports the simulator's measures (last line JSON). With `--out-dir`
//! each run is kept as `<label>.json` (summary and every latency) and every run in the folder is
//! drawn as one latency-CDF plot, `latency-cdf.png`, so runs of several policies (or a simulator
//! run written with `diffmesh-sim --latencies-out`) are compared on one picture.
use crate::load_inputs::{mask_png, template_png};
use crate::load_tap::{breakdown, JobTap, Timeline};
use crate::plot::{latency_cdf, Series};
use anyhow::{bail, Context};
use diffmesh_sched::cost_model::LinearFit;
use diffmesh_sched::sim::metrics::percentile;
use diffmesh_sched::sim::workload::read_mask_ratios;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct LoadArgs {
    /// Gateway base URL.
    #[arg(
        long,
        env = "DIFFMESH_LOAD_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    url: String,
    /// Poisson arrival rate (requests/s).
    #[arg(long, required_unless_present = "plot_only")]
    rps: Option<f64>,
    /// Seconds of arrivals (the run then waits for every request).
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Mask-ratio file (one ratio in [0, 1] a line) the masks are drawn from.
    #[arg(long, required_unless_present = "plot_only")]
    mask_ratios: Option<PathBuf>,
    /// Seed of arrivals, ratio draws and mask placement.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print only the final JSON line.
    #[arg(long)]
    json: bool,
    /// Keep this run as `<label>.json` here and redraw `latency-cdf.png` from every run here.
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Name of this run in its file and the plot legend (e.g. the router's policy). With
    /// `--out-dir` the run's arrivals are also kept as `<label>.trace.csv` (`arrival_s,
    /// mask_ratio,template_id`), the trace `cargo xtask sim --trace` replays.
    #[arg(long, default_value = "live")]
    label: String,
    /// Only redraw `<out-dir>/latency-cdf.png` from the runs kept there.
    #[arg(long, requires = "out_dir")]
    plot_only: bool,
    /// Image size (WxH) of templates and masks; 64x64 is the tiny model's resolution.
    #[arg(long, default_value = "64x64")]
    size: String,
    /// Distinct templates, used in turn (each has its own template id in the mesh).
    #[arg(long, default_value_t = 4)]
    templates: u32,
    /// Upload the template image with every edit instead of registering the templates first
    /// (`POST /v1/templates`) and editing by `template_id`. Uploaded edits have no captured
    /// cache, so the denoiser runs them in full compute.
    #[arg(long)]
    upload: bool,
    /// Denoising steps per request (the gateway's default when absent).
    #[arg(long)]
    steps: Option<u32>,
    /// `true_cfg_scale` of every edit (the gateway's `--default-true-cfg-scale` when absent;
    /// 1 turns true CFG off, so one mesh serves both sides of a comparison).
    #[arg(long)]
    true_cfg_scale: Option<f32>,
    #[arg(
        long,
        default_value = "a yellow square on the right on a blue background"
    )]
    prompt: String,
    /// Deadline of one HTTP request (s).
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// Requests in flight at most (arrivals beyond wait for a slot, and their wait counts).
    #[arg(long, default_value_t = 512)]
    max_in_flight: usize,
    /// SLO deadline = arrival + this x the request's standalone latency (from the calibration).
    #[arg(long, default_value_t = 3.0)]
    slo_factor: f64,
    /// Sequential requests on the idle mesh, at the smallest, median and largest ratio each,
    /// that measure the standalone latency for the SLO (0: no calibration, no SLO figure).
    #[arg(long, default_value_t = 2)]
    calibrate: u32,
    /// NATS server whose job events give each job's start (for `mean_queue`); a cluster as
    /// comma-separated URLs.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Do not listen to job events (`mean_queue` is then not reported).
    #[arg(long)]
    no_nats: bool,
    /// Send each edit with an `Idempotency-Key` and repeat it up to this many times when no
    /// answer came (the connection failed or was cut) or the answer was 502/503, as a client of
    /// a replicated gateway would: a repeat is answered with the job the first try started.
    /// Latency counts from the first try.
    #[arg(long, default_value_t = 0)]
    retries: u32,
    /// Pause before the first repeat (s), doubling per repeat.
    #[arg(long, default_value_t = 0.25)]
    retry_pause_s: f64,
}

/// Outcome of one request.
#[derive(Debug, Clone)]
struct Outcome {
    ratio: f64,
    sent: Instant,
    status: u16,
    latency_s: f64,
    /// Tries sent (1 without repeats).
    tries: u32,
}

struct Inputs {
    width: u32,
    height: u32,
    templates: Vec<Vec<u8>>,
    /// Registered template ids, one per template (empty: upload the images).
    template_ids: Vec<String>,
}

pub fn load(args: LoadArgs) -> anyhow::Result<()> {
    if args.plot_only {
        let dir = args
            .out_dir
            .as_deref()
            .context("--plot-only needs --out-dir")?;
        let path = plot_runs(dir)?;
        println!("wrote {}", path.display());
        return Ok(());
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(run(args))
}

fn parse_size(s: &str) -> anyhow::Result<(u32, u32)> {
    let (w, h) = s
        .split_once('x')
        .with_context(|| format!("--size: `{s}` is not WxH"))?;
    let (w, h): (u32, u32) = (
        w.trim()
            .parse()
            .with_context(|| format!("--size: width `{w}`"))?,
        h.trim()
            .parse()
            .with_context(|| format!("--size: height `{h}`"))?,
    );
    anyhow::ensure!(w > 0 && h > 0, "--size: both sides must be > 0");
    Ok((w, h))
}

async fn run(args: LoadArgs) -> anyhow::Result<()> {
    let rps = args.rps.context("--rps is required")?;
    anyhow::ensure!(rps > 0.0 && rps.is_finite(), "--rps must be > 0");
    anyhow::ensure!(args.duration > 0.0, "--duration must be > 0");
    anyhow::ensure!(args.templates > 0, "--templates must be > 0");
    anyhow::ensure!(
        args.retry_pause_s >= 0.0 && args.retry_pause_s.is_finite(),
        "--retry-pause-s must be >= 0"
    );
    let ratio_file = args
        .mask_ratios
        .as_deref()
        .context("--mask-ratios is required")?;
    let ratios = read_mask_ratios(ratio_file)?;
    let (width, height) = parse_size(&args.size)?;
    let say = |s: String| {
        if !args.json {
            println!("{s}");
        }
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(args.timeout_s))
        .build()?;
    let base = args.url.trim_end_matches('/');
    let url = format!("{base}/v1/images/edits");
    let templates: Vec<Vec<u8>> = (0..args.templates)
        .map(|i| template_png(width, height, i))
        .collect::<anyhow::Result<_>>()?;
    let mut template_ids = Vec::new();
    if !args.upload {
        let started = Instant::now();
        for png in &templates {
            template_ids.push(register_template(&client, base, png, args.steps).await?);
        }
        say(format!(
            "registered {} templates (capture passes) in {:.1}s",
            template_ids.len(),
            started.elapsed().as_secs_f64()
        ));
    }
    let inputs = Arc::new(Inputs {
        width,
        height,
        templates,
        template_ids,
    });
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);

    let standalone = if args.calibrate > 0 {
        let fit = calibrate(&client, &url, &args, &inputs, &ratios, &mut rng).await?;
        say(format!(
            "calibration (idle mesh, {} requests per ratio): standalone latency {:.3}s + {:.3}s x mask ratio",
            args.calibrate, fit.intercept, fit.slope
        ));
        Some(fit)
    } else {
        None
    };
    let tap = if args.no_nats {
        None
    } else {
        match JobTap::connect(&args.nats_url).await {
            Ok(t) => Some(t),
            Err(e) => {
                say(format!(
                    "no job events ({e:#}): mean_queue and events are not reported"
                ));
                None
            }
        }
    };

    // Arrivals and their masks, all drawn before the clock starts.
    let mut plan = Vec::new();
    let mut t = 0.0;
    loop {
        let u: f64 = 1.0 - rng.random::<f64>();
        t += -u.ln() / rps;
        if t >= args.duration {
            break;
        }
        let ratio = ratios[rng.random_range(0..ratios.len())];
        let mask = mask_png(width, height, ratio, &mut rng)?;
        let template = plan.len() as u32 % args.templates;
        plan.push((t, ratio, template, mask));
    }
    say(format!(
        "load: {} requests, Poisson {rps} req/s for {}s, masks from {} at {width}x{height}, {} templates -> {url}",
        plan.len(),
        args.duration,
        ratio_file.display(),
        args.templates
    ));
    let arrivals: Vec<(f64, f64, u32)> = plan
        .iter()
        .map(|(at, ratio, template, _)| (*at, *ratio, *template))
        .collect();
    let limit = Arc::new(tokio::sync::Semaphore::new(args.max_in_flight.max(1)));
    // Keys unique to this run: the gateway remembers a key for a day, and a later run with the
    // same seed must not be answered with this run's jobs.
    let run_nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let retry = Retry {
        times: args.retries,
        pause: Duration::from_secs_f64(args.retry_pause_s),
    };
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (at, ratio, template, mask)) in plan.into_iter().enumerate() {
        tokio::time::sleep_until((started + Duration::from_secs_f64(at)).into()).await;
        let sent = Instant::now();
        let permit = limit.clone().acquire_owned().await?;
        let (client, url, inputs) = (client.clone(), url.clone(), inputs.clone());
        let form = EditForm {
            template,
            mask,
            prompt: args.prompt.clone(),
            steps: args.steps,
            true_cfg_scale: args.true_cfg_scale,
            seed: args.seed.wrapping_add(i as u64),
            idempotency_key: (retry.times > 0).then(|| format!("load-{run_nonce:x}-{i}")),
        };
        tasks.spawn(async move {
            let (status, tries) = retry.send(&client, &url, &inputs, &form).await;
            drop(permit);
            Outcome {
                ratio,
                sent,
                status,
                latency_s: sent.elapsed().as_secs_f64(),
                tries,
            }
        });
    }
    let mut outcomes = Vec::new();
    while let Some(o) = tasks.join_next().await {
        outcomes.push(o?);
    }
    let timelines = tap.map(|t| t.timelines());
    let summary = summarize(
        &args,
        rps,
        &outcomes,
        standalone.as_ref(),
        timelines.as_deref(),
    );
    say(format!(
        "completed {}/{} (429: {}, other errors: {}, sent again: {}), latency p50 {:.3}s p95 {:.3}s p99 {:.3}s, mean queue {}, throughput {:.3} req/s, SLO attainment {}",
        summary["completed"], summary["submitted"], summary["rejected"], summary["failed"], summary["retried"],
        summary["p50"].as_f64().unwrap_or(f64::NAN), summary["p95"].as_f64().unwrap_or(f64::NAN),
        summary["p99"].as_f64().unwrap_or(f64::NAN),
        summary["mean_queue"], summary["throughput"].as_f64().unwrap_or(0.0), summary["slo_attainment"]
    ));
    if let Some(dir) = &args.out_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("--out-dir {}", dir.display()))?;
        let mut latencies: Vec<f64> = outcomes
            .iter()
            .filter(|o| o.status == 200)
            .map(|o| o.latency_s)
            .collect();
        latencies.sort_by(f64::total_cmp);
        let record = json!({ "label": args.label, "summary": summary, "latencies": latencies });
        let path = dir.join(format!("{}.json", args.label));
        std::fs::write(&path, serde_json::to_string_pretty(&record)?)?;
        let trace = dir.join(format!("{}.trace.csv", args.label));
        std::fs::write(&trace, trace_csv(&arrivals))
            .with_context(|| format!("writing {}", trace.display()))?;
        let plot = plot_runs(dir)?;
        say(format!("kept {}; plot {}", path.display(), plot.display()));
    }
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}

struct EditForm {
    template: u32,
    mask: Vec<u8>,
    prompt: String,
    steps: Option<u32>,
    true_cfg_scale: Option<f32>,
    seed: u64,
    idempotency_key: Option<String>,
}

/// When and how often an edit is sent again.
#[derive(Clone, Copy)]
struct Retry {
    times: u32,
    pause: Duration,
}

impl Retry {
    /// Send `f`, again after a pause while the answer says the request may not have been
    /// served; the last status and the tries sent.
    async fn send(
        &self,
        client: &reqwest::Client,
        url: &str,
        inputs: &Inputs,
        f: &EditForm,
    ) -> (u16, u32) {
        let mut tries = 0;
        loop {
            let status = send(client, url, inputs, f).await;
            tries += 1;
            if tries > self.times || !matches!(status, 0 | 502 | 503) {
                return (status, tries);
            }
            tokio::time::sleep(self.pause * 2u32.saturating_pow(tries - 1).min(16)).await;
        }
    }
}

/// One edit request; the HTTP status, or 0 when no answer came (connection error, timeout).
async fn send(client: &reqwest::Client, url: &str, inputs: &Inputs, f: &EditForm) -> u16 {
    let part = |bytes: Vec<u8>, name: &str| {
        reqwest::multipart::Part::bytes(bytes)
            .file_name(name.to_string())
            .mime_str("image/png")
    };
    let Ok(mask) = part(f.mask.clone(), "mask.png") else {
        return 0;
    };
    let mut form = reqwest::multipart::Form::new()
        .part("mask", mask)
        .text("prompt", f.prompt.clone())
        .text("response_format", "png")
        .text("seed", f.seed.to_string());
    // A registered template by id, else the image itself.
    form = match inputs.template_ids.get(f.template as usize) {
        Some(id) => form.text("template_id", id.clone()),
        None => match part(
            inputs.templates[f.template as usize].clone(),
            "template.png",
        ) {
            Ok(image) => form.part("image", image),
            Err(_) => return 0,
        },
    };
    if let Some(s) = f.steps {
        form = form.text("num_inference_steps", s.to_string());
    }
    if let Some(g) = f.true_cfg_scale {
        form = form.text("true_cfg_scale", g.to_string());
    }
    let mut request = client.post(url).multipart(form);
    if let Some(key) = &f.idempotency_key {
        request = request.header("Idempotency-Key", key);
    }
    match request.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            // The whole body is part of the latency (the image the client waits for).
            match resp.bytes().await {
                Ok(_) => status,
                Err(_) => 0,
            }
        }
        Err(_) => 0,
    }
}

/// Register one template (`POST /v1/templates`, which runs its capture pass); its id.
async fn register_template(
    client: &reqwest::Client,
    base: &str,
    png: &[u8],
    steps: Option<u32>,
) -> anyhow::Result<String> {
    let image = reqwest::multipart::Part::bytes(png.to_vec())
        .file_name("template.png")
        .mime_str("image/png")?;
    let mut form = reqwest::multipart::Form::new().part("image", image);
    if let Some(s) = steps {
        form = form.text("num_inference_steps", s.to_string());
    }
    let url = format!("{base}/v1/templates");
    let resp = client
        .post(&url)
        .multipart(form)
        .send()
        .await
        .with_context(|| format!("POST {url} (is the mesh up?)"))?;
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    anyhow::ensure!(
        status.is_success(),
        "POST {url} answered {status}: {body} (use --upload for a gateway without templates)"
    );
    let v: Value = serde_json::from_str(&body).with_context(|| format!("POST {url}: {body}"))?;
    v["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("POST {url}: no `id` in {body}"))
}

/// Standalone latency against mask ratio, from sequential requests on the idle mesh.
async fn calibrate(
    client: &reqwest::Client,
    url: &str,
    args: &LoadArgs,
    inputs: &Inputs,
    ratios: &[f64],
    rng: &mut ChaCha8Rng,
) -> anyhow::Result<LinearFit> {
    let mut sorted = ratios.to_vec();
    sorted.sort_by(f64::total_cmp);
    let points = [
        sorted[0],
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
    ];
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for (k, &ratio) in points.iter().enumerate() {
        for i in 0..args.calibrate {
            let form = EditForm {
                template: (k as u32 + i) % args.templates,
                mask: mask_png(inputs.width, inputs.height, ratio, rng)?,
                prompt: args.prompt.clone(),
                steps: args.steps,
                true_cfg_scale: args.true_cfg_scale,
                seed: args.seed ^ 0xca1,
                idempotency_key: None,
            };
            let t = Instant::now();
            let status = send(client, url, inputs, &form).await;
            if status != 200 {
                bail!("calibration request to {url} answered {status} (is the mesh up?)");
            }
            xs.push(ratio);
            ys.push(t.elapsed().as_secs_f64());
        }
    }
    if xs.iter().all(|x| *x == xs[0]) {
        let mean = ys.iter().sum::<f64>() / ys.len() as f64;
        return Ok(LinearFit {
            slope: 0.0,
            intercept: mean,
            r2: 1.0,
            samples: ys.len(),
        });
    }
    Ok(LinearFit::fit("calibration latency", &xs, &ys)?)
}

/// The simulator's measures for the live run.
fn summarize(
    args: &LoadArgs,
    rps: f64,
    outcomes: &[Outcome],
    standalone: Option<&LinearFit>,
    timelines: Option<&[Timeline]>,
) -> Value {
    let starts: Option<Vec<Instant>> =
        timelines.map(|ts| ts.iter().filter_map(|t| t.started).collect());
    let done: Vec<&Outcome> = outcomes.iter().filter(|o| o.status == 200).collect();
    let mut lat: Vec<f64> = done.iter().map(|o| o.latency_s).collect();
    lat.sort_by(f64::total_cmp);
    let rejected = outcomes.iter().filter(|o| o.status == 429).count();
    let failed = outcomes.len() - done.len() - rejected;
    let retried = outcomes.iter().filter(|o| o.tries > 1).count();
    let repeats: u32 = outcomes.iter().map(|o| o.tries.saturating_sub(1)).sum();
    let first = outcomes.iter().map(|o| o.sent).min();
    let last = done
        .iter()
        .map(|o| o.sent + Duration::from_secs_f64(o.latency_s))
        .max();
    let throughput = match (first, last) {
        (Some(f), Some(l)) if l > f => done.len() as f64 / (l - f).as_secs_f64(),
        _ => 0.0,
    };
    let slo = standalone.map(|fit| {
        let met = done
            .iter()
            .filter(|o| o.latency_s <= args.slo_factor * fit.predict(o.ratio))
            .count();
        met as f64 / outcomes.len().max(1) as f64
    });
    // Mean of (first Started - send) over the jobs: the sums need no pairing of job ids with
    // requests, only the same set of jobs (every completed request started once, nothing else ran).
    let mean_queue = starts.and_then(|s| {
        (s.len() == done.len() && !done.is_empty()).then(|| {
            let origin = first.unwrap_or_else(Instant::now);
            let since = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
            let started: f64 = s.iter().map(|&t| since(t)).sum();
            let sent: f64 = done.iter().map(|o| since(o.sent)).sum();
            ((started - sent) / done.len() as f64).max(0.0)
        })
    });
    let nan_to_null = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
    json!({
        "label": args.label,
        "rps": rps,
        "duration": args.duration,
        "submitted": outcomes.len(),
        "completed": done.len(),
        "rejected": rejected,
        "failed": failed,
        // Requests sent more than once (`--retries`), and the repeats sent in all.
        "retried": retried,
        "repeats": repeats,
        "p50": nan_to_null(percentile(&lat, 50.0)),
        "p95": nan_to_null(percentile(&lat, 95.0)),
        "p99": nan_to_null(percentile(&lat, 99.0)),
        "mean_latency": nan_to_null(lat.iter().sum::<f64>() / lat.len().max(1) as f64),
        "mean_queue": mean_queue,
        "throughput": throughput,
        "slo_attainment": slo,
        // The idle mesh's latency of one request against its mask ratio: what a simulator
        // run of the same trace adds beyond the denoisers (`--request-overhead-s`) rests on it.
        "standalone": standalone.map(|f| json!({ "intercept_s": f.intercept, "slope_s": f.slope })),
        // The jobs' time from their events: queued to last step is what the simulator models.
        "events": timelines.map(breakdown),
        "seed": args.seed,
    })
}

/// The arrivals as the trace file `diffmesh-sim --trace` reads.
fn trace_csv(arrivals: &[(f64, f64, u32)]) -> String {
    let mut out = String::from("arrival_s,mask_ratio,template_id\n");
    for (at, ratio, template) in arrivals {
        out.push_str(&format!("{at:.6},{ratio},{template}\n"));
    }
    out
}

/// Redraw `<dir>/latency-cdf.png` from every run file (`*.json` with `label` and `latencies`).
fn plot_runs(dir: &Path) -> anyhow::Result<PathBuf> {
    let mut series = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    entries.sort();
    for path in entries {
        let text = std::fs::read_to_string(&path)?;
        let Ok(v) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        let (Some(label), Some(lat)) = (v["label"].as_str(), v["latencies"].as_array()) else {
            continue;
        };
        let p95 = v["summary"]["p95"].as_f64().unwrap_or(f64::NAN);
        series.push(Series {
            label: format!("{label} p95 {p95:.2}"),
            latencies: lat.iter().filter_map(Value::as_f64).collect(),
        });
    }
    anyhow::ensure!(
        !series.is_empty(),
        "no run files (*.json with label and latencies) in {}",
        dir.display()
    );
    let path = dir.join("latency-cdf.png");
    latency_cdf("LATENCY CDF", &series, &path)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::trace_csv;
    use diffmesh_sched::sim::workload::read_trace;

    #[test]
    fn the_kept_trace_is_what_the_simulator_replays() {
        let arrivals = [(0.25, 0.05, 0), (0.5, 1.0, 1), (1.75, 0.3, 0)];
        let path = std::env::temp_dir().join(format!("diffmesh-trace-{}.csv", std::process::id()));
        std::fs::write(&path, trace_csv(&arrivals)).unwrap();
        let shape = diffmesh_sched::synthetic::profile(0).shape;
        let read = read_trace(&path, &shape, 20).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!(read.len(), 3);
        for (a, (at, ratio, template)) in read.iter().zip(arrivals) {
            assert_eq!(a.time_s, at);
            assert_eq!(a.masked_tokens, shape.masked_tokens(ratio));
            assert_eq!(a.template, Some(u64::from(template)));
            assert_eq!(a.steps, 20);
        }
    }
}
