//! A node's ranks with a transformer replica each (GF-DiT's workers): a step task runs on a
//! group of free ranks, every member computing its share of a sequence-parallel forward over
//! the group-free collectives of `diffmesh-parallel`, and the group's first member handing
//! back the velocities. A guided step's two rows on an even group run side by side, one per
//! half (CFG parallelism). An edit's mask-aware step splits its masked tokens over the group,
//! each member reading the template cache itself. The engine thread dispatches tasks in one order, so two ranks
//! always meet their shared collectives in the same order (each rank runs its queue in
//! order).
use crate::templates::{StepKv, TemplateEntry};
use diffmesh_model::flux::sequence_parallel::SequenceParallel;
use diffmesh_model::flux::{FluxConfig, FluxInputs, FluxTransformer, SharedBlockReads};
use diffmesh_model::pipeline::stepper::MaskedRow;
use diffmesh_model::tch::nn::VarStore;
use diffmesh_model::tch::{self, Device, Kind, Tensor};
use diffmesh_model::Result as ModelResult;
use diffmesh_parallel::shm::Endpoint;
use diffmesh_parallel::{Group, RankConfig, Ranks};
use diffmesh_shared::panic_message;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// One rank's copy of the transformer (on its own device on a GPU node).
struct Replica {
    model: FluxTransformer,
    _store: VarStore,
    device: Device,
}

/// What a member of a task's group reports when it is done with it.
struct RankReport {
    task: u64,
    /// The velocities of its group's rows, by row index (the group's first member), or this
    /// member's error; None: another member reports them.
    outcome: Option<Result<Vec<(usize, Tensor)>, String>>,
}

struct Pending {
    members: Vec<usize>,
    left: usize,
    rows: Vec<Option<Tensor>>,
    error: Option<String>,
    started: Instant,
}

/// A step task every member of its group has finished.
pub struct TaskDone {
    pub task: u64,
    pub ranks: Vec<usize>,
    /// One velocity per input row, on the first member's device; or why the step failed.
    pub outcome: Result<Vec<Tensor>, String>,
    pub seconds: f64,
}

/// The ranks, what each is busy with, and the tasks in flight.
pub struct RankPool {
    ranks: Ranks,
    replicas: Vec<Arc<Mutex<Option<Replica>>>>,
    cfg: FluxConfig,
    busy: Vec<bool>,
    /// Group ids: one fresh id per task (a group is only a descriptor).
    next_group: u64,
    reports_tx: mpsc::Sender<RankReport>,
    reports: mpsc::Receiver<RankReport>,
    pending: HashMap<u64, Pending>,
    cfg_split_tasks: u64,
}

/// The device of rank `rank` on a node whose model sits on `device`.
fn rank_device(device: Device, rank: usize) -> Device {
    match device {
        Device::Cuda(_) => Device::Cuda(rank),
        other => other,
    }
}

impl RankPool {
    /// Start `ranks` rank threads, each loading the transformer of `transformer_dir` on its
    /// device with `threads` intra-op threads (CPU ranks share the machine's cores).
    pub fn start(
        transformer_dir: &Path,
        ranks: usize,
        device: Device,
        kind: Kind,
        threads: i32,
    ) -> Result<Self, String> {
        if ranks == 0 {
            return Err("ranks: must be at least 1".into());
        }
        let world = Ranks::start(RankConfig::new(ranks))
            .map_err(|e| format!("ranks: starting the rank threads: {e}"))?;
        let replicas: Vec<Arc<Mutex<Option<Replica>>>> =
            (0..ranks).map(|_| Arc::new(Mutex::new(None))).collect();
        let loads: Vec<_> = replicas
            .iter()
            .enumerate()
            .map(|(rank, slot)| {
                let (slot, dir) = (slot.clone(), transformer_dir.to_path_buf());
                world.submit(rank, move |_| -> Result<FluxConfig, String> {
                    tch::set_num_threads(threads.max(1));
                    let device = rank_device(device, rank);
                    let (model, store) = FluxTransformer::load(&dir, device, kind)
                        .map_err(|e| format!("rank {rank}: loading the transformer: {e}"))?;
                    let cfg = model.cfg.clone();
                    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(Replica {
                        model,
                        _store: store,
                        device,
                    });
                    Ok(cfg)
                })
            })
            .collect();
        let mut cfg = None;
        for (rank, load) in loads.into_iter().enumerate() {
            cfg = load
                .recv()
                .map_err(|_| format!("rank {rank} stopped while loading"))?
                .map(Some)?;
        }
        let cfg = cfg.ok_or("ranks: must be at least 1")?;
        let (reports_tx, reports) = mpsc::channel();
        Ok(Self {
            ranks: world,
            replicas,
            cfg,
            busy: vec![false; ranks],
            next_group: 1,
            reports_tx,
            reports,
            pending: HashMap::new(),
            cfg_split_tasks: 0,
        })
    }

