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
//! Needs the heads to divide among the ranks (Flux's 24 over 2, 3, 4, 6, 8); ring attention
//! for the rest is still to come.
use super::blocks::{self, to_heads};
use super::{check_inputs, FluxInputs, FluxTransformer};
use crate::error::{ModelError, Result};
use diffmesh_parallel::{Collectives, Group};
use tch::{Kind, Tensor};

/// One rank's view of the split: the group, its shard of the image tokens, the head share.
struct Split<'a, C> {
    comm: &'a mut C,
    group: &'a Group,
    ranks: i64,
    /// Image tokens per rank (the last ranks' shards padded to it).
    shard: i64,
    /// Heads per rank.
    heads: i64,
    head_dim: i64,
}

fn comm_err(e: diffmesh_parallel::Error) -> ModelError {
    ModelError::input("ranks", e.to_string())
}

/// A tensor's values as f32, in its (contiguous) element order.
fn floats(t: &Tensor) -> Result<Vec<f32>> {
    let flat = t.f_to_kind(Kind::Float)?.f_contiguous()?.f_view([-1])?;
    Ok(Vec::<f32>::try_from(&flat)?)
}

fn tensor(values: &[f32], shape: &[i64], like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(values)?
        .f_view(shape)?
        .f_to_kind(like.kind())?
        .f_to_device(like.device())?)
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
        let input = floats(send)?;
        let mut out = vec![0.0; input.len() * self.ranks as usize];
        self.comm
            .all_gather(self.group, &input, &mut out)
            .map_err(comm_err)?;
        let mut shape = vec![self.ranks];
        shape.extend(send.size());
        tensor(&out, &shape, send)
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

    /// Attention over the whole sequence for this rank's heads. `q`, `k`, `v` are
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
    /// its shard of the image tokens (Ulysses sequence parallelism); each member returns the
    /// whole velocity `[B, N, out]`. Every member calls it with the same inputs.
    pub fn forward_ulysses<C: Collectives>(
        &self,
        inputs: &FluxInputs,
        comm: &mut C,
        group: &Group,
    ) -> Result<Tensor> {
        let shapes = check_inputs(&self.cfg, inputs)?;
        let (n, t) = (shapes.img_tokens, shapes.txt_tokens);
        let ranks = group.size() as i64;
        let heads = self.cfg.num_attention_heads;
        if heads % ranks != 0 {
            return Err(ModelError::input(
                "ranks",
                format!("Ulysses needs the {heads} heads to divide among {ranks} ranks"),
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
        let mask = (n % ranks != 0)
            .then(|| Tensor::f_arange(t + ranks * shard, (Kind::Int64, device))?.f_lt(t + n))
            .transpose()?;
        let mut split = Split {
            comm,
            group,
            ranks,
            shard,
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
