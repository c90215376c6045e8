//! The FlashPS mask-aware forward against the full forward (fp32 CPU, random weights).
use diffmesh_model::flux::{
    CapturedKv, FluxConfig, FluxInputs, FluxTransformer, KvCache, KvFormat, KvSink,
    MaskedAttention, MaskedRequest,
};
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use std::sync::{Mutex, MutexGuard};

const N_H: i64 = 6;
const N_W: i64 = 7;
const N: i64 = N_H * N_W;

/// What a test holds while it runs: the weights, and the turn on torch's one global RNG.
/// Tests take turns so that each draws the same numbers on every run (interleaved draws
/// made a run's inputs depend on thread timing, and a tolerance failure unrepeatable).
struct Fixture {
    _vs: nn::VarStore,
    _turn: MutexGuard<'static, ()>,
}

fn model() -> (FluxTransformer, Fixture) {
    static TURN: Mutex<()> = Mutex::new(());
    // A test that failed holding the turn poisons it; the others still run.
    let turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    tch::manual_seed(11);
    let cfg = FluxConfig {
        in_channels: 16,
        out_channels: Some(8),
        num_layers: 2,
        num_single_layers: 2,
        attention_head_dim: 16,
        num_attention_heads: 2,
        joint_attention_dim: 24,
        pooled_projection_dim: 12,
        guidance_embeds: true,
        axes_dims_rope: vec![4, 6, 6],
        ..Default::default()
    };
    let vs = nn::VarStore::new(Device::Cpu);
    let model = FluxTransformer::new(&vs.root(), cfg).unwrap();
    // Perturb the norm weights away from their all-ones init so a mix-up of norms would show.
    tch::no_grad(|| {
        for (name, mut v) in vs.variables() {
            if name.contains(".norm_") && v.dim() == 1 {
                v.copy_(&(1.0 + 0.2 * v.randn_like()));
            }
        }
    });
    (
        model,
        Fixture {
            _vs: vs,
            _turn: turn,
        },
    )
}

/// One request's full inputs (batch 1) on an `N_H x N_W` grid with `t` text tokens.
struct Case {
    hs: Tensor,
    text: Tensor,
    pooled: Tensor,
    timestep: f64,
    guidance: f64,
    img_ids: Tensor,
    txt_ids: Tensor,
}

impl Case {
    fn new(t: i64, timestep: f64, guidance: f64) -> Self {
        let opts = (Kind::Float, Device::Cpu);
        let rows = Tensor::arange(N_H, opts)
            .view([N_H, 1])
            .expand([N_H, N_W], false);
        let cols = Tensor::arange(N_W, opts)
            .view([1, N_W])
            .expand([N_H, N_W], false);
        let img_ids =
            Tensor::stack(&[Tensor::zeros([N_H, N_W], opts), rows, cols], -1).view([N, 3]);
        Self {
            hs: Tensor::randn([1, N, 16], opts),
            text: Tensor::randn([1, t, 24], opts),
            pooled: Tensor::randn([1, 12], opts),
            timestep,
            guidance,
            img_ids,
            txt_ids: Tensor::zeros([t, 3], opts),
        }
    }

    fn inputs(&self) -> FluxInputs {
        FluxInputs {
            hidden_states: self.hs.shallow_clone(),
            encoder_hidden_states: self.text.shallow_clone(),
            pooled_projections: self.pooled.shallow_clone(),
            timestep: Tensor::from_slice(&[self.timestep as f32]),
            img_ids: self.img_ids.shallow_clone(),
            txt_ids: self.txt_ids.shallow_clone(),
            guidance: Some(Tensor::from_slice(&[self.guidance as f32])),
        }
    }

    /// Full forward of this case, capturing its K/V cache in `format`.
    fn full_with_cache(&self, model: &FluxTransformer, format: KvFormat) -> (Tensor, CapturedKv) {
        let mut cache = CapturedKv::new(format);
        let out = tch::no_grad(|| model.forward_capture(&self.inputs(), &mut cache)).unwrap();
        assert_eq!(cache.blocks.len(), model.num_blocks());
        assert_eq!(cache.blocks[0].0.size(), [N, model.inner_dim()]);
        (out.squeeze_dim(0), cache)
    }

