//! The mask-aware edit forward split over 2, 3 and 4 CPU ranks equals the single-rank
//! mask-aware forward (fp32, random weights): raw and prepared caches, a partial mask, every
//! token masked (no cache read), fewer masked tokens than ranks (some shares empty), and a
//! batch of two requests with different masks, timesteps and templates.
use std::sync::Mutex;

use diffmesh_model::flux::{
    CapturedKv, FluxConfig, FluxInputs, FluxTransformer, KvFormat, MaskedRequest,
};
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use diffmesh_parallel::{Group, RankConfig, Ranks};

const N_H: i64 = 5;
const N_W: i64 = 7;
const N: i64 = N_H * N_W;
const T: i64 = 4;

/// Torch's RNG is global: models and inputs are drawn one at a time from fixed seeds, so
/// every rank holds the same weights as the reference.
static TURN: Mutex<()> = Mutex::new(());

fn model() -> (FluxTransformer, nn::VarStore) {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    tch::manual_seed(7);
    let cfg = FluxConfig {
        in_channels: 16,
        out_channels: Some(8),
        num_layers: 2,
        num_single_layers: 2,
        attention_head_dim: 8,
        num_attention_heads: 3,
        joint_attention_dim: 24,
        pooled_projection_dim: 12,
        guidance_embeds: true,
        axes_dims_rope: vec![2, 2, 4],
        ..Default::default()
    };
    let vs = nn::VarStore::new(Device::Cpu);
    let model = FluxTransformer::new(&vs.root(), cfg).unwrap();
    // Norm weights away from their all-ones init, drawn in name order (repeatable).
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

/// One request as plain numbers (tensors cannot be shared between rank threads).
#[derive(Clone)]
struct Request {
    hs: Vec<f32>,
    text: Vec<f32>,
    pooled: Vec<f32>,
    timestep: f64,
    /// Masked token indices, in the order given.
    index: Vec<i64>,
    format: KvFormat,
}

impl Request {
    fn new(seed: i64, masked: i64, timestep: f64, format: KvFormat) -> Self {
        let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        tch::manual_seed(seed);
        let opts = (Kind::Float, Device::Cpu);
        let vec = |x: Tensor| Vec::<f32>::try_from(&x.view([-1])).unwrap();
        Self {
            hs: vec(Tensor::randn([N, 16], opts)),
            text: vec(Tensor::randn([T, 24], opts)),
            pooled: vec(Tensor::randn([12], opts)),
            timestep,
            index: Vec::<i64>::try_from(
                &Tensor::randperm(N, (Kind::Int64, Device::Cpu)).narrow(0, 0, masked),
            )
            .unwrap(),
            format,
        }
    }

    fn ids() -> (Tensor, Tensor) {
        let opts = (Kind::Float, Device::Cpu);
        let rows = Tensor::arange(N_H, opts)
            .view([N_H, 1])
            .expand([N_H, N_W], false);
        let cols = Tensor::arange(N_W, opts)
            .view([1, N_W])
            .expand([N_H, N_W], false);
        let img = Tensor::stack(&[Tensor::zeros([N_H, N_W], opts), rows, cols], -1).view([N, 3]);
        (img, Tensor::zeros([T, 3], opts))
    }

    /// The template's K/V, captured by a full forward of its latents.
    fn capture(&self, model: &FluxTransformer) -> CapturedKv {
        let (img_ids, txt_ids) = Self::ids();
        let inputs = FluxInputs {
            hidden_states: Tensor::from_slice(&self.hs).view([1, N, 16]),
            encoder_hidden_states: Tensor::from_slice(&self.text).view([1, T, 24]),
            pooled_projections: Tensor::from_slice(&self.pooled).view([1, 12]),
            timestep: Tensor::from_slice(&[self.timestep as f32]),
            img_ids,
            txt_ids,
            guidance: Some(Tensor::from_slice(&[3.5f32])),
        };
        let mut cache = CapturedKv::new(self.format);
        let _velocity = tch::no_grad(|| model.forward_capture(&inputs, &mut cache)).unwrap();
        cache
    }

    fn masked<'a>(&self, cache: &'a CapturedKv) -> MaskedRequest<'a> {
        let (img_ids, txt_ids) = Self::ids();
        let index = Tensor::from_slice(&self.index);
        MaskedRequest {
            hidden_states: Tensor::from_slice(&self.hs)
                .view([N, 16])
                .index_select(0, &index),
            token_index: index,
            encoder_hidden_states: Tensor::from_slice(&self.text).view([T, 24]),
            pooled_projections: Tensor::from_slice(&self.pooled),
            timestep: self.timestep as f32 as f64,
            guidance: Some(3.5),
            img_ids,
            txt_ids,
            cache,
            full_hidden_states: None,
        }
    }
}

