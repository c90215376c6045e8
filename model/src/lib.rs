//! diffmesh model core: diffusion model code written with tch (libtorch).
//!
//! Laid out like HuggingFace diffusers so real checkpoints load by key name.
pub mod autocast;
pub mod bench_inputs;
pub mod bench_worker;
pub mod components;
pub mod controlnets;
pub mod device;
pub mod error;
pub mod flux;
pub mod host_tensor;
pub mod lora;
pub mod model_dir;
pub mod noise_scheduler;
pub mod packing;
pub mod pipeline;
pub mod preview;
pub mod quality;
pub mod safetensors_file;
pub mod schedulers;
pub mod stable_diffusion;
pub mod text;
pub mod tiny;
pub mod unet;
pub mod vae;
pub mod weights;

pub use error::{ModelError, Result};
pub use tch;
pub use vae::cli_forward_vae;
