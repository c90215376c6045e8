//! The Stable Diffusion loop stepped as states in batches (what an engine's continuous batching
//! does) on the reduced SD 2.1 directory of python/parity/gen_sd21_pipeline.py: three requests
//! that differ in everything a batch may mix (prompts, guided and unguided, the checkpoint's
//! DDIM and an ancestral Euler, step counts, a text-to-image and an inpainting request that
//! starts late, joining at different times) each end on the image the pipeline gives it alone;
//! a finished state, mixed sides and an early decode are refused naming `states`. Templates:
//! a capture changes nothing; an edit at mask 1.0 is the full inpainting; edits with different
//! masks and prompts batched equal each alone; outside its mask an edit's latents are the
//! capture's exactly; another template's cache moves the result; edits of another schedule,
//! strength or guidance are refused naming the field.
mod py_fixture;

use diffmesh_model::pipeline::cli::{read_image, read_mask};
use diffmesh_model::pipeline::noise::seeded_noise;
use diffmesh_model::stable_diffusion::inpaint::InpaintInputs;
use diffmesh_model::stable_diffusion::stepper::SdState;
use diffmesh_model::stable_diffusion::template::SdTemplate;
use diffmesh_model::stable_diffusion::template::TemplateSteps;
use diffmesh_model::stable_diffusion::{SdPipeline, SdRequest};
use diffmesh_model::unet::masked::UNetTemplateCache;
use py_fixture::{generate, max_abs_diff, read_tensors};
use std::sync::{Arc, Mutex};
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
            .filter(|(id, s)| !(s.done() || round == 0 && *id == 1))
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

/// Runs states to the end, all in one batch each round.
fn run_together(pipe: &SdPipeline, states: &mut [&mut SdState]) {
    while states.iter().any(|s| !s.done()) {
        let mut batch: Vec<&mut SdState> = states
            .iter_mut()
            .filter(|s| !s.done())
            .map(|s| &mut **s)
            .collect();
        pipe.step_batch(&mut batch, &mut |_, _, _| {
            unreachable!("DDIM draws no noise")
        })
        .unwrap();
    }
}

/// `own` inside the latent mask of `mask` (`[1, 1, H, W]`), `template` outside.
fn mixed_latents(template: &Tensor, own: &Tensor, mask: &Tensor) -> Tensor {
    let s = template.size();
    let m = mask
        .ge(0.5)
        .to_kind(Kind::Float)
        .upsample_nearest2d([s[2], s[3]], None, None);
    own * &m + template * (1.0 - &m)
}

