//! Whole FLUX.1 pipelines against diffusers 0.42.1 (python/parity/gen_flux_pipelines.py): reduced
//! `FluxPipeline` and `FluxFillPipeline` directories with random weights, saved in the layout people
//! download, loaded by diffmesh's model-directory loader. Prompt embeddings (`encode_prompt`) match
//! within 1e-4 and the final images within 2e-3 (f32), by the functions `cargo xtask encode-prompt`
//! and `cargo xtask generate` run.
mod py_fixture;

use diffmesh_model::model_dir::LoadedModel;
use diffmesh_model::packing::{pack_latents, token_mask};
use diffmesh_model::pipeline::cli::{
    encode_prompt_file, generate_file, read_image, read_mask, GenerateFileArgs,
};
use diffmesh_model::pipeline::fill::{fill, FillInputs};
use diffmesh_model::pipeline::stepper::{DenoiseState, EditSpec, StepRequest};
use diffmesh_model::pipeline::{GenerateOptions, GenerationRequest};
use py_fixture::{generate, max_abs_diff, read_tensors};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::{Device, Kind};

/// One fixture for both tests (it trains a tokenizer and runs two pipelines).
fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| generate("gen_flux_pipelines.py", &[], "parity-flux-pipelines"))
}

const EMBED_TOL: f64 = 1e-4;
const IMAGE_TOL: f64 = 2e-3;

#[derive(serde::Deserialize)]
struct Cases {
    height: i64,
    width: i64,
    steps: usize,
    guidance_scale: f64,
    lengths: Vec<i64>,
    prompt: String,
    pipelines: Vec<String>,
}

fn cases(dir: &Path) -> Cases {
    serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).expect("cases"))
        .expect("cases.json")
}

fn generate_args(dir: &Path, cases: &Cases, name: &str, out: &Path) -> GenerateFileArgs {
    let fill = name == "fill";
    GenerateFileArgs {
        model_dir: dir.join(name),
        prompt: cases.prompt.clone(),
        height: cases.height,
        width: cases.width,
        steps: cases.steps,
        guidance_scale: cases.guidance_scale,
        max_sequence_length: cases.lengths[1],
        latents: dir.join("latents.safetensors"),
        image: fill.then(|| dir.join("image.png")),
        mask: fill.then(|| dir.join("mask.png")),
        out: out.to_path_buf(),
        device: Device::Cpu,
        kind: Kind::Float,
    }
}

#[test]
fn flux_pipelines_match_diffusers() {
    let dir = fixture();
    let cases = cases(dir);
    let scratch = tempfile::tempdir().expect("tempdir");
    for name in &cases.pipelines {
        let folder = dir.join(name);
        for n in &cases.lengths {
            let out = scratch
                .path()
                .join(format!("{name}_encode_{n}.safetensors"));
            encode_prompt_file(
                &folder,
                &dir.join("prompts.txt"),
                *n,
                &out,
                Device::Cpu,
                Kind::Float,
            )
            .expect("encode-prompt");
            let got = read_tensors(&out);
            let want = read_tensors(&folder.join(format!("expected/encode_{n}.safetensors")));
            for key in ["prompt_embeds", "pooled_prompt_embeds"] {
                assert_eq!(got[key].size(), want[key].size(), "{name} N={n} {key}");
                let err = max_abs_diff(&got[key], &want[key]);
                println!("{name} N={n} {key}: max abs error {err:.2e}");
                assert!(err <= EMBED_TOL, "{name} N={n} {key}: {err} > {EMBED_TOL}");
            }
        }

        let out = scratch.path().join(format!("{name}_image.safetensors"));
        generate_file(&generate_args(dir, &cases, name, &out)).expect("generate");
        let got = &read_tensors(&out)["image"];
        let want = &read_tensors(&folder.join("expected/image.safetensors"))["image"];
        assert_eq!(got.size(), want.size(), "{name} image shape");
        let err = max_abs_diff(got, want);
        let spread = want.std(true).double_value(&[]);
        println!("{name} image: max abs error {err:.2e} (image std {spread:.3})");
        assert!(
            spread > 0.01,
            "{name}: a flat reference would prove nothing"
        );
        assert!(err <= IMAGE_TOL, "{name} image: {err} > {IMAGE_TOL}");
    }
}

