//! The model's parameters to and from wire bytes: sorted by name, converted
//! to the sync dtype on the host, `weights − base` deltas, and the center
//! loaded into the model. Everything libtorch of model sync, apart from the
//! protocol ([`super::session`]), which never touches a tensor.

use dflash_model::draft::DraftModel;
use tch::{Device, Kind, Tensor};

use super::error::SyncClientError;
use super::settings::SyncDtype;

/// One tensor in transit: name, shape, raw little-endian bytes.
pub(super) type WireTensor = dflash_proto::chunks::ReceivedTensor;

/// The model's trainable parameters, sorted by name (the checkpoint order).
pub(super) fn sorted_parameters(model: &DraftModel) -> Vec<(String, Tensor)> {
    let mut parameters: Vec<(String, Tensor)> = model.var_store().variables().into_iter().collect();
    parameters.sort_by(|left, right| left.0.cmp(&right.0));
    parameters
}

pub(super) fn tensor_to_wire(
    name: &str,
    tensor: &Tensor,
    dtype: SyncDtype,
) -> Result<WireTensor, SyncClientError> {
    let host = tensor
        .detach()
        .f_to_device(Device::Cpu)?
        .f_to_kind(dtype.kind())?
        .contiguous();
    let elements = host.numel();
    let mut bytes = vec![0u8; elements * dtype.kind().elt_size_in_bytes()];
    host.f_copy_data_u8(&mut bytes, elements)?;
    let shape = host.size().iter().map(|&dim| dim as u64).collect();
    Ok((name.to_string(), shape, bytes))
}

/// `weights − base` for every parameter, as `dtype` bytes.
pub(super) fn delta_to_wire(
    parameters: &[(String, Tensor)],
    base: &[(String, Tensor)],
    dtype: SyncDtype,
) -> Result<Vec<WireTensor>, SyncClientError> {
    parameters
        .iter()
        .zip(base)
        .map(|((name, weights), (base_name, base))| {
            if name != base_name {
                return Err(SyncClientError::Tensor {
                    name: name.clone(),
                    detail: format!("base holds {base_name:?} at its place"),
                });
            }
            let delta = tch::no_grad(|| weights.detach().f_sub(base))?;
            tensor_to_wire(name, &delta, dtype)
        })
        .collect()
}

/// Copies the center into the model's parameters and returns the new base
/// (a copy of the same values).
pub(super) fn load_center(
    parameters: &[(String, Tensor)],
    center: Vec<WireTensor>,
) -> Result<Vec<(String, Tensor)>, SyncClientError> {
    if center.len() != parameters.len() {
        return Err(SyncClientError::Protocol(format!(
            "the center has {} tensors, the model {}",
            center.len(),
            parameters.len()
        )));
    }
    let mut base = Vec::with_capacity(parameters.len());
    for ((name, parameter), (center_name, shape, bytes)) in parameters.iter().zip(center) {
        if *name != center_name {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("the center sent {center_name:?} at its place"),
            });
        }
        let shape: Vec<i64> = shape.iter().map(|&dim| dim as i64).collect();
        if shape != parameter.size() {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("center shape {shape:?}, model shape {:?}", parameter.size()),
            });
        }
        let elements: i64 = shape.iter().product();
        let kind = if bytes.len() as i64 == elements * 4 {
            Kind::Float
        } else if bytes.len() as i64 == elements * 2 {
            Kind::BFloat16
        } else {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("{} bytes for {elements} elements", bytes.len()),
            });
        };
        let values = Tensor::f_from_data_size(&bytes, &shape, kind)?
            .f_to_kind(Kind::Float)?
            .f_to_device(parameter.device())?;
        tch::no_grad(|| parameter.shallow_clone().f_copy_(&values))?;
        base.push((name.clone(), values));
    }
    Ok(base)
}
