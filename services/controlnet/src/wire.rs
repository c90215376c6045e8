//! Tensors to and from their message form ([`WireTensor`]).
use diffmesh_model::host_tensor::{from_host, to_host};
use diffmesh_model::tch::{Device, Tensor};
use diffmesh_shared::wire::controlnet_service::WireTensor;

pub fn to_wire(t: &Tensor) -> Result<WireTensor, String> {
    let (dtype, shape, data) = to_host(t)?;
    WireTensor::from_parts(dtype.name(), shape, data)
}

/// The tensor `w` describes, on `device`; an error names `field`.
pub fn from_wire(w: &WireTensor, device: Device, field: &str) -> Result<Tensor, String> {
    from_host(w.dtype.name(), &w.shape, &w.data, device).map_err(|e| format!("{field}: {e}"))
}
