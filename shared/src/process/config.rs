//! Flags every service shares; flattened into each service's own clap struct.
//!
//! Conventions of every service's flags: each has an environment variable of the same name,
//! prefixed by the service (`DENOISER_`, `ROUTER_`, `GATEWAY_`, `CODEC_`, `CACHESTORE_`,
//! `CONTROLNET_`) except these shared ones; durations are written as humantime durations
//! (`500ms`, `2s`, `1m`: [`duration`]), sizes in bytes.
use std::net::SocketAddr;
use std::time::Duration;

/// Parse a flag's duration (`500ms`, `2s`, `1m 30s`; see `humantime::parse_duration`).
pub fn duration(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value).map_err(|e| format!("{e} (write e.g. 500ms, 2s, 1m)"))
}

/// Parse `--js-job-retention`: a duration of at least a day. A record must outlive what refers
/// to it: an idempotency key answers with its job for a day, and an async job may wait a day in
/// the durable queue before a router places it from its record.
pub fn job_retention(value: &str) -> Result<Duration, String> {
    let d = duration(value)?;
    if d < MIN_JOB_RETENTION {
        return Err(format!(
            "{value}: keep job records at least a day (idempotency keys and queued async jobs \
             refer to them that long)"
        ));
    }
    Ok(d)
}

/// The shortest `--js-job-retention`.
pub const MIN_JOB_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Common service flags (`#[command(flatten)]` this into a service's config).
#[derive(Debug, Clone, clap::Args)]
pub struct CommonConfig {
    /// NATS server URL(s), comma-separated.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Address of the small HTTP server for /healthz, /readyz and /metrics (port 0 = any free port).
    #[arg(long, env = "HEALTH_ADDR", default_value = "0.0.0.0:9090")]
    pub health_addr: SocketAddr,
    /// OTLP/gRPC collector endpoint for traces (e.g. http://otel-collector:4317); unset = no export.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, env = "LOG_JSON", default_value_t = false)]
    pub log_json: bool,
    /// How long to keep retrying the first NATS connection before giving up.
    #[arg(long, env = "NATS_CONNECT_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub nats_connect_timeout: Duration,
    /// Replicas of the mesh's JetStream buckets and streams (1 on a single server; 3 on a
    /// three-node cluster). Missing ones are created with this many at start-up and existing
    /// ones with fewer are scaled up (`jetstream_layout`).
    #[arg(long, env = "JS_REPLICAS", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..=5))]
    pub js_replicas: u8,
    /// Bytes the mesh's JetStream streams may take together, each its fixed share
    /// (`jetstream_layout`); 0: no byte bounds. Every server holding replicas reserves it
    /// against its `max_file_store`, so it must fit there (with the async-job queue's own bound).
    #[arg(long, env = "JS_MAX_BYTES", default_value_t = 8 * 1024 * 1024 * 1024)]
    pub js_max_bytes: u64,
    /// How long job records (`GET /v1/jobs/{id}`) are kept before the bucket drops them (at
    /// least a day); the services that write them (gateways, routers) set the bucket's age limit
    /// to it at start, so give them the same value. Result images live in the blob bucket for
    /// a day whatever this says.
    #[arg(long, env = "JS_JOB_RETENTION", default_value = "7days", value_parser = job_retention)]
    pub js_job_retention: Duration,
    /// NATS user of this service on a server with authorization (`nats::auth`: one user per
    /// service kind); unset: anonymous.
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,
    /// That user's password (environment only: NATS_PASSWORD; a password does not belong on a
    /// command line).
    #[arg(skip = std::env::var("NATS_PASSWORD").ok())]
    pub nats_password: Option<String>,
    /// CA certificate (PEM) the NATS server's certificate must be signed by; set, the
    /// connection must be TLS (`cargo xtask compose-secrets` makes one for `compose/`).
    #[arg(long, env = "NATS_CA_FILE")]
    pub nats_ca_file: Option<std::path::PathBuf>,
}

impl CommonConfig {
    /// Config for in-process tests: the given NATS URL, health server on a free local port.
    pub fn for_tests(nats_url: impl Into<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            health_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            otlp_endpoint: None,
            log_json: false,
            nats_connect_timeout: Duration::from_secs(10),
            js_replicas: 1,
            js_max_bytes: 1024 * 1024 * 1024,
            js_job_retention: crate::stores::jetstream_layout::JOBS.max_age,
            nats_user: None,
            nats_password: None,
            nats_ca_file: None,
        }
    }

    /// Connect to NATS as this service's user (anonymously when none is set) as `name`, over
    /// TLS checked against `--nats-ca-file` when one is given.
    pub async fn connect_nats(&self, name: &str) -> Result<async_nats::Client, crate::MeshError> {
        let security = crate::nats::NatsSecurity {
            credentials: self
                .nats_user
                .as_deref()
                .map(|user| (user, self.nats_password.as_deref().unwrap_or(""))),
            ca_file: self.nats_ca_file.as_deref(),
        };
        crate::nats::connect_as(&self.nats_url, name, self.nats_connect_timeout, security).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        common: CommonConfig,
    }

    #[test]
    fn flattens_and_parses() {
        let cli = Cli::try_parse_from([
            "svc",
            "--nats-url",
            "nats://n:4222",
            "--health-addr",
            "127.0.0.1:0",
            "--log-json",
        ])
        .unwrap();
        assert_eq!(cli.common.nats_url, "nats://n:4222");
        assert!(cli.common.log_json);
        assert_eq!(cli.common.health_addr.port(), 0);
        assert!(Cli::try_parse_from(["svc", "--health-addr", "not-an-addr"]).is_err());
        assert_eq!(cli.common.js_replicas, 1);
        let three = Cli::try_parse_from(["svc", "--js-replicas", "3"]).unwrap();
        assert_eq!(three.common.js_replicas, 3);
        // JetStream allows at most 5 replicas.
        let err = Cli::try_parse_from(["svc", "--js-replicas", "6"])
            .err()
            .unwrap();
        assert!(err.to_string().contains("--js-replicas"), "{err}");
        let slow = Cli::try_parse_from(["svc", "--nats-connect-timeout", "1m 30s"]).unwrap();
        assert_eq!(slow.common.nats_connect_timeout, Duration::from_secs(90));
        let err = Cli::try_parse_from(["svc", "--nats-connect-timeout", "30"])
            .err()
            .unwrap();
        assert!(err.to_string().contains("--nats-connect-timeout"), "{err}");
    }
}
