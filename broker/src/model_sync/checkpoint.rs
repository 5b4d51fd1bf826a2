//! The center on disk, in the same reference `dflash` format as a drafter's
//! checkpoint (`config.json` + `model.safetensors` with the draft parameters
//! in f32, `{"format": "pt"}` metadata), so `DFlashDraftModel.from_pretrained`
//! loads it with no missing or unexpected keys. Beside them, for resuming
//! after a broker restart: `center_state.json` (version and counters) and,
//! when the outer step has momentum, `outer_optimizer.safetensors`.
//!
//! Written with the `safetensors` crate, not libtorch, into a hidden
//! temporary sibling directory that is renamed into place: a reader sees the
//! whole previous center or the whole new one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use super::arith::{self, WireDtype};
use super::center::{Center, CenterTensor};

pub const CONFIG_FILE_NAME: &str = "config.json";
pub const MODEL_FILE_NAME: &str = "model.safetensors";
pub const STATE_FILE_NAME: &str = "center_state.json";
pub const OPTIMIZER_FILE_NAME: &str = "outer_optimizer.safetensors";

/// A tensor read back: name, shape, values.
type NamedValues = (String, Vec<u64>, Vec<f32>);

const VELOCITY_PREFIX: &str = "velocity.";
const DELTA_SUM_PREFIX: &str = "delta_sum.";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },
}

