//! The activation functions text encoders name in their configs (transformers' `ACT2FN` keys).
use crate::error::{ModelError, Result};
use tch::Tensor;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(1.702 x)`: OpenAI CLIP's.
    QuickGelu,
    /// The exact (erf) GELU.
    Gelu,
    /// The tanh approximation as torch fuses it (`gelu_pytorch_tanh`).
    GeluTanh,
    /// The tanh approximation written out op by op (`gelu_new`: T5 v1.1's gated-gelu). Same
    /// function as `GeluTanh`, but bf16/f16 round each op, so parity needs the same ops.
    GeluNew,
    /// `gelu_fast`: the tanh approximation factored as transformers writes it.
    GeluFast,
    Relu,
}

impl Activation {
    /// Parse the config value of `field`, naming it when it is not one diffmesh implements.
    pub fn parse(field: &str, name: &str) -> Result<Self> {
        Ok(match name {
            "quick_gelu" => Self::QuickGelu,
            "gelu" => Self::Gelu,
            "gelu_pytorch_tanh" => Self::GeluTanh,
            "gelu_new" => Self::GeluNew,
            "gelu_fast" => Self::GeluFast,
            "relu" => Self::Relu,
            other => {
                return Err(ModelError::config(
                    field,
                    format!(
                        "activation `{other}` is not supported \
                         (quick_gelu, gelu, gelu_new, gelu_fast, gelu_pytorch_tanh, relu)"
                    ),
                ))
            }
        })
    }

    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::QuickGelu => x.f_mul(&x.f_mul_scalar(1.702)?.f_sigmoid()?)?,
            Self::Gelu => x.f_gelu("none")?,
            Self::GeluTanh => x.f_gelu("tanh")?,
            // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            Self::GeluNew => {
                let inner = x.f_add(&x.f_pow_tensor_scalar(3.0)?.f_mul_scalar(0.044715)?)?;
                let tanh = inner
                    .f_mul_scalar((2.0 / std::f64::consts::PI).sqrt())?
                    .f_tanh()?;
                x.f_mul_scalar(0.5)?.f_mul(&tanh.f_add_scalar(1.0)?)?
            }
            // 0.5 x (1 + tanh(x 0.7978845608 (1 + 0.044715 x^2)))
            Self::GeluFast => {
                let inner = x.f_mul_scalar(0.044715)?.f_mul(x)?.f_add_scalar(1.0)?;
                let tanh = x.f_mul_scalar(0.7978845608)?.f_mul(&inner)?.f_tanh()?;
                x.f_mul_scalar(0.5)?.f_mul(&tanh.f_add_scalar(1.0)?)?
            }
            Self::Relu => x.f_relu()?,
        })
    }
}
