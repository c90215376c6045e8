//! Template activation caches on the denoiser (FlashPS): the local tier of whole caches in host
//! memory, the cachestore client that fills it and stores new captures, the loader thread
//! that streams one step's blocks into the engine while earlier blocks compute (through a
//! copy stream on a GPU), and the templates' own pixels held for their edits.
pub mod entry;
pub mod fetcher;
pub mod fused_decode;
pub mod gpu_copy;
pub mod layout;
pub mod loader;
pub mod pixels;
pub mod store;

pub use entry::{LocalTier, TemplateEntry};
pub use fetcher::{CacheFetcher, Fetched};
pub use gpu_copy::GpuCopy;
pub use layout::CacheLayout;
pub use loader::{KvLoader, LoadStats, StepKv, StreamedKv};
pub use pixels::TemplatePixels;
