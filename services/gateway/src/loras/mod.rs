//! LoRA adapters registered once and named in image requests, so the denoisers apply them on
//! the one base model they serve (many adapters, one model): the upload's checks (`form`),
//! the upload streamed to disk (`spool`), the records and weights in JetStream (`store`), and the `loras` field of image requests
//! (`params`: reading, checks, and the lookup that each is registered). LoRAs are scoped per
//! API key as templates are. The endpoints are in the api layer (`api/loras.rs`).
pub mod form;
pub mod params;
pub mod spool;
pub mod store;
