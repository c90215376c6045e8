//! The Flux transformer's forward split over the ranks of a logical group by sequence
//! (DeepSpeed-Ulysses, as xDiT and vLLM-Omni run Flux; issue 47 point 3).
//!
//! Every rank holds the whole request's inputs and computes one shard of the image tokens
//! (`ceil(N / R)` each, the last shards padded) and all text tokens (replicated: they are
//! few, and every rank needs them in the text stream). Everything token-wise (AdaLN, the
//! projections, the MLPs) runs on the rank's own tokens. Attention needs every token, so
//! around it the image queries, keys and values go from "my tokens, all heads" to "all
//! tokens, my heads" with one all-to-all each; each rank attends over the whole sequence
//! for `H / R` heads (its share of the text heads is local), and one all-to-all (image) and
//! one all-gather (text) bring the outputs back to "my tokens, all heads". Padded keys are
//! masked out. At the end every rank all-gathers the velocity, so each returns the whole
//! `[B, N, out]`, equal to the single-rank forward up to float rounding.
//!
//! Ulysses needs the heads to divide among the ranks (Flux's 24 over 2, 3, 4, 6, 8). Ring
//! attention ([`SequenceParallel::Ring`]) does not: each rank keeps all heads of its queries
//! and the image keys and values travel around the ring, one shard a step ([`Collectives::shift`]),
//! each folded into the rank's running softmax (the text's keys, the same on every rank, are
//! folded in once, locally); every rank then holds its own tokens' outputs and the text's,
//! with no exchange back.
use super::blocks::{self, to_heads};
use super::{check_inputs, FluxInputs, FluxTransformer};
use crate::error::{ModelError, Result};
use diffmesh_parallel::{Collectives, Group};
use tch::{Kind, Tensor};

/// How a group splits attention over the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceParallel {
    /// All-to-all over heads (the heads must divide among the ranks).
    Ulysses,
    /// Keys and values passed around the ring, any head count.
    Ring,
}

impl std::str::FromStr for SequenceParallel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "ulysses" => Ok(Self::Ulysses),
            "ring" => Ok(Self::Ring),
            other => Err(format!("`{other}`: expected ulysses or ring")),
        }
    }
}

/// One rank's view of the split: the group, its shard of the image tokens, the head share.
struct Split<'a, C> {
    comm: &'a mut C,
    group: &'a Group,
    how: SequenceParallel,
    ranks: i64,
    /// Image tokens per rank (the last ranks' shards padded to it).
    shard: i64,
    /// Real (unpadded) image tokens of each rank's shard.
    real: Vec<i64>,
    /// Heads per rank (Ulysses).
    heads: i64,
    head_dim: i64,
}

/// A running softmax over key blocks (flash attention's online form), in fp32.
struct Online {
    /// Row maxima `[B, H, Sq, 1]`, sums of exponentials, and the weighted values `[B, H, Sq, D]`.
    max: Tensor,
    sum: Tensor,
    acc: Tensor,
    scale: f64,
}

impl Online {
    fn new(q: &Tensor) -> Result<Self> {
        let s = q.size();
        let opts = (Kind::Float, q.device());
        Ok(Self {
            max: Tensor::f_full([s[0], s[1], s[2], 1], f64::NEG_INFINITY, opts)?,
            sum: Tensor::f_zeros([s[0], s[1], s[2], 1], opts)?,
            acc: Tensor::f_zeros([s[0], s[1], s[2], s[3]], opts)?,
            scale: 1.0 / (s[3] as f64).sqrt(),
        })
    }

