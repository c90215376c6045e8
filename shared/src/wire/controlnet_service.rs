//! ControlNet-as-a-Service (Katz, section 5): ControlNets run on dedicated workers beside the
//! denoisers, which send each steered step's inputs there and add the residuals that come back.
//!
//! A denoiser picks a worker from the workers' heartbeats ([`ControlNetHeartbeat`]), opens a
//! session per steered image with the inputs that stay fixed for the whole job
//! ([`SessionOpen`]: prompt embeddings, control latents, position ids), then sends per step only
//! what changes ([`StepRequest`]: the noisy latents and the timestep). Every message goes to the
//! worker's own subjects, chunked when large (`chunked`); a worker that is gone or lost the
//! session is replaced by another, and the session opened again there.
//!
//! Sessions are of a Flux ControlNet (`FluxControlNetModel`) or, with [`SessionOpen::unet`], of a
//! UNet ControlNet (diffusers' `ControlNetModel`, SD 2.x and SDXL): then the fixed inputs are the
//! UNet's text conditioning and the control image, one row per guidance branch, each step sends
//! the UNet's sample and timestep, and the answer is [`StepReply::UnetResiduals`].
use serde::{Deserialize, Serialize};

/// Workers -> denoisers: periodic [`ControlNetHeartbeat`].
pub const HEARTBEAT: &str = "diffmesh.controlnet.heartbeat";

/// Every request subject of worker `worker_id` (a subscription filter).
pub fn worker_requests(worker_id: &str) -> String {
    format!("diffmesh.controlnet.worker.{worker_id}.*")
}
/// Open a session on worker `worker_id` ([`SessionOpen`] -> [`OpenReply`]).
pub fn open_subject(worker_id: &str) -> String {
    format!("diffmesh.controlnet.worker.{worker_id}.open")
}
/// One step of a session on worker `worker_id` ([`StepRequest`] -> [`StepReply`]).
pub fn step_subject(worker_id: &str) -> String {
    format!("diffmesh.controlnet.worker.{worker_id}.step")
}
/// Close a session on worker `worker_id` ([`SessionClose`], no answer).
pub fn close_subject(worker_id: &str) -> String {
    format!("diffmesh.controlnet.worker.{worker_id}.close")
}
/// Liveness of worker `worker_id` (empty request, empty answer): it waits for its own answer
/// before announcing itself, so no denoiser sends to subjects the server does not route yet.
pub fn ping_subject(worker_id: &str) -> String {
    format!("diffmesh.controlnet.worker.{worker_id}.ping")
}

/// Element type of a [`WireTensor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireDtype {
    F32,
    Bf16,
    F16,
    I64,
}

impl WireDtype {
    const ALL: [WireDtype; 4] = [
        WireDtype::F32,
        WireDtype::Bf16,
        WireDtype::F16,
        WireDtype::I64,
    ];

    /// Its name (`f32`, `bf16`, `f16`, `i64`): how the model crate's tensors name it.
    pub fn name(self) -> &'static str {
        match self {
            WireDtype::F32 => "f32",
            WireDtype::Bf16 => "bf16",
            WireDtype::F16 => "f16",
            WireDtype::I64 => "i64",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    pub fn size(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::Bf16 | WireDtype::F16 => 2,
            WireDtype::I64 => 8,
        }
    }
}

/// A dense tensor: its shape, element type and little-endian contents, row-major.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTensor {
    pub shape: Vec<i64>,
    pub dtype: WireDtype,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

impl WireTensor {
    /// A tensor of element type `dtype` (by name, see [`WireDtype::name`]).
    pub fn from_parts(dtype: &str, shape: Vec<i64>, data: Vec<u8>) -> Result<Self, String> {
        let dtype =
            WireDtype::from_name(dtype).ok_or_else(|| format!("no wire element type `{dtype}`"))?;
        Ok(Self { shape, dtype, data })
    }

