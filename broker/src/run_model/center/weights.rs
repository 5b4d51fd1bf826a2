//! The center's weights: each tensor in f32, shared snapshots of them for
//! replies and checkpoints, and the checks a snapshot must pass against
//! them (every tensor once, each with the center's shape).
//!
//! Apart from [`super::ModelSyncState`] because the checkpoint reads and
//! writes these types too, with no drafters or sessions involved.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::error::SyncError;
use super::upload::Upload;
use crate::run_model::arith::{self, WireDtype};

/// One tensor of the center, in f32.
///
/// The buffer is shared (`Arc`): a snapshot for a save or a reply clones
/// the pointer under the lock, not the values (4.2 GB for a 1B-parameter
/// drafter); a newer snapshot replaces the whole center.
#[derive(Debug, Clone)]
pub struct CenterTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Arc<Vec<f32>>,
}

/// The run's shared weights.
#[derive(Debug, Clone)]
pub struct Center {
    /// Sorted by name (the checkpoint order).
    pub tensors: Vec<CenterTensor>,
    pub by_name: HashMap<String, usize>,
    /// The draft model's `config.json`, as the snapshot's sender sent it.
    pub config_json: String,
    /// The committed optimizer steps the weights are trained for.
    pub version: u64,
    /// Samples those steps trained on (every member's).
    pub samples: u64,
}

impl Center {
    pub fn new(
        config_json: String,
        mut tensors: Vec<CenterTensor>,
        version: u64,
    ) -> Result<Self, SyncError> {
        serde_json::from_str::<serde_json::Value>(&config_json)
            .map_err(|error| SyncError::Config(error.to_string()))?;
        tensors.sort_by(|left, right| left.name.cmp(&right.name));
        // The run's one model is finite by construction: no snapshot and no
        // checkpoint may make it otherwise.
        for tensor in &tensors {
            let values = &tensor.values;
            if let Some(index) = values.iter().position(|value| !value.is_finite()) {
                return Err(SyncError::BadTensor {
                    name: tensor.name.clone(),
                    detail: format!(
                        "weights are not finite ({} at element {index}): refused as the run's model",
                        values[index]
                    ),
                });
            }
        }
        let mut by_name = HashMap::new();
        for (index, tensor) in tensors.iter().enumerate() {
            if by_name.insert(tensor.name.clone(), index).is_some() {
                return Err(SyncError::DuplicateTensor(tensor.name.clone()));
            }
        }
        Ok(Center {
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
            .map(|tensor| tensor.values.len() as u64)
            .sum()
    }

    /// Bytes the weights hold.
    pub fn memory_bytes(&self) -> u64 {
        4 * self.parameters()
    }
}

/// One center tensor encoded for the wire: name, shape, bytes.
pub type EncodedTensor = (String, Vec<u64>, Bytes);

/// One version of the center's weights (name, shape, shared values), in
/// checkpoint order; see
/// [`ModelSyncState::center_snapshot`](super::ModelSyncState::center_snapshot).
pub struct CenterSnapshot {
    pub version: u64,
    pub tensors: Vec<(String, Vec<u64>, Arc<Vec<f32>>)>,
}

impl CenterSnapshot {
    /// The weights encoded as `dtype`, one buffer per tensor.
    pub fn encode(self, dtype: WireDtype) -> (u64, Vec<EncodedTensor>) {
        let tensors = self
            .tensors
            .into_iter()
            .map(|(name, shape, values)| (name, shape, Bytes::from(arith::encode(&values, dtype))))
            .collect();
        (self.version, tensors)
    }
}

/// Checks a snapshot against the center before anything is applied: it
/// holds every tensor of the center exactly once, each with the center's
/// shape.
pub(super) fn check_upload_against_center(
    center: &Center,
    upload: &Upload,
) -> Result<(), SyncError> {
    // Every tensor of the center exactly once, with its shape.
    if upload.tensors.len() != center.tensors.len() {
        let sent: std::collections::HashSet<&str> = upload
            .tensors
            .iter()
            .map(|tensor| tensor.name.as_str())
            .collect();
        for tensor in &center.tensors {
            if !sent.contains(tensor.name.as_str()) {
                return Err(SyncError::MissingTensor(tensor.name.clone()));
            }
        }
    }
    for tensor in &upload.tensors {
        check_against_center(center, &tensor.name, &tensor.shape)?;
    }
    Ok(())
}

pub(super) fn check_against_center(
    center: &Center,
    name: &str,
    shape: &[u64],
) -> Result<(), SyncError> {
    let index = center
        .by_name
        .get(name)
        .ok_or_else(|| SyncError::UnknownTensor(name.to_string()))?;
    let center_shape = &center.tensors[*index].shape;
    if center_shape.as_slice() != shape {
        return Err(SyncError::ShapeMismatch {
            name: name.to_string(),
            got: shape.to_vec(),
            center: center_shape.clone(),
        });
    }
    Ok(())
}
