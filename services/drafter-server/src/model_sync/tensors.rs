//! The model's parameters to and from wire bytes: sorted by name, copied
//! to the host as f32, and the run's model loaded into the model.
//! Everything libtorch of model sync, apart from the protocol
//! ([`super::session`]), which never touches a tensor.

use dflash_model::draft::DraftModel;
use tch::{Device, Kind, Tensor};

use super::error::SyncClientError;

/// One tensor in transit: name, shape, raw little-endian bytes.
pub(super) type WireTensor = dflash_proto::chunks::ReceivedTensor;

/// The model's trainable parameters, sorted by name (the checkpoint order).
pub(super) fn sorted_parameters(model: &DraftModel) -> Vec<(String, Tensor)> {
    let mut parameters: Vec<(String, Tensor)> = model.var_store().variables().into_iter().collect();
    parameters.sort_by(|left, right| left.0.cmp(&right.0));
    parameters
}

/// One parameter as f32 bytes on the host (the master weights are f32).
pub(super) fn tensor_to_wire(name: &str, tensor: &Tensor) -> Result<WireTensor, SyncClientError> {
    let host = tensor
        .detach()
        .f_to_device(Device::Cpu)?
        .f_to_kind(Kind::Float)?
        .contiguous();
    let elements = host.numel();
    let mut bytes = vec![0u8; elements * Kind::Float.elt_size_in_bytes()];
    host.f_copy_data_u8(&mut bytes, elements)?;
    let shape = host.size().iter().map(|&dim| dim as u64).collect();
    Ok((name.to_string(), shape, bytes))
}

/// Copies the run's model (f32 tensors, sorted by name) into the model's
/// parameters, after checking every name and shape.
pub(super) fn load_model(
    parameters: &[(String, Tensor)],
    received: Vec<WireTensor>,
) -> Result<(), SyncClientError> {
    if received.len() != parameters.len() {
        return Err(SyncClientError::Protocol(format!(
            "the run's model has {} tensors, this drafter's {}",
            received.len(),
            parameters.len()
        )));
    }
    for ((name, parameter), (received_name, shape, bytes)) in parameters.iter().zip(received) {
        if *name != received_name {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("the run's model has {received_name:?} at its place"),
            });
        }
        let shape: Vec<i64> = shape.iter().map(|&dim| dim as i64).collect();
        if shape != parameter.size() {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("run's shape {shape:?}, model shape {:?}", parameter.size()),
            });
        }
        let elements: i64 = shape.iter().product();
        if bytes.len() as i64 != elements * 4 {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("{} bytes for {elements} f32 elements", bytes.len()),
            });
        }
        let values = Tensor::f_from_data_size(&bytes, &shape, Kind::Float)?
            .f_to_device(parameter.device())?;
        tch::no_grad(|| parameter.shallow_clone().f_copy_(&values))?;
    }
    Ok(())
}
