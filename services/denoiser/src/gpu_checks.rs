//! Checks of the serving math on a CUDA GPU against the CPU (ignored where there is none): the
//! full forward, and a packed mask-aware step whose cache is streamed from pinned memory through
//! the copy stream, as a GPU denoiser runs it. Run where a GPU is:
//! `cargo test -p diffmesh-denoiser --lib -- --ignored gpu_`.
use crate::cached_step::CaptureSink;
use crate::templates::{CacheLayout, GpuCopy, KvLoader, TemplateEntry};
use diffmesh_model::bench_inputs::{medium_config, random_inputs_on, MEDIUM_SIDE, MEDIUM_TXT};
use diffmesh_model::flux::kv_codec::CacheDtype;
use diffmesh_model::flux::{FluxInputs, FluxTransformer, KvCache, KvFormat, MaskedRequest};
use diffmesh_model::tch::{self, nn, Device, Kind, Tensor};
use std::sync::Arc;

const CUDA: Device = Device::Cuda(0);

fn inputs_to(i: &FluxInputs, device: Device, kind: Kind) -> FluxInputs {
    let f = |t: &Tensor| t.to_device(device).to_kind(kind);
    FluxInputs {
        hidden_states: f(&i.hidden_states),
        encoder_hidden_states: f(&i.encoder_hidden_states),
        pooled_projections: f(&i.pooled_projections),
        timestep: f(&i.timestep),
        // Position ids stay f32, as the pipeline passes them.
        img_ids: i.img_ids.to_device(device),
        txt_ids: i.txt_ids.to_device(device),
        guidance: i.guidance.as_ref().map(f),
    }
}

/// Relative error: max |a - b| over max |b|, both on the CPU in f32.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (
        a.to_device(Device::Cpu).to_kind(Kind::Float),
        b.to_device(Device::Cpu).to_kind(Kind::Float),
    );
    assert_eq!(a.size(), b.size());
    let diff = f64::try_from((&a - &b).abs().max()).unwrap();
    diff / f64::try_from(b.abs().max()).unwrap().max(1e-12)
}

fn request<'a>(inputs: &FluxInputs, index: &Tensor, cache: &'a dyn KvCache) -> MaskedRequest<'a> {
    MaskedRequest {
        hidden_states: inputs.hidden_states.get(0).index_select(0, index),
        token_index: index.shallow_clone(),
        encoder_hidden_states: inputs.encoder_hidden_states.get(0),
        pooled_projections: inputs.pooled_projections.get(0),
        timestep: 0.5,
        guidance: Some(3.5),
        img_ids: inputs.img_ids.shallow_clone(),
        txt_ids: inputs.txt_ids.shallow_clone(),
        cache,
        full_hidden_states: None,
    }
}

fn capture(model: &FluxTransformer, inputs: &FluxInputs, dtype: CacheDtype) -> TemplateEntry {
    let mut sink = CaptureSink::new(CacheLayout::One(KvFormat::Prepared), dtype);
    let _output = model.forward_capture(inputs, &mut sink).unwrap();
    sink.end_step();
    sink.finish("gpu-check".into(), model.num_blocks()).unwrap()
}

/// Two packed requests (masks of 20% and 50% of the tokens), their caches streamed by `loader`:
/// each output with its masked token indexes.
fn masked_step(
    model: &FluxTransformer,
    inputs: &FluxInputs,
    entry: &Arc<TemplateEntry>,
    loader: &KvLoader,
    kind: Kind,
    device: Device,
) -> Vec<(Tensor, Tensor)> {
    let n = MEDIUM_SIDE * MEDIUM_SIDE;
    let indexes: Vec<Tensor> = [5, 2]
        .iter()
        .map(|&stride| Tensor::arange_start_step(0, n, stride, (Kind::Int64, device)))
        .collect();
    let streams = loader.load_step(
        vec![(entry.clone(), 0), (entry.clone(), 0)],
        0,
        kind,
        device,
    );
    let reqs: Vec<MaskedRequest> = indexes
        .iter()
        .zip(&streams)
        .map(|(i, s)| request(inputs, i, s))
        .collect();
    let outs = model.forward_masked(&reqs).unwrap();
    outs.into_iter().zip(indexes).collect()
}

