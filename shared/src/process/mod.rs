//! What every service process sets up: the flags they share ([`config`]), logs and traces
//! ([`telemetry`]), `/healthz`, `/readyz` and `/metrics` ([`health`], [`metrics`]), the shutdown
//! signal ([`shutdown`]) and the actor system ([`actors`]).
pub mod actors;
pub mod config;
pub mod health;
pub mod metrics;
pub mod shutdown;
pub mod telemetry;