/// Every request's velocity, flattened, from one rank's point of view.
type Velocities = Vec<Vec<f32>>;

fn flat(outs: Vec<Tensor>) -> Velocities {
    outs.iter()
        .map(|o| Vec::<f32>::try_from(&o.contiguous().view([-1])).unwrap())
        .collect()
}

fn single_rank(batch: &[Request]) -> Velocities {
    let (model, _vs) = model();
    let caches: Vec<CapturedKv> = batch.iter().map(|r| r.capture(&model)).collect();
    let reqs: Vec<MaskedRequest> = batch
        .iter()
        .zip(&caches)
        .map(|(r, c)| r.masked(c))
        .collect();
    flat(tch::no_grad(|| model.forward_masked(&reqs)).unwrap())
}

fn split(batch: &[Request], ranks: usize) -> Vec<Velocities> {
    let world = Ranks::start(RankConfig::new(ranks)).unwrap();
    let batch = batch.to_vec();
    world
        .on_all(move |ep| {
            let (model, _vs) = model();
            let caches: Vec<CapturedKv> = batch.iter().map(|r| r.capture(&model)).collect();
            let reqs: Vec<MaskedRequest> = batch
                .iter()
                .zip(&caches)
                .map(|(r, c)| r.masked(c))
                .collect();
            let group = Group::new(1, &(0..ranks).collect::<Vec<_>>(), ep.rank(), ranks).unwrap();
            tch::no_grad(|| model.forward_masked_sequence_parallel(&reqs, ep, &group))
                .map(flat)
                .map_err(|e| e.to_string())
        })
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.expect("the rank ran")
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
        })
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
fn a_spread_edit_equals_the_single_rank_edit() {
    use KvFormat::{Hidden, Prepared, Raw};
    let cases: Vec<(&str, Vec<Request>)> = vec![
        ("raw, 11 of 35 masked", vec![Request::new(1, 11, 0.6, Raw)]),
        (
            "prepared, 11 of 35",
            vec![Request::new(2, 11, 0.35, Prepared)],
        ),
        ("every token masked", vec![Request::new(3, N, 0.8, Raw)]),
        ("2 masked tokens", vec![Request::new(4, 2, 0.5, Prepared)]),
        (
            "a batch of two",
            vec![
                Request::new(5, 9, 0.7, Raw),
                Request::new(6, 20, 0.2, Prepared),
            ],
        ),
        (
            "a batch with a hidden-stream cache",
            vec![
                Request::new(7, 9, 0.7, Prepared),
                Request::new(8, 14, 0.45, Hidden),
            ],
        ),
    ];
    for (what, batch) in &cases {
        let reference = single_rank(batch);
        for (r, v) in reference.iter().enumerate() {
            assert_eq!(v.len() as i64, batch[r].index.len() as i64 * 8);
            assert!(
                v.iter().any(|x| x.abs() > 1e-3),
                "a trivial output proves nothing"
            );
        }
        for ranks in [2, 3, 4] {
            for (rank, outs) in split(batch, ranks).into_iter().enumerate() {
                for (r, (out, want)) in outs.iter().zip(&reference).enumerate() {
                    let diff = max_diff(out, want);
                    eprintln!(
                        "{what}: {ranks} ranks, rank {rank}, request {r}: max |diff| {diff:e}"
                    );
                    assert!(
                        diff <= 1e-4,
                        "{what}: {ranks} ranks, rank {rank}, request {r}: max |diff| {diff}"
                    );
                }
            }
        }
    }
}
