//! Tensors to and from their message form ([`WireTensor`]).
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_shared::controlnet_service::{WireDtype, WireTensor};

/// `t` as a message field (copied to the host, contiguous). f64 travels as f32, every other
/// kind but f32, bf16 and f16 as i64 (position ids).
pub fn to_wire(t: &Tensor) -> Result<WireTensor, String> {
    let convert = |e: diffmesh_model::tch::TchError| e.to_string();
    let (dtype, kind) = match t.kind() {
        Kind::Float => (WireDtype::F32, Kind::Float),
        Kind::BFloat16 => (WireDtype::Bf16, Kind::BFloat16),
        Kind::Half => (WireDtype::F16, Kind::Half),
        Kind::Double => (WireDtype::F32, Kind::Float),
        _ => (WireDtype::I64, Kind::Int64),
    };
    let host = t
        .f_to_device(Device::Cpu)
        .and_then(|h| h.f_to_kind(kind))
        .and_then(|h| h.f_contiguous())
        .map_err(convert)?;
    let numel = host.numel();
    let mut data = vec![0u8; numel * dtype.size()];
    host.f_copy_data_u8(&mut data, numel).map_err(convert)?;
    Ok(WireTensor {
        shape: host.size(),
        dtype,
        data,
    })
}

/// The tensor `w` describes, on `device`; an error names `field` when it is malformed.
pub fn from_wire(w: &WireTensor, device: Device, field: &str) -> Result<Tensor, String> {
    if let Some(problem) = w.problem() {
        return Err(format!("{field}: {problem}"));
    }
    let kind = match w.dtype {
        WireDtype::F32 => Kind::Float,
        WireDtype::Bf16 => Kind::BFloat16,
        WireDtype::F16 => Kind::Half,
        WireDtype::I64 => Kind::Int64,
    };
    Tensor::f_from_data_size(&w.data, &w.shape, kind)
        .and_then(|t| t.f_to_device(device))
        .map_err(|e| format!("{field}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_survive_the_trip_bit_for_bit() {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Int64] {
            let t = Tensor::randn([2, 3, 5], (Kind::Float, Device::Cpu)).to_kind(kind);
            let back = from_wire(&to_wire(&t).unwrap(), Device::Cpu, "t").unwrap();
            assert_eq!(back.kind(), kind);
            assert_eq!(back.size(), [2, 3, 5]);
            assert!(back.equal(&t), "{kind:?} changed on the way");
        }
        // A transposed (non-contiguous) tensor travels in its logical order.
        let t = Tensor::arange(6, (Kind::Float, Device::Cpu))
            .reshape([2, 3])
            .tr();
        assert!(from_wire(&to_wire(&t).unwrap(), Device::Cpu, "t")
            .unwrap()
            .equal(&t));
    }

    #[test]
    fn malformed_tensors_name_their_field() {
        let mut w = to_wire(&Tensor::ones([4], (Kind::Float, Device::Cpu))).unwrap();
        w.data.pop();
        let err = from_wire(&w, Device::Cpu, "hidden_states").unwrap_err();
        assert!(err.starts_with("hidden_states:"), "{err}");
    }
}
