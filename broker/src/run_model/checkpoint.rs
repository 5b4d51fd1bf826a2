//! The center on disk, in the same reference `dflash` format as a drafter's
//! checkpoint (`config.json` + `model.safetensors` with the draft parameters
//! in f32, `{"format": "pt"}` metadata), so `DFlashDraftModel.from_pretrained`
//! loads it with no missing or unexpected keys. Beside them, for resuming
//! after a broker restart: `center_state.json` (the step and the samples).
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

/// A tensor read back: name, shape, values.
pub type NamedValues = (String, Vec<u64>, Vec<f32>);

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

/// The counters that make a resumed center continue where it stopped (a
/// file written by an older broker, with local SGD's counters beside
/// these, reads the same).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CenterState {
    /// The committed steps the weights are trained for.
    pub version: u64,
    pub samples: u64,
}

/// Writes `center` to `dir` atomically, replacing what was there: every
/// file goes into a hidden staging sibling first, which then takes `dir`'s
/// place.
pub fn write_center(dir: &Path, center: &Center) -> Result<(), CheckpointError> {
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
    dflash_shell::replace_directory(dir, |staging| write_center_files(staging, center))
}

/// Writes the center's files into `staging`: the model config, the weights
/// and the counters.
fn write_center_files(staging: &Path, center: &Center) -> Result<(), CheckpointError> {
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
    let state_path = staging.join(STATE_FILE_NAME);
    write_text(&state_path, &state_text(&state_path, center)?)
}

/// The files [`write_center`] writes, in memory, as (file name, bytes):
/// the same encoders, without the disk (the fuzz seeds and round trips;
/// small centers only, the whole checkpoint is held twice).
pub fn encode_center_files(
    center: &Center,
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
    let state_path = Path::new(STATE_FILE_NAME);
    files.push((
        STATE_FILE_NAME,
        state_text(state_path, center)?.into_bytes(),
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
fn state_text(state_path: &Path, center: &Center) -> Result<String, CheckpointError> {
    let state = CenterState {
        version: center.version,
        samples: center.samples,
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
}

/// Reads a center written by [`write_center`]; `None` when `dir` holds no
/// center yet. `_outer_state` is ignored: it asked for local SGD's outer
/// optimizer state, which is gone; the argument stays until the callers
/// that still pass it (the data-parallel fault test) drop it.
pub fn read_center(dir: &Path, _outer_state: bool) -> Result<Option<Center>, CheckpointError> {
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
    let files = CenterFiles {
        config_json: &config_json,
        model: &model,
        state_json: state_json.as_deref(),
    };
    decode_center(dir, files).map(Some)
}

/// The center in `files` (read from `dir`, which errors name): the
/// counters and the weights. Every length in the files is checked before
/// anything is allocated from it (the fuzz target `center_checkpoint`
/// feeds it any bytes).
pub fn decode_center(dir: &Path, files: CenterFiles<'_>) -> Result<Center, CheckpointError> {
    let state = decode_state(&dir.join(STATE_FILE_NAME), files.state_json)?;
    let tensors: Vec<CenterTensor> =
        decode_f32_safetensors(&dir.join(MODEL_FILE_NAME), files.model)?
            .into_iter()
            .map(|(name, shape, values)| CenterTensor {
                name,
                shape,
                values: std::sync::Arc::new(values),
            })
            .collect();
    let mut center = Center::new(files.config_json.to_string(), tensors, state.version)
        .map_err(|error| format_error(dir, error.to_string()))?;
    center.samples = state.samples;
    Ok(center)
}

/// The center's counters; zero when the checkpoint has none (a drafter's
/// checkpoint used as the starting center).
fn decode_state(state_path: &Path, text: Option<&str>) -> Result<CenterState, CheckpointError> {
    match text {
        Some(text) => {
            serde_json::from_str(text).map_err(|error| format_error(state_path, error.to_string()))
        }
        None => Ok(CenterState {
            version: 0,
            samples: 0,
        }),
    }
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
