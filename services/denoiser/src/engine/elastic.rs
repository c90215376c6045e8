//! The engine's step loop on elastic ranks (`--ranks R`, [`crate::ranks`]): instead of one
//! batched forward on its own model, each iteration takes the step tasks that ended on the
//! ranks (their velocities step the jobs' states here), asks the node's elastic policy which
//! ready jobs step next on how many ranks, and dispatches those tasks to groups of free ranks.
//! Jobs step asynchronously, each at its own pace and degree, like in `diffmesh-sim`.
//!
//! An edit whose template cache is resident steps mask-aware on its ranks, each member
//! computing a share of the masked tokens ([`crate::ranks::pool::RankPool::dispatch_edit`]);
//! template captures record K/V, which the split forward does not, and run on the engine's
//! own transformer between iterations.
use super::{Active, Engine, EngineEvent, EngineJob, EngineJobError};
use crate::cached_step::CachedStepper;
use crate::ranks::pool::TaskDone;
use crate::ranks::ElasticRanks;
use diffmesh_model::pipeline::stepper::DenoiseState;
use diffmesh_sched::elastic::policies::Ready;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// How long an iteration that dispatched nothing waits for a task to end (commands such as
/// submits are handled between iterations).
const TASK_WAIT: Duration = Duration::from_millis(5);

/// Where a job stands on the ranks.
#[derive(Debug, Clone)]
pub(super) struct Placement {
    /// Its step task in flight.
    task: Option<u64>,
    /// That task is a mask-aware edit step (velocities of the masked tokens only).
    masked: bool,
    /// Ranks of its last (or running) step; empty before its first.
    ranks: Vec<usize>,
    class: usize,
    /// On the policy's clock.
    arrival: f64,
    deadline: f64,
}

/// Why a node with elastic ranks does not run `job` (None: it does).
pub(super) fn refusal(job: &EngineJob) -> Option<EngineJobError> {
    let p = &job.job.params;
    let field = if job.lora.is_some() || !p.loras.is_empty() {
        "params.loras"
    } else if p.controlnet.is_some() || !job.control_rgb.is_empty() {
        "params.controlnet"
    } else if p.cache_threshold.is_some() {
        "params.cache_threshold"
    } else {
        return None;
    };
    Some(EngineJobError::Input(format!(
        "{field}: this denoiser steps on elastic ranks (--ranks), which run generations, \
         edits and captures without adapters or step caching"
    )))
}

