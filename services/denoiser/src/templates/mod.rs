//! Template activation caches on the denoiser (FlashPS): the local tier of whole caches in host
//! memory, the cachestore client that fills it and stores new captures, and the loader thread
//! that streams one step's blocks into the engine while earlier blocks compute.
pub mod entry;
pub mod loader;
pub mod store;

pub use entry::{LocalTier, TemplateEntry};
pub use loader::{KvLoader, LoadStats, StreamedKv};