    fn request<'a>(&self, index: &Tensor, cache: &'a dyn KvCache) -> MaskedRequest<'a> {
        MaskedRequest {
            hidden_states: self.hs.squeeze_dim(0).index_select(0, index),
            token_index: index.shallow_clone(),
            encoder_hidden_states: self.text.squeeze_dim(0),
            pooled_projections: self.pooled.squeeze_dim(0),
            timestep: self.timestep as f32 as f64,
            guidance: Some(self.guidance as f32 as f64),
            img_ids: self.img_ids.shallow_clone(),
            txt_ids: self.txt_ids.shallow_clone(),
            cache,
            full_hidden_states: Some(self.hs.squeeze_dim(0)),
        }
    }
}

/// `count` distinct token indices in random order.
fn random_mask(count: i64) -> Tensor {
    Tensor::randperm(N, (Kind::Int64, Device::Cpu)).narrow(0, 0, count)
}

fn max_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    f64::try_from((a - b).abs().max()).unwrap()
}

fn masked(model: &FluxTransformer, reqs: &[MaskedRequest]) -> Vec<Tensor> {
    tch::no_grad(|| model.forward_masked(reqs)).unwrap()
}

const FORMATS: [KvFormat; 3] = [KvFormat::Raw, KvFormat::Prepared, KvFormat::Hidden];

/// A copy of `cache` (same format) with every block's K/V passed through `f`.
fn map_cache(cache: &CapturedKv, f: impl Fn(&Tensor) -> Tensor) -> CapturedKv {
    CapturedKv {
        blocks: cache.blocks.iter().map(|(k, v)| (f(k), f(v))).collect(),
        format: cache.format,
    }
}

#[test]
fn all_tokens_masked_equals_full_forward_without_reading_the_cache() {
    let (model, _fixture) = model();
    let case = Case::new(5, 0.63, 3.5);
    let (full, _) = case.full_with_cache(&model, KvFormat::Raw);
    let index = random_mask(N); // every token, in shuffled order
    for format in FORMATS {
        let empty = CapturedKv::new(format); // reading it would fail
        let out = masked(&model, &[case.request(&index, &empty)]);
        assert_eq!(out[0].size(), [N, 8]);
        let expected = full.index_select(0, &index);
        let err = max_err(&out[0], &expected);
        println!("{format:?} mask 1.0: max abs err {err:.3e}");
        // Which rows differ tells a wrong key order (every row) from a stale row (a few).
        let bad_rows = i64::try_from(
            (&out[0] - &expected)
                .abs()
                .amax([1], false)
                .gt(1e-5)
                .sum(Kind::Int64),
        )
        .unwrap();
        assert!(err <= 1e-5, "{format:?}: {err} in {bad_rows} of {N} rows");
    }
}

#[test]
fn partial_mask_with_captured_cache_equals_full_forward_at_masked_tokens() {
    let (model, _fixture) = model();
    let case = Case::new(5, 0.4, 2.0);
    let index = random_mask(13);
    let mut outs = Vec::new();
    for format in FORMATS {
        let (full, cache) = case.full_with_cache(&model, format);
        assert_eq!(cache.format, format);
        let expected = full.index_select(0, &index);
        let out = masked(&model, &[case.request(&index, &cache)]);
        let err = max_err(&out[0], &expected);
        println!("{format:?} mask 13/{N}: max abs err {err:.3e}");
        assert!(err <= 1e-4, "{format:?}: {err}");

        // Garbage at the masked rows of the cache changes nothing: masked positions use fresh K/V.
        let noisy = |t: &Tensor, rows: &Tensor| {
            t.index_copy(
                0,
                rows,
                &Tensor::randn([rows.size()[0], t.size()[1]], (Kind::Float, Device::Cpu)),
            )
        };
        let at_masked = map_cache(&cache, |t| noisy(t, &index));
        let err = max_err(
            &masked(&model, &[case.request(&index, &at_masked)])[0],
            &expected,
        );
        assert!(
            err <= 1e-4,
            "{format:?}: masked cache rows were read: {err}"
        );

        // Garbage at one unmasked row does change the output: the cache really provides context.
        let all: Vec<i64> = Vec::try_from(&index).unwrap();
        let unmasked = (0..N).find(|i| !all.contains(i)).unwrap();
        let row = Tensor::from_slice(&[unmasked]);
        let at_unmasked = map_cache(&cache, |t| noisy(t, &row));
        let err = max_err(
            &masked(&model, &[case.request(&index, &at_unmasked)])[0],
            &expected,
        );
        assert!(
            err > 1e-3,
            "{format:?}: an unmasked cache row had no effect: {err}"
        );
        outs.push(out.into_iter().next().unwrap());
    }
    // Every format describes the same attention inputs (the hidden stream's K/V are rebuilt
    // under the edit's conditioning, here the template's own).
    for (format, out) in FORMATS.iter().zip(&outs).skip(1) {
        let err = max_err(out, &outs[0]);
        println!("raw vs {format:?}: max abs err {err:.3e}");
        assert!(err <= 1e-5, "raw vs {format:?}: {err}");
    }
}