impl From<dflash_shell::DurableError> for CheckpointError {
    fn from(error: dflash_shell::DurableError) -> Self {
        CheckpointError::Io {
            path: error.path,
            source: error.source,
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The counters that make a resumed center continue where it stopped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CenterState {
    pub version: u64,
    pub samples: u64,
    pub updates_applied: u64,
    pub updates_discarded: u64,
    pub pending_deltas: u32,
    /// The method and parameters the center was trained with (informational).
    pub method: String,
}

/// Writes `center` to `dir` atomically, replacing what was there: every
/// file goes into a hidden staging sibling first, which then takes `dir`'s
/// place.
pub fn write_center(dir: &Path, center: &Center, method: &str) -> Result<(), CheckpointError> {
    // Never written unless finite: a saved center is what every later
    // resume and every user of the run trusts.
    for tensor in &center.tensors {
        if let Some(index) = tensor.values.iter().position(|value| !value.is_finite()) {
            return Err(CheckpointError::Format {
                path: dir.to_path_buf(),
                detail: format!(
                    "tensor {:?} is not finite ({} at element {index}); the center is not written",
                    tensor.name, tensor.values[index]
                ),
            });
        }
    }
    dflash_shell::replace_directory(dir, |staging| write_center_files(staging, center, method))
}

/// Writes the center's files into `staging`: the model config, the weights,
/// the outer optimizer's state when it has momentum, and the counters.
fn write_center_files(
    staging: &Path,
    center: &Center,
    method: &str,
) -> Result<(), CheckpointError> {
    let config_path = staging.join(CONFIG_FILE_NAME);
    let config: serde_json::Value =
        serde_json::from_str(&center.config_json).map_err(|error| CheckpointError::Format {
            path: config_path.clone(),
            detail: format!("model config: {error}"),
        })?;
    write_text(&config_path, &pretty(&config))?;

    let weights: Vec<(String, &CenterTensor, &[f32])> = center
        .tensors
        .iter()
        .map(|tensor| (tensor.name.clone(), tensor, tensor.values.as_slice()))
        .collect();
    write_f32_safetensors(&staging.join(MODEL_FILE_NAME), &weights)?;
    let has_momentum = center
        .tensors
        .iter()
        .any(|tensor| !tensor.velocity.is_empty());
    if has_momentum {
        let mut state: Vec<(String, &CenterTensor, &[f32])> = Vec::new();
        for tensor in &center.tensors {
            state.push((
                format!("{VELOCITY_PREFIX}{}", tensor.name),
                tensor,
                tensor.velocity.as_slice(),
            ));
            state.push((
                format!("{DELTA_SUM_PREFIX}{}", tensor.name),
                tensor,
                tensor.delta_sum.as_slice(),
            ));
        }
        write_f32_safetensors(&staging.join(OPTIMIZER_FILE_NAME), &state)?;
    }
    let state = CenterState {
        version: center.version,
        samples: center.samples,
        updates_applied: center.updates_applied,
        updates_discarded: center.updates_discarded,
        pending_deltas: center.pending_deltas,
        method: method.to_string(),
    };
    let state_json = serde_json::to_value(&state).map_err(|error| CheckpointError::Format {
        path: staging.join(STATE_FILE_NAME),
        detail: error.to_string(),
    })?;
    write_text(&staging.join(STATE_FILE_NAME), &pretty(&state_json))
}

/// Reads a center written by [`write_center`]; `None` when `dir` holds no
/// center yet. With `momentum` the outer optimizer state is read too (zeros
/// when the checkpoint has none).
pub fn read_center(dir: &Path, momentum: bool) -> Result<Option<Center>, CheckpointError> {
    let model_path = dir.join(MODEL_FILE_NAME);
    if !model_path.is_file() {
        return Ok(None);
    }
    let config_path = dir.join(CONFIG_FILE_NAME);
    let config_json = std::fs::read_to_string(&config_path).map_err(io_error(&config_path))?;
    let state = read_state(dir)?;
    let mut tensors: Vec<CenterTensor> = read_f32_safetensors(&model_path)?
        .into_iter()
        .map(|(name, shape, values)| CenterTensor {
            name,
            shape,
            values: std::sync::Arc::new(values),
            velocity: std::sync::Arc::default(),
            delta_sum: std::sync::Arc::default(),
        })
        .collect();
    let pending_deltas = if momentum {
        read_optimizer_state(dir, &mut tensors, state.pending_deltas)?
    } else {
        0
    };
    let mut center = Center::new(config_json, tensors, state.version).map_err(|error| {
        CheckpointError::Format {
            path: dir.to_path_buf(),
            detail: error.to_string(),
        }
    })?;
    center.samples = state.samples;
    center.updates_applied = state.updates_applied;
    center.updates_discarded = state.updates_discarded;
    center.pending_deltas = pending_deltas;
    Ok(Some(center))
}

/// Reads the center's counters; all zero when the checkpoint has none (a
/// drafter's checkpoint used as the starting center).
fn read_state(dir: &Path) -> Result<CenterState, CheckpointError> {
    let state_path = dir.join(STATE_FILE_NAME);
    match std::fs::read_to_string(&state_path) {
        Ok(text) => serde_json::from_str(&text).map_err(|error| CheckpointError::Format {
            path: state_path.clone(),
            detail: error.to_string(),
        }),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(CenterState {
            version: 0,
            samples: 0,
            updates_applied: 0,
            updates_discarded: 0,
            pending_deltas: 0,
            method: String::new(),
        }),
        Err(source) => Err(CheckpointError::Io {
            path: state_path,
            source,
        }),
    }
}

/// Fills each tensor's velocity and delta sum from the outer optimizer's
/// file (zeros for a tensor it does not hold, or for all when there is no
/// file). Returns the pending deltas to resume with: `pending_deltas` as
/// saved, or 0 without the file.
fn read_optimizer_state(
    dir: &Path,
    tensors: &mut [CenterTensor],
    pending_deltas: u32,
) -> Result<u32, CheckpointError> {
    let optimizer_path = dir.join(OPTIMIZER_FILE_NAME);
    let (mut stored, pending_deltas): (HashMap<String, Vec<f32>>, u32) = if optimizer_path.is_file()
    {
        let stored = read_f32_safetensors(&optimizer_path)?
            .into_iter()
            .map(|(name, _, values)| (name, values))
            .collect();
        (stored, pending_deltas)
    } else {
        (HashMap::new(), 0)
    };
    for tensor in tensors {
        let elements = tensor.values.len();
        let mut take = |prefix: &str| -> Result<Vec<f32>, CheckpointError> {
            match stored.remove(&format!("{prefix}{}", tensor.name)) {
                Some(values) if values.len() == elements => Ok(values),
                Some(values) => Err(CheckpointError::Format {
                    path: optimizer_path.clone(),
                    detail: format!(
                        "{prefix}{} has {} elements, the weight has {elements}",
                        tensor.name,
                        values.len()
                    ),
                }),
                None => Ok(vec![0.0; elements]),
            }
        };
        tensor.velocity = std::sync::Arc::new(take(VELOCITY_PREFIX)?);
        tensor.delta_sum = std::sync::Arc::new(take(DELTA_SUM_PREFIX)?);
    }
    Ok(pending_deltas)
}

fn write_f32_safetensors(
    path: &Path,
    tensors: &[(String, &CenterTensor, &[f32])],
) -> Result<(), CheckpointError> {
    let buffers: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, tensor, values)| {
            (
                name.clone(),
                tensor.shape.iter().map(|&dim| dim as usize).collect(),
                arith::encode(values, WireDtype::F32),
            )
        })
        .collect();
    let views = buffers
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|view| (name.clone(), view))
                .map_err(|error| CheckpointError::Format {
                    path: path.to_path_buf(),
                    detail: format!("tensor {name:?}: {error}"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|error| {
        CheckpointError::Format {
            path: path.to_path_buf(),
            detail: error.to_string(),
        }
    })
}

/// Every tensor of a safetensors file as f32 (bf16 and f32 files are read).
fn read_f32_safetensors(path: &Path) -> Result<Vec<NamedValues>, CheckpointError> {
    let bytes = std::fs::read(path).map_err(io_error(path))?;
    let format_error = |detail: String| CheckpointError::Format {
        path: path.to_path_buf(),
        detail,
    };
    let file = SafeTensors::deserialize(&bytes).map_err(|error| format_error(error.to_string()))?;
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        let dtype = match view.dtype() {
            Dtype::F32 => WireDtype::F32,
            Dtype::BF16 => WireDtype::Bf16,
            other => {
                return Err(format_error(format!(
                    "tensor {name:?} has dtype {other:?}, expected F32 or BF16"
                )))
            }
        };
        let shape: Vec<u64> = view.shape().iter().map(|&dim| dim as u64).collect();
        let mut values = vec![0.0f32; shape.iter().product::<u64>() as usize];
        arith::decode_into(&mut values, view.data(), dtype)
            .map_err(|error| format_error(format!("tensor {name:?}: {error}")))?;
        tensors.push((name, shape, values));
    }
    Ok(tensors)
}

fn pretty(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string()) + "\n"
}

fn write_text(path: &Path, text: &str) -> Result<(), CheckpointError> {
    Ok(dflash_shell::write_synced(path, text.as_bytes())?)
}
