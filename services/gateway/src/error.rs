//! The gateway's API errors and their one mapping to HTTP status and JSON body in OpenAI's
//! shape, `{"error": {"message", "type", "param", "code"}}` (so the official SDKs' exceptions
//! carry them), plus the earlier `error_type` and `field` (the same values as `code` and
//! `param`) for clients written against them.
use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use diffmesh_shared::wire::messages::{error_types, FieldError};
use diffmesh_shared::MeshError;
use serde::Serialize;
use utoipa::ToSchema;

/// Seconds a client is told to wait before retrying a job the mesh could not serve for now
/// (`Retry-After` of a 503 job failure): about a heartbeat or two, time for a store or worker
/// to answer again or for the router to know of another placement.
const JOB_RETRY_AFTER_S: u64 = 2;

/// `error_type` values that only the gateway produces (the mesh's are in
/// `shared::wire::messages::error_types`).
pub mod gateway_error_types {
    /// Missing or unknown API key (HTTP 401).
    pub const AUTHENTICATION: &str = "authentication_error";
    /// No such job for this API key, or no such result (HTTP 404).
    pub const NOT_FOUND: &str = "not_found_error";
    /// The job's state does not allow the request (HTTP 409).
    pub const CONFLICT: &str = "conflict_error";
    /// An `Idempotency-Key` was reused with a different request (HTTP 422).
    pub const IDEMPOTENCY: &str = "idempotency_error";
    /// The key keeps as many templates or LoRAs, or bytes, as its quota allows (HTTP 429/413).
    pub const QUOTA: &str = "quota_exceeded";
    /// The mesh's storage for templates, LoRAs or caches is at its bound (HTTP 507).
    pub const STORAGE_FULL: &str = "storage_full";
}

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
    /// The router's admission queue is full (HTTP 429 with Retry-After).
    #[error("{message}")]
    Overloaded { message: String, retry_after_s: u64 },
    /// This API key is over its request-rate or concurrency limit (HTTP 429 with Retry-After).
    #[error("{message}")]
    RateLimited { message: String, retry_after_s: u64 },
    /// The key keeps as much as a storage quota allows (`quotas`): HTTP 429 for a count, 413
    /// (`too_large`) for bytes; `quota` names the flag.
    #[error("{message}")]
    QuotaExceeded {
        quota: &'static str,
        too_large: bool,
        message: String,
    },
    /// No API key, or an unknown one (HTTP 401).
    #[error("{message}")]
    Unauthorized { message: String },
    /// Nothing under this name for this API key (HTTP 404); `field` names the path parameter.
    #[error("{message}")]
    NotFound { field: String, message: String },
    /// The job's state does not allow this (HTTP 409), e.g. cancelling a finished job.
    #[error("{message}")]
    Conflict { message: String },
    /// The `Idempotency-Key` was used before with a different request (HTTP 422).
    #[error("{message}")]
    IdempotencyMismatch { message: String },
    /// The job was cancelled before it finished (HTTP 409).
    #[error("{message}")]
    Cancelled { message: String },
    /// The client closed the connection before its job finished; the job was cancelled. No
    /// one reads this answer: its 499 (nginx's "client closed request") is for logs and metrics.
    #[error("the client closed the connection before the job finished; it was cancelled")]
    ClientGone,
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
            ApiError::Overloaded { .. } => "overloaded",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::QuotaExceeded { .. } => "quota_exceeded",
            ApiError::Unauthorized { .. } => "unauthorized",
            ApiError::NotFound { .. } => "not_found",
            ApiError::Conflict { .. } => "conflict",
            ApiError::IdempotencyMismatch { .. } => "idempotency_mismatch",
            ApiError::Cancelled { .. } => "cancelled",
            ApiError::ClientGone => "client_closed",
            ApiError::Timeout { .. } => "timeout",
            ApiError::JobFailed { .. } => "job_failed",
            ApiError::Mesh(e) => e.reason(),
            ApiError::Internal(_) => "internal",
        }
    }

    /// The machine-readable `error_type` (also what a failed job's record keeps).
    pub fn error_type(&self) -> &str {
        match self {
            ApiError::Invalid(e) => &e.error_type,
            ApiError::TooLarge { .. } => error_types::TOO_LARGE,
            ApiError::Unavailable { .. } => error_types::UNAVAILABLE,
            ApiError::Overloaded { .. } | ApiError::RateLimited { .. } => error_types::RATE_LIMITED,
            ApiError::QuotaExceeded { .. } => gateway_error_types::QUOTA,
            ApiError::Unauthorized { .. } => gateway_error_types::AUTHENTICATION,
            ApiError::NotFound { .. } => gateway_error_types::NOT_FOUND,
            ApiError::Conflict { .. } => gateway_error_types::CONFLICT,
            ApiError::IdempotencyMismatch { .. } => gateway_error_types::IDEMPOTENCY,
            ApiError::Cancelled { .. } | ApiError::ClientGone => error_types::CANCELLED,
            ApiError::Timeout { .. } => error_types::TIMEOUT,
            ApiError::JobFailed { error_type, .. } => error_type,
            ApiError::Mesh(MeshError::NoResponders { .. }) => error_types::UNAVAILABLE,
            ApiError::Mesh(MeshError::Timeout { .. }) => error_types::TIMEOUT,
            ApiError::Mesh(MeshError::StoreFull { .. }) => gateway_error_types::STORAGE_FULL,
            ApiError::Mesh(_) | ApiError::Internal(_) => error_types::INTERNAL,
        }
    }

    fn field(&self) -> Option<&str> {
        match self {
            ApiError::Invalid(e) => Some(&e.field),
            ApiError::TooLarge { field, .. } | ApiError::NotFound { field, .. } => Some(field),
            ApiError::Unauthorized { .. } => Some("Authorization"),
            ApiError::IdempotencyMismatch { .. } => Some("Idempotency-Key"),
            _ => None,
        }
    }
}

