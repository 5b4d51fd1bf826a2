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
pub type NamedValues = (String, Vec<u64>, Vec<f32>);

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
    write_text(&config_path, &config_text(&config_path, center)?)?;
    let model_path = staging.join(MODEL_FILE_NAME);
    let weights = weight_buffers(center);
    safetensors::serialize_to_file(
        f32_views(&model_path, &weights)?,
        Some(safetensors_metadata()),
        &model_path,
    )
    .map_err(|error| format_error(&model_path, error.to_string()))?;
    if let Some(state) = optimizer_buffers(center) {
        let optimizer_path = staging.join(OPTIMIZER_FILE_NAME);
        safetensors::serialize_to_file(
            f32_views(&optimizer_path, &state)?,
            Some(safetensors_metadata()),
            &optimizer_path,
        )
        .map_err(|error| format_error(&optimizer_path, error.to_string()))?;
    }
    let state_path = staging.join(STATE_FILE_NAME);
    write_text(&state_path, &state_text(&state_path, center, method)?)
}

/// The files [`write_center`] writes, in memory, as (file name, bytes):
/// the same encoders, without the disk (the fuzz seeds and round trips;
/// small centers only, the whole checkpoint is held twice).
pub fn encode_center_files(
    center: &Center,
    method: &str,
) -> Result<Vec<(&'static str, Vec<u8>)>, CheckpointError> {
    let config_path = Path::new(CONFIG_FILE_NAME);
    let model_path = Path::new(MODEL_FILE_NAME);
    let mut files = vec![
        (
            CONFIG_FILE_NAME,
            config_text(config_path, center)?.into_bytes(),
        ),
        (
            MODEL_FILE_NAME,
            safetensors::serialize(
                f32_views(model_path, &weight_buffers(center))?,
                Some(safetensors_metadata()),
            )
            .map_err(|error| format_error(model_path, error.to_string()))?,
        ),
    ];
    if let Some(state) = optimizer_buffers(center) {
        let optimizer_path = Path::new(OPTIMIZER_FILE_NAME);
        files.push((
            OPTIMIZER_FILE_NAME,
            safetensors::serialize(
                f32_views(optimizer_path, &state)?,
                Some(safetensors_metadata()),
            )
            .map_err(|error| format_error(optimizer_path, error.to_string()))?,
        ));
    }
    let state_path = Path::new(STATE_FILE_NAME);
    files.push((
        STATE_FILE_NAME,
        state_text(state_path, center, method)?.into_bytes(),
    ));
    Ok(files)
}

fn format_error(path: &Path, detail: String) -> CheckpointError {
    CheckpointError::Format {
        path: path.to_path_buf(),
        detail,
    }
}

/// `config.json`: the model config, pretty-printed.
fn config_text(config_path: &Path, center: &Center) -> Result<String, CheckpointError> {
    let config: serde_json::Value = serde_json::from_str(&center.config_json)
        .map_err(|error| format_error(config_path, format!("model config: {error}")))?;
    Ok(pretty(&config))
}

/// `center_state.json`: the counters a resumed center continues from.
fn state_text(state_path: &Path, center: &Center, method: &str) -> Result<String, CheckpointError> {
    let state = CenterState {
        version: center.version,
        samples: center.samples,
        updates_applied: center.updates_applied,
        updates_discarded: center.updates_discarded,
        pending_deltas: center.pending_deltas,
        method: method.to_string(),
    };
    let state_json = serde_json::to_value(&state)
        .map_err(|error| format_error(state_path, error.to_string()))?;
    Ok(pretty(&state_json))
}

/// A tensor to write: its name in the file, its shape, its f32 bytes.
type TensorBuffer = (String, Vec<usize>, Vec<u8>);

/// The weights, encoded for `model.safetensors`.
fn weight_buffers(center: &Center) -> Vec<TensorBuffer> {
    center
        .tensors
        .iter()
        .map(|tensor| tensor_buffer(tensor.name.clone(), tensor, &tensor.values))
        .collect()
}

/// The outer optimizer's state (velocity and delta sum of every tensor),
/// encoded for `outer_optimizer.safetensors`; `None` without momentum.
fn optimizer_buffers(center: &Center) -> Option<Vec<TensorBuffer>> {
    let has_momentum = center
        .tensors
        .iter()
        .any(|tensor| !tensor.velocity.is_empty());
    if !has_momentum {
        return None;
    }
    let mut state = Vec::new();
    for tensor in &center.tensors {
        state.push(tensor_buffer(
            format!("{VELOCITY_PREFIX}{}", tensor.name),
            tensor,
            &tensor.velocity,
        ));
        state.push(tensor_buffer(
            format!("{DELTA_SUM_PREFIX}{}", tensor.name),
            tensor,
            &tensor.delta_sum,
        ));
    }
    Some(state)
}

fn tensor_buffer(name: String, tensor: &CenterTensor, values: &[f32]) -> TensorBuffer {
    (
        name,
        tensor.shape.iter().map(|&dim| dim as usize).collect(),
        arith::encode(values, WireDtype::F32),
    )
}

fn safetensors_metadata() -> HashMap<String, String> {
    HashMap::from([("format".to_string(), "pt".to_string())])
}

/// The safetensors views of `buffers` (f32), each checked against its shape.
fn f32_views<'a>(
    path: &Path,
    buffers: &'a [TensorBuffer],
) -> Result<Vec<(String, TensorView<'a>)>, CheckpointError> {
    buffers
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|view| (name.clone(), view))
                .map_err(|error| format_error(path, format!("tensor {name:?}: {error}")))
        })
        .collect()
}

