//! Run one model component on inputs read from a safetensors file and write its outputs
//! (used by parity checks against diffusers and for debugging a checkpoint).
use clap::Parser;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(about = "Run one diffmesh model component on safetensors inputs")]
struct Args {
    /// A diffusers model directory, or the component folder itself.
    #[arg(long, env = "DIFFMESH_MODEL_DIR")]
    model_dir: PathBuf,
    /// Which component to run: `transformer` (Flux) or `vae` (AutoencoderKL).
    #[arg(long, value_parser = ["transformer", "vae"])]
    component: String,
    /// Input tensors by name (see the component's `cli_forward_*` docs).
    #[arg(long)]
    inputs: PathBuf,
    /// Where to write the output tensors.
    #[arg(long)]
    out: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.component.as_str() {
        // Flux transformer: inputs are the FluxInputs fields, output `sample`.
        "transformer" => {
            diffmesh_model::flux::cli_forward_transformer(&args.model_dir, &args.inputs, &args.out)?
        }

        // ---- VAE (owned by the VAE helper) ----
        "vae" => diffmesh_model::cli_forward_vae(&args.model_dir, &args.inputs, &args.out)?,

        other => anyhow::bail!("unknown component `{other}`"),
    }
    println!("wrote {}", args.out.display());
    Ok(())
}
