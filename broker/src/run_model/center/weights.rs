//! The center's weights: each tensor's f32 little-endian bytes as the
//! snapshot's sender sent them (never decoded), shared copies of them for
//! reads and checkpoints, and the checks a snapshot must pass against them
//! (every tensor once, each with the center's shape; the finite check is
//! the upload's, before the lock).
//!
//! Apart from [`super::ModelSyncState`] because the checkpoint reads and
//! writes these types too, with no drafters or sessions involved.

use std::collections::HashMap;

use bytes::Bytes;

use super::upload::Upload;
use crate::rpc_error::SyncError;

/// One tensor of the center: its f32 little-endian bytes, in the chunks
/// they arrived in (or the one slice a checkpoint was read into).
///
/// The chunks are shared (`Bytes`): a read or a save clones their handles
/// under the lock, never the bytes (4.2 GB for a 1B-parameter drafter),
/// and a newer snapshot replaces the whole center without touching them.
#[derive(Debug, Clone)]
pub struct CenterTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub data: Vec<Bytes>,
}

impl CenterTensor {
    /// Bytes the tensor holds.
    pub fn byte_len(&self) -> u64 {
        self.data.iter().map(|chunk| chunk.len() as u64).sum()
    }
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
    /// A center of `tensors`, whose values the caller checked finite (an
    /// upload before the lock, a checkpoint when read): the run's one model
    /// is finite by construction, and this pass over 4 bytes a parameter
    /// stays out of the lock.
    pub fn new(
        config_json: String,
        mut tensors: Vec<CenterTensor>,
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
            .map(|tensor| tensor.shape.iter().product::<u64>())
            .sum()
    }

    /// Bytes the weights hold.
    pub fn memory_bytes(&self) -> u64 {
        self.tensors.iter().map(CenterTensor::byte_len).sum()
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
