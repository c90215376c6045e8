//! Loading the model a denoiser serves, by family.
use crate::{model, unet_engine, DenoiserConfig, DenoiserError};
use diffmesh_model::tch::{Device, Kind};
use std::path::Path;

/// The model a denoiser serves: a FLUX.1-layout model (or the tiny one) on the Flux engine, or
/// a UNet pipeline (SD 2.x, SDXL) on the UNet engine.
pub(crate) enum Loaded {
    Flux(Box<model::EngineModel>),
    Unet(Box<unet_engine::UnetModel>),
}

/// Load the model in `dir` (off the runtime), with its elastic ranks where configured.
pub(crate) async fn load_model(
    config: &DenoiserConfig,
    dir: &Path,
    device: Device,
    kind: Kind,
    model_id: &str,
) -> Result<Loaded, DenoiserError> {
    let load_dir = dir.to_path_buf();
    let id = model_id.to_string();
    let (size, max_model_pixels) = (config.default_resolution, config.max_model_pixels);
    let controlnet_dir = config.controlnet_dir.clone();
    let thread =
        |e: tokio::task::JoinError| DenoiserError::Thread(std::io::Error::other(e.to_string()));
    let model_error = |source| DenoiserError::Model {
        dir: dir.to_path_buf(),
        source,
    };
    if diffmesh_model::stable_diffusion::is_unet_pipeline_dir(dir) {
        // What only the Flux engine serves is refused by flag, not ignored.
        if config.ranks > 1 {
            return Err(DenoiserError::Flag {
                flag: "ranks",
                value: config.ranks.to_string(),
                expected: "unset for a UNet model (SD 2.x, SDXL)",
            });
        }
        let model = tokio::task::spawn_blocking(move || {
            unet_engine::UnetModel::load(&load_dir, device, kind, id, size).map(|mut m| {
                m.controlnet_dir = controlnet_dir;
                m
            })
        })
        .await
        .map_err(thread)?
        .map_err(model_error)?;
        tracing::info!(model = %model_id, dir = %dir.display(), ?device, ?kind, family = %model.card.family, "UNet model loaded");
        return Ok(Loaded::Unet(Box::new(model)));
    }
    let mut model = tokio::task::spawn_blocking(move || {
        model::EngineModel::load(&load_dir, device, kind, id, size).map(|mut m| {
            m.controlnet_dir = controlnet_dir;
            m.limit_model_pixels(max_model_pixels);
            m
        })
    })
    .await
    .map_err(thread)?
    .map_err(model_error)?;
    tracing::info!(model = %model_id, dir = %dir.display(), ?device, ?kind, "model loaded");
    if let Some(settings) = config.elastic_settings(model.card.geometry.default_width)? {
        let ranks_dir = dir.to_path_buf();
        model = tokio::task::spawn_blocking(move || {
            model.start_ranks(&ranks_dir, &settings).map(|()| model)
        })
        .await
        .map_err(thread)?
        .map_err(DenoiserError::Ranks)?;
    }
    Ok(Loaded::Flux(Box::new(model)))
}