    /// Why the contents do not fit the shape and dtype (`None`: they do).
    pub fn problem(&self) -> Option<String> {
        if self.shape.iter().any(|&d| d < 0) {
            return Some(format!("negative dimension in {:?}", self.shape));
        }
        let numel = self
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d as usize));
        match numel.and_then(|n| n.checked_mul(self.dtype.size())) {
            Some(bytes) if bytes == self.data.len() => None,
            _ => Some(format!(
                "{} bytes do not hold {:?} of {:?}",
                self.data.len(),
                self.shape,
                self.dtype
            )),
        }
    }
}

/// What a worker keeps for one steered image while its job runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionOpen {
    /// Unique per image of a job (the job id and the image's row).
    pub session: String,
    pub job_id: String,
    /// The ControlNet (a folder name on the worker).
    pub controlnet: String,
    /// diffusers' `controlnet_conditioning_scale`.
    pub scale: f64,
    /// The request's embedded-guidance scale (used when a Flux ControlNet embeds guidance).
    pub guidance_scale: f64,
    /// Flux: `[1, T, joint_attention_dim]` prompt embeddings. UNet: `[R, T, cross_attention_dim]`,
    /// one row per guidance branch (negative first), as the UNet takes them.
    pub encoder_hidden_states: WireTensor,
    /// Flux's `[1, pooled_projection_dim]` (None in a UNet session).
    #[serde(default)]
    pub pooled_projections: Option<WireTensor>,
    /// Flux's position ids (None in a UNet session).
    #[serde(default)]
    pub img_ids: Option<WireTensor>,
    #[serde(default)]
    pub txt_ids: Option<WireTensor>,
    /// Flux: `[1, N, in_channels]` packed control latents. UNet: the control image
    /// `[R, 3, H, W]` in [0, 1], repeated per row.
    pub control: WireTensor,
    /// A UNet ControlNet's session (None: a Flux ControlNet's).
    #[serde(default)]
    pub unet: Option<UNetSession>,
}

/// The UNet-only fixed inputs of a session: SDXL's added conditioning, per row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct UNetSession {
    /// `[R, projection_dim]` pooled text embeddings (SDXL).
    pub text_embeds: Option<WireTensor>,
    /// `[R, 6]` size and crop conditioning (SDXL).
    pub time_ids: Option<WireTensor>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum OpenReply {
    Opened,
    /// The worker cannot serve it (no such ControlNet, inputs that do not fit it); the message
    /// names the field.
    Failed {
        error: String,
    },
}

