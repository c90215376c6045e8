//! Helpers of the engine tests ([`engine`]: the harness) and of the steered-generation tests: a
//! random tiny model with a random ControlNet, and steered jobs.
#![allow(dead_code)]
pub mod engine;

use diffmesh_denoiser::engine::EngineJob;
use diffmesh_model::tiny::controlnet_train::save_random_model_and_controlnet;
use diffmesh_shared::wire::controlnet::ControlNetRef;
use diffmesh_shared::wire::messages::DenoiseJob;
use std::path::Path;

/// A random tiny model in `dir` and a random ControlNet of it in `dir/controlnets/rand`.
pub fn write_model_and_controlnet(dir: &Path) {
    save_random_model_and_controlnet(dir, "rand").unwrap();
}

pub fn job(id: &str, controlnet: Option<&str>) -> DenoiseJob {
    let mut j = diffmesh_shared::testing::generation_job(id, "a red circle", 5, 3);
    j.params.controlnet = controlnet.map(|name| ControlNetRef {
        name: name.into(),
        scale: 1.0,
    });
    j
}

/// A left-half-white control image at the model resolution.
pub fn control_rgb() -> Vec<u8> {
    (0..64 * 64)
        .flat_map(|i| if i % 64 < 32 { [255u8; 3] } else { [0; 3] })
        .collect()
}

pub fn engine_job(j: DenoiseJob) -> EngineJob {
    let steered = j.params.controlnet.is_some();
    let mut e = EngineJob::new(j, None);
    e.control_rgb = steered.then(control_rgb).into_iter().collect();
    e
}

/// A codec stand-in on `client`: answers every post-processing request `Done` (PNG keys named
/// after the outputs), so a denoiser's jobs end without a real codec.
pub async fn stand_in_codec(client: &async_nats::Client) {
    use diffmesh_shared::wire::messages::{decode, encode, PostprocessReply, PostprocessRequest};
    use futures::StreamExt;
    let mut codec = client
        .subscribe(diffmesh_shared::wire::subjects::CODEC_POST)
        .await
        .unwrap();
    let c = client.clone();
    tokio::spawn(async move {
        while let Some(msg) = codec.next().await {
            let req: PostprocessRequest = decode(&msg.payload).unwrap();
            let reply = PostprocessReply::Done {
                png_keys: req.output_keys.iter().map(|k| format!("{k}.png")).collect(),
            };
            c.publish(msg.reply.unwrap(), encode(&reply).unwrap().into())
                .await
                .unwrap();
        }
    });
}
