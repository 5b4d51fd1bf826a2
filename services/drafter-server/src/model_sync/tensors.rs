//! The model to and from its checkpoint's files in memory: the files the
//! drafter's one checkpoint writer makes (`dflash_model::draft::model_files`)
//! are what a snapshot sends, and the run's model's files, read from the
//! broker, are loaded into the model's parameters. Everything libtorch of
//! model sync, apart from the protocol ([`super::session`]), which never
//! touches a tensor.

use std::collections::HashMap;

use dflash_model::draft::checkpoint::{safetensors_shapes, visit_safetensors_bytes};
use dflash_model::draft::{model_files, sorted_parameters, DraftError, DraftModel, ModelFiles};

use super::error::SyncClientError;

/// Where the run's model's tensors come from, in errors.
const ORIGIN: &str = "the run's model";

/// The model's `config.json` and `model.safetensors` (f32 master weights),
/// byte for byte what its checkpoint directory would hold.
pub(super) fn snapshot_files(model: &DraftModel) -> Result<ModelFiles, SyncClientError> {
    model_files(model).map_err(|error| SyncClientError::Model(error.to_string()))
}

/// Copies the run's model (its `model.safetensors` bytes) into the model's
/// parameters. First, from the header alone, it checks that the file holds
/// exactly the model's parameters, each with its shape (a refusal names
/// the tensor and changes nothing); then it copies one tensor at a time,
/// so the file and one tensor are held, not the file twice.
pub(super) fn load_model(model: &DraftModel, weights: &[u8]) -> Result<(), SyncClientError> {
    let model_error = |error: DraftError| SyncClientError::Model(error.to_string());
    let parameters: HashMap<String, tch::Tensor> = sorted_parameters(model).into_iter().collect();
    let shapes = safetensors_shapes(weights, ORIGIN).map_err(model_error)?;
    if shapes.len() != parameters.len() {
        return Err(SyncClientError::Protocol(format!(
            "the run's model has {} tensors, this drafter's {}",
            shapes.len(),
            parameters.len()
        )));
    }
    for (name, shape) in &shapes {
        let parameter = parameters
            .get(name)
            .ok_or_else(|| SyncClientError::Tensor {
                name: name.clone(),
                detail: "not a parameter of this drafter".to_string(),
            })?;
        if *shape != parameter.size() {
            return Err(SyncClientError::Tensor {
                name: name.clone(),
                detail: format!("run's shape {shape:?}, model shape {:?}", parameter.size()),
            });
        }
    }
    visit_safetensors_bytes(weights, ORIGIN, |name, values| {
        let Some(parameter) = parameters.get(name) else {
            return Ok(());
        };
        let values = values
            .f_to_kind(parameter.kind())?
            .f_to_device(parameter.device())?;
        tch::no_grad(|| parameter.shallow_clone().f_copy_(&values))?;
        Ok(())
    })
    .map_err(model_error)
}
