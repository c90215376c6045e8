//! CPU autocast to bfloat16 for the duration of a guard (libtorch's `at::autocast` for the CPU
//! device, through a small C++ shim; tch only switches the CUDA one). Matmuls and attention run
//! in bf16 (AMX or AVX512-BF16 units do them several times faster than f32); parameters,
//! gradients' accumulation and reductions stay f32.
use crate::error::{ModelError, Result};

extern "C" {
    fn diffmesh_cpu_autocast_enter() -> i32;
    fn diffmesh_cpu_autocast_exit() -> i32;
    fn diffmesh_cpu_autocast_is_enabled() -> i32;
}

/// CPU autocast is on while this lives (on this thread: autocast state is thread-local).
#[must_use = "autocast ends when the guard drops"]
pub struct CpuAutocast {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl CpuAutocast {
    pub fn enter() -> Result<Self> {
        // SAFETY: the shim takes no arguments and catches every C++ exception.
        match unsafe { diffmesh_cpu_autocast_enter() } {
            0 => Ok(Self {
                _not_send: std::marker::PhantomData,
            }),
            _ => Err(ModelError::input(
                "autocast",
                "libtorch refused CPU autocast",
            )),
        }
    }
}

impl Drop for CpuAutocast {
    fn drop(&mut self) {
        // SAFETY: as in `enter`; a failure here cannot be reported from drop and leaves
        // autocast off at worst.
        unsafe {
            diffmesh_cpu_autocast_exit();
        }
    }
}

/// Whether this CPU has bf16 matrix units (AVX512-BF16; every AMX CPU has them too), where
/// autocast pays: elsewhere libtorch emulates bf16 and a step gets slower, not faster.
pub fn cpu_has_bf16_units() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// When to train under CPU autocast.
#[derive(clap::ValueEnum, serde::Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Bf16Mode {
    /// On where the CPU has bf16 units ([`cpu_has_bf16_units`]), off elsewhere.
    Auto,
    #[value(alias = "true")]
    On,
    #[value(alias = "false")]
    Off,
}

impl Bf16Mode {
    pub fn enabled(self) -> bool {
        match self {
            Bf16Mode::Auto => cpu_has_bf16_units(),
            Bf16Mode::On => true,
            Bf16Mode::Off => false,
        }
    }
}

/// Whether CPU autocast is on for this thread.
pub fn cpu_autocast_enabled() -> bool {
    // SAFETY: as in `CpuAutocast::enter`.
    unsafe { diffmesh_cpu_autocast_is_enabled() == 1 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn matmul_runs_in_bf16_inside_the_guard_only() {
        let a = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([16, 4], (Kind::Float, Device::Cpu));
        assert!(!cpu_autocast_enabled());
        {
            let _guard = CpuAutocast::enter().unwrap();
            assert!(cpu_autocast_enabled());
            let low = a.matmul(&b);
            assert_eq!(low.kind(), Kind::BFloat16);
            drop(_guard);
            let reference = a.matmul(&b);
            let err = (low.to_kind(Kind::Float) - &reference)
                .abs()
                .max()
                .double_value(&[]);
            // bf16 keeps 8 bits of mantissa: close to, not equal to, the f32 product.
            assert!(err > 0.0 && err < 0.5, "{err}");
        }
        assert!(!cpu_autocast_enabled());
        assert_eq!(a.matmul(&b).kind(), Kind::Float);
    }

    #[test]
    fn bf16_flag_keeps_the_old_boolean_spellings() {
        use clap::ValueEnum;
        let parse = |v: &str| Bf16Mode::from_str(v, false).ok();
        assert_eq!(parse("true"), Some(Bf16Mode::On));
        assert_eq!(parse("false"), Some(Bf16Mode::Off));
        assert_eq!(parse("auto"), Some(Bf16Mode::Auto));
        assert_eq!(parse("maybe"), None);
        assert_eq!(Bf16Mode::Auto.enabled(), cpu_has_bf16_units());
    }
}
