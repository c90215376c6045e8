//! ControlNet steering of the UNet family (diffusers' `StableDiffusionControlNetPipeline` and
//! `StableDiffusionXLControlNetPipeline`, several ControlNets as `MultiControlNetModel`): a
//! request carries one control image and scale per ControlNet ([`SdControl`]); before each step
//! the ControlNets run on the request's own UNet inputs for that step ([`SdControlStep`]), their
//! residuals are summed, and the batched UNet forward adds them to the request's rows
//! ([`SdPipeline::step_batch_steered`]).
//!
//! The state holds images and scales, not the networks: which ControlNet a request names is the
//! engine's business (it keeps them loaded, and could ask a ControlNet worker instead, since
//! [`SdControlStep`] is plain tensors).
use super::stepper::{Extra, SdState};
use super::SdPipeline;
use crate::components::LatentCodec;
use crate::error::{ModelError, Result};
use crate::unet::{ControlNetModel, UNetInputs, UNetResiduals};
use tch::{Kind, Tensor};

/// One ControlNet's control of a request: its image and diffusers'
/// `controlnet_conditioning_scale`.
#[derive(Debug)]
pub struct SdControl {
    /// `[1, 3, H, W]` in [0, 1] at the request's resolution (diffusers' control image
    /// processor does not normalise).
    pub image: Tensor,
    pub scale: f64,
}

/// A request's ControlNet inputs for its next step.
#[derive(Debug)]
pub struct SdControlStep {
    /// The UNet's inputs of the request's rows (both guidance branches), as the ControlNets
    /// take them: the scaled latents, not an inpainting UNet's extra channels.
    pub inputs: UNetInputs,
    /// Per ControlNet, in the request's order: its image repeated per row, and its scale.
    pub images: Vec<(Tensor, f64)>,
}

impl SdControlStep {
    /// The summed residuals of `nets` (one per control, in order), each scaled by its control's
    /// scale, as `MultiControlNetModel` sums them.
    pub fn residuals(&self, nets: &[&ControlNetModel]) -> Result<UNetResiduals> {
        if nets.len() != self.images.len() {
            return Err(ModelError::input(
                "controlnet",
                format!(
                    "{} ControlNets for {} control images",
                    nets.len(),
                    self.images.len()
                ),
            ));
        }
        let mut sum: Option<UNetResiduals> = None;
        for (k, net) in nets.iter().enumerate() {
            let r = self.one(k, net)?;
            sum = Some(match sum {
                Some(s) => s.sum(&r)?,
                None => r,
            });
        }
        sum.ok_or_else(|| ModelError::input("controlnet", "a steered step without controls"))
    }

    /// Control `k`'s residuals from its ControlNet `net`, scaled (the caller sums them with
    /// [`UNetResiduals::sum`] when it holds one network at a time).
    pub fn one(&self, k: usize, net: &ControlNetModel) -> Result<UNetResiduals> {
        let (image, scale) = self.images.get(k).ok_or_else(|| {
            ModelError::input(
                "controlnet",
                format!("control {k} of {}", self.images.len()),
            )
        })?;
        tch::no_grad(|| net.forward(&self.inputs, image, *scale))
    }
}

impl SdPipeline {
    /// Steer a generation's `state` (before its first step) with `controls`; an error names
    /// the field. Inpainting, captures and edits are not steered.
    pub fn steer(&self, state: &mut SdState, controls: Vec<SdControl>) -> Result<()> {
        if !matches!(state.extra, Extra::None) || !state.attention_is_full() {
            return Err(ModelError::input(
                "controlnet",
                "only generations are steered (not inpainting, captures or template edits)",
            ));
        }
        if state.next_step() != 0 {
            return Err(ModelError::input(
                "controlnet",
                "a request is steered before its first step",
            ));
        }
        let f = self.vae.downscale_factor();
        let [h, w] = state.latent_side();
        let want = [1, 3, h * f, w * f];
        let mut images = Vec::with_capacity(controls.len());
        for (i, c) in controls.into_iter().enumerate() {
            let field = format!("controls[{i}]");
            if c.image.size() != want {
                return Err(ModelError::input(
                    format!("{field}.image"),
                    format!("expected {want:?}, got {:?}", c.image.size()),
                ));
            }
            if !c.scale.is_finite() {
                return Err(ModelError::input(
                    format!("{field}.scale"),
                    "must be finite",
                ));
            }
            let image = c
                .image
                .f_to_device(state.latents().device())?
                .f_to_kind(Kind::Float)?
                .f_repeat([state.rows(), 1, 1, 1])?;
            images.push((image, c.scale));
        }
        state.controls = images;
        Ok(())
    }