    /// Fold in the first `valid` keys and values of `[B, S, H, D]` blocks, for queries `q`
    /// `[B, H, Sq, D]` (fp32).
    fn add(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, valid: i64) -> Result<()> {
        if valid == 0 {
            return Ok(());
        }
        let heads_first = |x: &Tensor| -> Result<Tensor> {
            Ok(x.f_narrow(1, 0, valid)?
                .f_transpose(1, 2)?
                .f_to_kind(Kind::Float)?)
        };
        let (k, v) = (heads_first(k)?, heads_first(v)?);
        let scores = q
            .f_matmul(&k.f_transpose(-2, -1)?)?
            .f_mul_scalar(self.scale)?;
        let max = self.max.f_maximum(&scores.f_amax([-1], true)?)?;
        // exp(-inf - finite) = 0 drops the empty start.
        let carry = self.max.f_sub(&max)?.f_exp()?;
        let p = scores.f_sub(&max)?.f_exp()?;
        self.sum = self.sum.f_mul(&carry)?.f_add(&p.f_sum_dim_intlist(
            [-1i64].as_slice(),
            true,
            Kind::Float,
        )?)?;
        self.acc = self.acc.f_mul(&carry)?.f_add(&p.f_matmul(&v)?)?;
        self.max = max;
        Ok(())
    }

    /// `[B, Sq, H * D]`.
    fn finish(self) -> Result<Tensor> {
        let o = self.acc.f_div(&self.sum)?;
        let s = o.size();
        Ok(o.f_transpose(1, 2)?.f_reshape([s[0], s[2], s[1] * s[3]])?)
    }
}

/// A collective's failure as the model's error, naming `ranks` (also used by `elastic` and
/// `cfg_parallel`).
pub(crate) fn comm_err(e: diffmesh_parallel::Error) -> ModelError {
    ModelError::input("ranks", e.to_string())
}

/// A tensor's values as f32, in its (contiguous) element order.
pub(crate) fn floats(t: &Tensor) -> Result<Vec<f32>> {
    let flat = t.f_to_kind(Kind::Float)?.f_contiguous()?.f_view([-1])?;
    Ok(Vec::<f32>::try_from(&flat)?)
}

fn tensor(values: &[f32], shape: &[i64], like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(values)?
        .f_view(shape)?
        .f_to_kind(like.kind())?
        .f_to_device(like.device())?)
}

/// Every member's `send` (the same shape on each), `[R, ...]` in group order.
pub(crate) fn all_gather<C: Collectives>(
    comm: &mut C,
    group: &Group,
    send: &Tensor,
) -> Result<Tensor> {
    let input = floats(send)?;
    let mut out = vec![0.0; input.len() * group.size()];
    comm.all_gather(group, &input, &mut out).map_err(comm_err)?;
    let mut shape = vec![group.size() as i64];
    shape.extend(send.size());
    tensor(&out, &shape, send)
}

