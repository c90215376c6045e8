//! One error type for the model layer.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("io error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid json in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// Strict loading: every missing, mis-shaped (and, where asked, unexpected) key is listed.
    #[error("weights in {dir} do not match the model:\n{report}")]
    Weights { dir: PathBuf, report: String },
    #[error("unsupported component `{component}` of class `{class}`: {reason}")]
    Unsupported {
        component: String,
        class: String,
        reason: String,
    },
    #[error("invalid input `{field}`: {reason}")]
    Input { field: String, reason: String },
    #[error("invalid config `{field}`: {reason}")]
    Config { field: String, reason: String },
}

impl ModelError {
    pub fn input(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Input {
            field: field.into(),
            reason: reason.into(),
        }
    }
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Read and parse a JSON file, naming the file on error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}
