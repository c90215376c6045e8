use clap::Parser;
use diffmesh_controlnet::{run, WorkerConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = WorkerConfig::parse();
    let _telemetry = diffmesh_shared::process::telemetry::init_telemetry(
        "diffmesh-controlnet",
        config.common.otlp_endpoint.as_deref(),
        config.common.log_json,
    )?;
    run(config, diffmesh_shared::process::shutdown::on_signal()).await?;
    Ok(())
}