    pub fn size(&self) -> usize {
        self.busy.len()
    }

    /// Ranks with no task, in rank order.
    pub fn free(&self) -> Vec<usize> {
        (0..self.busy.len()).filter(|&r| !self.busy[r]).collect()
    }

    /// The transformer's configuration (every replica's).
    pub fn config(&self) -> &FluxConfig {
        &self.cfg
    }

    /// Ranks running a step task now.
    pub fn busy(&self) -> usize {
        self.busy.iter().filter(|&&b| b).count()
    }

    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// How a group of `k` ranks splits attention: Ulysses where the heads divide among them
    /// (one all-to-all pair per block), else ring attention.
    fn split_for(&self, k: usize) -> SequenceParallel {
        if self.cfg.num_attention_heads % k as i64 == 0 {
            SequenceParallel::Ulysses
        } else {
            SequenceParallel::Ring
        }
    }

    /// Run a forward per row of `inputs` on the free ranks `members` (group order), as task
    /// `task`; its end comes from [`RankPool::poll`]. A guided step's two rows on an even
    /// group run side by side, one on each half (Katz's latent parallelism: CFG parallel),
    /// each half splitting its row by sequence; otherwise the whole group takes the rows in
    /// turn.
    pub fn dispatch(
        &mut self,
        task: u64,
        members: &[usize],
        inputs: &[FluxInputs],
    ) -> Result<(), String> {
        self.check_free(task, members)?;
        let cfg_split = inputs.len() == 2 && members.len().is_multiple_of(2);
        // (ranks, row indices) per group of this task.
        let parts: Vec<(&[usize], Vec<usize>)> = if cfg_split {
            let (first, second) = members.split_at(members.len() / 2);
            vec![(first, vec![0]), (second, vec![1])]
        } else {
            vec![(members, (0..inputs.len()).collect())]
        };
        self.cfg_split_tasks += u64::from(cfg_split);
        for (group_ranks, rows) in parts {
            let how = self.split_for(group_ranks.len());
            self.submit_to_group(task, group_ranks, |_| {
                let mine: Vec<(usize, FluxInputs)> =
                    rows.iter().map(|&i| (i, shallow(&inputs[i]))).collect();
                move |replica: &Replica, endpoint: &mut Endpoint, group: &Group| {
                    mine.iter()
                        .map(|(i, x)| {
                            let x = to_device(x, replica.device)?;
                            let v = if group.size() == 1 {
                                replica.model.forward(&x)?
                            } else {
                                replica
                                    .model
                                    .forward_sequence_parallel(&x, endpoint, group, how)?
                            };
                            Ok((*i, v))
                        })
                        .collect()
                }
            })?;
        }
        self.track(task, members, inputs.len());
        Ok(())
    }

    /// Run an edit's mask-aware step on the free ranks `members`: every member computes its
    /// share of each row's masked tokens against `step` of the template cache `entry`, which
    /// it reads itself onto its device ([`StepKv`]); the rows' velocities `[M, out]` come back
    /// as [`RankPool::dispatch`]'s do.
    pub fn dispatch_edit(
        &mut self,
        task: u64,
        members: &[usize],
        rows: &[MaskedRow],
        entry: &Arc<TemplateEntry>,
        step: usize,
    ) -> Result<(), String> {
        self.check_free(task, members)?;
        self.submit_to_group(task, members, |_| {
            let mine: Vec<MaskedRow> = rows.iter().map(MaskedRow::shallow_clone).collect();
            let entry = entry.clone();
            move |replica: &Replica, endpoint: &mut Endpoint, group: &Group| {
                let (device, kind) = replica.model.device_kind();
                let cache = StepKv::new(entry, step, kind, device);
                // The rows (a guided edit's two, a job's images) read one step of one cache,
                // block by block together: each block is decoded once for all of them.
                let shared = SharedBlockReads::new(&cache);
                let requests: Vec<_> = mine.iter().map(|r| r.request(&shared)).collect();
                let velocities = if group.size() == 1 {
                    replica.model.forward_masked(&requests)?
                } else {
                    replica
                        .model
                        .forward_masked_sequence_parallel(&requests, endpoint, group)?
                };
                Ok(velocities.into_iter().enumerate().collect())
            }
        })?;
        self.track(task, members, rows.len());
        Ok(())
    }

    fn check_free(&self, task: u64, members: &[usize]) -> Result<(), String> {
        let world = self.size();
        if members.is_empty() || members.iter().any(|&r| r >= world || self.busy[r]) {
            return Err(format!(
                "ranks {members:?} are not all free ranks of this node"
            ));
        }
        if self.pending.contains_key(&task) {
            return Err(format!("task {task} is already running"));
        }
        Ok(())
    }