fn medium_on(device: Device, from: &nn::VarStore) -> (FluxTransformer, nn::VarStore) {
    let mut vs = nn::VarStore::new(device);
    let model = FluxTransformer::new(&vs.root(), medium_config()).unwrap();
    vs.copy(from).unwrap();
    (model, vs)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_forward_and_streamed_masked_step_match_the_cpu() {
    let _guard = tch::no_grad_guard();
    tch::manual_seed(3);
    let cpu_vs = nn::VarStore::new(Device::Cpu);
    let cpu_model = FluxTransformer::new(&cpu_vs.root(), medium_config()).unwrap();
    let (gpu_model, _gpu_vs) = medium_on(CUDA, &cpu_vs);
    let inputs = random_inputs_on(&medium_config(), MEDIUM_SIDE, MEDIUM_TXT, 1, Device::Cpu);
    let gpu_inputs = inputs_to(&inputs, CUDA, Kind::Float);

    let full_cpu = cpu_model.forward(&inputs).unwrap();
    let full_gpu = gpu_model.forward(&gpu_inputs).unwrap();
    let err = rel_err(&full_gpu, &full_cpu);
    println!("f32 full forward, GPU against CPU: relative error {err:.2e}");
    assert!(err < 1e-3, "full forward: {err}");

    // One f32 cache, captured on the CPU: the CPU streams it from host memory, the GPU from
    // pinned memory through the copy stream.
    let entry = Arc::new(capture(&cpu_model, &inputs, CacheDtype::F32));
    let gpu = GpuCopy::new(0, 2).unwrap();
    let pinned = Arc::new(gpu.pin(&entry).unwrap());
    let cpu_loader = KvLoader::spawn(2, None).unwrap();
    let gpu_loader = KvLoader::spawn(2, Some(gpu)).unwrap();
    let on_cpu = masked_step(
        &cpu_model,
        &inputs,
        &entry,
        &cpu_loader,
        Kind::Float,
        Device::Cpu,
    );
    // Twice on the GPU: the second reuses the ring's buffers.
    for round in 0..2 {
        let on_gpu = masked_step(
            &gpu_model,
            &gpu_inputs,
            &pinned,
            &gpu_loader,
            Kind::Float,
            CUDA,
        );
        for (r, ((g, index), (c, _))) in on_gpu.iter().zip(&on_cpu).enumerate() {
            let err = rel_err(g, c);
            println!("round {round} request {r}: masked step, GPU against CPU: {err:.2e}");
            assert!(err < 1e-3, "round {round} request {r}: {err}");
            // And against the full forward's rows at the masked tokens.
            let expected = full_gpu.get(0).index_select(0, index);
            let err = rel_err(g, &expected);
            println!("round {round} request {r}: masked step against full compute: {err:.2e}");
            assert!(err < 1e-3, "round {round} request {r} vs full: {err}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_bf16_masked_step_stays_close_to_full_compute() {
    let _guard = tch::no_grad_guard();
    tch::manual_seed(4);
    let mut vs = nn::VarStore::new(CUDA);
    let model = FluxTransformer::new(&vs.root(), medium_config()).unwrap();
    vs.set_kind(Kind::BFloat16);
    let inputs = inputs_to(
        &random_inputs_on(&medium_config(), MEDIUM_SIDE, MEDIUM_TXT, 1, Device::Cpu),
        CUDA,
        Kind::BFloat16,
    );
    let full = model.forward(&inputs).unwrap();
    let entry = capture(&model, &inputs, CacheDtype::Bf16);
    let gpu = GpuCopy::new(0, GpuCopy::RING).unwrap();
    let pinned = Arc::new(gpu.pin(&entry).unwrap());
    let loader = KvLoader::spawn(2, Some(gpu)).unwrap();
    let outs = masked_step(&model, &inputs, &pinned, &loader, Kind::BFloat16, CUDA);
    for (r, (o, index)) in outs.iter().enumerate() {
        let expected = full.get(0).index_select(0, index);
        let err = rel_err(o, &expected);
        println!("bf16 request {r}: masked step against full compute: {err:.2e}");
        // bf16 keeps 8 bits of mantissa; two orders of evaluation differ by a few ulps.
        assert!(err < 5e-2, "request {r}: {err}");
    }
}
