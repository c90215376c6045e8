//! diffmesh shared crate: message types, NATS subjects, configuration, telemetry, errors.
pub mod blob_store;
pub mod cache_read;
pub mod cachestore;
pub mod config;
pub mod error;
pub mod health;
pub mod idempotency;
pub mod jetstream_layout;
pub mod job;
pub mod lora;
pub mod messages;
pub mod metrics;
pub mod nats;
pub mod reconnects;
pub mod reopening_watch;
pub mod serve;
pub mod shutdown;
pub mod subjects;
pub mod telemetry;
pub mod templates;
pub mod testing;
pub mod trace_context;
pub mod transient;
pub mod unanswered;

pub use config::CommonConfig;
pub use error::MeshError;
