//! Train (default) or evaluate the tiny default model. `cargo xtask train-tiny` calls this.
//!
//! diffmesh-train-tiny --out weights/tiny   # the shipped weights (53 min on an AMX CPU)
//! diffmesh-train-tiny eval --model-dir weights/tiny --untrained-seed 0 --report weights/tiny
//! diffmesh-train-tiny lora --model-dir weights/tiny --out weights/tiny-loras/outline.safetensors
//! diffmesh-train-tiny controlnet --model-dir weights/tiny --out weights/tiny-controlnets/silhouette
//! diffmesh-train-tiny unet --text-from weights/tiny --out weights/tiny-unet
//! diffmesh-train-tiny unet-eval --model-dir weights/tiny-unet --report weights/tiny-unet
use clap::{Parser, Subcommand};
use diffmesh_model::tiny::{
    controlnet_eval, controlnet_train, eval, lora_train, train, unet_eval, unet_train,
};

#[derive(Parser, Debug)]
#[command(
    about = "Train or evaluate diffmesh's tiny Flux-architecture model",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    train: train::TrainArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train from scratch (the default when no subcommand is given).
    Train(train::TrainArgs),
    /// Generate the 100 held-out prompts and check the images; prints a JSON line last.
    Eval(eval::EvalArgs),
    /// Train a LoRA of a trained model in the "outline" style (hollow shapes); prints a JSON
    /// line last.
    Lora(lora_train::LoraTrainArgs),
    /// Train the "silhouette" ControlNet of a trained model (control image: the object's
    /// silhouette); prints a JSON line last.
    Controlnet(controlnet_train::ControlNetTrainArgs),
    /// Measure the silhouette ControlNet: overlap of the drawn object with the silhouette, with
    /// and without it, on held-out scenes; prints a JSON line last.
    ControlnetEval(controlnet_eval::ControlNetEvalArgs),
    /// Train the tiny UNet (an SD pipeline over the tiny model's text encoder and pixel
    /// codec); prints a JSON line last.
    Unet(unet_train::UNetTrainArgs),
    /// Evaluate the tiny UNet: held-out accuracy, and mask-aware edits against full compute;
    /// prints a JSON line last.
    UnetEval(unet_eval::UNetEvalArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Eval(args)) => {
            let summary = eval::run(&args)?;
            println!("{}", serde_json::to_string(&summary)?);
        }
        Some(Command::Lora(args)) => {
            println!(
                "{}",
                serde_json::to_string(&lora_train::train_lora(&args)?)?
            );
        }
        Some(Command::Controlnet(args)) => {
            println!(
                "{}",
                serde_json::to_string(&controlnet_train::train_controlnet(&args)?)?
            );
        }
        Some(Command::ControlnetEval(args)) => {
            println!("{}", serde_json::to_string(&controlnet_eval::run(&args)?)?);
        }
        Some(Command::Unet(args)) => {
            println!(
                "{}",
                serde_json::to_string(&unet_train::train_unet(&args)?)?
            );
        }
        Some(Command::UnetEval(args)) => {
            println!("{}", serde_json::to_string(&unet_eval::run_eval(&args)?)?);
        }
        Some(Command::Train(args)) => report(train::train(&args)?)?,
        None => report(train::train(&cli.train)?)?,
    }
    Ok(())
}

fn report(summary: train::TrainSummary) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}
