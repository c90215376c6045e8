//! diffmesh-codec binary: parse flags, start telemetry, run until SIGTERM.
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "diffmesh-codec",
    about = "Image pre/post-processing for the diffmesh mesh"
)]
struct Cli {
    #[command(flatten)]
    codec: diffmesh_codec::CodecConfig,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let common = &cli.codec.common;
    let _telemetry = diffmesh_shared::process::telemetry::init_telemetry(
        "diffmesh-codec",
        common.otlp_endpoint.as_deref(),
        common.log_json,
    )?;
    let shutdown = diffmesh_shared::process::shutdown::on_signal();
    diffmesh_codec::run(cli.codec, shutdown).await?;
    Ok(())
}
