//! ControlNet steering for stepped requests (diffusers' `FluxControlNetPipeline`): a request's
//! control image is encoded and packed once; at every step the ControlNet runs on the request's
//! own step inputs plus those latents, and its residuals go into the transformer's forward.
//!
//! The ControlNet's forward needs nothing from the transformer's, so it can run anywhere: in the
//! same process ([`ControlStep::residuals`]) or on a ControlNet worker that receives the
//! [`ControlStep`] tensors (Katz's ControlNet-as-a-Service). Rows of one batched forward may
//! carry different ControlNets or none: [`merge_rows`] maps each row's residuals to the
//! transformer's blocks (diffusers' interval rule) and fills the rest with zeros.
use super::stepper::StepRequest;
use super::{FluxPipeline, Prepared};
use crate::error::{ModelError, Result};
use crate::flux::{ControlResiduals, FluxControlNet, FluxInputs};
use crate::packing::pack_latents;
use tch::{Kind, Tensor};

/// The control of one request: its image and how strongly it steers.
#[derive(Debug)]
pub struct ControlInput {
    /// `[1, 3, H, W]` in [-1, 1] at the request's resolution.
    pub image: Tensor,
    /// diffusers' `controlnet_conditioning_scale`.
    pub scale: f64,
}

/// What a request keeps between steps: the packed control latents.
#[derive(Debug)]
pub(crate) struct ControlState {
    pub latents: Tensor,
    pub scale: f64,
    /// The request's embedded-guidance scale (a ControlNet may embed guidance even when the
    /// transformer does not; diffusers decides by the ControlNet's own `guidance_embeds`).
    pub guidance_scale: f64,
}

impl ControlState {
    /// Check and encode the control image like the template of an edit (the codec's encoding,
    /// packed); diffusers' pipeline samples the VAE posterior here, we take its mean so a
    /// request's result depends on its seed only.
    pub(crate) fn new(
        p: &FluxPipeline<'_>,
        prep: &Prepared,
        req: &StepRequest,
        c: &ControlInput,
    ) -> Result<Self> {
        let expect = [1, 3, req.height, req.width];
        if c.image.size() != expect {
            return Err(ModelError::input(
                "control.image",
                format!("expected {expect:?}, got {:?}", c.image.size()),
            ));
        }
        if !c.scale.is_finite() {
            return Err(ModelError::input("control.scale", "must be finite"));
        }
        let image = c.image.f_to_device(prep.device)?.f_to_kind(prep.kind)?;
        let latents = pack_latents(&p.codec.encode(&image)?.f_to_kind(prep.kind)?)?;
        Ok(Self {
            latents,
            scale: c.scale,
            guidance_scale: req.guidance_scale,
        })
    }
}

/// One request's ControlNet inputs for its next step.
#[derive(Debug)]
pub struct ControlStep {
    /// The transformer's inputs for the step (`B = 1`); `guidance` as the transformer wants it.
    pub inputs: FluxInputs,
    /// `[1, N, in_channels]` packed control latents.
    pub control: Tensor,
    pub scale: f64,
    pub guidance_scale: f64,
}

impl ControlStep {
    /// Run `net` on this step (in the caller's thread): the residuals, already scaled.
    pub fn residuals(&self, net: &FluxControlNet) -> Result<ControlResiduals> {
        tch::no_grad(|| {
            let guidance = match (&self.inputs.guidance, net.cfg.guidance_embeds) {
                (_, false) => None,
                (Some(g), true) => Some(g.shallow_clone()),
                (None, true) => {
                    let device = self.inputs.hidden_states.device();
                    Some(Tensor::f_full(
                        [1],
                        self.guidance_scale,
                        (Kind::Float, device),
                    )?)
                }
            };
            let inputs = FluxInputs {
                hidden_states: self.inputs.hidden_states.shallow_clone(),
                encoder_hidden_states: self.inputs.encoder_hidden_states.shallow_clone(),
                pooled_projections: self.inputs.pooled_projections.shallow_clone(),
                timestep: self.inputs.timestep.shallow_clone(),
                img_ids: self.inputs.img_ids.shallow_clone(),
                txt_ids: self.inputs.txt_ids.shallow_clone(),
                guidance,
            };
            net.forward(&inputs, &self.control, self.scale)
        })
    }
}

/// The residuals of a batched forward whose rows (same token count `n`, width `inner`) each
/// bring their own residuals or none, laid out one per transformer block (`doubles` double
/// blocks, `singles` single blocks). `None` when no row brings any.
pub fn merge_rows(
    rows: &[Option<&ControlResiduals>],
    doubles: usize,
    singles: usize,
    like: &Tensor,
) -> Result<Option<ControlResiduals>> {
    if rows.iter().all(Option::is_none) {
        return Ok(None);
    }
    let size = like.size();
    if size.len() != 3 {
        return Err(ModelError::input(
            "control",
            "residual rows must be [1, N, inner]",
        ));
    }
    let zero = Tensor::f_zeros([1, size[1], size[2]], (like.kind(), like.device()))?;
    let block = |pick: &dyn Fn(&ControlResiduals) -> Option<&Tensor>| -> Result<Option<Tensor>> {
        let picked: Vec<Option<&Tensor>> = rows.iter().map(|r| r.and_then(pick)).collect();
        if picked.iter().all(Option::is_none) {
            return Ok(None);
        }
        let parts: Vec<&Tensor> = picked.iter().map(|p| p.unwrap_or(&zero)).collect();
        Ok(Some(Tensor::f_cat(&parts, 0)?))
    };
    let mut double = Vec::with_capacity(doubles);
    for i in 0..doubles {
        double.push(block(&|r| r.for_double(i, doubles))?);
    }
    let mut single = Vec::with_capacity(singles);
    for j in 0..singles {
        single.push(block(&|r| r.for_single(j, singles))?);
    }
    // One residual per block, so the transformer's interval rule maps them one to one; a block
    // no row steers gets zeros (rare: only when ControlNets of different depths mix).
    let batch = rows.len() as i64;
    let fill = |v: Vec<Option<Tensor>>| -> Result<Vec<Tensor>> {
        if v.iter().all(Option::is_none) {
            return Ok(Vec::new());
        }
        v.into_iter()
            .map(|t| match t {
                Some(t) => Ok(t),
                None => Ok(Tensor::f_zeros(
                    [batch, size[1], size[2]],
                    (like.kind(), like.device()),
                )?),
            })
            .collect()
    };
    Ok(Some(ControlResiduals {
        double: fill(double)?,
        single: fill(single)?,
    }))
}