/// A capture keeping two formats of every block, as the three-way planner's caches do.
struct TwoFormats(CapturedKv, CapturedKv);

impl KvSink for TwoFormats {
    fn put(&mut self, _block: usize, _k: &Tensor, _v: &Tensor) -> diffmesh_model::Result<()> {
        unreachable!("a two-format sink is given put_as")
    }

    fn formats(&self) -> Vec<KvFormat> {
        vec![self.0.format, self.1.format]
    }

    fn put_as(
        &mut self,
        block: usize,
        format: KvFormat,
        k: &Tensor,
        v: &Tensor,
    ) -> diffmesh_model::Result<()> {
        match format == self.0.format {
            true => self.0.put(block, k, v),
            false => self.1.put(block, k, v),
        }
    }
}

/// Per block, one of two caches of the same template: a plan mixing K/V and hidden blocks.
struct Mixed<'a> {
    kv: &'a CapturedKv,
    hidden: &'a CapturedKv,
    hidden_blocks: Vec<bool>,
}

impl KvCache for Mixed<'_> {
    fn block_kv(&self, block: usize) -> diffmesh_model::Result<(Tensor, Tensor)> {
        match self.hidden_blocks[block] {
            true => self.hidden.block_kv(block),
            false => self.kv.block_kv(block),
        }
    }

    fn block_format(&self, block: usize) -> KvFormat {
        match self.hidden_blocks[block] {
            true => self.hidden.format,
            false => self.kv.format,
        }
    }

    fn formats(&self) -> Vec<KvFormat> {
        vec![self.kv.format, self.hidden.format]
    }
}

