//! Every MessagePack message a service decodes from NATS (`messages::decode::<T>`, the request
//! helpers' replies, the async queue's entries), in one table: the first byte of a fuzz input
//! picks the type, the rest is the message. One index past the table is the cache's step-blob
//! format, which the denoiser parses out of cache values.
use diffmesh_shared::stores::async_queue::QueuedJob;
use diffmesh_shared::wire::cachestore::{
    CacheDelete, CacheDeleteReply, CacheGet, CacheGetReply, CacheLocate, CacheLocateReply,
    CachePrefetch, CachePrefetchReply, CachePut, CachePutReply, CacheRange, CacheStatsReply,
    CacheTier, KeyLocation,
};
use diffmesh_shared::wire::controlnet::ControlNetRef;
use diffmesh_shared::wire::controlnet_service::{
    ControlNetHeartbeat, OpenReply, SessionClose, SessionOpen, StepReply, StepRequest, WireTensor,
};
use diffmesh_shared::wire::lora::LoraRef;
use diffmesh_shared::wire::messages::{
    decode, encode, BlockPlan, CancelJob, DenoiseJob, EvictTemplate, FieldError, GenerationParams,
    Heartbeat, JobEvent, JobKind, OutcomeQuery, PostprocessReply, PostprocessRequest,
    PreparedInputs, PreparedTemplate, PreprocessReply, PreprocessRequest, RunningJob, StepJob,
    StepSample, SubmitReply, TemplateCaptured, TemplateImage, TemplateRef, TrueCfg, WantedEvent,
};
use diffmesh_shared::wire::models::{ModelCard, ModelFeatures, ModelGeometry, Resolution};
use diffmesh_shared::wire::templates::{pack_step, step_block_ranges};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// What is checked once a message decoded: whatever its receiver checks before use.
pub trait Received {
    fn received(&self) {}
}

fn tensor_checked(t: &WireTensor) {
    // The ControlNet worker and the denoiser refuse a tensor whose bytes do not fit its shape
    // before they build it; `problem` must answer for any shape, not overflow.
    let _ = t.problem();
}

impl Received for SessionOpen {
    fn received(&self) {
        for t in [
            Some(&self.encoder_hidden_states),
            self.pooled_projections.as_ref(),
            self.img_ids.as_ref(),
            self.txt_ids.as_ref(),
            Some(&self.control),
        ]
        .into_iter()
        .flatten()
        {
            tensor_checked(t);
        }
        if let Some(u) = &self.unet {
            u.text_embeds
                .iter()
                .chain(&u.time_ids)
                .for_each(tensor_checked);
        }
    }
}

impl Received for StepRequest {
    fn received(&self) {
        tensor_checked(&self.hidden_states);
        tensor_checked(&self.timestep);
        self.guidance.iter().for_each(tensor_checked);
    }
}

impl Received for StepReply {
    fn received(&self) {
        match self {
            StepReply::Residuals { double, single, .. } => {
                double.iter().chain(single).for_each(tensor_checked)
            }
            StepReply::UnetResiduals { down, mid, .. } => {
                down.iter().chain([mid]).for_each(tensor_checked)
            }
            StepReply::UnknownSession | StepReply::Failed { .. } => {}
        }
    }
}

macro_rules! wire_types {
    (checked: $($checked:ident),* ; plain: $($plain:ident),* $(,)?) => {
        $(impl Received for $plain {})*

        /// The message types, in table order.
        pub const NAMES: &[&str] = &[$(stringify!($checked),)* $(stringify!($plain),)*];

        /// Decode `bytes` as the type at `index` (and check it as its receiver would); `false`
        /// when no type has that index.
        fn decode_nth(index: usize, bytes: &[u8]) -> bool {
            let mut i = 0;
            $(
                if index == i {
                    received::<$checked>(bytes);
                    return true;
                }
                i += 1;
            )*
            $(
                if index == i {
                    received::<$plain>(bytes);
                    return true;
                }
                i += 1;
            )*
            let _ = i;
            false
        }
    };
}

