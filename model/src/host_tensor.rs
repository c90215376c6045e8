//! Tensors as plain bytes on the host (what travels between processes, e.g. to a ControlNet
//! worker): the element type, the shape, and the little-endian contents, row-major. The message
//! types that carry them are the wire contract's (`diffmesh_shared::wire::controlnet_service`); this
//! module is the tch side of the copy.
use tch::{Device, Kind, Tensor};

/// Element types a tensor travels as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostDtype {
    F32,
    Bf16,
    F16,
    I64,
}

impl HostDtype {
    /// The name the wire contract spells it with.
    pub fn name(self) -> &'static str {
        match self {
            HostDtype::F32 => "f32",
            HostDtype::Bf16 => "bf16",
            HostDtype::F16 => "f16",
            HostDtype::I64 => "i64",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::F32, Self::Bf16, Self::F16, Self::I64]
            .into_iter()
            .find(|d| d.name() == name)
    }

    fn kind(self) -> Kind {
        match self {
            HostDtype::F32 => Kind::Float,
            HostDtype::Bf16 => Kind::BFloat16,
            HostDtype::F16 => Kind::Half,
            HostDtype::I64 => Kind::Int64,
        }
    }

    fn size(self) -> usize {
        match self {
            HostDtype::F32 => 4,
            HostDtype::Bf16 | HostDtype::F16 => 2,
            HostDtype::I64 => 8,
        }
    }
}

/// `t` copied to the host, contiguous: its element type, shape and bytes. f64 travels as f32,
/// every other kind but f32, bf16 and f16 as i64 (position ids).
pub fn to_host(t: &Tensor) -> Result<(HostDtype, Vec<i64>, Vec<u8>), String> {
    let dtype = match t.kind() {
        Kind::Float | Kind::Double => HostDtype::F32,
        Kind::BFloat16 => HostDtype::Bf16,
        Kind::Half => HostDtype::F16,
        _ => HostDtype::I64,
    };
    let host = t
        .f_to_device(Device::Cpu)
        .and_then(|h| h.f_to_kind(dtype.kind()))
        .and_then(|h| h.f_contiguous())
        .map_err(|e| e.to_string())?;
    let numel = host.numel();
    let mut data = vec![0u8; numel * dtype.size()];
    host.f_copy_data_u8(&mut data, numel)
        .map_err(|e| e.to_string())?;
    Ok((dtype, host.size(), data))
}

/// The tensor of element type `dtype` (by name) and `shape` holding `data`, on `device`.
pub fn from_host(
    dtype: &str,
    shape: &[i64],
    data: &[u8],
    device: Device,
) -> Result<Tensor, String> {
    let dtype = HostDtype::from_name(dtype).ok_or_else(|| format!("unknown dtype `{dtype}`"))?;
    let bytes = shape.iter().try_fold(dtype.size(), |n, &d| {
        n.checked_mul(usize::try_from(d).ok()?)
    });
    if bytes != Some(data.len()) {
        return Err(format!(
            "{} bytes do not hold {shape:?} of {}",
            data.len(),
            dtype.name()
        ));
    }
    Tensor::f_from_data_size(data, shape, dtype.kind())
        .and_then(|t| t.f_to_device(device))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(t: &Tensor) -> Tensor {
        let (dtype, shape, data) = to_host(t).unwrap();
        from_host(dtype.name(), &shape, &data, Device::Cpu).unwrap()
    }

    #[test]
    fn tensors_survive_the_trip_bit_for_bit() {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Int64] {
            let t = Tensor::randn([2, 3, 5], (Kind::Float, Device::Cpu)).to_kind(kind);
            let back = round_trip(&t);
            assert_eq!(back.kind(), kind);
            assert_eq!(back.size(), [2, 3, 5]);
            assert!(back.equal(&t), "{kind:?} changed on the way");
        }
        // A transposed (non-contiguous) tensor travels in its logical order.
        let t = Tensor::arange(6, (Kind::Float, Device::Cpu))
            .reshape([2, 3])
            .tr();
        assert!(round_trip(&t).equal(&t));
    }

    #[test]
    fn names_are_the_wire_contracts() {
        for d in [
            HostDtype::F32,
            HostDtype::Bf16,
            HostDtype::F16,
            HostDtype::I64,
        ] {
            assert_eq!(HostDtype::from_name(d.name()), Some(d));
        }
        assert_eq!(HostDtype::from_name("f64"), None);
    }

    #[test]
    fn bytes_that_do_not_fit_the_shape_are_refused() {
        let (dtype, shape, mut data) =
            to_host(&Tensor::ones([4], (Kind::Float, Device::Cpu))).unwrap();
        data.pop();
        assert!(from_host(dtype.name(), &shape, &data, Device::Cpu).is_err());
        assert!(from_host("f32", &[-1, 4], &[], Device::Cpu).is_err());
        assert!(from_host("f64", &[], &[0; 8], Device::Cpu).is_err());
    }
}