impl Engine {
    /// One iteration on the ranks; whether anything stepped or started.
    pub(super) fn step_on_ranks(&mut self) -> bool {
        let Some(mut ranks) = self.model.ranks.take() else {
            return false;
        };
        // A panic here restarts the engine (`actor`): the ranks go back first, so the next
        // engine steps on them too (tasks of the jobs that failed end unclaimed).
        let stepped = catch_unwind(AssertUnwindSafe(|| self.iterate_ranks(&mut ranks)));
        self.model.ranks = Some(ranks);
        stepped.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    fn iterate_ranks(&mut self, ranks: &mut ElasticRanks) -> bool {
        for a in self
            .active
            .iter_mut()
            .filter(|a| a.elastic.is_none() && a.capture.is_none())
        {
            a.elastic = Some(place(ranks, a));
        }
        let capturing = self.active.iter().any(|a| a.capture.is_some());
        if capturing {
            self.step_captures();
        }
        let ended = ranks.pool.poll(Duration::ZERO);
        let mut progressed = !ended.is_empty();
        self.apply_ended(ended);
        let started = self.start_ready(ranks);
        progressed |= started;
        if !started {
            let ended = ranks.pool.poll(TASK_WAIT);
            progressed |= !ended.is_empty();
            self.apply_ended(ended);
        }
        if let Some(m) = &self.metrics {
            m.elastic.ranks_busy.set(ranks.pool.busy() as i64);
        }
        progressed || capturing
    }

    /// Step the jobs whose tasks ended with the velocities they brought.
    fn apply_ended(&mut self, ended: Vec<TaskDone>) {
        for done in ended {
            let Some(a) = self.active.iter_mut().find(|a| {
                a.elastic
                    .as_ref()
                    .is_some_and(|p| p.task == Some(done.task))
            }) else {
                continue; // cancelled or failed meanwhile
            };
            let masked = a.elastic.as_mut().is_some_and(|p| {
                p.task = None;
                p.masked
            });
            let stepped = done
                .outcome
                .and_then(|velocities| apply(a, velocities, masked));
            if let Err(e) = stepped {
                a.failed.get_or_insert(EngineJobError::Model(e));
                continue;
            }
            let (step, total) = a.states.first().map(|s| s.progress()).unwrap_or((0, 0));
            let event = EngineEvent::Step {
                job_id: a.job.job_id.clone(),
                step: step as u32,
                total: total as u32,
                ranks: Some(done.ranks.len() as u32),
            };
            if let Some(m) = &self.metrics {
                let mode = if masked { "mask_aware" } else { "full" };
                m.step_rows
                    .with_label_values(&[mode])
                    .inc_by(a.rows() as u64);
                let degree = done.ranks.len().to_string();
                m.elastic.steps.with_label_values(&[&degree]).inc();
                m.elastic
                    .step_seconds
                    .with_label_values(&[&degree])
                    .observe(done.seconds);
            }
            self.ledger.emit(event);
            if let Some(s) = a.states.first() {
                let (height, width) = crate::model::job_resolution_of(&a.job, &self.model.card);
                if let Some(preview) = crate::previews::preview_event(
                    self.model.preview.as_ref(),
                    &a.job,
                    step as u32,
                    total as u32,
                    (width as u32, height as u32),
                    || s.unpacked_latents(),
                    self.metrics.as_ref(),
                ) {
                    self.ledger.emit(preview.into());
                }
            }
        }
    }

    /// Ask the policy about the ready jobs and dispatch what it chose; whether any started.
    fn start_ready(&mut self, ranks: &mut ElasticRanks) -> bool {
        let free = ranks.pool.free();
        let ready: Vec<Ready> = self
            .active
            .iter()
            .enumerate()
            .filter(|(_, a)| is_ready(a))
            .map(|(id, a)| {
                let p = a.elastic.as_ref().expect("placed above");
                let (done, total) = a.states.first().map(|s| s.progress()).unwrap_or((0, 0));
                Ready {
                    id,
                    class: p.class,
                    arrival: p.arrival,
                    deadline: p.deadline,
                    // A step runs one forward per row (images x guidance branches).
                    steps_left: ((total - done) * a.rows()) as u32,
                    degree: p.ranks.len() as u32,
                }
            })
            .collect();
        if ready.is_empty() || free.is_empty() {
            return false;
        }
        let mut chosen = ranks.decide(free.len() as u32, &ready);
        if chosen.is_empty() && ranks.pool.in_flight() == 0 {
            // A policy that starts nothing on idle ranks would stall the node.
            chosen.push((ready[0].id, 1));
        }
        let mut free = free;
        let mut started = false;
        for (id, k) in chosen {
            let k = k as usize;
            // Only ready jobs (not one named twice), on ranks that are free.
            if k == 0 || k > free.len() || !self.active.get(id).is_some_and(is_ready) {
                tracing::warn!(
                    id,
                    k,
                    free = free.len(),
                    "the elastic policy's choice was refused"
                );
                continue;
            }
            let a = &mut self.active[id];
            let last = &a.elastic.as_ref().expect("placed above").ranks;
            // Its last ranks first where free (no artifact moves on a GPU node), then the lowest.
            let mut members: Vec<usize> = last
                .iter()
                .copied()
                .filter(|r| free.contains(r))
                .take(k)
                .collect();
            for &r in &free {
                if members.len() == k {
                    break;
                }
                if !members.contains(&r) {
                    members.push(r);
                }
            }
            free.retain(|r| !members.contains(r));
            let task = ranks.next_task_id();
            let masked = mask_aware_cache(a);
            let dispatched = match &masked {
                Some((entry, step)) => flat_rows(a, |s| s.masked_step_rows()).and_then(|rows| {
                    ranks
                        .pool
                        .dispatch_edit(task, &members, &rows, entry, *step)
                }),
                None => flat_rows(a, |s| s.step_inputs())
                    .and_then(|rows| ranks.pool.dispatch(task, &members, &rows)),
            };
            if let Err(e) = dispatched {
                a.failed = Some(EngineJobError::Model(e));
                continue;
            }
            let p = a.elastic.as_mut().expect("placed above");
            if let Some(m) = &self.metrics {
                if !p.ranks.is_empty() && p.ranks.len() != k {
                    m.elastic.degree_changes.inc();
                }
            }
            p.task = Some(task);
            p.masked = masked.is_some();
            p.ranks = members;
            started = true;
        }
        started
    }
}

/// The template cache and step `a` reads if its next step runs mask-aware: every unfinished
/// state of an edit can ([`CachedStepper::usable`]); they step together, so at one index.
fn mask_aware_cache(
    a: &Active,
) -> Option<(std::sync::Arc<crate::templates::TemplateEntry>, usize)> {
    let mut states = a.states.iter().filter(|s| !s.is_done()).peekable();
    let step = states.peek()?.step_index();
    let mut usable = states
        .map(|s| CachedStepper::usable(s, a.cache.as_ref()).filter(|_| s.step_index() == step));
    let first = usable.next()??.clone();
    usable.all(|c| c.is_some()).then_some((first, step))
}

/// The rows of `a`'s unfinished states' next step, made by `rows_of`, in state order.
fn flat_rows<T>(
    a: &Active,
    rows_of: impl Fn(&DenoiseState) -> diffmesh_model::Result<Vec<T>>,
) -> Result<Vec<T>, String> {
    let mut all = Vec::new();
    for s in a.states.iter().filter(|s| !s.is_done()) {
        all.extend(rows_of(s).map_err(|e| e.to_string())?);
    }
    Ok(all)
}

fn is_ready(a: &Active) -> bool {
    a.failed.is_none()
        && a.capture.is_none()
        && !a.cancelled
        && a.elastic.as_ref().is_some_and(|p| p.task.is_none())
        && a.states.iter().any(|s| !s.is_done())
}

/// A newly admitted job's class, arrival and deadline on the policy's clock. An edit is
/// classed by its masked tokens: its mask-aware steps compute only those (the cached keys
/// add attention, the model leaves that out).
fn place(ranks: &ElasticRanks, a: &Active) -> Placement {
    let tokens = a
        .states
        .first()
        .map_or(1, |s| match (&a.cache, s.masked_tokens()) {
            (Some(_), Some(m)) => m,
            _ => s.image_tokens(),
        }) as f64;
    let arrival = ranks.now();
    Placement {
        task: None,
        masked: false,
        ranks: Vec::new(),
        class: ranks.class_of(tokens),
        arrival,
        deadline: a
            .job
            .params
            .deadline_unix_ms
            .map_or(f64::INFINITY, |ms| ranks.clock_of_unix_ms(ms)),
    }
}

/// Step every unfinished state of `a` with its rows' velocities, in dispatch order (of the
/// masked tokens only where the step was `masked`).
fn apply(
    a: &mut Active,
    velocities: Vec<diffmesh_model::tch::Tensor>,
    masked: bool,
) -> Result<(), String> {
    let mut velocities = velocities.into_iter();
    for s in a.states.iter_mut().filter(|s| !s.is_done()) {
        let device = s.latents().device();
        let rows = velocities
            .by_ref()
            .take(s.rows())
            .map(|v| v.f_to_device(device))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let stepped = if masked {
            s.apply_masked_velocities(rows)
        } else {
            s.apply_velocities(rows)
        };
        stepped.map_err(|e| e.to_string())?;
    }
    Ok(())
}
