//! The center's weights: each tensor in f32 with its outer optimizer
//! buffers, shared snapshots of them for replies and checkpoints, and the
//! checks an upload must pass against them (every tensor once, each with
//! the center's shape, and a base that is not from the future).
//!
//! Apart from [`super::ModelSyncState`] because the checkpoint reads and
//! writes these types too, with no drafters or sessions involved.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::error::SyncError;
use super::settings::MagnitudeBounds;
use super::upload::Upload;
use crate::model_sync::arith::{self, WireDtype};

/// One tensor of the center, in f32, with its outer optimizer state.
///
/// Each buffer is shared (`Arc`): a snapshot for a save or a reply clones
/// the pointers under the lock, not the values (12 bytes per parameter:
/// 12.6 GB for a 1B-parameter drafter), and an update copies a buffer only
/// while such a snapshot still holds it ([`Arc::make_mut`]).
#[derive(Debug, Clone)]
pub struct CenterTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Arc<Vec<f32>>,
    /// Nesterov velocity (empty when the momentum is 0).
    pub velocity: Arc<Vec<f32>>,
    /// Sum of the deltas since the last momentum step (empty likewise).
    pub delta_sum: Arc<Vec<f32>>,
}

/// The run's shared weights.
#[derive(Debug, Clone)]
pub struct Center {
    /// Sorted by name (the checkpoint order).
    pub tensors: Vec<CenterTensor>,
    pub by_name: HashMap<String, usize>,
    /// The draft model's `config.json`, as the first drafter sent it.
    pub config_json: String,
    /// Bumped by every applied delta.
    pub version: u64,
    /// Deltas in `delta_sum` not yet folded into the velocity.
    pub pending_deltas: u32,
    pub samples: u64,
    pub updates_applied: u64,
    pub updates_discarded: u64,
    /// Bounds on the largest magnitude in the weights and the outer
    /// optimizer's buffers: measured when the center is made, then carried
    /// forward through each step without a pass over the buffers (see
    /// [`MagnitudeBounds`]), so a delta that could overflow f32 is refused
    /// before it touches anything.
    pub magnitudes: MagnitudeBounds,
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
        // The run's one model is finite by construction: no JOIN and no
        // checkpoint may make it otherwise.
        for tensor in &tensors {
            let buffers = [
                ("weights", &tensor.values),
                ("outer velocity", &tensor.velocity),
                ("outer delta sum", &tensor.delta_sum),
            ];
            for (what, values) in buffers {
                if let Some(index) = values.iter().position(|value| !value.is_finite()) {
                    return Err(SyncError::BadTensor {
                        name: tensor.name.clone(),
                        detail: format!(
                            "{what} are not finite ({} at element {index}): refused as the run's model",
                            values[index]
                        ),
                    });
                }
            }
        }
        let mut by_name = HashMap::new();
        for (index, tensor) in tensors.iter().enumerate() {
            if by_name.insert(tensor.name.clone(), index).is_some() {
                return Err(SyncError::DuplicateTensor(tensor.name.clone()));
            }
        }
        let mut center = Center {
            tensors,
            by_name,
            config_json,
            version,
            pending_deltas: 0,
            samples: 0,
            updates_applied: 0,
            updates_discarded: 0,
            magnitudes: MagnitudeBounds::default(),
        };
        center.magnitudes = center.measure_magnitudes();
        Ok(center)
    }

    /// The largest magnitude in each of the weights, the velocities and
    /// the delta sums, measured (one pass over every buffer: when the
    /// center is made, and when the carried bounds alone would refuse a
    /// delta).
    pub fn measure_magnitudes(&self) -> MagnitudeBounds {
        let largest = |buffer: fn(&CenterTensor) -> &[f32]| {
            self.tensors
                .iter()
                .flat_map(|tensor| buffer(tensor).iter())
                .fold(0.0f64, |largest, &value| {
                    largest.max(f64::from(value.abs()))
                })
        };
        MagnitudeBounds {
            values: largest(|tensor| &tensor.values),
            velocity: largest(|tensor| &tensor.velocity),
            delta_sum: largest(|tensor| &tensor.delta_sum),
        }
    }

    /// The L2 norm of every weight together (one pass; taken when the
    /// center is made or resumed, not per exchange).
    pub fn weights_norm(&self) -> f64 {
        self.tensors
            .iter()
            .flat_map(|tensor| tensor.values.iter())
            .map(|&value| f64::from(value).powi(2))
            .sum::<f64>()
            .sqrt()
    }

    pub fn parameters(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| tensor.values.len() as u64)
            .sum()
    }

    /// Bytes held: weights plus the outer optimizer's buffers.
    pub fn memory_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| {
                4 * (tensor.values.len() + tensor.velocity.len() + tensor.delta_sum.len()) as u64
            })
            .sum()
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

/// Checks an upload against the center before anything is applied: its base
/// is not from the future, and it holds every tensor of the center exactly
/// once, each with the center's shape.
pub(super) fn check_upload_against_center(
    center: &Center,
    upload: &Upload,
) -> Result<(), SyncError> {
    if upload.base_version > center.version {
        return Err(SyncError::FutureBase {
            base: upload.base_version,
            center: center.version,
        });
    }
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
