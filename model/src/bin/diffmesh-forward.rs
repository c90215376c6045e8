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
    /// Which component to run: `transformer` (Flux), `unet` (UNet2DConditionModel),
    /// `controlnet` (a UNet's ControlNetModel: residuals) or `vae` (AutoencoderKL).
    #[arg(long, value_parser = ["transformer", "unet", "controlnet", "vae"])]
    component: String,
    /// Input tensors by name (see the component's `cli_forward_*` docs).
    #[arg(long)]
    inputs: PathBuf,
    /// Where to write the output tensors.
    #[arg(long)]
    out: PathBuf,
    /// Split the transformer's forward over this many CPU ranks (threads; GF-DiT's sequence
    /// parallelism); 1: the plain forward.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// How attention is split over the ranks: `ulysses` (heads must divide) or `ring`.
    #[arg(long, default_value = "ulysses")]
    sp: diffmesh_model::flux::sequence_parallel::SequenceParallel,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.ranks > 1 && args.component != "transformer" {
        anyhow::bail!("--ranks splits the transformer only");
    }
    match args.component.as_str() {
        // Flux transformer: inputs are the FluxInputs fields, output `sample`.
        "transformer" if args.ranks > 1 => {
            diffmesh_model::flux::sequence_parallel::cli_forward_transformer_split(
                &args.model_dir,
                &args.inputs,
                &args.out,
                args.ranks,
                args.sp,
            )?
        }
        "transformer" => {
            diffmesh_model::flux::cli_forward_transformer(&args.model_dir, &args.inputs, &args.out)?
        }

        // UNet2DConditionModel (SD2.x, SDXL): inputs are its forward's argument names.
        "unet" => diffmesh_model::unet::cli_forward_unet(&args.model_dir, &args.inputs, &args.out)?,
        "controlnet" => diffmesh_model::unet::controlnet::cli_forward_controlnet(
            &args.model_dir,
            &args.inputs,
            &args.out,
        )?,

        // ---- VAE (owned by the VAE helper) ----
        "vae" => diffmesh_model::cli_forward_vae(&args.model_dir, &args.inputs, &args.out)?,

        other => anyhow::bail!("unknown component `{other}`"),
    }
    println!("wrote {}", args.out.display());
    Ok(())
}