/// The three-way planner's plans read K/V at some blocks and the hidden stream at others: a
/// capture keeping both formats stores what two one-format captures do, and any mix of the
/// two equals full compute at the masked tokens, each block read in its own format.
#[test]
fn blocks_read_in_mixed_formats_equal_full_compute() {
    let (model, _fixture) = model();
    let case = Case::new(5, 0.4, 2.0);
    let index = random_mask(13);
    let blocks = model.num_blocks();
    for kv_format in [KvFormat::Raw, KvFormat::Prepared] {
        let (full, kv_alone) = case.full_with_cache(&model, kv_format);
        let mut both = TwoFormats(
            CapturedKv::new(kv_format),
            CapturedKv::new(KvFormat::Hidden),
        );
        let _output = tch::no_grad(|| model.forward_capture(&case.inputs(), &mut both)).unwrap();
        let (_, hidden_alone) = case.full_with_cache(&model, KvFormat::Hidden);
        for (a, b) in [(&both.0, &kv_alone), (&both.1, &hidden_alone)] {
            for ((ak, av), (bk, bv)) in a.blocks.iter().zip(&b.blocks) {
                assert!(
                    ak.equal(bk) && av.equal(bv),
                    "{kv_format:?}: capture differs"
                );
            }
        }
        let expected = full.index_select(0, &index);
        let plans: [Vec<bool>; 3] = [
            (0..blocks).map(|b| b % 2 == 0).collect(),
            (0..blocks).map(|b| b >= blocks / 2).collect(),
            vec![true; blocks],
        ];
        for hidden_blocks in plans {
            let mixed = Mixed {
                kv: &both.0,
                hidden: &both.1,
                hidden_blocks: hidden_blocks.clone(),
            };
            let out = masked(&model, &[case.request(&index, &mixed)]);
            let err = max_err(&out[0], &expected);
            println!("{kv_format:?} + hidden at {hidden_blocks:?}: max abs err {err:.3e}");
            assert!(err <= 1e-4, "{kv_format:?} {hidden_blocks:?}: {err}");
        }
        // Each block is read in its own format only: garbage in the format a block does not
        // read changes nothing, garbage in the one it reads does.
        let first_hidden: Vec<bool> = (0..blocks).map(|b| b == 0).collect();
        let spoil = |c: &CapturedKv, block: usize| CapturedKv {
            blocks: c
                .blocks
                .iter()
                .enumerate()
                .map(|(b, (k, v))| match b == block {
                    true => (k.randn_like(), v.randn_like()),
                    false => (k.shallow_clone(), v.shallow_clone()),
                })
                .collect(),
            format: c.format,
        };
        let (kv_spoilt, hidden_spoilt) = (spoil(&both.0, 0), spoil(&both.1, 0));
        let read = |kv: &CapturedKv, hidden: &CapturedKv| {
            let mixed = Mixed {
                kv,
                hidden,
                hidden_blocks: first_hidden.clone(),
            };
            max_err(
                &masked(&model, &[case.request(&index, &mixed)])[0],
                &expected,
            )
        };
        assert!(
            read(&kv_spoilt, &both.1) <= 1e-4,
            "{kv_format:?}: unread K/V was read"
        );
        assert!(
            read(&both.0, &hidden_spoilt) > 1e-3,
            "{kv_format:?}: hidden block unread"
        );
    }
}

/// A hidden-stream (Y) cache rebuilds the unmasked tokens' K/V under the edit's own
/// conditioning: an edit with another prompt (its pooled embedding enters every block's AdaLN)
/// reads different K/V from it than from the template's stored K/V, while with the template's
/// prompt the two agree (checked above). Stored as one tensor per block, not two.
#[test]
fn hidden_cache_follows_the_edits_conditioning() {
    let (model, _fixture) = model();
    let template = Case::new(5, 0.4, 2.0);
    let (_, prepared) = template.full_with_cache(&model, KvFormat::Prepared);
    let (_, hidden) = template.full_with_cache(&model, KvFormat::Hidden);
    for (k, v) in &hidden.blocks {
        assert!(k.equal(v), "a hidden block is one tensor, given twice");
    }
    let index = random_mask(13);
    let mut edit = Case::new(5, 0.4, 2.0);
    edit.hs = template.hs.shallow_clone();
    edit.text = template.text.shallow_clone();
    let outs: Vec<Tensor> = [&prepared, &hidden]
        .iter()
        .map(|c| masked(&model, &[edit.request(&index, *c)]).remove(0))
        .collect();
    let err = max_err(&outs[0], &outs[1]);
    println!("another pooled prompt: prepared vs hidden {err:.3e}");
    assert!(
        err > 1e-4,
        "the hidden cache ignored the edit's conditioning: {err}"
    );
}

#[test]
fn cache_format_is_honoured() {
    let (model, _fixture) = model();
    let case = Case::new(5, 0.4, 2.0);
    let index = random_mask(13);
    let (full, raw) = case.full_with_cache(&model, KvFormat::Raw);
    let (_, prepared) = case.full_with_cache(&model, KvFormat::Prepared);
    // Values are raw in both formats; keys differ (norm + RoPE applied at capture).
    for ((rk, rv), (pk, pv)) in raw.blocks.iter().zip(&prepared.blocks) {
        assert_eq!(rk.size(), pk.size());
        assert!(max_err(rv, pv) <= 1e-6);
        assert!(max_err(rk, pk) > 1e-2);
    }
    // Prepared keys read as raw ones (norm + RoPE applied twice) give a wrong result.
    let mislabelled = map_cache(&prepared, |t| t.shallow_clone());
    let mislabelled = CapturedKv {
        format: KvFormat::Raw,
        ..mislabelled
    };
    let out = masked(&model, &[case.request(&index, &mislabelled)]);
    let err = max_err(&out[0], &full.index_select(0, &index));
    assert!(err > 1e-3, "format ignored: {err}");
}