impl<C: Collectives> Split<'_, C> {
    fn all_to_all(&mut self, send: &Tensor) -> Result<Tensor> {
        let input = floats(send)?;
        let mut out = vec![0.0; input.len()];
        self.comm
            .all_to_all(self.group, &input, &mut out)
            .map_err(comm_err)?;
        tensor(&out, &send.size(), send)
    }

    fn all_gather(&mut self, send: &Tensor) -> Result<Tensor> {
        all_gather(self.comm, self.group, send)
    }

    /// `[B, L, H, D]` of this rank's image tokens -> `[B, R * L, H / R, D]`: every rank's
    /// tokens (in rank order, which is token order) for this rank's heads.
    fn tokens_for_my_heads(&mut self, x: &Tensor) -> Result<Tensor> {
        let (b, l) = (x.size()[0], x.size()[1]);
        let (r, hg, d) = (self.ranks, self.heads, self.head_dim);
        // Part j (heads of rank j) first, for the all-to-all.
        let send = x.f_view([b, l, r, hg, d])?.f_permute([2, 0, 1, 3, 4])?;
        let got = self.all_to_all(&send.f_contiguous()?)?; // [R(from rank i), B, L, hg, D]
        Ok(got
            .f_permute([1, 0, 2, 3, 4])?
            .f_reshape([b, r * l, hg, d])?)
    }

    /// `[B, R * L, H/R * D]` (every token, this rank's heads) -> `[B, L, H * D]` (this
    /// rank's tokens, every head).
    fn heads_for_my_tokens(&mut self, o: &Tensor) -> Result<Tensor> {
        let (b, r, l) = (o.size()[0], self.ranks, self.shard);
        let w = o.size()[2];
        // Part i (tokens of rank i) first.
        let send = o.f_view([b, r, l, w])?.f_permute([1, 0, 2, 3])?;
        let got = self.all_to_all(&send.f_contiguous()?)?; // [R(heads of rank j), B, L, w]
        Ok(got.f_permute([1, 2, 0, 3])?.f_reshape([b, l, r * w])?)
    }

    /// `[B, T, H/R * D]` text outputs of this rank's heads -> `[B, T, H * D]`, every head.
    fn all_heads(&mut self, o: &Tensor) -> Result<Tensor> {
        let (b, t, w) = (o.size()[0], o.size()[1], o.size()[2]);
        let got = self.all_gather(o)?; // [R, B, T, w]
        Ok(got
            .f_permute([1, 2, 0, 3])?
            .f_reshape([b, t, self.ranks * w])?)
    }

    /// Attention of this rank's queries over the whole sequence. `q`, `k`, `v` are
    /// `[B, T + L, H, D]` (text then this rank's image tokens, RoPE applied to `q` and `k`);
    /// returns the text and image outputs `[B, T, H*D]` and `[B, L, H*D]`.
    fn attention(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        t: i64,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        match self.how {
            SequenceParallel::Ulysses => self.ulysses(q, k, v, t, mask),
            SequenceParallel::Ring => self.ring(q, k, v, t),
        }
    }

    /// Ring attention: every head of this rank's queries against the text's keys, then every
    /// rank's image shard as it comes round.
    fn ring(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, t: i64) -> Result<(Tensor, Tensor)> {
        let (l, d) = (self.shard, self.head_dim);
        let kind = q.kind();
        let qh = q.f_transpose(1, 2)?.f_to_kind(Kind::Float)?;
        let mut online = Online::new(&qh)?;
        online.add(&qh, &k.f_narrow(1, 0, t)?, &v.f_narrow(1, 0, t)?, t)?;
        // Keys and values of one shard together, `[B, L, H, 2D]`: one shift a step.
        let mut kv = Tensor::f_cat(&[&k.f_narrow(1, t, l)?, &v.f_narrow(1, t, l)?], 3)?;
        let (ranks, me) = (self.ranks as usize, self.group.position);
        for step in 0..ranks {
            let owner = (me + ranks - step) % ranks;
            let (kb, vb) = (kv.f_narrow(3, 0, d)?, kv.f_narrow(3, d, d)?);
            online.add(&qh, &kb, &vb, self.real[owner])?;
            if step + 1 < ranks {
                kv = self.shift(&kv)?;
            }
        }
        let o = online.finish()?.f_to_kind(kind)?;
        Ok((o.f_narrow(1, 0, t)?, o.f_narrow(1, t, l)?))
    }

    /// Send `x` to the next rank and take the previous rank's (the same shape).
    fn shift(&mut self, x: &Tensor) -> Result<Tensor> {
        let ranks = self.group.size();
        let me = self.group.position;
        let input = floats(x)?;
        let mut out = vec![0.0; input.len()];
        self.comm
            .shift(
                self.group,
                (me + 1) % ranks,
                (me + ranks - 1) % ranks,
                &input,
                &mut out,
            )
            .map_err(comm_err)?;
        tensor(&out, &x.size(), x)
    }

    /// Ulysses: every token for this rank's heads, then back.
    fn ulysses(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        t: i64,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let (l, h0) = (self.shard, self.group.position as i64 * self.heads);
        let mut whole = |x: &Tensor| -> Result<Tensor> {
            let txt = x.f_narrow(1, 0, t)?.f_narrow(2, h0, self.heads)?;
            let img = self.tokens_for_my_heads(&x.f_narrow(1, t, l)?)?;
            Ok(Tensor::f_cat(&[&txt, &img], 1)?)
        };
        let (q, k, v) = (whole(q)?, whole(k)?, whole(v)?);
        let o = match mask {
            Some(mask) => masked_attention(&q, &k, &v, mask)?,
            None => blocks::attention(&q, &k, &v)?,
        };
        let img_tokens = o.size()[1] - t;
        let txt = self.all_heads(&o.f_narrow(1, 0, t)?)?;
        let img = self.heads_for_my_tokens(&o.f_narrow(1, t, img_tokens)?)?;
        Ok((txt, img))
    }
}

