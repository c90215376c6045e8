//! The Stable Diffusion loop stepped as states in batches (what an engine's continuous batching
//! does) on the reduced SD 2.1 directory of python/parity/gen_sd21_pipeline.py: three requests
//! that differ in everything a batch may mix (prompts, guided and unguided, the checkpoint's
//! DDIM and an ancestral Euler, step counts, a text-to-image and an inpainting request that
//! starts late, joining at different times) each end on the image the pipeline gives it alone;
//! a finished state, mixed sides and an early decode are refused naming `states`.
mod py_fixture;

use diffmesh_model::pipeline::cli::{read_image, read_mask};
use diffmesh_model::pipeline::noise::seeded_noise;
use diffmesh_model::stable_diffusion::inpaint::InpaintInputs;
use diffmesh_model::stable_diffusion::stepper::SdState;
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use py_fixture::{generate, max_abs_diff, read_tensors};
use tch::{Device, Kind, Tensor};

/// Request `id`'s noise at `step` (ancestral steps only).
fn noise(id: u64, step: usize, shape: &[i64]) -> diffmesh_model::Result<Tensor> {
    seeded_noise(id * 1000 + step as u64, shape, Device::Cpu, Kind::Float)
}

fn request(prompt: &str, steps: usize, guidance_scale: f64, scheduler: Option<&str>) -> SdRequest {
    SdRequest {
        prompt: prompt.into(),
        negative_prompt: Some("blurry".into()),
        height: 32,
        width: 32,
        steps,
        guidance_scale,
        scheduler: scheduler.map(String::from),
    }
}

#[test]
fn requests_stepped_in_batches_equal_each_alone() {
    let dir = generate("gen_sd21_pipeline.py", &[], "sd-stepper");
    // The plain inpainting directory: the text-to-image UNet with the inpainting pipeline.
    let pipe = SdPipeline::load(&dir.join("inpaint"), Device::Cpu, Kind::Float).unwrap();
    let latents = read_tensors(&dir.join("latents.safetensors"))["latents"].shallow_clone();
    let other_latents = seeded_noise(7, &latents.size(), Device::Cpu, Kind::Float).unwrap();
    let (image, mask) = (
        read_image(&dir.join("image.png")).unwrap(),
        read_mask(&dir.join("mask.png")).unwrap(),
    );
    let inputs = InpaintInputs {
        image: &image,
        mask: &mask,
        strength: 0.75,
    };
    let requests = [
        (request("a cat on a sofa", 4, 5.0, None), &latents, None),
        (
            request("a dog in the snow", 3, 1.0, Some("euler_a")),
            &other_latents,
            None,
        ),
        (
            request("a red hat", 4, 4.0, Some("euler")),
            &latents,
            Some(&inputs),
        ),
    ];
    let alone: Vec<Tensor> = requests
        .iter()
        .enumerate()
        .map(|(id, (req, latents, inpaint))| {
            let mut n = |step: usize, shape: &[i64]| noise(id as u64, step, shape);
            match inpaint {
                Some(inputs) => pipe.inpaint(req, inputs, latents, &mut n).unwrap(),
                None => pipe.generate(req, latents, &mut n).unwrap(),
            }
        })
        .collect();

    let mut states: Vec<SdState> = requests
        .iter()
        .map(|(req, latents, inpaint)| pipe.prepare(req, latents, *inpaint).unwrap())
        .collect();
    assert_eq!(
        states
            .iter()
            .map(|s| (s.rows(), s.next_step()))
            .collect::<Vec<_>>(),
        [(2, 0), (1, 0), (2, 1)],
        "rows and starting steps (strength 0.75 of 4 starts at step 1)"
    );
    // Request 1 joins after one step of the others; then every unfinished state steps together.
    let mut round = 0;
    while states.iter().any(|s| !s.done()) {
        let (ids, mut batch): (Vec<u64>, Vec<&mut SdState>) = states
            .iter_mut()
            .enumerate()
            .filter(|(id, s)| !s.done() && !(round == 0 && *id == 1))
            .map(|(id, s)| (id as u64, s))
            .unzip();
        pipe.step_batch(&mut batch, &mut |i, step, shape| noise(ids[i], step, shape))
            .unwrap();
        round += 1;
    }
    assert_eq!(round, 4, "rounds");
    for (id, (state, alone)) in states.iter().zip(&alone).enumerate() {
        let batched = pipe.decode(state).unwrap();
        let err = max_abs_diff(&batched, alone);
        let spread = (alone.max() - alone.min()).double_value(&[]);
        println!("request {id}: batched vs alone max abs err {err:.2e} (spread {spread:.2})");
        assert!(spread > 0.1, "request {id}: a flat image proves nothing");
        assert!(err <= 1e-4, "request {id}: {err}");
    }
    // The three images differ: the batch did not hand one request's rows to another.
    assert!(max_abs_diff(&alone[0], &alone[1]) > 1e-2);

    // Refusals name `states`.
    let done = &mut states[0];
    let err = pipe
        .step_batch(&mut [done], &mut |_, _, _| unreachable!())
        .unwrap_err()
        .to_string();
    assert!(err.contains("states"), "{err}");
    let bigger = seeded_noise(3, &[1, 4, 24, 16], Device::Cpu, Kind::Float).unwrap();
    let tall = request("a tall one", 2, 5.0, None);
    let tall = SdRequest { height: 48, ..tall };
    let mut a = pipe.prepare(&requests[0].0, &latents, None).unwrap();
    let mut b = pipe.prepare(&tall, &bigger, None).unwrap();
    let err = pipe.decode(&a).unwrap_err().to_string();
    assert!(err.contains("states"), "{err}");
    let err = pipe
        .step_batch(&mut [&mut a, &mut b], &mut |_, _, _| unreachable!())
        .unwrap_err()
        .to_string();
    assert!(err.contains("states") && err.contains("side"), "{err}");
}