wire_types!(
    checked: SessionOpen, StepRequest, StepReply;
    plain: PreprocessRequest, PreprocessReply, PostprocessRequest, PostprocessReply, DenoiseJob,
    QueuedJob, SubmitReply, JobEvent, Heartbeat, CancelJob, EvictTemplate, TemplateCaptured,
    OutcomeQuery, CacheGet, CacheGetReply, CachePut, CachePutReply, CacheDelete,
    CacheDeleteReply, CacheLocate, CacheLocateReply, CachePrefetch, CachePrefetchReply,
    CacheRange, CacheStatsReply, OpenReply, SessionClose, ControlNetHeartbeat,
);

/// Decode as the receiver does; a message that decoded is one the mesh can send on again
/// (routers re-publish queued jobs, gateways re-send), so it must encode and decode again.
fn received<T: DeserializeOwned + Serialize + Received>(bytes: &[u8]) {
    let Ok(message) = decode::<T>(bytes) else {
        return;
    };
    message.received();
    let again = encode(&message).expect("a decoded message encodes");
    decode::<T>(&again).expect("a re-encoded message decodes");
}

/// One fuzz input: the first byte picks the type (modulo the table and the step blob).
pub fn fuzz_one(data: &[u8]) {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    let index = usize::from(selector) % (NAMES.len() + 1);
    if !decode_nth(index, bytes) {
        if let Ok(ranges) = step_block_ranges(bytes) {
            // The denoiser slices the entry with these ranges.
            assert!(ranges
                .iter()
                .all(|r| r.start <= r.end && r.end <= bytes.len()));
        }
    }
}

/// A seed: the table index of `T` and the message.
fn seed<T: Serialize>(message: &T) -> (String, Vec<u8>) {
    let full = std::any::type_name::<T>();
    let name = full.rsplit("::").next().unwrap_or(full);
    let index = NAMES
        .iter()
        .position(|n| *n == name)
        .unwrap_or_else(|| panic!("{name} is not in the wire table"));
    let mut bytes = vec![index as u8];
    bytes.extend(encode(message).expect("seed encodes"));
    (name.to_string(), bytes)
}

fn params() -> GenerationParams {
    GenerationParams {
        model: "tiny".into(),
        prompt: "a red circle on the left".into(),
        n: 2,
        num_inference_steps: 4,
        guidance_scale: 3.5,
        seed: 7,
        width: 64,
        height: 48,
        loras: vec![LoraRef {
            id: "lora-1".into(),
            scale: 0.8,
        }],
        deadline_unix_ms: Some(1_700_000_000_000),
        controlnet: Some(ControlNetRef {
            name: "silhouette".into(),
            scale: 0.5,
        }),
        extra_controlnets: vec![ControlNetRef {
            name: "depth".into(),
            scale: 0.25,
        }],
        true_cfg: Some(TrueCfg {
            scale: 4.0,
            negative_prompt: "blurry".into(),
        }),
        preview_steps: vec![1, 3],
        strength: None,
        cache_threshold: Some(0.1),
        cache_method: Some(diffmesh_shared::wire::messages::StepCacheMethod::FirstBlock),
    }
}

fn inputs() -> PreparedInputs {
    PreparedInputs {
        image_key: Some("j1/prepared-image.rgb".into()),
        template_image_key: None,
        token_mask_key: Some("j1/token-mask.u8".into()),
        mask_ratio: 0.25,
        masked_tokens: 64,
        input_width: 64,
        input_height: 48,
        model_width: 64,
        model_height: 48,
        token_rows: 12,
        token_cols: 16,
        template_id: Some("tpl".into()),
        control_image_key: None,
        extra_control_image_keys: Vec::new(),
    }
}

fn job() -> DenoiseJob {
    DenoiseJob {
        job_id: "j1".into(),
        kind: JobKind::Edit,
        params: params(),
        inputs: inputs(),
        raw_image_key: Some("j1/image".into()),
        raw_mask_key: Some("j1/mask".into()),
        attempt: 1,
        template: Some(TemplateRef {
            template_id: "tpl".into(),
            prompt: "a blue background".into(),
            seed: 7,
            steps: 4,
            guidance_scale: 1.0,
            cache_key: "tpl-abc".into(),
        }),
    }
}

