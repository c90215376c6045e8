//! LoRA adapters on the denoiser (Katz §6): fetched from the mesh's LoRA store into a host-memory
//! cache while their job already steps on the base model (bounded asynchronous loading, see the
//! engine's `lora_steps`), then patched into the weights in place by the engine thread.
pub mod adapter;
pub mod metrics;
pub mod store;

pub use adapter::{adapter_from_bytes, LoraBlob};
pub use store::{LoadedLora, LoraFailure, LoraSlot, LoraStore};