    /// One step of `states` (as [`Self::step_batch`]), each steered state's rows adding
    /// `residuals[i]`: its controls' summed residuals for this step ([`SdState::control_step`]).
    /// `residuals` is empty when no state is steered, else one entry per state.
    pub fn step_batch_steered(
        &self,
        states: &mut [&mut SdState],
        noise: &mut super::stepper::BatchNoise,
        residuals: &[Option<UNetResiduals>],
    ) -> Result<()> {
        let merged = merge_rows(states, residuals)?;
        self.step_batch_with(states, noise, merged.as_ref())
    }

    /// A steered generation alone to its end (diffusers' ControlNet pipelines with `latents=`):
    /// `nets` are the ControlNets of `controls`, in order.
    pub fn generate_steered(
        &self,
        req: &super::SdRequest,
        latents: &Tensor,
        controls: Vec<SdControl>,
        nets: &[&ControlNetModel],
        noise: &mut dyn FnMut(usize, &[i64]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let mut state = self.prepare(req, latents, None)?;
        self.steer(&mut state, controls)?;
        while !state.done() {
            let r = state
                .control_step()?
                .map(|step| step.residuals(nets))
                .transpose()?;
            self.step_batch_steered(
                &mut [&mut state],
                &mut |_, step, shape| noise(step, shape),
                &[r],
            )?;
        }
        self.decode(&state)
    }
}

impl SdState {
    /// Whether ControlNets steer this request.
    pub fn steered(&self) -> bool {
        !self.controls.is_empty()
    }

    /// The inputs its ControlNets take for its next step (None when not steered).
    pub fn control_step(&self) -> Result<Option<SdControlStep>> {
        if self.controls.is_empty() || self.done() {
            return Ok(None);
        }
        Ok(Some(SdControlStep {
            inputs: self.unet_inputs()?,
            images: self
                .controls
                .iter()
                .map(|(image, scale)| (image.shallow_clone(), *scale))
                .collect(),
        }))
    }
}

/// The residuals of a batched forward whose states each bring their controls' residuals or
/// none (zeros in their rows). None when no state is steered.
fn merge_rows(
    states: &[&mut SdState],
    residuals: &[Option<UNetResiduals>],
) -> Result<Option<UNetResiduals>> {
    if residuals.is_empty() {
        if let Some(i) = states.iter().position(|s| s.steered()) {
            return Err(ModelError::input(
                "controlnet",
                format!("state {i} is steered but no residuals were given"),
            ));
        }
        return Ok(None);
    }
    if residuals.len() != states.len() {
        return Err(ModelError::input(
            "controlnet",
            format!(
                "{} residual entries for {} states",
                residuals.len(),
                states.len()
            ),
        ));
    }
    for (i, (s, r)) in states.iter().zip(residuals).enumerate() {
        if s.steered() != r.is_some() {
            let why = if r.is_some() { "unsteered" } else { "steered" };
            return Err(ModelError::input(
                "controlnet",
                format!("state {i} is {why} but residuals say otherwise"),
            ));
        }
        if let Some(r) = r {
            let rows = |t: &Tensor| t.size().first().copied();
            if std::iter::once(&r.mid)
                .chain(&r.down)
                .any(|t| rows(t) != Some(s.rows()))
            {
                return Err(ModelError::input(
                    "controlnet",
                    format!("state {i}'s residuals are not {} rows", s.rows()),
                ));
            }
        }
    }
    let Some(like) = residuals.iter().flatten().next() else {
        return Ok(None);
    };
    if residuals
        .iter()
        .flatten()
        .any(|r| r.down.len() != like.down.len())
    {
        return Err(ModelError::input(
            "controlnet",
            "the batch's ControlNets do not fit one UNet (their residual counts differ)",
        ));
    }
    let column = |pick: &dyn Fn(&UNetResiduals) -> &Tensor| -> Result<Tensor> {
        let template = pick(like);
        let mut parts = Vec::with_capacity(states.len());
        for (s, r) in states.iter().zip(residuals) {
            parts.push(match r {
                Some(r) => pick(r).shallow_clone(),
                None => {
                    let mut shape = template.size();
                    shape[0] = s.rows();
                    Tensor::f_zeros(&shape, (template.kind(), template.device()))?
                }
            });
        }
        Ok(Tensor::f_cat(&parts, 0)?)
    };
    let down = (0..like.down.len())
        .map(|k| column(&|r| &r.down[k]))
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(UNetResiduals {
        down,
        mid: column(&|r| &r.mid)?,
    }))
}
