//! Memory of the device a denoiser computes on, for `/metrics`
//! (`diffmesh_denoiser_device_memory_bytes{state="used"|"free"}`), sampled with each heartbeat:
//! on a CUDA device the driver's count (`cuMemGetInfo` through cudarc: every process on the
//! device together, the caching allocator's reserve included), on the CPU the host's
//! (`MemTotal - MemAvailable` and `MemAvailable` from /proc/meminfo). Free memory falling
//! towards zero warns before jobs start failing for it.
use crate::templates::GpuCopy;
use diffmesh_model::tch::Device;
use std::sync::Arc;

/// Bytes used and free on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub used: u64,
    pub free: u64,
}

/// Where a denoiser's device memory is read from.
pub enum MemorySource {
    /// The CUDA device of the denoiser's copy stream (its context is libtorch's too).
    Cuda(Arc<GpuCopy>),
    /// The host: the denoiser computes on the CPU.
    Host,
    /// A CUDA device whose driver cudarc could not open: not measured.
    Unknown,
}

impl MemorySource {
    /// The source for a denoiser on `device` with its copy stream (`EngineModel::gpu_copy`).
    pub fn for_device(device: Device, gpu: Option<Arc<GpuCopy>>) -> Self {
        match (device, gpu) {
            (Device::Cpu, _) => MemorySource::Host,
            (_, Some(gpu)) => MemorySource::Cuda(gpu),
            _ => MemorySource::Unknown,
        }
    }

    /// The memory now, or None where it cannot be read.
    pub fn sample(&self) -> Option<DeviceMemory> {
        match self {
            MemorySource::Cuda(gpu) => {
                let (free, total) = gpu.mem_get_info().ok()?;
                Some(DeviceMemory {
                    used: total.saturating_sub(free),
                    free,
                })
            }
            MemorySource::Host => parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?),
            MemorySource::Unknown => None,
        }
    }
}

/// Used and free host memory from the text of /proc/meminfo (values in kB).
pub fn parse_meminfo(text: &str) -> Option<DeviceMemory> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line[name.len()..]
            .trim_start_matches(':')
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        Some(kb.saturating_mul(1024))
    };
    let (total, available) = (field("MemTotal")?, field("MemAvailable")?);
    Some(DeviceMemory {
        used: total.saturating_sub(available),
        free: available,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_comes_from_meminfo() {
        let text = "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20480000 kB\n";
        assert_eq!(
            parse_meminfo(text),
            Some(DeviceMemory {
                used: 4_096_000 * 1024,
                free: 20_480_000 * 1024
            })
        );
        assert_eq!(parse_meminfo("MemTotal: 10 kB\n"), None);
        assert_eq!(parse_meminfo("garbage"), None);
        // This machine's own.
        let here = MemorySource::Host.sample().expect("/proc/meminfo");
        assert!(here.free > 0 && here.used > 0, "{here:?}");
    }
}