/// Every error response: `{"error": {"message", "type", "param", "code", "error_type",
/// "field"}}`.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// What went wrong, in words a client can act on.
    pub message: String,
    /// OpenAI's coarse kind, from the status: `invalid_request_error` (400, 413, 422),
    /// `authentication_error` (401), `not_found_error` (404), `conflict_error` (409),
    /// `rate_limit_error` (429), `server_error` (5xx).
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field (or header, or path parameter) at fault, when one is.
    pub param: Option<String>,
    /// Machine-readable kind, e.g. `invalid_request_error`, `rate_limited`, `quota_exceeded`.
    pub code: String,
    /// The same as `code` (the name before OpenAI's shape).
    pub error_type: String,
    /// The same as `param` (the name before OpenAI's shape).
    pub field: Option<String>,
}

/// OpenAI's `type` of an error answered with `status`.
fn openai_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        429 => "rate_limit_error",
        500.. => "server_error",
        _ => "invalid_request_error",
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Invalid(_) => StatusCode::BAD_REQUEST,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unavailable { .. } | ApiError::Mesh(MeshError::NoResponders { .. }) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Overloaded { .. } | ApiError::RateLimited { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::QuotaExceeded { too_large, .. } => match too_large {
                true => StatusCode::PAYLOAD_TOO_LARGE,
                false => StatusCode::TOO_MANY_REQUESTS,
            },
            ApiError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Conflict { .. } | ApiError::Cancelled { .. } => StatusCode::CONFLICT,
            ApiError::IdempotencyMismatch { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::ClientGone => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
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
                error_types::TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
                error_types::RATE_LIMITED => StatusCode::TOO_MANY_REQUESTS,
                error_types::CANCELLED => StatusCode::CONFLICT,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            ApiError::Mesh(MeshError::StoreFull { .. }) => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::Mesh(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status_code());
        match self {
            ApiError::Unavailable { retry_after_s, .. }
            | ApiError::Overloaded { retry_after_s, .. }
            | ApiError::RateLimited { retry_after_s, .. } => {
                response.insert_header((header::RETRY_AFTER, retry_after_s.to_string()));
            }
            ApiError::Unauthorized { .. } => {
                response.insert_header((header::WWW_AUTHENTICATE, "Bearer realm=\"diffmesh\""));
            }
            // A job the mesh could not serve for now (a LoRA store or ControlNet worker that
            // did not answer, a lost worker): a 503 a client may retry, and when.
            ApiError::JobFailed { error_type, .. }
                if matches!(
                    error_type.as_str(),
                    error_types::UNAVAILABLE | error_types::WORKER_LOST
                ) =>
            {
                response.insert_header((header::RETRY_AFTER, JOB_RETRY_AFTER_S.to_string()));
            }
            _ => {}
        }
        let message = match self {
            // Downstream services that are not running: say which, in words a client can act on.
            ApiError::Mesh(MeshError::NoResponders { subject }) => {
                format!("a backend service is not running (no responder on {subject}); retry later")
            }
            other => other.to_string(),
        };
        let (code, param) = (self.error_type(), self.field().map(str::to_string));
        response.json(ErrorBody {
            error: ErrorDetail {
                message,
                kind: openai_type(self.status_code()).into(),
                param: param.clone(),
                code: code.to_string(),
                error_type: code.to_string(),
                field: param,
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
        // OpenAI's shape, what the SDK's BadRequestError reads.
        assert_eq!(v["error"]["param"], "n");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], error_types::INVALID_REQUEST);
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

    #[test]
    fn limits_and_auth_errors_say_when_and_what() {
        let e = ApiError::Overloaded {
            message: "queue full".into(),
            retry_after_s: 2,
        };
        let resp = e.error_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers().get(header::RETRY_AFTER).unwrap(), "2");
        assert_eq!(
            body_json(&e)["error"]["error_type"],
            error_types::RATE_LIMITED
        );
        assert_eq!(body_json(&e)["error"]["type"], "rate_limit_error");
        assert_eq!(body_json(&e)["error"]["code"], error_types::RATE_LIMITED);

        // A job the mesh could not serve for now: 503, retry later.
        let e = ApiError::JobFailed {
            message: "controlnet: no worker answered".into(),
            error_type: error_types::UNAVAILABLE.into(),
        };
        let resp = e.error_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(resp.headers().get(header::RETRY_AFTER).is_some());
        let e = ApiError::JobFailed {
            message: "model error".into(),
            error_type: error_types::INTERNAL.into(),
        };
        let resp = e.error_response();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(resp.headers().get(header::RETRY_AFTER).is_none());

        let e = ApiError::RateLimited {
            message: "slow down".into(),
            retry_after_s: 5,
        };
        let resp = e.error_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers().get(header::RETRY_AFTER).unwrap(), "5");

        let e = ApiError::Unauthorized {
            message: "missing API key".into(),
        };
        let resp = e.error_response();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert!(resp.headers().contains_key(header::WWW_AUTHENTICATE));
        let v = body_json(&e);
        assert_eq!(v["error"]["field"], "Authorization");
        assert_eq!(
            v["error"]["error_type"],
            gateway_error_types::AUTHENTICATION
        );

        let e = ApiError::NotFound {
            field: "id".into(),
            message: "no such job".into(),
        };
        assert_eq!(e.status_code(), StatusCode::NOT_FOUND);
        assert_eq!(body_json(&e)["error"]["field"], "id");
        let e = ApiError::IdempotencyMismatch {
            message: "different request".into(),
        };
        assert_eq!(e.status_code(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(body_json(&e)["error"]["field"], "Idempotency-Key");

        // A job the mesh reports cancelled is a 409, not a server error.
        let e = ApiError::JobFailed {
            message: "job cancelled".into(),
            error_type: error_types::CANCELLED.into(),
        };
        assert_eq!(e.status_code(), StatusCode::CONFLICT);
    }
}
