//! The gateway's API errors and their one mapping to HTTP status and JSON body
//! `{"error": {"message", "error_type", "field"}}`.
use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use diffmesh_shared::messages::{error_types, FieldError};
use diffmesh_shared::MeshError;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field is missing, malformed or out of range.
    #[error("{}: {}", .0.field, .0.message)]
    Invalid(FieldError),
    /// The body or one upload is larger than allowed.
    #[error("{field}: larger than the limit of {limit} bytes")]
    TooLarge { field: String, limit: usize },
    /// No worker can take the job now; the client should retry later.
    #[error("{message}")]
    Unavailable { message: String, retry_after_s: u64 },
    /// The job did not finish in time.
    #[error("{message}")]
    Timeout { message: String },
    /// The mesh ran the job and it failed (worker lost after retries, model error, ...).
    #[error("{message}")]
    JobFailed { message: String, error_type: String },
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("{0}")]
    Internal(String),
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        ApiError::Invalid(e)
    }
}

impl ApiError {
    /// Label for the failure counter.
    pub fn reason(&self) -> &'static str {
        match self {
            ApiError::Invalid(_) => "invalid_request",
            ApiError::TooLarge { .. } => "too_large",
            ApiError::Unavailable { .. } => "unavailable",
            ApiError::Timeout { .. } => "timeout",
            ApiError::JobFailed { .. } => "job_failed",
            ApiError::Mesh(e) => e.reason(),
            ApiError::Internal(_) => "internal",
        }
    }

    fn error_type(&self) -> &str {
        match self {
            ApiError::Invalid(e) => &e.error_type,
            ApiError::TooLarge { .. } => error_types::TOO_LARGE,
            ApiError::Unavailable { .. } => error_types::UNAVAILABLE,
            ApiError::Timeout { .. } => error_types::TIMEOUT,
            ApiError::JobFailed { error_type, .. } => error_type,
            ApiError::Mesh(MeshError::NoResponders { .. }) => error_types::UNAVAILABLE,
            ApiError::Mesh(MeshError::Timeout { .. }) => error_types::TIMEOUT,
            ApiError::Mesh(_) | ApiError::Internal(_) => error_types::INTERNAL,
        }
    }

    fn field(&self) -> Option<&str> {
        match self {
            ApiError::Invalid(e) => Some(&e.field),
            ApiError::TooLarge { field, .. } => Some(field),
            _ => None,
        }
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: String,
    error_type: &'a str,
    field: Option<&'a str>,
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Invalid(_) => StatusCode::BAD_REQUEST,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unavailable { .. } | ApiError::Mesh(MeshError::NoResponders { .. }) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Timeout { .. } | ApiError::Mesh(MeshError::Timeout { .. }) => {
                StatusCode::GATEWAY_TIMEOUT
            }
            // A failure reported by the mesh keeps its meaning: no capacity left is still a 503.
            ApiError::JobFailed { error_type, .. } => match error_type.as_str() {
                error_types::UNAVAILABLE | error_types::WORKER_LOST => {
                    StatusCode::SERVICE_UNAVAILABLE
                }
                error_types::TIMEOUT => StatusCode::GATEWAY_TIMEOUT,
                error_types::INVALID_REQUEST => StatusCode::BAD_REQUEST,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            ApiError::Mesh(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status_code());
        if let ApiError::Unavailable { retry_after_s, .. } = self {
            response.insert_header((header::RETRY_AFTER, retry_after_s.to_string()));
        }
        let message = match self {
            // Downstream services that are not running: say which, in words a client can act on.
            ApiError::Mesh(MeshError::NoResponders { subject }) => {
                format!("a backend service is not running (no responder on {subject}); retry later")
            }
            other => other.to_string(),
        };
        response.json(ErrorBody {
            error: ErrorDetail {
                message,
                error_type: self.error_type(),
                field: self.field(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::body::MessageBody;

    fn body_json(err: &ApiError) -> serde_json::Value {
        let body = err.error_response().into_body().try_into_bytes().unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    #[test]
    fn maps_status_and_body() {
        let e = ApiError::Invalid(FieldError::invalid("n", "must be between 1 and 4, got 9"));
        assert_eq!(e.status_code(), StatusCode::BAD_REQUEST);
        let v = body_json(&e);
        assert_eq!(v["error"]["field"], "n");
        assert_eq!(v["error"]["error_type"], error_types::INVALID_REQUEST);
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("between 1 and 4"));

        let e = ApiError::Unavailable {
            message: "no denoiser".into(),
            retry_after_s: 3,
        };
        let resp = e.error_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers().get(header::RETRY_AFTER).unwrap(), "3");
        assert_eq!(body_json(&e)["error"]["field"], serde_json::Value::Null);

        let e = ApiError::TooLarge {
            field: "image".into(),
            limit: 10,
        };
        assert_eq!(e.status_code(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(body_json(&e)["error"]["field"], "image");
    }
}
