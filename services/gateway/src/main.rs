//! diffmesh-gateway binary: parse flags, start telemetry, serve until SIGTERM.
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "diffmesh-gateway",
    about = "OpenAI-images-compatible HTTP API of diffmesh"
)]
struct Cli {
    #[command(flatten)]
    gateway: diffmesh_gateway::GatewayConfig,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let common = &cli.gateway.common;
    let _telemetry = diffmesh_shared::process::telemetry::init_telemetry(
        "diffmesh-gateway",
        common.otlp_endpoint.as_deref(),
        common.log_json,
    )?;
    let shutdown = diffmesh_shared::process::shutdown::on_signal();
    diffmesh_gateway::run(cli.gateway, shutdown).await?;
    Ok(())
}
