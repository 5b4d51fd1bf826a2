//! The model to and from its checkpoint's files in memory: the files the
//! drafter's one checkpoint writer makes (`dflash_model::draft::model_files`)
//! are what a snapshot sends, and the run's model's files, read from the
//! broker, are loaded into the model's parameters. Everything libtorch of
//! model sync, apart from the protocol ([`super::session`]), which never
//! touches a tensor.

use dflash_model::draft::checkpoint::read_safetensors_bytes;
use dflash_model::draft::{model_files, sorted_parameters, DraftModel, ModelFiles};
use tch::Tensor;

use super::error::SyncClientError;

/// The model's `config.json` and `model.safetensors` (f32 master weights),
/// byte for byte what its checkpoint directory would hold.
pub(super) fn snapshot_files(model: &DraftModel) -> Result<ModelFiles, SyncClientError> {
    model_files(model).map_err(|error| SyncClientError::Model(error.to_string()))
}

/// Copies the run's model (its `model.safetensors` bytes) into the model's
/// parameters, after checking that it holds exactly the model's
/// parameters, each with its shape.
pub(super) fn load_model(model: &DraftModel, weights: &[u8]) -> Result<(), SyncClientError> {
    let mut received = read_safetensors_bytes(weights, "the run's model")
        .map_err(|error| SyncClientError::Model(error.to_string()))?;
    let parameters = sorted_parameters(model);
    if received.len() != parameters.len() {
        return Err(SyncClientError::Protocol(format!(
            "the run's model has {} tensors, this drafter's {}",
            received.len(),
            parameters.len()
        )));
    }
    for (name, parameter) in &parameters {
        let values: Tensor = received
            .remove(name)
            .ok_or_else(|| SyncClientError::Tensor {
                name: name.clone(),
                detail: "missing from the run's model".to_string(),
            })?;
        if values.size() != parameter.size() {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!(
                    "run's shape {:?}, model shape {:?}",
                    values.size(),
                    parameter.size()
                ),
            });
        }
        let values = values
            .f_to_kind(parameter.kind())?
            .f_to_device(parameter.device())?;
        tch::no_grad(|| parameter.shallow_clone().f_copy_(&values))?;
    }
    Ok(())
}
