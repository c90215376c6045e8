//! A trajectory whose steps change layout (GF-DiT's elastic parallelism) gives the image the
//! same trajectory on one rank gives: the shipped tiny model, 6 steps, on 4 CPU ranks with
//! SP4 (ring) -> SP3 (Ulysses, other ranks and order) -> SP2 (ring, a rank joining that
//! must be sent the latents) -> SP1 (a rank that left two steps ago, sent them again). And
//! CFG parallelism: a guided generation with the prompt's and the negative prompt's forwards
//! on two halves of a group (each half split by sequence on 4 ranks) ends where the
//! single-rank guided generation does.
use std::path::Path;

use diffmesh_model::flux::elastic::{Layout, Trajectory};
use diffmesh_model::flux::sequence_parallel::SequenceParallel::{Ring, Ulysses};
use diffmesh_model::flux::{FluxInputs, FluxTransformer};
use diffmesh_model::noise_scheduler::FlowMatchEulerDiscreteScheduler;
use diffmesh_model::tch::{self, Device, Kind, Tensor};
/// The tests of this file one at a time: loading a model draws from torch's global RNG (its
/// variables are initialised before the weights are read), which would shift another test's
/// seeded draws and give its ranks or its reference other numbers.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

use diffmesh_parallel::{Group, RankConfig, Ranks};

const STEPS: usize = 6;
const N_H: i64 = 4;
const N_W: i64 = 4;
const T: i64 = 6;

fn tiny() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny")
}

/// Initial noise and conditioning, as numbers (tensors stay on their thread).
fn case() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    // Torch's RNG is global and the tests run at once: one draw at a time.
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(31);
    let opts = (Kind::Float, Device::Cpu);
    let v = |x: Tensor| Vec::<f32>::try_from(&x.view([-1])).unwrap();
    (
        v(Tensor::randn([1, N_H * N_W, 48], opts)),
        v(Tensor::randn([1, T, 128], opts)),
        v(Tensor::randn([1, 128], opts)),
    )
}

fn inputs(text: &[f32], pooled: &[f32]) -> FluxInputs {
    let opts = (Kind::Float, Device::Cpu);
    let rows = Tensor::arange(N_H, opts)
        .view([N_H, 1])
        .expand([N_H, N_W], false);
    let cols = Tensor::arange(N_W, opts)
        .view([1, N_W])
        .expand([N_H, N_W], false);
    FluxInputs {
        hidden_states: Tensor::zeros([1, N_H * N_W, 48], opts),
        encoder_hidden_states: Tensor::from_slice(text).view([1, T, 128]),
        pooled_projections: Tensor::from_slice(pooled).view([1, 128]),
        timestep: Tensor::zeros([1], opts),
        img_ids: Tensor::stack(&[Tensor::zeros([N_H, N_W], opts), rows, cols], -1)
            .view([N_H * N_W, 3]),
        txt_ids: Tensor::zeros([T, 3], opts),
        guidance: None,
    }
}

fn run(plan: Vec<Layout>, world: usize) -> Vec<Option<Vec<f32>>> {
    let (noise, text, pooled) = case();
    let ranks = Ranks::start(RankConfig::new(world)).unwrap();
    ranks
        .on_all(move |ep| {
            let dir = tiny().join("transformer");
            let (model, _vs) = FluxTransformer::load(&dir, Device::Cpu, Kind::Float).unwrap();
            let scheduler = FlowMatchEulerDiscreteScheduler::from_config_file(
                &tiny().join("scheduler/scheduler_config.json"),
            )
            .unwrap();
            let schedule = scheduler.flux_schedule(STEPS, N_H * N_W).unwrap();
            let latents = Tensor::from_slice(&noise).view([1, N_H * N_W, 48]);
            let me = ep.rank();
            let inputs = inputs(&text, &pooled);
            let trajectory = Trajectory {
                model: &model,
                inputs: &inputs,
                latents: &latents,
                schedule: &schedule,
                plan: &plan,
            };
            let out = tch::no_grad(|| trajectory.run(ep, me, world)).unwrap();
            out.map(|t| Vec::<f32>::try_from(&t.view([-1])).unwrap())
        })
        .into_iter()
        .map(|r| r.expect("the rank ran"))
        .collect()
}