/// [`blocks::attention`] with a key mask `[S]` (true: attend).
fn masked_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let out = Tensor::f_scaled_dot_product_attention(
        &q.f_transpose(1, 2)?,
        &k.f_transpose(1, 2)?,
        &v.f_transpose(1, 2)?,
        Some(&mask.f_view([1, 1, 1, -1])?),
        0.0,
        false,
        None,
        false,
    )?;
    let size = out.size();
    Ok(out
        .f_transpose(1, 2)?
        .f_reshape([size[0], size[2], size[1] * size[3]])?)
}

impl FluxTransformer {
    /// The forward of [`FluxTransformer::forward`], computed by every member of `group` for
    /// its shard of the image tokens, attention split as `how` says; each member returns the
    /// whole velocity `[B, N, out]`. Every member calls it with the same inputs.
    pub fn forward_sequence_parallel<C: Collectives>(
        &self,
        inputs: &FluxInputs,
        comm: &mut C,
        group: &Group,
        how: SequenceParallel,
    ) -> Result<Tensor> {
        let shapes = check_inputs(&self.cfg, inputs)?;
        let (n, t) = (shapes.img_tokens, shapes.txt_tokens);
        let ranks = group.size() as i64;
        let heads = self.cfg.num_attention_heads;
        if how == SequenceParallel::Ulysses && heads % ranks != 0 {
            return Err(ModelError::input(
                "ranks",
                format!(
                    "Ulysses needs the {heads} heads to divide among {ranks} ranks \
                     (ring attention does not)"
                ),
            ));
        }
        let head_dim = self.cfg.attention_head_dim;
        let shard = (n + ranks - 1) / ranks;
        let start = group.position as i64 * shard;
        let real = (n - start).clamp(0, shard);
        let hs = &inputs.hidden_states;
        let device = hs.device();

        // This rank's image tokens, zero-padded to the shard length.
        let mine = hs.f_narrow(1, start.min(n), real)?;
        let mine = if real < shard {
            let pad = Tensor::f_zeros(
                [hs.size()[0], shard - real, hs.size()[2]],
                (hs.kind(), device),
            )?;
            Tensor::f_cat(&[&mine, &pad], 1)?
        } else {
            mine
        };
        let mut img = self.x_embedder.forward(&mine)?;
        let cond = self.conditioning(
            &inputs.timestep,
            inputs.guidance.as_ref(),
            &inputs.pooled_projections,
        )?;
        let mut txt = self
            .context_embedder
            .forward(&inputs.encoder_hidden_states)?;
        // RoPE rows of the text and of this rank's tokens (padding takes the text's first,
        // it is masked out of every key and dropped from every output).
        let ids = Tensor::f_cat(&[&shapes.txt_ids, &shapes.img_ids], 0)?.f_to_device(device)?;
        let rope = super::embeddings::Rope::new(&ids, &self.cfg.axes_dims_rope)?;
        let mut rows: Vec<i64> = (0..t).collect();
        rows.extend((0..shard).map(|i| if i < real { t + start + i } else { 0 }));
        let rope = rope.select(&Tensor::f_from_slice(&rows)?.f_to_device(device)?)?;
        // Keys of the whole exchanged sequence: text, then every rank's shard in order.
        let mask = (how == SequenceParallel::Ulysses && n % ranks != 0)
            .then(|| Tensor::f_arange(t + ranks * shard, (Kind::Int64, device))?.f_lt(t + n))
            .transpose()?;
        let mut split = Split {
            comm,
            group,
            how,
            ranks,
            shard,
            real: (0..ranks)
                .map(|r| (n - r * shard).clamp(0, shard))
                .collect(),
            heads: heads / ranks,
            head_dim,
        };
        let per_row = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };

