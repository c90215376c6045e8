use clap::Parser;
use diffmesh_cachestore::{run, CachestoreConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = CachestoreConfig::parse();
    let _telemetry = diffmesh_shared::process::telemetry::init_telemetry(
        "diffmesh-cachestore",
        config.common.otlp_endpoint.as_deref(),
        config.common.log_json,
    )?;
    run(config, diffmesh_shared::process::shutdown::on_signal()).await?;
    Ok(())
}