#[test]
fn packed_batch_equals_each_request_alone() {
    let (model, _fixture) = model();
    // Different prompts (and text lengths), timesteps, guidance, masks and cache formats.
    let cases = [
        Case::new(5, 0.9, 3.5),
        Case::new(3, 0.35, 1.0),
        Case::new(7, 0.05, 4.0),
        Case::new(4, 0.5, 2.5),
    ];
    let formats = [
        KvFormat::Raw,
        KvFormat::Prepared,
        KvFormat::Hidden,
        KvFormat::Hidden,
    ];
    let caches: Vec<CapturedKv> = cases
        .iter()
        .zip(formats)
        .map(|(c, f)| c.full_with_cache(&model, f).1)
        .collect();
    let masks = [
        random_mask(4),
        random_mask(N),
        random_mask(21),
        random_mask(9),
    ];
    let reqs: Vec<MaskedRequest> = cases
        .iter()
        .zip(&caches)
        .zip(&masks)
        .map(|((c, kv), m)| c.request(m, kv))
        .collect();
    let batched = masked(&model, &reqs);
    assert_eq!(batched.len(), reqs.len());
    for (r, req) in reqs.iter().enumerate() {
        let alone = masked(&model, std::slice::from_ref(req));
        let err = max_err(&batched[r], &alone[0]);
        let scale = f64::try_from(alone[0].abs().max()).unwrap();
        println!(
            "request {r} ({:?}): batch vs alone max abs err {err:.3e} (output max {scale:.3})",
            formats[r]
        );
        // Not bitwise: GEMMs over different row counts may round differently (as in torch
        // itself), by a few ulps of the output's scale; a wrong row is off by ~0.1.
        assert!(
            err <= 1e-5 * scale.max(1.0),
            "request {r}: {err} (output max {scale})"
        );
    }
}

/// The padded batch attention (one call for all requests, the GPU default) gives what the
/// per-request loop gives: requests of one text length with different masks (one computing every
/// token), timesteps, guidance and cache formats, with and without a full prefix of blocks; and a
/// batch of different text lengths, which it cannot pad, falls back to the loop.
#[test]
fn padded_attention_equals_the_per_request_loop() {
    let (mut model, _fixture) = model();
    let n_double = model.transformer_blocks.len();
    let same_text = [
        Case::new(5, 0.9, 3.5),
        Case::new(5, 0.35, 1.0),
        Case::new(5, 0.05, 4.0),
    ];
    let mixed_text = [Case::new(3, 0.5, 2.5), Case::new(6, 0.7, 3.0)];
    let formats = [KvFormat::Raw, KvFormat::Prepared, KvFormat::Hidden];
    for (cases, masks) in [
        (
            &same_text[..],
            vec![random_mask(4), random_mask(N), random_mask(21)],
        ),
        (&mixed_text[..], vec![random_mask(11), random_mask(30)]),
    ] {
        let caches: Vec<CapturedKv> = cases
            .iter()
            .zip(formats)
            .map(|(c, f)| c.full_with_cache(&model, f).1)
            .collect();
        let reqs: Vec<MaskedRequest> = cases
            .iter()
            .zip(&caches)
            .zip(&masks)
            .map(|((c, kv), m)| c.request(m, kv))
            .collect();
        for prefix in [0, 1, n_double + 1] {
            let mut outs = Vec::new();
            for mode in [MaskedAttention::PerRequest, MaskedAttention::Padded] {
                model.masked_attention = mode;
                outs.push(tch::no_grad(|| model.forward_masked_prefix(&reqs, prefix)).unwrap());
            }
            for (r, (looped, padded)) in outs[0].iter().zip(&outs[1]).enumerate() {
                let err = max_err(padded, looped);
                println!(
                    "{} requests, prefix {prefix}, request {r}: padded vs loop {err:.3e}",
                    reqs.len()
                );
                assert!(err <= 1e-5, "prefix {prefix} request {r}: {err}");
            }
        }
    }
}

