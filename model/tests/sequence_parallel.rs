//! The sequence-parallel Flux forward on 2 and 4 CPU ranks equals the single-rank forward
//! (fp32, random weights), with the image tokens dividing among the ranks and with an odd
//! count (the last shards padded): Ulysses with 4 heads; ring attention with 4 heads and with
//! 3 (which do not divide). Ulysses on heads that do not divide is refused naming `ranks`.
use std::sync::Mutex;

use diffmesh_model::flux::sequence_parallel::SequenceParallel;
use diffmesh_model::flux::{FluxConfig, FluxInputs, FluxTransformer};
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
/// The tests of this file one at a time: loading a model draws from torch's global RNG (its
/// variables are initialised before the weights are read), which would shift another test's
/// seeded draws and give its ranks or its reference other numbers.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

use diffmesh_parallel::{Group, RankConfig, Ranks};

/// Torch's RNG is global: models are built one at a time from the same seed, so every rank
/// holds the same weights as the reference.
static TURN: Mutex<()> = Mutex::new(());

fn model(heads: i64) -> (FluxTransformer, nn::VarStore) {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(5);
    let cfg = FluxConfig {
        in_channels: 16,
        out_channels: Some(8),
        num_layers: 2,
        num_single_layers: 2,
        attention_head_dim: 8,
        num_attention_heads: heads,
        joint_attention_dim: 24,
        pooled_projection_dim: 12,
        guidance_embeds: true,
        axes_dims_rope: vec![2, 2, 4],
        ..Default::default()
    };
    let vs = nn::VarStore::new(Device::Cpu);
    let model = FluxTransformer::new(&vs.root(), cfg).unwrap();
    // Norm weights away from their all-ones init, so a mix-up of norms or heads shows;
    // drawn in name order (the store's map iterates in a different order on every build).
    tch::no_grad(|| {
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut v) in vars {
            if name.contains("norm_") && v.dim() == 1 {
                v.copy_(&(1.0 + 0.3 * v.randn_like()));
            }
        }
    });
    (model, vs)
}

/// Inputs as plain numbers (tensors cannot be shared between rank threads).
#[derive(Clone)]
struct Case {
    n_h: i64,
    n_w: i64,
    t: i64,
    hs: Vec<f32>,
    text: Vec<f32>,
    pooled: Vec<f32>,
}

impl Case {
    fn new(n_h: i64, n_w: i64, t: i64) -> Self {
        let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        tch::manual_seed(17);
        let n = n_h * n_w;
        let opts = (Kind::Float, Device::Cpu);
        let vec = |x: Tensor| Vec::<f32>::try_from(&x.view([-1])).unwrap();
        Self {
            n_h,
            n_w,
            t,
            hs: vec(Tensor::randn([1, n, 16], opts)),
            text: vec(Tensor::randn([1, t, 24], opts)),
            pooled: vec(Tensor::randn([1, 12], opts)),
        }
    }

    fn inputs(&self) -> FluxInputs {
        let opts = (Kind::Float, Device::Cpu);
        let (n_h, n_w, n) = (self.n_h, self.n_w, self.n_h * self.n_w);
        let rows = Tensor::arange(n_h, opts)
            .view([n_h, 1])
            .expand([n_h, n_w], false);
        let cols = Tensor::arange(n_w, opts)
            .view([1, n_w])
            .expand([n_h, n_w], false);
        FluxInputs {
            hidden_states: Tensor::from_slice(&self.hs).view([1, n, 16]),
            encoder_hidden_states: Tensor::from_slice(&self.text).view([1, self.t, 24]),
            pooled_projections: Tensor::from_slice(&self.pooled).view([1, 12]),
            timestep: Tensor::from_slice(&[0.6f32]),
            img_ids: Tensor::stack(&[Tensor::zeros([n_h, n_w], opts), rows, cols], -1).view([n, 3]),
            txt_ids: Tensor::zeros([self.t, 3], opts),
            guidance: Some(Tensor::from_slice(&[3.5f32])),
        }
    }
}

fn single_rank(case: &Case, heads: i64) -> Vec<f32> {
    let (model, _vs) = model(heads);
    let out = tch::no_grad(|| model.forward(&case.inputs())).unwrap();
    Vec::<f32>::try_from(&out.view([-1])).unwrap()
}