        for block in &self.transformer_blocks {
            let (img_mod, txt_mod) = block.mods(&cond.temb_silu, &per_row, &per_row)?;
            let (qi, qt) = block.pre(&img, &txt, &img_mod, &txt_mod)?;
            let q = rope.apply(&Tensor::f_cat(&[&qt.q, &qi.q], 1)?)?;
            let k = rope.apply(&Tensor::f_cat(&[&qt.k, &qi.k], 1)?)?;
            let v = to_heads(&Tensor::f_cat(&[&qt.v, &qi.v], 1)?, head_dim)?;
            let (attn_txt, attn_img) = split.attention(&q, &k, &v, t, mask.as_ref())?;
            (img, txt) = block.post(&img, &txt, &attn_img, &attn_txt, &img_mod, &txt_mod)?;
        }
        let mut x = Tensor::f_cat(&[&txt, &img], 1)?;
        for block in &self.single_transformer_blocks {
            let m = block.mods(&cond.temb_silu, &per_row)?;
            let pre = block.pre(&x, &m)?;
            let q = rope.apply(&pre.qkv.q)?;
            let k = rope.apply(&pre.qkv.k)?;
            let v = to_heads(&pre.qkv.v, head_dim)?;
            let (attn_txt, attn_img) = split.attention(&q, &k, &v, t, mask.as_ref())?;
            let attn = Tensor::f_cat(&[&attn_txt, &attn_img], 1)?;
            x = block.post(&x, &attn, &pre.mlp, &m)?;
        }
        let out = self.final_layer(&x.f_narrow(1, t, shard)?, &cond.temb_silu, &per_row)?;
        // Every rank's shard, in token order; the padding is last.
        let all = split.all_gather(&out)?; // [R, B, L, out]
        let size = out.size();
        Ok(all
            .f_permute([1, 0, 2, 3])?
            .f_reshape([size[0], ranks * shard, size[2]])?
            .f_narrow(1, 0, n)?)
    }
}

/// `cargo xtask forward --component transformer --ranks R --sp ulysses|ring`: the same inputs
/// and output file as [`super::cli_forward_transformer`], computed by `ranks` CPU ranks (threads,
/// each loading the weights as a device's rank would); rank 0's output is written, after
/// checking that every rank returned the same.
pub fn cli_forward_transformer_split(
    model_dir: &std::path::Path,
    inputs: &std::path::Path,
    out: &std::path::Path,
    ranks: usize,
    how: SequenceParallel,
) -> Result<()> {
    use diffmesh_parallel::{RankConfig, Ranks};
    if ranks == 0 {
        return Err(ModelError::input("ranks", "must be at least 1"));
    }
    let world = Ranks::start(RankConfig::new(ranks))
        .map_err(|e| ModelError::input("ranks", format!("starting the rank threads: {e}")))?;
    let (dir, file) = (super::component_dir(model_dir), inputs.to_path_buf());
    let outputs = world.on_all(
        move |ep| -> std::result::Result<(Vec<f32>, Vec<i64>), String> {
            let mut run = || -> Result<(Vec<f32>, Vec<i64>)> {
                let (model, _vs) = FluxTransformer::load(&dir, tch::Device::Cpu, Kind::Float)?;
                let x = super::cli_inputs(&file)?;
                let members: Vec<usize> = (0..ranks).collect();
                let group = Group::new(1, &members, ep.rank(), ranks).map_err(comm_err)?;
                let y = tch::no_grad(|| model.forward_sequence_parallel(&x, ep, &group, how))?;
                Ok((floats(&y)?, y.size()))
            };
            run().map_err(|e| e.to_string())
        },
    );
    let mut first: Option<(Vec<f32>, Vec<i64>)> = None;
    for (rank, result) in outputs.into_iter().enumerate() {
        let (values, shape) = result
            .ok_or_else(|| ModelError::input("ranks", format!("rank {rank} stopped")))?
            .map_err(|e| ModelError::input("ranks", format!("rank {rank}: {e}")))?;
        match &first {
            None => first = Some((values, shape)),
            Some((v0, _)) if *v0 != values => {
                return Err(ModelError::input(
                    "ranks",
                    format!("rank {rank} returned another velocity than rank 0"),
                ))
            }
            Some(_) => {}
        }
    }
    let (values, shape) = first.expect("at least one rank");
    let sample = Tensor::f_from_slice(&values)?.f_view(shape.as_slice())?;
    Tensor::write_safetensors(&[("sample", sample)], out)?;
    Ok(())
}