#[test]
fn rejects_bad_requests_naming_the_field() {
    let (model, _fixture) = model();
    let case = Case::new(5, 0.5, 3.5);
    for format in FORMATS {
        let (_, cache) = case.full_with_cache(&model, format);
        let mut req = case.request(&random_mask(5), &cache);
        req.token_index = Tensor::from_slice(&[1i64, 2, 3, 4, N]);
        let err = model.forward_masked(&[req]).unwrap_err().to_string();
        assert!(err.contains("requests[0].token_index"), "{err}");
        let mut req = case.request(&random_mask(5), &cache);
        req.guidance = None;
        let err = model.forward_masked(&[req]).unwrap_err().to_string();
        assert!(err.contains("guidance"), "{err}");
        let short = CapturedKv {
            blocks: cache.blocks[..1]
                .iter()
                .map(|(k, v)| (k.shallow_clone(), v.shallow_clone()))
                .collect(),
            format,
        };
        let err = model
            .forward_masked(&[case.request(&random_mask(5), &short)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("block 1 missing"), "{err}");
        let wrong = map_cache(&cache, |t| t.narrow(0, 0, N - 1));
        let err = model
            .forward_masked(&[case.request(&random_mask(5), &wrong)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("cache.k") && err.contains("block 0"), "{err}");
    }
}

/// A full prefix of blocks reads no cache and keeps the result exact: with the cache of every
/// prefix block poisoned (NaN), the output still equals the full forward at the masked tokens,
/// alone and packed with a second request, for prefixes ending in the double and single blocks.
#[test]
fn full_prefix_blocks_read_no_cache_and_stay_exact() {
    let (model, _fixture) = model();
    let n_blocks = model.num_blocks();
    let a = Case::new(5, 0.4, 2.0);
    let b = Case::new(3, 0.8, 2.0);
    let (ia, ib) = (random_mask(13), random_mask(30));
    for format in FORMATS {
        let (full_a, cache_a) = a.full_with_cache(&model, format);
        let (full_b, cache_b) = b.full_with_cache(&model, format);
        for prefix in 0..=n_blocks {
            let poison = |c: &CapturedKv| CapturedKv {
                blocks: c
                    .blocks
                    .iter()
                    .enumerate()
                    .map(|(i, (k, v))| {
                        if i < prefix {
                            (k.full_like(f64::NAN), v.full_like(f64::NAN))
                        } else {
                            (k.shallow_clone(), v.shallow_clone())
                        }
                    })
                    .collect(),
                format: c.format,
            };
            let (pa, pb) = (poison(&cache_a), poison(&cache_b));
            let reqs = [a.request(&ia, &pa), b.request(&ib, &pb)];
            let out = tch::no_grad(|| model.forward_masked_prefix(&reqs, prefix)).unwrap();
            let ea = max_err(&out[0], &full_a.index_select(0, &ia));
            let eb = max_err(&out[1], &full_b.index_select(0, &ib));
            println!("{format:?} prefix {prefix}: max abs err {ea:.3e} / {eb:.3e}");
            assert!(
                ea <= 1e-4 && eb <= 1e-4,
                "{format:?} prefix {prefix}: {ea} {eb}"
            );
            let alone = tch::no_grad(|| model.forward_masked_prefix(&reqs[..1], prefix)).unwrap();
            assert!(max_err(&alone[0], &out[0]) <= 1e-5);
        }
    }
}

#[test]
fn full_prefix_without_full_hidden_states_names_the_field() {
    let (model, _fixture) = model();
    let case = Case::new(5, 0.4, 2.0);
    let (_, cache) = case.full_with_cache(&model, KvFormat::Raw);
    let index = random_mask(9);
    let mut req = case.request(&index, &cache);
    req.full_hidden_states = None;
    let err = tch::no_grad(|| model.forward_masked_prefix(&[req], 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("requests[0].full_hidden_states"), "{err}");
}
