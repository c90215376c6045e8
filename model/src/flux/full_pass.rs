//! The full forward's blocks, as a pass that can stop after any double block and go on later
//! over a subset of its rows: the plain forward runs it straight through, first-block caching
//! (`step_cache`) stops after block 0, decides per request, and runs the rest only for the rows
//! that compute.
use super::blocks::{self, attention};
use super::embeddings::Rope;
use super::{check_inputs, Conditioning, ControlResiduals, FluxInputs, FluxTransformer};
use super::{KvFormat, KvSink};
use crate::error::{ModelError, Result};
use tch::Tensor;

/// A full forward part-way through its double blocks.
pub(crate) struct Pass {
    /// `[B, N, inner]` after `x_embedder`.
    pub img_in: Tensor,
    /// `[B, N, inner]` image stream after the blocks run so far.
    pub img: Tensor,
    /// `[B, T, inner]` text stream after the blocks run so far.
    txt: Tensor,
    pub cond: Conditioning,
    rope: Rope,
    /// Double blocks run so far.
    next_double: usize,
}

/// What [`FluxTransformer::forward_blocks`] leaves for the final layer.
pub(crate) struct BlockRun {
    /// `[B, N, inner]` after `x_embedder`.
    pub img_in: Tensor,
    /// `[B, N, inner]` after the last block.
    pub img_out: Tensor,
    pub cond: Conditioning,
}

impl Pass {
    /// Rows `index` (`[R]`, int64) of the pass, to go on with a subset of its batch.
    pub fn select_rows(&self, index: &Tensor) -> Result<Self> {
        Ok(Self {
            img_in: self.img_in.f_index_select(0, index)?,
            img: self.img.f_index_select(0, index)?,
            txt: self.txt.f_index_select(0, index)?,
            cond: Conditioning {
                temb_silu: self.cond.temb_silu.f_index_select(0, index)?,
            },
            rope: Rope {
                freqs: self.rope.freqs.shallow_clone(),
            },
            next_double: self.next_double,
        })
    }

    /// The same pass without copying its tensors (to go on with every row, keeping this one).
    pub fn select_all(&self) -> Result<Self> {
        Ok(Self {
            img_in: self.img_in.shallow_clone(),
            img: self.img.shallow_clone(),
            txt: self.txt.shallow_clone(),
            cond: Conditioning {
                temb_silu: self.cond.temb_silu.shallow_clone(),
            },
            rope: Rope {
                freqs: self.rope.freqs.shallow_clone(),
            },
            next_double: self.next_double,
        })
    }

    pub fn rows(&self) -> i64 {
        self.img.size()[0]
    }
}

impl FluxTransformer {
    /// Every block of a full forward: the image stream entering the first block and leaving
    /// the last, and the conditioning (what the final layer and step caching need).
    pub(crate) fn forward_blocks(
        &self,
        inputs: &FluxInputs,
        mut sink: Option<&mut dyn KvSink>,
        control: Option<&ControlResiduals>,
    ) -> Result<BlockRun> {
        let mut pass = self.begin_pass(inputs)?;
        let doubles = self.transformer_blocks.len();
        self.run_doubles(&mut pass, doubles, &mut sink, control)?;
        self.finish_pass(pass, &mut sink, control)
    }

    /// Embed the inputs: a pass before any block.
    pub(crate) fn begin_pass(&self, inputs: &FluxInputs) -> Result<Pass> {
        let shapes = check_inputs(&self.cfg, inputs)?;
        let (img, cond) = self.embedded(inputs)?;
        let txt = self
            .context_embedder
            .forward(&inputs.encoder_hidden_states)?;
        let ids =
            Tensor::f_cat(&[&shapes.txt_ids, &shapes.img_ids], 0)?.f_to_device(img.device())?;
        Ok(Pass {
            img_in: img.shallow_clone(),
            img,
            txt,
            cond,
            rope: Rope::new(&ids, &self.cfg.axes_dims_rope)?,
            next_double: 0,
        })
    }

