//! One error enum for the scheduling layer; every variant names the field or file at fault.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Parse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("invalid JSON in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid `{field}`: {message}")]
    InvalidField { field: String, message: String },
    #[error("cannot fit {what}: {message}")]
    Fit { what: String, message: String },
    #[error("unknown policy `{0}` (known: round-robin, request-count, token-count, mask-aware, mask-aware-marginal, mask-aware-deferring, flashps-greedy)")]
    UnknownPolicy(String),
}

impl SchedError {
    pub fn field(field: &str, message: impl Into<String>) -> Self {
        SchedError::InvalidField {
            field: field.to_string(),
            message: message.into(),
        }
    }
}