#[test]
fn a_trajectory_moved_sp4_sp3_sp2_sp1_equals_one_never_moved() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let layout = |ranks: &[usize], how| Layout {
        ranks: ranks.to_vec(),
        how,
    };
    let alone = run(vec![layout(&[0], Ring); STEPS], 1);
    let reference = alone[0].clone().expect("rank 0 ends holding the latents");
    let plan = vec![
        layout(&[0, 1, 2, 3], Ring),
        layout(&[0, 1, 2, 3], Ring),
        layout(&[3, 1, 0], Ulysses),
        layout(&[2, 3], Ring),
        layout(&[1], Ring),
        layout(&[1], Ring),
    ];
    let moved = run(plan, 4);
    for (rank, out) in moved.iter().enumerate() {
        assert_eq!(
            out.is_some(),
            rank == 1,
            "rank {rank} holds the result: {}",
            out.is_some()
        );
    }
    let out = moved[1].as_ref().unwrap();
    let diff = out
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("max |diff| after {STEPS} steps: {diff:e}");
    assert!(diff <= 1e-4, "{diff}");
    assert!(
        reference
            .iter()
            .zip(case().0.iter())
            .any(|(a, b)| (a - b).abs() > 1e-2),
        "the steps changed nothing"
    );
}

/// A guided generation (true CFG, scale 4) of `STEPS` steps: on one rank (both forwards
/// there), or on a group of `ranks` split in two halves; every rank's final latents.
fn guided(ranks: usize) -> Vec<Vec<f32>> {
    let (noise, text, pooled) = case();
    let negative: Vec<f32> = text.iter().map(|v| -0.5 * v + 0.1).collect();
    let world = Ranks::start(RankConfig::new(ranks)).unwrap();
    world
        .on_all(move |ep| {
            let dir = tiny().join("transformer");
            let (model, _vs) = FluxTransformer::load(&dir, Device::Cpu, Kind::Float).unwrap();
            let scheduler = FlowMatchEulerDiscreteScheduler::from_config_file(
                &tiny().join("scheduler/scheduler_config.json"),
            )
            .unwrap();
            let schedule = scheduler.flux_schedule(STEPS, N_H * N_W).unwrap();
            let mut x = Tensor::from_slice(&noise).view([1, N_H * N_W, 48]);
            let members: Vec<usize> = (0..ranks).collect();
            tch::no_grad(|| {
                for i in 0..STEPS {
                    let at = |text: &[f32]| {
                        let mut inputs = inputs(text, &pooled);
                        inputs.hidden_states = x.shallow_clone();
                        inputs.timestep = Tensor::from_slice(&[schedule.timesteps[i] / 1000.0]);
                        inputs
                    };
                    let (cond, uncond) = (at(&text), at(&negative));
                    let v = if ranks == 1 {
                        let (c, u) = (
                            model.forward(&cond).unwrap(),
                            model.forward(&uncond).unwrap(),
                        );
                        &u + (&c - &u) * 4.0
                    } else {
                        let group = Group::new(7, &members, ep.rank(), ranks).unwrap();
                        model
                            .velocity_cfg_parallel(&cond, &uncond, 4.0, ep, &group, Ring)
                            .unwrap()
                    };
                    x = schedule.step(i, &v, &x).unwrap();
                }
            });
            Vec::<f32>::try_from(&x.view([-1])).unwrap()
        })
        .into_iter()
        .map(|r| r.expect("the rank ran"))
        .collect()
}

#[test]
fn cfg_parallel_generation_equals_the_single_rank_guided_one() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let reference = guided(1).remove(0);
    for ranks in [2, 4] {
        for (rank, out) in guided(ranks).iter().enumerate() {
            let diff = out
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            eprintln!("CFG over {ranks} ranks, rank {rank}: max |diff| {diff:e}");
            assert!(diff <= 1e-4, "{ranks} ranks, rank {rank}: {diff}");
        }
    }
}
