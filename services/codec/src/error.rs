//! Codec errors: a bad input (answered as `Invalid`, becomes a 4xx at the gateway) or a
//! failure of the mesh or of the codec itself (answered as `Failed`).
use diffmesh_shared::wire::messages::FieldError;
use diffmesh_shared::MeshError;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("{}: {}", .0.field, .0.message)]
    Invalid(FieldError),
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("encoding PNG failed: {0}")]
    Encode(#[from] image::ImageError),
    #[error("bad request from {sender}: {message}")]
    BadMessage {
        sender: &'static str,
        message: String,
    },
    #[error("image work panicked: {0}")]
    WorkPanicked(String),
    #[error("the request did not finish within {0:?}")]
    Timeout(std::time::Duration),
    #[error("invalid codec configuration: {0}")]
    Config(String),
    #[error("health server: {0}")]
    Health(#[from] std::io::Error),
    #[error("metrics registration: {0}")]
    Metrics(#[from] prometheus::Error),
}

impl From<FieldError> for CodecError {
    fn from(e: FieldError) -> Self {
        CodecError::Invalid(e)
    }
}

impl CodecError {
    /// Label for the failure counter.
    pub fn reason(&self) -> &'static str {
        match self {
            CodecError::Invalid(_) => "invalid_input",
            CodecError::Mesh(e) => e.reason(),
            CodecError::Encode(_) => "encode",
            CodecError::BadMessage { .. } => "bad_message",
            CodecError::WorkPanicked(_) => "panic",
            CodecError::Timeout(_) => "timeout",
            CodecError::Config(_) => "config",
            CodecError::Health(_) | CodecError::Metrics(_) => "startup",
        }
    }
}
