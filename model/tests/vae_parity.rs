//! AutoencoderKL parity with diffusers 0.42.1 on reduced configs with random weights, fp32 CPU:
//! posterior mean/logvar, decode, and the full forward within 1e-4; the LatentCodec scaling and
//! the `diffmesh-forward --component vae` entry point on the same fixtures.
mod py_fixture;

use diffmesh_model::components::LatentCodec;
use diffmesh_model::vae::AutoencoderKL;
use py_fixture::{generate, max_abs_diff, read_tensors};
use tch::{Device, Kind, Tensor};

const TOL: f64 = 1e-4;

#[test]
fn vae_matches_diffusers() {
    let dir = generate("gen_vae_scheduler.py", &["vae"], "parity-vae");
    let cases: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).expect("cases.json"))
            .expect("json");
    assert_eq!(cases.len(), 4);
    for name in &cases {
        let case_dir = dir.join(name);
        let vae = AutoencoderKL::load(&case_dir, Device::Cpu, Kind::Float).expect("load vae");
        let io = read_tensors(&case_dir.join("io.safetensors"));
        tch::no_grad(|| {
            let dist = vae.posterior(&io["sample"]).expect("encode");
            let errs = [
                ("latent_mean", max_abs_diff(&dist.mean, &io["latent_mean"])),
                (
                    "latent_logvar",
                    max_abs_diff(&dist.logvar, &io["latent_logvar"]),
                ),
                (
                    "decoded",
                    max_abs_diff(
                        &vae.decode_unscaled(&io["latent_mean"]).expect("decode"),
                        &io["decoded"],
                    ),
                ),
                (
                    "forward",
                    max_abs_diff(
                        &vae.forward(&io["sample"]).expect("forward"),
                        &io["forward"],
                    ),
                ),
            ];
            println!("{name}: {errs:?}");
            for (what, err) in errs {
                assert!(err <= TOL, "{name}: {what} max abs error {err} > {TOL}");
            }

            // LatentCodec applies (mean - shift) * scale and inverts it before decoding.
            let cfg = &vae.config;
            let shift = cfg.shift_factor.unwrap_or(0.0);
            let scaled = LatentCodec::encode(&vae, &io["sample"]).expect("codec encode");
            let want = (&io["latent_mean"] - shift) * cfg.scaling_factor;
            assert!(max_abs_diff(&scaled, &want) <= TOL, "{name}: codec scaling");
            let decoded = LatentCodec::decode(&vae, &scaled).expect("codec decode");
            assert!(
                max_abs_diff(&decoded, &io["decoded"]) <= TOL * 10.0,
                "{name}: codec decode"
            );
            assert_eq!(
                vae.downscale_factor(),
                1 << (cfg.block_out_channels.len() - 1)
            );
        });
    }

    // The CLI entry point on the first case.
    let case_dir = dir.join(&cases[0]);
    let out = case_dir.join("cli_out.safetensors");
    diffmesh_model::cli_forward_vae(&case_dir, &case_dir.join("io.safetensors"), &out)
        .expect("cli forward");
    let got = read_tensors(&out);
    let io = read_tensors(&case_dir.join("io.safetensors"));
    assert!(max_abs_diff(&got["latent_mean"], &io["latent_mean"]) <= TOL);
    assert!(max_abs_diff(&got["decoded"], &io["forward"]) <= TOL);
}

#[test]
fn vae_rejects_bad_inputs_and_configs() {
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let cfg = diffmesh_model::vae::AutoencoderKLConfig {
        block_out_channels: vec![32, 64],
        down_block_types: vec!["DownEncoderBlock2D".into(); 2],
        up_block_types: vec!["UpDecoderBlock2D".into(); 2],
        norm_num_groups: 8,
        ..Default::default()
    };
    let vae = AutoencoderKL::new(&vs.root(), cfg.clone()).expect("valid config");
    let err = vae
        .posterior(&Tensor::zeros([1, 4, 8, 8], (Kind::Float, Device::Cpu)))
        .unwrap_err();
    assert!(err.to_string().contains("images"), "{err}");
    let err = vae
        .decode_unscaled(&Tensor::zeros([1, 3, 8, 8], (Kind::Float, Device::Cpu)))
        .unwrap_err();
    assert!(err.to_string().contains("latents"), "{err}");

    let bad = diffmesh_model::vae::AutoencoderKLConfig {
        norm_num_groups: 5,
        ..cfg.clone()
    };
    assert!(AutoencoderKL::new(&vs.root(), bad)
        .unwrap_err()
        .to_string()
        .contains("norm_num_groups"));
    let bad = diffmesh_model::vae::AutoencoderKLConfig {
        up_block_types: vec!["AttnUpDecoderBlock2D".into(); 2],
        ..cfg
    };
    assert!(AutoencoderKL::new(&vs.root(), bad)
        .unwrap_err()
        .to_string()
        .contains("up_block_types"));
}
