//! The load generator's view of the mesh's job events (`diffmesh.job.*.events`): when each job
//! was queued on a denoiser, joined its batch, finished its last step and was done (after the
//! codec's post-processing). It splits a live request's latency into the part the simulator
//! models (queued to last step) and the rest, so a gap between the two is placed, not guessed.
use anyhow::Context;
use diffmesh_sched::sim::metrics::percentile;
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// When the tap saw each of one job's events (the first of each kind).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Timeline {
    pub queued: Option<Instant>,
    pub started: Option<Instant>,
    pub last_step: Option<Instant>,
    pub done: Option<Instant>,
}

/// The events that place a job in time, decoded from a MessagePack `JobEvent` (externally
/// tagged, fields by name: `{"Step": {"step": 3, "total": 20}}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    Queued,
    Started,
    LastStep,
    Done,
}

fn mark(payload: &[u8]) -> Option<Mark> {
    let v: Value = rmp_serde::from_slice(payload).ok()?;
    let (kind, body) = v.as_object()?.iter().next()?;
    match kind.as_str() {
        "Queued" => Some(Mark::Queued),
        "Started" => Some(Mark::Started),
        "Done" => Some(Mark::Done),
        "Step" => {
            let (step, total) = (body["step"].as_u64()?, body["total"].as_u64()?);
            (step >= total).then_some(Mark::LastStep)
        }
        _ => None,
    }
}

impl Timeline {
    fn note(&mut self, mark: Mark, at: Instant) {
        let slot = match mark {
            Mark::Queued => &mut self.queued,
            Mark::Started => &mut self.started,
            Mark::LastStep => &mut self.last_step,
            Mark::Done => &mut self.done,
        };
        slot.get_or_insert(at);
    }
}

pub struct JobTap {
    jobs: Arc<Mutex<HashMap<String, Timeline>>>,
    task: tokio::task::JoinHandle<()>,
}

impl JobTap {
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        // A cluster is given as comma-separated URLs, as to the services.
        let servers: Vec<&str> = url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        // On a server with users (`cargo xtask up` starting its own): `run/nats/admin.env`.
        let options = match (std::env::var("NATS_USER"), std::env::var("NATS_PASSWORD")) {
            (Ok(user), Ok(password)) => {
                async_nats::ConnectOptions::with_user_and_password(user, password)
            }
            _ => async_nats::ConnectOptions::new(),
        };
        let client =
            tokio::time::timeout(Duration::from_secs(3), options.connect(servers.as_slice()))
                .await
                .with_context(|| format!("connecting to {url} timed out"))??;
        // `diffmesh_shared::wire::subjects::job_events("*")`, spelled out so xtask need not build the
        // shared crate (actix, OpenTelemetry) before its first command.
        let mut sub = client.subscribe("diffmesh.job.*.events").await?;
        client.flush().await?;
        let jobs: Arc<Mutex<HashMap<String, Timeline>>> = Arc::default();
        let seen = jobs.clone();
        let task = tokio::spawn(async move {
            let _client = client;
            while let Some(msg) = sub.next().await {
                let now = Instant::now();
                if let Some(m) = mark(&msg.payload) {
                    if let Ok(mut jobs) = seen.lock() {
                        jobs.entry(msg.subject.as_str().to_string())
                            .or_default()
                            .note(m, now);
                    }
                }
            }
        });
        Ok(JobTap { jobs, task })
    }

    /// Stop listening; every job seen, in no order.
    pub fn timelines(self) -> Vec<Timeline> {
        self.task.abort();
        let jobs = self.jobs.lock().map(|m| m.clone()).unwrap_or_default();
        jobs.into_values().collect()
    }
}

/// Quantiles (s) of the parts of the jobs' time the events bound, over the jobs that have both
/// ends: `at_denoiser` (queued to last step: what the simulator models, less its
/// `--request-overhead-s`), `wait` (queued to started), `denoise` (started to last step) and
/// `post` (last step to done: the codec's post-processing and its NATS hops).
pub fn breakdown(timelines: &[Timeline]) -> Value {
    let part = |from: fn(&Timeline) -> Option<Instant>, to: fn(&Timeline) -> Option<Instant>| {
        let mut xs: Vec<f64> = timelines
            .iter()
            .filter_map(|t| Some(to(t)?.saturating_duration_since(from(t)?).as_secs_f64()))
            .collect();
        xs.sort_by(f64::total_cmp);
        let mean = xs.iter().sum::<f64>() / xs.len().max(1) as f64;
        json!({
            "jobs": xs.len(),
            "mean": mean,
            "p50": percentile(&xs, 50.0),
            "p95": percentile(&xs, 95.0),
            "p99": percentile(&xs, 99.0),
        })
    };
    json!({
        "at_denoiser": part(|t| t.queued, |t| t.last_step),
        "wait": part(|t| t.queued, |t| t.started),
        "denoise": part(|t| t.started, |t| t.last_step),
        "post": part(|t| t.last_step, |t| t.done),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(v: Value) -> Vec<u8> {
        rmp_serde::to_vec_named(&v).unwrap()
    }

    #[test]
    fn marks_from_job_events() {
        let step = |step, total| encode(json!({"Step": {"step": step, "total": total}}));
        assert_eq!(mark(&step(3, 20)), None);
        assert_eq!(mark(&step(20, 20)), Some(Mark::LastStep));
        let queued = encode(json!({"Queued": {"worker_id": "w", "position": 0}}));
        assert_eq!(mark(&queued), Some(Mark::Queued));
        let started = encode(json!({"Started": {"worker_id": "w"}}));
        assert_eq!(mark(&started), Some(Mark::Started));
        assert_eq!(
            mark(&encode(json!({"Done": {"png_keys": []}}))),
            Some(Mark::Done)
        );
        assert_eq!(mark(&encode(json!({"Failed": {"message": "x"}}))), None);
        assert_eq!(mark(b"not msgpack"), None);
    }

    #[test]
    fn breakdown_of_hand_made_timelines() {
        let t0 = Instant::now();
        let at = |ms: u64| Some(t0 + Duration::from_millis(ms));
        let mut first = Timeline::default();
        first.note(Mark::Queued, t0);
        first.note(Mark::Started, t0 + Duration::from_millis(100));
        // A repeated event keeps the first time.
        first.note(Mark::Started, t0 + Duration::from_millis(150));
        first.note(Mark::LastStep, t0 + Duration::from_millis(400));
        first.note(Mark::Done, t0 + Duration::from_millis(450));
        assert_eq!(first.started, at(100));
        // Queued only: left out of every part that needs a later event.
        let second = Timeline {
            queued: at(0),
            ..Timeline::default()
        };
        let b = breakdown(&[first, second]);
        assert_eq!(b["at_denoiser"]["jobs"], 1);
        assert!((b["at_denoiser"]["mean"].as_f64().unwrap() - 0.4).abs() < 1e-9);
        assert!((b["wait"]["p50"].as_f64().unwrap() - 0.1).abs() < 1e-9);
        assert!((b["denoise"]["p95"].as_f64().unwrap() - 0.3).abs() < 1e-9);
        assert!((b["post"]["p99"].as_f64().unwrap() - 0.05).abs() < 1e-9);
    }
}
