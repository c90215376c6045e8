//! Sessions of UNet ControlNets (diffusers' `ControlNetModel`, SD 2.x and SDXL) on a ControlNet
//! worker: what a session keeps (the UNet's text conditioning and the control image, one row
//! per guidance branch), which steps share a forward, and one forward for several sessions, each
//! answered with its own rows.
use crate::wire::{from_wire, to_wire};
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::unet::{ControlNetModel, UNetInputs};
use diffmesh_shared::wire::controlnet_service::{
    SessionOpen, StepReply, StepRequest, UNetSession, WireTensor,
};

/// One steered image's fixed inputs.
pub struct UnetSession {
    /// `[R, T, cross_attention_dim]`.
    encoder_hidden_states: Tensor,
    /// SDXL's `[R, P]` and `[R, 6]`.
    text_embeds: Option<Tensor>,
    time_ids: Option<Tensor>,
    /// `[R, 3, H, W]`.
    control: Tensor,
}

impl UnetSession {
    /// Check the open's inputs against `net` and keep them on `device` in the net's dtype; the
    /// error names the field.
    pub fn open(
        net: &ControlNetModel,
        o: &SessionOpen,
        added: &UNetSession,
        device: Device,
    ) -> Result<Self, String> {
        let kind = net_kind(net);
        let on = |w, field: &str| -> Result<Tensor, String> {
            from_wire(w, device, field)?
                .f_to_kind(kind)
                .map_err(|e| format!("{field}: {e}"))
        };
        let ehs = on(&o.encoder_hidden_states, "encoder_hidden_states")?;
        let control = on(&o.control, "control")?;
        let e = ehs.size();
        let cross = net.config.unet.context_dim();
        if e.len() != 3 || e[0] < 1 || e[2] != cross {
            return Err(format!(
                "encoder_hidden_states: expected [R, T, {cross}] for `{}`, got {e:?}",
                o.controlnet
            ));
        }
        let rows = e[0];
        let c = control.size();
        let channels = net.config.conditioning_channels;
        if c.len() != 4 || c[0] != rows || c[1] != channels {
            return Err(format!(
                "control: expected [{rows}, {channels}, H, W] for `{}`, got {c:?}",
                o.controlnet
            ));
        }
        let per_row = |t: &Option<WireTensor>, field: &str| -> Result<Option<Tensor>, String> {
            let Some(w) = t else {
                return Ok(None);
            };
            let t = from_wire(w, device, field)?;
            if t.dim() != 2 || t.size()[0] != rows {
                return Err(format!("{field}: expected [{rows}, _], got {:?}", t.size()));
            }
            Ok(Some(t))
        };
        Ok(Self {
            text_embeds: per_row(&added.text_embeds, "unet.text_embeds")?
                .map(|t| t.f_to_kind(kind))
                .transpose()
                .map_err(|e| format!("unet.text_embeds: {e}"))?,
            time_ids: per_row(&added.time_ids, "unet.time_ids")?
                .map(|t| t.f_to_kind(kind))
                .transpose()
                .map_err(|e| format!("unet.time_ids: {e}"))?,
            encoder_hidden_states: ehs,
            control,
        })
    }

    fn rows(&self) -> i64 {
        self.encoder_hidden_states.size()[0]
    }

    /// Whether this session's step `a` and `other`'s step `b` can share a forward: the same
    /// sample shape past the rows, the same text length, the same added conditioning.
    pub fn shares_forward(&self, a: &StepRequest, other: &Self, b: &StepRequest) -> bool {
        a.hidden_states.shape.get(1..) == b.hidden_states.shape.get(1..)
            && a.hidden_states.dtype == b.hidden_states.dtype
            && self.encoder_hidden_states.size()[1..] == other.encoder_hidden_states.size()[1..]
            && self.control.size()[1..] == other.control.size()[1..]
            && self.text_embeds.is_some() == other.text_embeds.is_some()
            && self.time_ids.is_some() == other.time_ids.is_some()
    }
}

fn net_kind(net: &ControlNetModel) -> Kind {
    net.device_kind().1
}

/// One forward of `net` at `scale` for the steps `reqs` of `sessions` (in order), a reply per
/// step with its session's rows.
pub fn step(
    net: &ControlNetModel,
    scale: f64,
    sessions: &[&UnetSession],
    reqs: &[&StepRequest],
    device: Device,
    compute_ms: impl Fn() -> f64,
) -> Result<Vec<StepReply>, String> {
    let kind = net_kind(net);
    let cat = |parts: Vec<Tensor>| Tensor::f_cat(&parts, 0).map_err(|e| e.to_string());
    let mut samples = Vec::with_capacity(reqs.len());
    let mut timesteps = Vec::with_capacity(reqs.len());
    for (s, r) in sessions.iter().zip(reqs) {
        let sample = from_wire(&r.hidden_states, device, "hidden_states")?;
        if sample.dim() != 4 || sample.size()[0] != s.rows() {
            return Err(format!(
                "hidden_states: expected [{}, C, h, w], got {:?}",
                s.rows(),
                sample.size()
            ));
        }
        let t = from_wire(&r.timestep, device, "timestep")?
            .f_to_kind(Kind::Float)
            .and_then(|t| t.f_reshape([-1]))
            .map_err(|e| format!("timestep: {e}"))?;
        // One for every row, or one per row (as the UNet engine sends it).
        let t = match t.size()[0] {
            1 => t.f_expand([s.rows()], false).map_err(|e| e.to_string())?,
            n if n == s.rows() => t,
            _ => {
                return Err(format!(
                    "timestep: expected [1] or [{}], got {:?}",
                    s.rows(),
                    t.size()
                ))
            }
        };
        samples.push(sample.f_to_kind(kind).map_err(|e| e.to_string())?);
        timesteps.push(t);
    }
    let held = |pick: &dyn Fn(&UnetSession) -> Option<&Tensor>| -> Result<Option<Tensor>, String> {
        let parts: Option<Vec<Tensor>> = sessions
            .iter()
            .map(|s| pick(s).map(Tensor::shallow_clone))
            .collect();
        parts.map(cat).transpose()
    };
    let inputs = UNetInputs {
        sample: cat(samples)?,
        timestep: cat(timesteps)?,
        encoder_hidden_states: held(&|s| Some(&s.encoder_hidden_states))?.ok_or("no sessions")?,
        text_embeds: held(&|s| s.text_embeds.as_ref())?,
        time_ids: held(&|s| s.time_ids.as_ref())?,
    };
    let control = held(&|s| Some(&s.control))?.ok_or("no sessions")?;
    let residuals = diffmesh_model::tch::no_grad(|| net.forward(&inputs, &control, scale))
        .map_err(|e| format!("controlnet: {e}"))?;
    let ms = compute_ms();
    let mut offset = 0;
    let mut replies = Vec::with_capacity(sessions.len());
    for s in sessions {
        let rows = |t: &Tensor| -> Result<WireTensor, String> {
            to_wire(&t.f_narrow(0, offset, s.rows()).map_err(|e| e.to_string())?)
        };
        replies.push(StepReply::UnetResiduals {
            down: residuals.down.iter().map(rows).collect::<Result<_, _>>()?,
            mid: rows(&residuals.mid)?,
            compute_ms: ms,
        });
        offset += s.rows();
    }
    Ok(replies)
}