/// One step's inputs of an open session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRequest {
    pub session: String,
    /// Flux: `[1, N, in_channels]` noisy latents. UNet: the UNet's sample `[R, C, h, w]` (the
    /// scaled model input).
    pub hidden_states: WireTensor,
    /// `[1]` timestep as the transformer (or the UNet) takes it.
    pub timestep: WireTensor,
    /// `[1]` embedded guidance, when the transformer takes one.
    pub guidance: Option<WireTensor>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StepReply {
    /// The residuals, already scaled: one per ControlNet double block, then per single block.
    Residuals {
        double: Vec<WireTensor>,
        single: Vec<WireTensor>,
        /// The forward's own time on the worker (ms), loading included.
        compute_ms: f64,
    },
    /// A UNet session's residuals, already scaled, with the session's rows: one per skip of
    /// the down path, and the mid block's.
    UnetResiduals {
        down: Vec<WireTensor>,
        mid: WireTensor,
        compute_ms: f64,
    },
    /// The worker holds no such session (restarted, or dropped it): open it again.
    UnknownSession,
    Failed {
        error: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionClose {
    pub session: String,
}

/// What a ControlNet worker tells the denoisers every heartbeat period.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlNetHeartbeat {
    pub worker_id: String,
    /// Flux ControlNets it can run (folders it holds), sorted.
    pub served: Vec<String>,
    /// UNet ControlNets (`ControlNetModel` folders) it can run, sorted; empty from older
    /// workers, which listed every folder in `served`.
    #[serde(default)]
    pub served_unet: Vec<String>,
    /// ControlNets loaded now (no loading on their first step).
    pub resident: Vec<String>,
    /// Sessions open.
    pub sessions: u32,
    /// Requests waiting for its compute thread.
    pub queued: u32,
    /// It takes no new sessions (shutting down).
    pub draining: bool,
    /// How often it sends heartbeats (ms), so a denoiser expires it after missing a few. 0 from
    /// older senders ([`ControlNetHeartbeat::interval`]: the default period then).
    #[serde(default)]
    pub interval_ms: u32,
}

impl ControlNetHeartbeat {
    /// How often this worker sends heartbeats.
    pub fn interval(&self) -> std::time::Duration {
        match self.interval_ms {
            0 => crate::wire::messages::DEFAULT_HEARTBEAT_INTERVAL,
            ms => std::time::Duration::from_millis(u64::from(ms)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_tensors_must_fill_their_shape() {
        let t = |shape: Vec<i64>, bytes: usize| WireTensor {
            shape,
            dtype: WireDtype::F32,
            data: vec![0; bytes],
        };
        assert_eq!(t(vec![2, 3], 24).problem(), None);
        assert_eq!(t(vec![], 4).problem(), None);
        assert!(t(vec![2, 3], 20).problem().is_some());
        assert!(t(vec![-1, 3], 12).problem().is_some());
        assert!(t(vec![i64::MAX, i64::MAX], 0).problem().is_some());
    }

    #[test]
    fn flux_opens_of_older_senders_read_and_unet_opens_round_trip() {
        let t = |n: i64| WireTensor {
            shape: vec![n],
            dtype: WireDtype::F32,
            data: vec![0; 4 * n as usize],
        };
        // An older denoiser's open: the Flux fields as plain values, no `unet`.
        #[derive(Serialize)]
        struct OlderOpen {
            session: String,
            job_id: String,
            controlnet: String,
            scale: f64,
            guidance_scale: f64,
            encoder_hidden_states: WireTensor,
            pooled_projections: WireTensor,
            img_ids: WireTensor,
            txt_ids: WireTensor,
            control: WireTensor,
        }
        let older = OlderOpen {
            session: "s".into(),
            job_id: "j".into(),
            controlnet: "c".into(),
            scale: 0.5,
            guidance_scale: 3.5,
            encoder_hidden_states: t(2),
            pooled_projections: t(3),
            img_ids: t(4),
            txt_ids: t(5),
            control: t(6),
        };
        let bytes = crate::wire::messages::encode(&older).unwrap();
        let open: SessionOpen = crate::wire::messages::decode(&bytes).unwrap();
        assert_eq!(open.pooled_projections, Some(t(3)));
        assert_eq!(open.txt_ids, Some(t(5)));
        assert_eq!(open.unet, None);

        let unet = SessionOpen {
            pooled_projections: None,
            img_ids: None,
            txt_ids: None,
            unet: Some(UNetSession {
                text_embeds: Some(t(7)),
                time_ids: None,
            }),
            ..open
        };
        let back: SessionOpen =
            crate::wire::messages::decode(&crate::wire::messages::encode(&unet).unwrap()).unwrap();
        assert_eq!(back, unet);
        let reply = StepReply::UnetResiduals {
            down: vec![t(1), t(2)],
            mid: t(3),
            compute_ms: 1.5,
        };
        let back: StepReply =
            crate::wire::messages::decode(&crate::wire::messages::encode(&reply).unwrap()).unwrap();
        assert_eq!(back, reply);
    }

    #[test]
    fn tensors_travel_as_binary() {
        let t = WireTensor {
            shape: vec![256],
            dtype: WireDtype::F32,
            data: vec![7; 1024],
        };
        let bytes = crate::wire::messages::encode(&t).unwrap();
        assert!(bytes.len() < 1100, "{} bytes for 1024 of data", bytes.len());
        let back: WireTensor = crate::wire::messages::decode(&bytes).unwrap();
        assert_eq!(back, t);
    }
}
