//! FLUX.1, SD 2.1 and SDXL pipelines on files, for comparing a checkpoint with diffusers outside the
//! mesh: `encode-prompt` (`FluxPipeline.encode_prompt`) and `generate` (`FluxPipeline`,
//! `FluxFillPipeline` or a Stable Diffusion (2.1, XL) pipeline from given latents, `output_type="pt"`).
use clap::{Args, Parser, Subcommand};
use diffmesh_model::device::{parse_device, parse_model_dtype};
use diffmesh_model::pipeline::cli::{encode_prompt_file, generate_file, GenerateFileArgs};
use diffmesh_model::tch::{Device, Kind};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(about = "FLUX.1 prompt encoding and pipelines on files")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args)]
struct Placement {
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
    /// f32, bf16, f16 or auto (every component's weights and activations).
    #[arg(long, default_value = "f32")]
    dtype: String,
}

impl Placement {
    fn kind(&self) -> anyhow::Result<Kind> {
        parse_model_dtype(&self.dtype, self.device)
            .map_err(|expected| anyhow::anyhow!("--dtype {}: expected {expected}", self.dtype))
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write `prompt_embeds` [P, N, D] and `pooled_prompt_embeds` [P, D'] of every line of FILE.
    EncodePrompt {
        /// A FLUX.1 diffusers directory (tokenizer, tokenizer_2, text_encoder, text_encoder_2).
        #[arg(long)]
        model_dir: PathBuf,
        /// One prompt a line; an empty line is the empty prompt.
        #[arg(long)]
        prompts: PathBuf,
        /// T5's padded length (diffusers: 512 unless told; FLUX.1-schnell is used with 256).
        #[arg(long, default_value_t = 512)]
        max_sequence_length: i64,
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        placement: Placement,
    },
    /// Write `image` [1, 3, H, W] in [0, 1] of one prompt from given packed latents.
    Generate {
        #[arg(long)]
        model_dir: PathBuf,
        #[arg(long)]
        prompt: String,
        #[arg(long)]
        height: i64,
        #[arg(long)]
        width: i64,
        #[arg(long)]
        steps: usize,
        /// Embedded guidance of guidance-distilled models (ignored by the others).
        #[arg(long, default_value_t = 3.5)]
        guidance_scale: f64,
        #[arg(long, default_value_t = 512)]
        max_sequence_length: i64,
        /// Safetensors with `latents` in diffusers' packed layout [1, N, 4C].
        #[arg(long)]
        latents: PathBuf,
        /// FluxFillPipeline: the image to repaint.
        #[arg(long)]
        image: Option<PathBuf>,
        /// FluxFillPipeline: white (>= 0.5) where the image is repainted.
        #[arg(long)]
        mask: Option<PathBuf>,
        /// SD and SDXL: the negative prompt (none: SDXL zeros where the checkpoint says so, SD encodes "").
        #[arg(long)]
        negative_prompt: Option<String>,
        /// SD and SDXL: euler, euler_a, dpmpp_2m, dpmpp_2m_karras or ddim on the checkpoint's training
        /// schedule (none: its own scheduler).
        #[arg(long)]
        scheduler: Option<String>,
        /// SD and SDXL: seeds the noise of ancestral steps.
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// SD and SDXL inpainting: how much of the schedule runs (diffusers' default).
        #[arg(long, default_value_t = 0.9999)]
        strength: f64,
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        placement: Placement,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::EncodePrompt {
            model_dir,
            prompts,
            max_sequence_length,
            out,
            placement,
        } => {
            let kind = placement.kind()?;
            encode_prompt_file(
                &model_dir,
                &prompts,
                max_sequence_length,
                &out,
                placement.device,
                kind,
            )?;
            println!("wrote {}", out.display());
        }
        Command::Generate {
            model_dir,
            prompt,
            height,
            width,
            steps,
            guidance_scale,
            max_sequence_length,
            latents,
            image,
            mask,
            negative_prompt,
            scheduler,
            seed,
            strength,
            out,
            placement,
        } => {
            let kind = placement.kind()?;
            if diffmesh_model::stable_diffusion::is_unet_pipeline_dir(&model_dir) {
                let request = diffmesh_model::stable_diffusion::SdRequest {
                    prompt,
                    negative_prompt,
                    height,
                    width,
                    steps,
                    guidance_scale,
                    scheduler,
                };
                diffmesh_model::stable_diffusion::generate_file(
                    &diffmesh_model::stable_diffusion::SdFileArgs {
                        model_dir,
                        request,
                        latents,
                        seed,
                        inpaint: match (image, mask) {
                            (Some(i), Some(m)) => Some((i, m, strength)),
                            (None, None) => None,
                            _ => anyhow::bail!("--image and --mask go together"),
                        },
                        out: out.clone(),
                        device: placement.device,
                        kind,
                    },
                )?;
                println!("wrote {}", out.display());
                return Ok(());
            }
            if scheduler.is_some() || negative_prompt.is_some() {
                anyhow::bail!("--scheduler and --negative-prompt are for SD and SDXL directories");
            }
            generate_file(&GenerateFileArgs {
                model_dir,
                prompt,
                height,
                width,
                steps,
                guidance_scale,
                max_sequence_length,
                latents,
                image,
                mask,
                out: out.clone(),
                device: placement.device,
                kind,
            })?;
            println!("wrote {}", out.display());
        }
    }
    Ok(())
}
