//! The gateway's Prometheus metrics, and the one middleware that counts and times every API
//! request ([`count_requests`]).
use std::time::Instant;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::middleware::Next;
use actix_web::{web, ResponseError};
use diffmesh_shared::process::metrics::{
    counter_vec, histogram_vec, FailureCounter, Unit, LATENCY_BUCKETS_SECONDS,
};
use prometheus::{HistogramVec, IntCounterVec, Registry};

use crate::error::ApiError;

#[derive(Clone)]
pub struct GatewayMetrics {
    /// `diffmesh_gateway_requests_total{endpoint, status}`.
    pub requests: IntCounterVec,
    /// `diffmesh_gateway_request_duration_seconds{endpoint}`: end-to-end latency.
    pub request_duration: HistogramVec,
    /// `diffmesh_gateway_stage_duration_seconds{stage}`: store, codec_pre, submit, denoise, fetch.
    pub stage_duration: HistogramVec,
    /// `diffmesh_gateway_failures_total{reason}`.
    pub failures: FailureCounter,
    /// `diffmesh_gateway_recovered_outcomes_total{outcome}`: jobs whose terminal event (done,
    /// failed) or capture report (captured) was lost here and learned elsewhere: from the
    /// denoiser that ended them (`lost_events`) or, for a capture, the router's job record.
    pub recovered_outcomes: IntCounterVec,
    /// `diffmesh_gateway_deadlines_total{outcome}`: jobs that gave a `deadline_ms`, by whether
    /// their result was ready in time (`met`), after it (`late`), or never (`failed`; cancelled
    /// jobs are not counted). SLO attainment = met / all three.
    pub deadlines: IntCounterVec,
    /// `diffmesh_gateway_webhooks_total{outcome}`: webhook attempts this gateway made, by
    /// outcome (`delivered`, `failed_attempt`: to be retried, `gave_up`).
    pub webhooks: IntCounterVec,
}

impl GatewayMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            requests: counter_vec(
                registry,
                "gateway",
                "requests",
                "API requests by endpoint and HTTP status",
                &["endpoint", "status"],
            )?,
            request_duration: histogram_vec(
                registry,
                "gateway",
                "request_duration",
                Unit::Seconds,
                "End-to-end API request latency",
                &["endpoint"],
                LATENCY_BUCKETS_SECONDS,
            )?,
            stage_duration: histogram_vec(
                registry,
                "gateway",
                "stage_duration",
                Unit::Seconds,
                "Time spent in each stage of a job as seen by the gateway",
                &["stage"],
                LATENCY_BUCKETS_SECONDS,
            )?,
            failures: FailureCounter::register(registry, "gateway")?,
            recovered_outcomes: {
                let recovered = counter_vec(
                    registry,
                    "gateway",
                    "recovered_outcomes",
                    "Jobs whose terminal event or capture report was lost here, learned from the mesh",
                    &["outcome"],
                )?;
                for outcome in ["done", "failed", "captured"] {
                    recovered.with_label_values(&[outcome]);
                }
                recovered
            },
            deadlines: {
                let deadlines = counter_vec(
                    registry,
                    "gateway",
                    "deadlines",
                    "Jobs with a deadline_ms, by whether their result was ready in time",
                    &["outcome"],
                )?;
                for outcome in ["met", "late", "failed"] {
                    deadlines.with_label_values(&[outcome]);
                }
                deadlines
            },
            webhooks: {
                let webhooks = counter_vec(
                    registry,
                    "gateway",
                    "webhooks",
                    "Webhook attempts this gateway made, by outcome",
                    &["outcome"],
                )?;
                for outcome in ["delivered", "failed_attempt", "gave_up"] {
                    webhooks.with_label_values(&[outcome]);
                }
                webhooks
            },
        })
    }
}

/// What [`count_requests`] needs: the metrics, and the endpoint label of each route
/// (`routes::endpoints`).
pub struct RequestCounting {
    pub metrics: GatewayMetrics,
    pub endpoints: Vec<(Method, &'static str, &'static str)>,
}

/// Middleware (`actix_web::middleware::from_fn`): counts every request of a labelled route by
/// endpoint and status, times it, counts a failure by its `ApiError` reason and logs it (a
/// warning for server errors). Handlers only return `Result<HttpResponse, ApiError>`.
pub async fn count_requests(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let counting = req.app_data::<web::Data<RequestCounting>>().cloned();
    let method = req.method().clone();
    let start = Instant::now();
    let res = next.call(req).await?;
    let Some(counting) = counting else {
        return Ok(res);
    };
    // The route's pattern is known once routing has run: after the call.
    let endpoint = res.request().match_pattern().and_then(|pattern| {
        counting
            .endpoints
            .iter()
            .find(|(m, path, _)| *m == method && *path == pattern)
            .map(|(_, _, endpoint)| *endpoint)
    });
    let Some(endpoint) = endpoint else {
        return Ok(res);
    };
    let metrics = &counting.metrics;
    if let Some(err) = res
        .response()
        .error()
        .and_then(|e| e.as_error::<ApiError>())
    {
        metrics.failures.inc(err.reason());
        if err.status_code().is_server_error() {
            tracing::warn!(endpoint, error = %err, "request failed");
        } else {
            tracing::info!(endpoint, error = %err, "request rejected");
        }
    }
    metrics
        .requests
        .with_label_values(&[endpoint, res.status().as_str()])
        .inc();
    metrics
        .request_duration
        .with_label_values(&[endpoint])
        .observe(start.elapsed().as_secs_f64());
    Ok(res)
}
