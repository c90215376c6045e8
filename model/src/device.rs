//! Devices and dtypes as the serving programs' flags name them (`--device`, `--dtype`).
use tch::{Device, Kind};

/// A device from a flag value: `auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`. The
/// error is what was expected.
pub fn parse_device(value: &str) -> Result<Device, &'static str> {
    match value {
        "auto" => Ok(Device::cuda_if_available()),
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        d => d
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or("auto, cpu, cuda or cuda:N"),
    }
}

/// The dtype of a model's weights and activations from a flag value: `f32`, `bf16`, `f16`, or
/// `auto`: bf16 on a GPU and on a CPU with bf16 matrix units (AVX512-BF16, AMX), where a step
/// costs a fraction of f32's and batches gain more; f32 elsewhere (libtorch would emulate bf16).
/// The error is what was expected.
pub fn parse_model_dtype(value: &str, device: Device) -> Result<Kind, &'static str> {
    match value {
        "f32" => Ok(Kind::Float),
        "bf16" => Ok(Kind::BFloat16),
        "f16" => Ok(Kind::Half),
        "auto" if device.is_cuda() || crate::autocast::cpu_has_bf16_units() => Ok(Kind::BFloat16),
        "auto" => Ok(Kind::Float),
        _ => Err("auto, f32, bf16 or f16"),
    }
}
