//! The model's weights: each tensor's f32 little-endian bytes as the
//! snapshot's sender sent them (never decoded), shared copies of them for
//! reads and checkpoints, and the checks a snapshot must pass against them
//! (every tensor once, each with the model's shape; the finite check is
//! the upload's, before the lock).
//!
//! Apart from [`super::ModelSyncState`] because the checkpoint reads and
//! writes these types too, with no drafters or sessions involved.

use std::collections::HashMap;

use bytes::Bytes;

use super::upload::Upload;
use crate::rpc_error::SyncError;

/// One tensor of the model: its f32 little-endian bytes, in the chunks
/// they arrived in (or the one slice a checkpoint was read into).
///
/// The chunks are shared (`Bytes`): a read or a save clones their handles
/// under the lock, never the bytes (4.2 GB for a 1B-parameter drafter),
/// and a newer snapshot replaces the whole model without touching them.
#[derive(Debug, Clone)]
pub struct StoredTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub data: Vec<Bytes>,
}

impl StoredTensor {
    /// Bytes the tensor holds.
    pub fn byte_len(&self) -> u64 {
        self.data.iter().map(|chunk| chunk.len() as u64).sum()
    }
}

/// The run's shared weights.
#[derive(Debug, Clone)]
pub struct StoredModel {
    /// Sorted by name (the checkpoint order).
    pub tensors: Vec<StoredTensor>,
    pub by_name: HashMap<String, usize>,
    /// The draft model's `config.json`, as the snapshot's sender sent it.
    pub config_json: String,
    /// The committed optimizer steps the weights are trained for.
    pub version: u64,
    /// Samples those steps trained on (every member's).
    pub samples: u64,
}

impl StoredModel {
    /// A model of `tensors`, whose values the caller checked finite (an
    /// upload before the lock, a checkpoint when read): the run's one model
    /// is finite by construction, and this pass over 4 bytes a parameter
    /// stays out of the lock.
    pub fn new(
        config_json: String,
        mut tensors: Vec<StoredTensor>,
        version: u64,
    ) -> Result<Self, SyncError> {
        serde_json::from_str::<serde_json::Value>(&config_json)
            .map_err(|error| SyncError::Config(error.to_string()))?;
        tensors.sort_by(|left, right| left.name.cmp(&right.name));
        let mut by_name = HashMap::new();
        for (index, tensor) in tensors.iter().enumerate() {
            if by_name.insert(tensor.name.clone(), index).is_some() {
                return Err(SyncError::DuplicateTensor(tensor.name.clone()));
            }
        }
        Ok(StoredModel {
            tensors,
            by_name,
            config_json,
            version,
            samples: 0,
        })
    }

    pub fn parameters(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| tensor.shape.iter().product::<u64>())
            .sum()
    }

    /// Bytes the weights hold.
    pub fn memory_bytes(&self) -> u64 {
        self.tensors.iter().map(StoredTensor::byte_len).sum()
    }
}

/// Checks a snapshot against the model before anything is applied: it
/// holds every tensor of the model exactly once, each with the model's
/// shape.
pub(super) fn check_upload_against_model(
    model: &StoredModel,
    upload: &Upload,
) -> Result<(), SyncError> {
    // Every tensor of the model exactly once, with its shape.
    if upload.tensors.len() != model.tensors.len() {
        let sent: std::collections::HashSet<&str> = upload
            .tensors
            .iter()
            .map(|tensor| tensor.name.as_str())
            .collect();
        for tensor in &model.tensors {
            if !sent.contains(tensor.name.as_str()) {
                return Err(SyncError::MissingTensor(tensor.name.clone()));
            }
        }
    }
    for tensor in &upload.tensors {
        check_against_model(model, &tensor.name, &tensor.shape)?;
    }
    Ok(())
}

pub(super) fn check_against_model(
    model: &StoredModel,
    name: &str,
    shape: &[u64],
) -> Result<(), SyncError> {
    let index = model
        .by_name
        .get(name)
        .ok_or_else(|| SyncError::UnknownTensor(name.to_string()))?;
    let stored_shape = &model.tensors[*index].shape;
    if stored_shape.as_slice() != shape {
        return Err(SyncError::ShapeMismatch {
            name: name.to_string(),
            got: shape.to_vec(),
            model: stored_shape.clone(),
        });
    }
    Ok(())
}