#[test]
fn template_captures_and_mask_aware_edits() {
    let dir = generate("gen_sd21_pipeline.py", &[], "sd-stepper-edits");
    let pipe = SdPipeline::load(&dir.join("inpaint"), Device::Cpu, Kind::Float).unwrap();
    let latents = read_tensors(&dir.join("latents.safetensors"))["latents"].shallow_clone();
    let image = read_image(&dir.join("image.png")).unwrap();
    let opts = (Kind::Float, Device::Cpu);
    let template_request = request("a cat on a sofa", 4, 5.0, None);
    let capture = |prompt: &str| {
        let req = SdRequest {
            prompt: prompt.into(),
            ..template_request.clone()
        };
        let mut state = pipe.prepare_capture(&req, &latents, &image, 0.75).unwrap();
        run_together(&pipe, &mut [&mut state]);
        let captured = pipe.decode(&state).unwrap();
        let x = state.latents().shallow_clone();
        (captured, x, Arc::new(state.into_template().unwrap()))
    };
    let (captured, template_x, template) = capture(&template_request.prompt);
    let (_, _, other_template) = capture("a bowl of soup");
    // Capturing changes nothing: the inpainting that repaints nothing.
    let nothing = Tensor::zeros([1, 1, 32, 32], opts);
    let plain = pipe
        .inpaint(
            &template_request,
            &InpaintInputs {
                image: &image,
                mask: &nothing,
                strength: 0.75,
            },
            &latents,
            &mut |_, _| unreachable!(),
        )
        .unwrap();
    assert_eq!(max_abs_diff(&captured, &plain), 0.0);
    assert_eq!(
        (template.start(), template.rows, template.steps.len()),
        (1, 2, 4)
    );
    assert!(template.steps[1..].iter().all(Option::is_some) && template.bytes() > 0);

    // Every pixel masked: the full inpainting.
    let edit_request = request("a red hat", 4, 4.0, None);
    let ones = Tensor::ones([1, 1, 32, 32], opts);
    let all = InpaintInputs {
        image: &image,
        mask: &ones,
        strength: 0.75,
    };
    let own = seeded_noise(9, &latents.size(), Device::Cpu, Kind::Float).unwrap();
    let mut edit = pipe
        .prepare_edit(&edit_request, &own, &all, template.clone())
        .unwrap();
    run_together(&pipe, &mut [&mut edit]);
    let full = pipe
        .inpaint(&edit_request, &all, &own, &mut |_, _| unreachable!())
        .unwrap();
    let err = max_abs_diff(&pipe.decode(&edit).unwrap(), &full);
    println!("edit at mask 1.0 vs full inpainting: max abs err {err:.2e}");
    assert!(err <= 1e-5, "mask 1.0: {err}");

    // Two edits with different masks and prompts: batched equals each alone.
    let mask_a = read_mask(&dir.join("mask.png")).unwrap();
    let mask_b = Tensor::zeros([1, 1, 32, 32], opts);
    let _ = mask_b.narrow(2, 16, 12).narrow(3, 0, 10).fill_(1.0);
    let edits = [("a red hat", &mask_a, 21), ("a blue boat", &mask_b, 22)];
    let prepare = |(prompt, mask, seed): (&str, &Tensor, u64), template: &Arc<SdTemplate>| {
        let own = seeded_noise(seed, &latents.size(), Device::Cpu, Kind::Float).unwrap();
        let inputs = InpaintInputs {
            image: &image,
            mask,
            strength: 0.75,
        };
        let req = request(prompt, 4, 4.0, None);
        pipe.prepare_edit(
            &req,
            &mixed_latents(&latents, &own, mask),
            &inputs,
            template.clone(),
        )
        .unwrap()
    };
    let alone: Vec<SdState> = edits
        .iter()
        .map(|e| {
            let mut state = prepare(*e, &template);
            run_together(&pipe, &mut [&mut state]);
            state
        })
        .collect();
    let mut together: Vec<SdState> = edits.iter().map(|e| prepare(*e, &template)).collect();
    let [a, b] = &mut together[..] else {
        unreachable!()
    };
    run_together(&pipe, &mut [a, b]);
    for (i, (batched, alone)) in together.iter().zip(&alone).enumerate() {
        let (batched, alone) = (pipe.decode(batched).unwrap(), pipe.decode(alone).unwrap());
        let err = max_abs_diff(&batched, &alone);
        println!("edit {i}: batched vs alone max abs err {err:.2e}");
        assert!(err <= 1e-4, "edit {i}: {err}");
    }
    // The loop reads a template step by step, as each step runs (a served template decodes
    // each step then, not the whole trajectory at admission).
    let recording = Arc::new(Recording {
        inner: template.clone(),
        asked: Mutex::new(Vec::new()),
    });
    let (prompt, mask, seed) = edits[0];
    let own = seeded_noise(seed, &latents.size(), Device::Cpu, Kind::Float).unwrap();
    let inputs = InpaintInputs {
        image: &image,
        mask,
        strength: 0.75,
    };
    let mut lazy = pipe
        .prepare_edit(
            &request(prompt, 4, 4.0, None),
            &mixed_latents(&latents, &own, mask),
            &inputs,
            recording.clone(),
        )
        .unwrap();
    let mut stepped = Vec::new();
    while !lazy.done() {
        stepped.push(lazy.next_step());
        run_one_step(&pipe, &mut lazy);
        assert_eq!(*recording.asked.lock().unwrap(), stepped);
    }
    let lazy = pipe.decode(&lazy).unwrap();
    assert_eq!(max_abs_diff(&lazy, &pipe.decode(&alone[0]).unwrap()), 0.0);
    // Outside its mask an edit's latents are the capture's, exactly (latent blending).
    let keep = 1.0
        - mask_a
            .upsample_nearest2d([16, 16], None, None)
            .ge(0.5)
            .to_kind(Kind::Float);
    let outside = max_abs_diff(&(alone[0].latents() * &keep), &(&template_x * &keep));
    assert_eq!(
        outside, 0.0,
        "unmasked latents left the template's trajectory"
    );
    // The cache is read: another template's cache moves the repainted pixels.
    let mut elsewhere = prepare(edits[0], &other_template);
    run_together(&pipe, &mut [&mut elsewhere]);
    let moved = max_abs_diff(
        &pipe.decode(&elsewhere).unwrap(),
        &pipe.decode(&alone[0]).unwrap(),
    );
    assert!(
        moved > 1e-3,
        "another template's cache moved the image by only {moved}"
    );

    // Refusals name the field.
    let inputs = InpaintInputs {
        image: &image,
        mask: &mask_a,
        strength: 0.75,
    };
    for (field, req, strength) in [
        ("num_inference_steps", request("x", 3, 4.0, None), 0.75),
        ("strength", request("x", 4, 4.0, None), 1.0),
        ("guidance_scale", request("x", 4, 1.0, None), 0.75),
    ] {
        let inputs = InpaintInputs { strength, ..inputs };
        let err = pipe
            .prepare_edit(&req, &latents, &inputs, template.clone())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    let mut cap = pipe
        .prepare_capture(&template_request, &latents, &image, 0.75)
        .unwrap();
    let mut ed = prepare(edits[0], &template);
    let err = pipe
        .step_batch(&mut [&mut cap, &mut ed], &mut |_, _, _| unreachable!())
        .unwrap_err()
        .to_string();
    assert!(err.contains("states"), "{err}");
}

/// A batch whose step fails part-way (here: the second state's ancestral noise cannot be had)
/// changes no state, so the engine's retry job by job steps each once: after a failed round the
/// DPM++ 2M state (whose scheduler keeps the previous prediction) and the Euler-ancestral one
/// end on the images they give alone.
#[test]
fn a_batch_that_fails_part_way_steps_no_one() {
    let dir = generate("gen_sd21_pipeline.py", &[], "sd-stepper-atomic");
    let pipe = SdPipeline::load(&dir.join("sd21"), Device::Cpu, Kind::Float).unwrap();
    let latents = read_tensors(&dir.join("latents.safetensors"))["latents"].shallow_clone();
    let requests = [
        request("a cat on a sofa", 4, 5.0, Some("dpmpp_2m")),
        request("a dog in the snow", 4, 5.0, Some("euler_a")),
    ];
    let alone: Vec<Tensor> = requests
        .iter()
        .enumerate()
        .map(|(id, req)| {
            let mut n = |step: usize, shape: &[i64]| noise(id as u64, step, shape);
            pipe.generate(req, &latents, &mut n).unwrap()
        })
        .collect();
    let mut states: Vec<SdState> = requests
        .iter()
        .map(|req| pipe.prepare(req, &latents, None).unwrap())
        .collect();
    let mut round = 0;
    while states.iter().any(|s| !s.done()) {
        let before: Vec<Tensor> = states.iter().map(|s| s.latents().copy()).collect();
        let mut batch: Vec<&mut SdState> = states.iter_mut().collect();
        if round == 2 {
            // The failing round: the first state steps (its scheduler moves) before the second's
            // noise fails; nothing may stay moved.
            let err = pipe
                .step_batch(&mut batch, &mut |i, step, shape| match i {
                    1 => Err(diffmesh_model::ModelError::input("noise", "unavailable")),
                    _ => noise(i as u64, step, shape),
                })
                .unwrap_err();
            assert!(err.to_string().contains("unavailable"), "{err}");
            for (s, b) in states.iter().zip(&before) {
                assert_eq!(s.next_step(), 2);
                assert_eq!(max_abs_diff(s.latents(), b), 0.0, "latents moved");
            }
            batch = states.iter_mut().collect();
        }
        pipe.step_batch(&mut batch, &mut |i, step, shape| {
            noise(i as u64, step, shape)
        })
        .unwrap();
        round += 1;
    }
    for (id, (state, alone)) in states.iter().zip(&alone).enumerate() {
        let err = max_abs_diff(&pipe.decode(state).unwrap(), alone);
        println!("request {id} after a failed round: max abs err {err:.2e} against alone");
        assert!(err <= 1e-5, "request {id}: {err}");
    }
}

/// A template read through [`TemplateSteps`], recording the steps asked for.
struct Recording {
    inner: Arc<SdTemplate>,
    asked: Mutex<Vec<usize>>,
}

impl TemplateSteps for Recording {
    fn steps(&self) -> usize {
        self.inner.steps()
    }

    fn start(&self) -> usize {
        self.inner.start()
    }

    fn rows(&self) -> i64 {
        self.inner.rows()
    }

    fn step(&self, k: usize) -> diffmesh_model::Result<Arc<UNetTemplateCache>> {
        self.asked.lock().unwrap().push(k);
        self.inner.step(k)
    }
}

/// One step of `state` alone (the checkpoint's DDIM draws no noise).
fn run_one_step(pipe: &SdPipeline, state: &mut SdState) {
    pipe.step_batch(&mut [state], &mut |_, _, _| unreachable!())
        .unwrap();
}