fn geometry() -> ModelGeometry {
    ModelGeometry {
        token_pixels: 4,
        resolution: Resolution::Scaled { max_pixels: 4096 },
        default_width: 64,
        default_height: 64,
    }
}

fn tensor(shape: Vec<i64>) -> WireTensor {
    let bytes = shape.iter().product::<i64>() as usize * 4;
    WireTensor::from_parts("f32", shape, vec![0; bytes]).expect("f32 is a wire type")
}

/// One encoded message of every type, and a step blob.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let running = RunningJob {
        job_id: "j1".into(),
        masked_tokens: 64,
        remaining_steps: 3,
        rows: 1,
        images: 2,
        control_s: 0.01,
    };
    let mut all = vec![
        seed(&SessionOpen {
            session: "j1-0".into(),
            job_id: "j1".into(),
            controlnet: "silhouette".into(),
            scale: 0.5,
            guidance_scale: 3.5,
            encoder_hidden_states: tensor(vec![1, 4, 8]),
            pooled_projections: Some(tensor(vec![1, 8])),
            img_ids: Some(tensor(vec![16, 3])),
            txt_ids: Some(tensor(vec![4, 3])),
            control: tensor(vec![1, 16, 4]),
            unet: None,
        }),
        seed(&SessionOpen {
            session: "j2-0".into(),
            job_id: "j2".into(),
            controlnet: "depth-xl".into(),
            scale: 0.5,
            guidance_scale: 5.0,
            encoder_hidden_states: tensor(vec![2, 4, 8]),
            pooled_projections: None,
            img_ids: None,
            txt_ids: None,
            control: tensor(vec![2, 3, 8, 8]),
            unet: Some(diffmesh_shared::wire::controlnet_service::UNetSession {
                text_embeds: Some(tensor(vec![2, 8])),
                time_ids: Some(tensor(vec![2, 6])),
            }),
        }),
        seed(&StepRequest {
            session: "j1-0".into(),
            hidden_states: tensor(vec![1, 16, 4]),
            timestep: tensor(vec![1]),
            guidance: Some(tensor(vec![1])),
        }),
        seed(&StepReply::Residuals {
            double: vec![tensor(vec![1, 16, 8])],
            single: vec![tensor(vec![1, 20, 8])],
            compute_ms: 1.5,
        }),
        seed(&PreprocessRequest {
            job_id: "j1".into(),
            kind: JobKind::Edit,
            image_key: Some("j1/image".into()),
            mask_key: Some("j1/mask".into()),
            params: params(),
            template_image: Some(TemplateImage {
                template_id: "tpl".into(),
                prepared: Some(PreparedTemplate {
                    key: "tpl/prepared".into(),
                    content_hash: "ab12".into(),
                }),
            }),
            control_image_key: Some("j1/control".into()),
            extra_control_image_keys: vec!["j1/control-1".into()],
            controlnets_listed: true,
            geometry: Some(geometry()),
        }),
        seed(&PreprocessReply::Prepared(inputs())),
        seed(&PreprocessReply::Invalid(FieldError::invalid(
            "mask", "no pixel",
        ))),
        seed(&PostprocessRequest {
            job: job(),
            output_keys: vec!["j1/out-0".into()],
            model_width: 64,
            model_height: 48,
        }),
        seed(&PostprocessReply::Done {
            png_keys: vec!["j1/result-0.png".into()],
        }),
        seed(&job()),
        seed(&QueuedJob {
            job: job(),
            place_by_ms: 1_700_000_000_000,
        }),
        seed(&SubmitReply::Overloaded {
            queue_depth: 3,
            retry_after_ms: 250,
        }),
        seed(&JobEvent::Preview {
            step: 1,
            total: 4,
            width: 2,
            height: 1,
            rgb: vec![0; 6],
        }),
        seed(&JobEvent::Captured {
            cache_key: "tpl-abc".into(),
            steps: 4,
            blocks: 2,
            bytes: 1024,
            quality: Some(diffmesh_shared::wire::templates::CacheQuality {
                box_ssim: 0.93,
                floor: 0.9,
                full_compute: false,
            }),
        }),
        seed(&Heartbeat {
            worker_id: "d1".into(),
            running: vec![running.clone()],
            queued: 1,
            waiting: vec![running],
            max_batch: 4,
            model: "tiny".into(),
            card: Some(ModelCard {
                id: "tiny".into(),
                family: "tiny".into(),
                pipeline: "FluxPipeline".into(),
                geometry: geometry(),
                features: ModelFeatures {
                    edit: true,
                    max_sequence_length: 16,
                    multi_controlnet: false,
                    step_cache: true,
                    first_block_cache: true,
                    ..Default::default()
                },
            }),
            draining: false,
            queue_capacity: 8,
            cached_templates: vec!["tpl".into()],
            cached_loras: vec!["lora-1".into()],
            controlnets: vec!["silhouette".into()],
            recent_steps: vec![StepSample {
                row_ratios: vec![0.25, 1.0],
                jobs: vec![StepJob {
                    mask_ratio: 0.25,
                    rows: 1,
                    cache_streams: 2,
                    control_s: 0.0,
                }],
                seconds: 0.02,
                block_plan: Some(BlockPlan {
                    full: 2,
                    cached: 10,
                    hidden: 4,
                    format: "prepared+hidden".into(),
                }),
            }],
            controlnet_step_s: Vec::new(),
            interval_ms: 500,
            ranks: 0,
            free_ranks: 0,
        }),
        seed(&CancelJob {
            job_id: "j1".into(),
        }),
        seed(&EvictTemplate {
            template_id: "tpl".into(),
            cache_key: "tpl-abc".into(),
        }),
        seed(&TemplateCaptured {
            worker_id: "d1".into(),
            cache_key: "tpl-abc".into(),
            bytes: 4096,
            model: "tiny".into(),
            format: "steps".into(),
            dtype: "bf16".into(),
            template_image_key: None,
        }),
        seed(&OutcomeQuery {
            job_id: "j1".into(),
            wanted: WantedEvent::Captured,
        }),
        seed(&CacheGet {
            key: "tpl-abc/s0".into(),
            ranged: true,
        }),
        seed(&CacheGetReply::Inline {
            tier: CacheTier::Memory,
            value: vec![1, 2, 3, 4],
        }),
        seed(&CachePut {
            key: "tpl-abc/s0".into(),
            value: Some(vec![9; 16]),
        }),
        seed(&CachePutReply::Stored { size: 16 }),
        seed(&CacheDelete {
            key: "tpl-abc/s0".into(),
        }),
        seed(&CacheDeleteReply::Deleted { existed: true }),
        seed(&CacheLocate {
            keys: vec!["tpl-abc/meta".into(), "tpl-abc/s0".into()],
        }),
        seed(&CacheLocateReply::Located {
            keys: vec![KeyLocation {
                key: "tpl-abc/s0".into(),
                tiers: vec![CacheTier::Disk, CacheTier::Cluster],
                size: Some(16),
            }],
        }),
        seed(&CachePrefetch {
            keys: vec!["tpl-abc/s1".into()],
        }),
        seed(&CachePrefetchReply::Scheduled { keys: 1 }),
        seed(&CacheRange {
            transfer: "t1".into(),
            offset: 0,
            len: 16,
        }),
        seed(&CacheStatsReply::default()),
        seed(&OpenReply::Opened),
        seed(&SessionClose {
            session: "j1-0".into(),
        }),
        seed(&ControlNetHeartbeat {
            worker_id: "c1".into(),
            served: vec!["silhouette".into()],
            served_unet: vec!["depth-xl".into()],
            resident: vec!["silhouette".into()],
            sessions: 1,
            queued: 0,
            draining: false,
            interval_ms: 500,
        }),
    ];
    let mut blob = vec![NAMES.len() as u8];
    blob.extend(pack_step(&[vec![1, 2, 3], vec![4, 5]]));
    all.push(("StepBlob".into(), blob));
    all
}