/// A center checkpoint's files as read from its directory; the optional
/// ones `None` when absent.
#[derive(Debug, Clone, Copy)]
pub struct CenterFiles<'a> {
    pub config_json: &'a str,
    pub model: &'a [u8],
    pub state_json: Option<&'a str>,
    pub optimizer: Option<&'a [u8]>,
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
    let state_path = dir.join(STATE_FILE_NAME);
    let state_json = match std::fs::read_to_string(&state_path) {
        Ok(text) => Some(text),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(CheckpointError::Io {
                path: state_path,
                source,
            })
        }
    };
    let model = std::fs::read(&model_path).map_err(io_error(&model_path))?;
    let optimizer_path = dir.join(OPTIMIZER_FILE_NAME);
    let optimizer = if momentum && optimizer_path.is_file() {
        Some(std::fs::read(&optimizer_path).map_err(io_error(&optimizer_path))?)
    } else {
        None
    };
    let files = CenterFiles {
        config_json: &config_json,
        model: &model,
        state_json: state_json.as_deref(),
        optimizer: optimizer.as_deref(),
    };
    decode_center(dir, files, momentum).map(Some)
}

/// The center in `files` (read from `dir`, which errors name): the
/// counters, the weights, and with `momentum` the outer optimizer's state.
/// Every length in the files is checked before anything is allocated from
/// it (the fuzz target `center_checkpoint` feeds it any bytes).
pub fn decode_center(
    dir: &Path,
    files: CenterFiles<'_>,
    momentum: bool,
) -> Result<Center, CheckpointError> {
    let state = decode_state(&dir.join(STATE_FILE_NAME), files.state_json)?;
    let mut tensors: Vec<CenterTensor> =
        decode_f32_safetensors(&dir.join(MODEL_FILE_NAME), files.model)?
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
        decode_optimizer_state(
            &dir.join(OPTIMIZER_FILE_NAME),
            files.optimizer,
            &mut tensors,
            state.pending_deltas,
        )?
    } else {
        0
    };
    let mut center = Center::new(files.config_json.to_string(), tensors, state.version)
        .map_err(|error| format_error(dir, error.to_string()))?;
    center.samples = state.samples;
    center.updates_applied = state.updates_applied;
    center.updates_discarded = state.updates_discarded;
    center.pending_deltas = pending_deltas;
    Ok(center)
}

/// The center's counters; all zero when the checkpoint has none (a
/// drafter's checkpoint used as the starting center).
fn decode_state(state_path: &Path, text: Option<&str>) -> Result<CenterState, CheckpointError> {
    match text {
        Some(text) => {
            serde_json::from_str(text).map_err(|error| format_error(state_path, error.to_string()))
        }
        None => Ok(CenterState {
            version: 0,
            samples: 0,
            updates_applied: 0,
            updates_discarded: 0,
            pending_deltas: 0,
            method: String::new(),
        }),
    }
}

/// Fills each tensor's velocity and delta sum from the outer optimizer's
/// file (zeros for a tensor it does not hold, or for all when there is no
/// file). Returns the pending deltas to resume with: `pending_deltas` as
/// saved, or 0 without the file.
fn decode_optimizer_state(
    optimizer_path: &Path,
    optimizer: Option<&[u8]>,
    tensors: &mut [CenterTensor],
    pending_deltas: u32,
) -> Result<u32, CheckpointError> {
    let (mut stored, pending_deltas): (HashMap<String, Vec<f32>>, u32) = match optimizer {
        Some(bytes) => {
            let stored = decode_f32_safetensors(optimizer_path, bytes)?
                .into_iter()
                .map(|(name, _, values)| (name, values))
                .collect();
            (stored, pending_deltas)
        }
        None => (HashMap::new(), 0),
    };
    for tensor in tensors {
        let elements = tensor.values.len();
        let mut take = |prefix: &str| -> Result<Vec<f32>, CheckpointError> {
            match stored.remove(&format!("{prefix}{}", tensor.name)) {
                Some(values) if values.len() == elements => Ok(values),
                Some(values) => Err(format_error(
                    optimizer_path,
                    format!(
                        "{prefix}{} has {} elements, the weight has {elements}",
                        tensor.name,
                        values.len()
                    ),
                )),
                None => Ok(vec![0.0; elements]),
            }
        };
        tensor.velocity = std::sync::Arc::new(take(VELOCITY_PREFIX)?);
        tensor.delta_sum = std::sync::Arc::new(take(DELTA_SUM_PREFIX)?);
    }
    Ok(pending_deltas)
}

/// Every tensor of a safetensors file's bytes as f32 (bf16 and f32 files
/// are read). safetensors checks the header against the data (offsets,
/// and shapes against byte lengths, without overflow) before any values
/// are allocated.
pub fn decode_f32_safetensors(
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<NamedValues>, CheckpointError> {
    let file =
        SafeTensors::deserialize(bytes).map_err(|error| format_error(path, error.to_string()))?;
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        let dtype = match view.dtype() {
            Dtype::F32 => WireDtype::F32,
            Dtype::BF16 => WireDtype::Bf16,
            other => {
                return Err(format_error(
                    path,
                    format!("tensor {name:?} has dtype {other:?}, expected F32 or BF16"),
                ))
            }
        };
        let shape: Vec<u64> = view.shape().iter().map(|&dim| dim as u64).collect();
        let mut values = vec![0.0f32; view.data().len() / dtype.element_bytes()];
        arith::decode_into(&mut values, view.data(), dtype)
            .map_err(|error| format_error(path, format!("tensor {name:?}: {error}")))?;
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