    /// Run the pass's double blocks up to (not including) `until`, adding `control`'s residual
    /// after each and handing each block's image K/V to `sink` (see
    /// [`FluxTransformer::forward_capture`]).
    pub(crate) fn run_doubles(
        &self,
        pass: &mut Pass,
        until: usize,
        sink: &mut Option<&mut dyn KvSink>,
        control: Option<&ControlResiduals>,
    ) -> Result<()> {
        let doubles = self.transformer_blocks.len();
        if until > doubles || until < pass.next_double {
            return Err(ModelError::input(
                "blocks",
                format!(
                    "cannot run double blocks {}..{until} of {doubles}",
                    pass.next_double
                ),
            ));
        }
        let (t, n) = (pass.txt.size()[1], pass.img.size()[1]);
        let head_dim = self.cfg.attention_head_dim;
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        let inner = self.cfg.inner_dim();
        let formats = sink.as_deref().map(|s| s.formats()).unwrap_or_default();
        for i in pass.next_double..until {
            let block = &self.transformer_blocks[i];
            let (img, txt) = (&pass.img, &pass.txt);
            let (img_mod, txt_mod) = block.mods(&pass.cond.temb_silu, &rows, &rows)?;
            let (qi, qt) = block.pre(img, txt, &img_mod, &txt_mod)?;
            let q = pass.rope.apply(&Tensor::f_cat(&[&qt.q, &qi.q], 1)?)?;
            let k = pass.rope.apply(&Tensor::f_cat(&[&qt.k, &qi.k], 1)?)?;
            if let Some(sink) = sink.as_deref_mut() {
                for &format in &formats {
                    match format {
                        KvFormat::Hidden => {
                            let h = img.f_select(0, 0)?;
                            sink.put_as(i, format, &h, &h)?
                        }
                        KvFormat::Prepared => {
                            // Image rows `t..t + n` of the prepared keys, as `[N, inner]`.
                            let k = k.f_select(0, 0)?.f_narrow(0, t, n)?.f_reshape([n, inner])?;
                            sink.put_as(i, format, &k, &qi.v.f_select(0, 0)?)?
                        }
                        KvFormat::Raw => {
                            let (k, v) = (qi.k_raw.f_select(0, 0)?, qi.v.f_select(0, 0)?);
                            sink.put_as(i, format, &k, &v)?
                        }
                    }
                }
            }
            let v = blocks::to_heads(&Tensor::f_cat(&[&qt.v, &qi.v], 1)?, head_dim)?;
            let o = attention(&q, &k, &v)?;
            let (attn_txt, attn_img) = (o.f_narrow(1, 0, t)?, o.f_narrow(1, t, n)?);
            let (mut img, txt) = block.post(img, txt, &attn_img, &attn_txt, &img_mod, &txt_mod)?;
            if let Some(r) = control.and_then(|c| c.for_double(i, doubles)) {
                img = img.f_add(r)?;
            }
            (pass.img, pass.txt) = (img, txt);
        }
        pass.next_double = until;
        Ok(())
    }

    /// Run the pass's remaining double blocks and every single block.
    pub(crate) fn finish_pass(
        &self,
        mut pass: Pass,
        sink: &mut Option<&mut dyn KvSink>,
        control: Option<&ControlResiduals>,
    ) -> Result<BlockRun> {
        let doubles = self.transformer_blocks.len();
        self.run_doubles(&mut pass, doubles, sink, control)?;
        let (t, n) = (pass.txt.size()[1], pass.img.size()[1]);
        let head_dim = self.cfg.attention_head_dim;
        let rows = |c: &Tensor| -> Result<Tensor> { Ok(c.f_unsqueeze(1)?) };
        let inner = self.cfg.inner_dim();
        let formats = sink.as_deref().map(|s| s.formats()).unwrap_or_default();
        let rope = &pass.rope;
        // One concatenation for all single blocks (diffusers re-concatenates in every block).
        let mut x = Tensor::f_cat(&[&pass.txt, &pass.img], 1)?;
        let singles = self.single_transformer_blocks.len();
        for (j, block) in self.single_transformer_blocks.iter().enumerate() {
            let m = block.mods(&pass.cond.temb_silu, &rows)?;
            let pre = block.pre(&x, &m)?;
            let q = rope.apply(&pre.qkv.q)?;
            let k = rope.apply(&pre.qkv.k)?;
            if let Some(sink) = sink.as_deref_mut() {
                let image = |x: &Tensor| x.f_select(0, 0)?.f_narrow(0, t, n);
                for &format in &formats {
                    let ck = match format {
                        // `x` is still this block's input.
                        KvFormat::Hidden => image(&x)?,
                        KvFormat::Prepared => {
                            k.f_select(0, 0)?.f_narrow(0, t, n)?.f_reshape([n, inner])?
                        }
                        KvFormat::Raw => image(&pre.qkv.k_raw)?,
                    };
                    let v = match format {
                        KvFormat::Hidden => ck.shallow_clone(),
                        _ => image(&pre.qkv.v)?,
                    };
                    sink.put_as(doubles + j, format, &ck, &v)?;
                }
            }
            let v = blocks::to_heads(&pre.qkv.v, head_dim)?;
            let o = attention(&q, &k, &v)?;
            x = block.post(&x, &o, &pre.mlp, &m)?;
            if let Some(r) = control.and_then(|c| c.for_single(j, singles)) {
                // The residual belongs to the image tokens, after the text ones.
                x = Tensor::f_cat(&[&x.f_narrow(1, 0, t)?, &x.f_narrow(1, t, n)?.f_add(r)?], 1)?;
            }
        }
        Ok(BlockRun {
            img_in: pass.img_in,
            img_out: x.f_narrow(1, t, n)?,
            cond: pass.cond,
        })
    }
}
