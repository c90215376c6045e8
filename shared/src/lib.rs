//! diffmesh shared crate: what the services have in common, grouped by what it is:
//! - [`wire`]: the contract between services (subjects, messages, formats);
//! - [`nats`]: NATS plumbing (connect, request/reply, serving, trace context);
//! - [`stores`]: durable state in JetStream (records, blobs, the bucket table);
//! - [`process`]: what every service process sets up (flags, telemetry, health, actors);
//! - [`error`]: the mesh layer's error type;
//! - `testing` (feature `testing`): the test fixtures (a real `nats-server`, sample jobs).
pub mod error;
pub mod nats;
pub mod process;
pub mod stores;
pub mod wire;

#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use error::{panic_message, MeshError};
pub use process::config::CommonConfig;