    /// Queue task `task` on every rank of `group_ranks` (one fresh group): `work_for(rank)`
    /// makes each member's work, which gets the rank's replica, endpoint and group position.
    /// The group's first member reports the rows' velocities, every member its errors.
    fn submit_to_group<W>(
        &mut self,
        task: u64,
        group_ranks: &[usize],
        mut work_for: impl FnMut(usize) -> W,
    ) -> Result<(), String>
    where
        W: FnOnce(&Replica, &mut Endpoint, &Group) -> ModelResult<Vec<(usize, Tensor)>>
            + Send
            + 'static,
    {
        let (id, world) = (self.next_group, self.size());
        self.next_group += 1;
        for &rank in group_ranks {
            let group = Group::new(id, group_ranks, rank, world).map_err(|e| e.to_string())?;
            let work = work_for(rank);
            let (replica, tx) = (self.replicas[rank].clone(), self.reports_tx.clone());
            self.ranks.submit(rank, move |endpoint| {
                let run = || -> Result<Vec<(usize, Tensor)>, String> {
                    let guard = replica.lock().unwrap_or_else(|p| p.into_inner());
                    let replica = guard.as_ref().ok_or("the rank holds no model")?;
                    tch::no_grad(|| work(replica, endpoint, &group)).map_err(|e| e.to_string())
                };
                let outcome = match catch_unwind(AssertUnwindSafe(run)) {
                    Ok(Ok(velocities)) => (group.position == 0).then_some(Ok(velocities)),
                    Ok(Err(e)) => Some(Err(e)),
                    Err(p) => Some(Err(format!("rank {rank} panicked: {}", panic_message(p)))),
                };
                let _ = tx.send(RankReport { task, outcome });
            });
            self.busy[rank] = true;
        }
        Ok(())
    }

    /// Wait for task `task`'s `rows` velocities from its `members`.
    fn track(&mut self, task: u64, members: &[usize], rows: usize) {
        self.pending.insert(
            task,
            Pending {
                members: members.to_vec(),
                left: members.len(),
                rows: (0..rows).map(|_| None).collect(),
                error: None,
                started: Instant::now(),
            },
        );
    }

    /// Tasks whose guided rows ran side by side on the two halves of their group.
    pub fn cfg_split_tasks(&self) -> u64 {
        self.cfg_split_tasks
    }

    /// The tasks that ended: waits up to `wait` for the first report when none is in yet.
    pub fn poll(&mut self, wait: Duration) -> Vec<TaskDone> {
        let mut done = Vec::new();
        if self.pending.is_empty() {
            return done;
        }
        let first = self.reports.recv_timeout(wait).ok();
        for report in first
            .into_iter()
            .chain(std::iter::from_fn(|| self.reports.try_recv().ok()))
        {
            let Some(p) = self.pending.get_mut(&report.task) else {
                continue;
            };
            p.left -= 1;
            match report.outcome {
                Some(Ok(rows)) => {
                    for (i, v) in rows {
                        if let Some(slot) = p.rows.get_mut(i) {
                            *slot = Some(v);
                        }
                    }
                }
                // The first error wins.
                Some(Err(e)) => {
                    p.error.get_or_insert(e);
                }
                None => {}
            }
            if p.left == 0 {
                let p = self.pending.remove(&report.task).expect("found above");
                for &r in &p.members {
                    self.busy[r] = false;
                }
                let outcome = match p.error {
                    Some(e) => Err(e),
                    None => p
                        .rows
                        .into_iter()
                        .collect::<Option<Vec<Tensor>>>()
                        .ok_or_else(|| "a row's velocity never came back".to_string()),
                };
                done.push(TaskDone {
                    task: report.task,
                    outcome,
                    seconds: p.started.elapsed().as_secs_f64(),
                    ranks: p.members,
                });
            }
        }
        done
    }
}

fn shallow(x: &FluxInputs) -> FluxInputs {
    FluxInputs {
        hidden_states: x.hidden_states.shallow_clone(),
        encoder_hidden_states: x.encoder_hidden_states.shallow_clone(),
        pooled_projections: x.pooled_projections.shallow_clone(),
        timestep: x.timestep.shallow_clone(),
        img_ids: x.img_ids.shallow_clone(),
        txt_ids: x.txt_ids.shallow_clone(),
        guidance: x.guidance.as_ref().map(Tensor::shallow_clone),
    }
}

fn to_device(x: &FluxInputs, device: Device) -> Result<FluxInputs, diffmesh_model::ModelError> {
    if x.hidden_states.device() == device {
        return Ok(shallow(x));
    }
    let to = |t: &Tensor| t.f_to_device(device);
    Ok(FluxInputs {
        hidden_states: to(&x.hidden_states)?,
        encoder_hidden_states: to(&x.encoder_hidden_states)?,
        pooled_projections: to(&x.pooled_projections)?,
        timestep: to(&x.timestep)?,
        img_ids: to(&x.img_ids)?,
        txt_ids: to(&x.txt_ids)?,
        guidance: x.guidance.as_ref().map(to).transpose()?,
    })
}