/// Each rank's whole output of the forward split `how` over `ranks` ranks.
fn split(
    case: &Case,
    heads: i64,
    ranks: usize,
    how: SequenceParallel,
) -> Vec<Result<Vec<f32>, String>> {
    let world = Ranks::start(RankConfig::new(ranks)).unwrap();
    let case = case.clone();
    world
        .on_all(move |ep| {
            let (model, _vs) = model(heads);
            let group = Group::new(1, &(0..ranks).collect::<Vec<_>>(), ep.rank(), ranks).unwrap();
            tch::no_grad(|| model.forward_sequence_parallel(&case.inputs(), ep, &group, how))
                .map(|out| Vec::<f32>::try_from(&out.view([-1])).unwrap())
                .map_err(|e| e.to_string())
        })
        .into_iter()
        .map(|r| r.expect("the rank ran"))
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn split_over_2_and_4_ranks_equals_one_rank() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    use SequenceParallel::{Ring, Ulysses};
    // 16 image tokens (divide by 2 and 4) and 15 (odd: shards padded), 5 text tokens.
    for (n_h, n_w) in [(4, 4), (3, 5)] {
        let case = Case::new(n_h, n_w, 5);
        for (heads, how) in [(4, Ulysses), (4, Ring), (3, Ring)] {
            let reference = single_rank(&case, heads);
            assert!(
                reference.iter().any(|v| v.abs() > 1e-3),
                "a trivial output proves nothing"
            );
            for ranks in [2, 4] {
                for (rank, out) in split(&case, heads, ranks, how).into_iter().enumerate() {
                    let out =
                        out.unwrap_or_else(|e| panic!("{how:?} {ranks} ranks, rank {rank}: {e}"));
                    let diff = max_diff(&out, &reference);
                    eprintln!(
                        "{how:?}, {heads} heads, {n_h}x{n_w} tokens, {ranks} ranks, rank {rank}: \
                         max |diff| {diff:e}"
                    );
                    assert!(
                        diff <= 1e-4,
                        "{how:?} {n_h}x{n_w} tokens on {ranks} ranks, rank {rank}: max |diff| {diff}"
                    );
                }
            }
        }
    }
}

#[test]
fn ulysses_refuses_heads_that_do_not_divide() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let case = Case::new(2, 3, 3);
    for out in split(&case, 4, 3, SequenceParallel::Ulysses) {
        let err = out.unwrap_err();
        assert!(err.contains("ranks") && err.contains("4 heads"), "{err}");
    }
}

/// `cargo xtask forward --ranks R --sp ...`'s code path on the shipped tiny model (3 heads):
/// the same inputs file and output as the plain forward, within 1e-4, ring attention on 2 and
/// 4 ranks and Ulysses on 3, with 15 image tokens.
#[test]
fn the_forward_tool_splits_the_tiny_model() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    use diffmesh_model::flux::cli_forward_transformer;
    use diffmesh_model::flux::sequence_parallel::cli_forward_transformer_split;
    let model_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny");
    let dir = tempfile::tempdir().unwrap();
    let inputs = dir.path().join("inputs.safetensors");
    {
        let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        tch::manual_seed(23);
        let opts = (Kind::Float, Device::Cpu);
        let (n_h, n_w, t) = (3i64, 5i64, 7i64);
        let rows = Tensor::arange(n_h, opts)
            .view([n_h, 1])
            .expand([n_h, n_w], false);
        let cols = Tensor::arange(n_w, opts)
            .view([1, n_w])
            .expand([n_h, n_w], false);
        let img_ids =
            Tensor::stack(&[Tensor::zeros([n_h, n_w], opts), rows, cols], -1).view([n_h * n_w, 3]);
        Tensor::write_safetensors(
            &[
                ("hidden_states", Tensor::randn([1, n_h * n_w, 48], opts)),
                ("encoder_hidden_states", Tensor::randn([1, t, 128], opts)),
                ("pooled_projections", Tensor::randn([1, 128], opts)),
                ("timestep", Tensor::from_slice(&[0.4f32])),
                ("img_ids", img_ids),
                ("txt_ids", Tensor::zeros([t, 3], opts)),
            ],
            &inputs,
        )
        .unwrap();
    }
    let read = |path: &std::path::Path| {
        let (_, sample) = Tensor::read_safetensors(path).unwrap().remove(0);
        Vec::<f32>::try_from(&sample.view([-1])).unwrap()
    };
    let plain = dir.path().join("plain.safetensors");
    cli_forward_transformer(&model_dir, &inputs, &plain).unwrap();
    let reference = read(&plain);
    for (ranks, how) in [
        (2, SequenceParallel::Ring),
        (4, SequenceParallel::Ring),
        (3, SequenceParallel::Ulysses),
    ] {
        let out = dir.path().join(format!("{ranks}-{how:?}.safetensors"));
        cli_forward_transformer_split(&model_dir, &inputs, &out, ranks, how).unwrap();
        let diff = max_diff(&read(&out), &reference);
        eprintln!("tiny model, {how:?} on {ranks} ranks: max |diff| {diff:e}");
        assert!(diff <= 1e-4, "{how:?} on {ranks} ranks: {diff}");
    }
    let err =
        cli_forward_transformer_split(&model_dir, &inputs, &plain, 2, SequenceParallel::Ulysses)
            .unwrap_err()
            .to_string();
    assert!(
        err.contains("3 heads") && err.contains("ring attention does not"),
        "{err}"
    );
}