#[test]
fn flux_pipeline_inputs_are_checked() {
    let dir = fixture();
    let cases = cases(dir);
    let scratch = tempfile::tempdir().expect("tempdir");
    let out = scratch.path().join("out.safetensors");
    let error = |args: GenerateFileArgs| generate_file(&args).unwrap_err().to_string();

    // The Fill model needs its image and mask; the text-to-image model takes neither.
    let mut args = generate_args(dir, &cases, "fill", &out);
    args.mask = None;
    assert!(error(args).contains("image"));
    let mut args = generate_args(dir, &cases, "dev", &out);
    args.image = Some(dir.join("image.png"));
    args.mask = Some(dir.join("mask.png"));
    assert!(error(args).contains("FluxFillPipeline"));

    // diffusers' limit on T5's length, and latents that do not fit the image size.
    let mut args = generate_args(dir, &cases, "dev", &out);
    args.max_sequence_length = 513;
    assert!(error(args).contains("max_sequence_length"));
    let mut args = generate_args(dir, &cases, "dev", &out);
    args.height *= 2;
    assert!(error(args).contains("latents"));

    // A prompts file with no line at all is refused; one empty line is the empty prompt.
    let empty = scratch.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let err = encode_prompt_file(&dir.join("dev"), &empty, 16, &out, Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(err.contains("prompts"), "{err}");
    let blank = scratch.path().join("blank.txt");
    std::fs::write(&blank, "\n").unwrap();
    encode_prompt_file(&dir.join("dev"), &blank, 16, &out, Device::Cpu, Kind::Float)
        .expect("the empty prompt");
    assert_eq!(read_tensors(&out)["prompt_embeds"].size(), [1, 16, 32]);

    // Resident bytes: every weight of the transformer and the VAE, in the dtype loaded.
    let f32_model =
        diffmesh_model::model_dir::LoadedModel::load(&dir.join("dev"), Device::Cpu, Kind::Float)
            .expect("load dev");
    let bf16_model =
        diffmesh_model::model_dir::LoadedModel::load(&dir.join("dev"), Device::Cpu, Kind::BFloat16)
            .expect("load dev in bf16");
    let (f32_bytes, bf16_bytes) = (f32_model.resident_bytes(), bf16_model.resident_bytes());
    for (i, component) in ["transformer", "text_encoders", "vae"].iter().enumerate() {
        assert_eq!(f32_bytes[i].0, *component);
        assert!(f32_bytes[i].1 > 0, "{component}");
        assert_eq!(f32_bytes[i].1, 2 * bf16_bytes[i].1, "{component}");
    }
    assert_eq!(
        f32_bytes[0].1,
        checkpoint_bytes(&dir.join("dev/transformer"))
    );
    assert_eq!(f32_bytes[2].1, checkpoint_bytes(&dir.join("dev/vae")));

    // A FLUX.1 directory missing its T5 names what is missing.
    let partial = scratch.path().join("partial");
    copy_dir(&dir.join("dev"), &partial);
    let index_path = partial.join("model_index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["text_encoder_2"] = serde_json::json!([null, null]);
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = diffmesh_model::model_dir::LoadedModel::load(&partial, Device::Cpu, Kind::Float)
        .err()
        .expect("a FLUX.1 directory without T5")
        .to_string();
    assert!(err.contains("text_encoder_2 (T5EncoderModel)"), "{err}");
}

/// Bytes of every tensor in a component folder's safetensors files.
fn checkpoint_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for path in diffmesh_model::weights::checkpoint_files(dir).unwrap() {
        let file = diffmesh_model::safetensors_file::SafetensorsFile::open(&path).unwrap();
        for entry in file.entries().values() {
            let n: i64 = entry.shape.iter().product();
            total += n as u64 * entry.kind.elt_size_in_bytes() as u64;
        }
    }
    total
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The engine's stepper on the Fill model. An edit repainting every token is `FluxFillPipeline`
/// with the whole image masked (same seed); with the fixture's mask, its unmasked tokens end on
/// the template's latents (the edit blend) and its masked ones are repainted.
#[test]
fn the_stepper_runs_fill_edits() {
    let dir = fixture();
    let cases = cases(dir);
    let model = LoadedModel::load(&dir.join("fill"), Device::Cpu, Kind::Float).expect("fill");
    let p = model.pipeline();
    let image = read_image(&dir.join("image.png")).unwrap();
    let (h, w) = (cases.height, cases.width);
    let unit = 2 * p.codec.downscale_factor();
    let tokens = (h / unit) * (w / unit);
    let run = |mask: &tch::Tensor| {
        let req = StepRequest {
            prompt: cases.prompt.clone(),
            seed: 11,
            height: h,
            width: w,
            steps: cases.steps,
            guidance_scale: cases.guidance_scale,
            edit: Some(EditSpec {
                template: image.shallow_clone(),
                token_mask: mask.shallow_clone(),
                strength: 1.0,
                template_seed: None,
            }),
            control: None,
            true_cfg: None,
            cache_threshold: None,
            cache_method: Default::default(),
        };
        let mut state = DenoiseState::new(&p, &req).expect("a Fill edit");
        while !state.is_done() {
            state.step(&p).unwrap();
        }
        (state.latents().shallow_clone(), state.decode(&p).unwrap())
    };

    let everything = tch::Tensor::ones([tokens], (Kind::Bool, Device::Cpu));
    let (_, stepped) = run(&everything);
    let requests = [GenerationRequest {
        prompt: cases.prompt.clone(),
        seed: 11,
    }];
    let opts = GenerateOptions {
        height: h,
        width: w,
        steps: cases.steps,
        guidance_scale: cases.guidance_scale,
        ..GenerateOptions::default()
    };
    let masks = tch::Tensor::ones([1, 1, h, w], (Kind::Float, Device::Cpu));
    let inputs = FillInputs {
        requests: &requests,
        images: &image,
        masks: &masks,
    };
    let piped = fill(&p, &inputs, &opts, None, None).unwrap().images;
    let err = max_abs_diff(&stepped, &piped);
    println!("fill stepper vs pipeline, whole image masked: max abs error {err:.2e}");
    assert!(err <= 1e-5, "{err}");

    let partial = token_mask(&read_mask(&dir.join("mask.png")).unwrap(), unit)
        .unwrap()
        .f_view([-1])
        .unwrap();
    let repainted = partial.sum(Kind::Int64).int64_value(&[]);
    assert!(
        0 < repainted && repainted < tokens,
        "{repainted} of {tokens}"
    );
    let (latents, _) = run(&partial);
    let template = pack_latents(&p.codec.encode(&image).unwrap()).unwrap();
    let keep = partial.logical_not().nonzero().view([-1]);
    let kept = max_abs_diff(
        &latents.index_select(1, &keep),
        &template.index_select(1, &keep),
    );
    assert!(kept <= 1e-5, "unmasked tokens left the template: {kept}");
    let moved = max_abs_diff(
        &latents.index_select(1, &partial.nonzero().view([-1])),
        &template.index_select(1, &partial.nonzero().view([-1])),
    );
    assert!(
        moved > 1e-2,
        "the masked tokens were not repainted: {moved}"
    );
}
