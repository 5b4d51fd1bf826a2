//! The run's model as the broker keeps it: its two files as the snapshot's
//! sender sent them (never decoded), what the weights' header says of
//! them, and the checks a snapshot must pass against them (the same
//! tensors, each with the model's shape; the finite check is the
//! upload's, before the lock).
//!
//! Apart from [`super::ModelSyncState`] because the checkpoint reads and
//! writes this type too, with no drafters or sessions involved.

use std::sync::Arc;

use super::files::{ModelFile, WeightsLayout};
use crate::rpc_error::SyncError;

/// The run's model: `config.json` and `model.safetensors` as they arrived.
///
/// The weights are shared (`Bytes` chunks, the layout behind an `Arc`): a
/// read or a save clones handles under the lock, never the bytes (4 GiB
/// for a 1 B-parameter drafter), and a newer snapshot replaces the whole
/// model without touching them.
#[derive(Debug, Clone)]
pub struct StoredModel {
    /// `config.json`, as the snapshot's sender sent it (UTF-8 JSON).
    pub config_json: String,
    /// `model.safetensors`, in the chunks it arrived in (or the one slice
    /// a checkpoint was read into).
    pub weights: ModelFile,
    /// What its header says: every tensor's name, shape and bytes.
    pub layout: Arc<WeightsLayout>,
    /// The committed optimizer steps the weights are trained for.
    pub version: u64,
    /// Samples those steps trained on (every member's).
    pub samples: u64,
}

impl StoredModel {
    pub fn parameters(&self) -> u64 {
        self.layout.parameters()
    }

    /// Bytes the model's files hold.
    pub fn memory_bytes(&self) -> u64 {
        self.weights.size + self.config_json.len() as u64
    }
}

/// Checks a snapshot's tensors (its header's) against the model's before
/// anything is applied: the same names, each with the model's shape.
pub(super) fn check_layout_against_model(
    model: &WeightsLayout,
    upload: &WeightsLayout,
) -> Result<(), SyncError> {
    for tensor in &model.tensors {
        if upload.get(&tensor.name).is_none() {
            return Err(SyncError::MissingTensor(tensor.name.clone()));
        }
    }
    for tensor in &upload.tensors {
        let stored = model
            .get(&tensor.name)
            .ok_or_else(|| SyncError::UnknownTensor(tensor.name.clone()))?;
        if stored.shape != tensor.shape {
            return Err(SyncError::ShapeMismatch {
                name: tensor.name.clone(),
                got: tensor.shape.clone(),
                model: stored.shape.clone(),
            });
        }
    }
    Ok(())
}
