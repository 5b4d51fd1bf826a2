//! The model on disk, in the same reference `dflash` format as a drafter's
//! checkpoint (`config.json` + `model.safetensors` with the draft parameters
//! in f32, `{"format": "pt"}` metadata), so `DFlashDraftModel.from_pretrained`
//! loads it with no missing or unexpected keys. Beside them, for resuming
//! after a broker restart: `center_state.json` (the step and the samples).
//!
//! Written with the `safetensors` crate, not libtorch, into a hidden
//! temporary sibling directory that is renamed into place: a reader sees the
//! whole previous model or the whole new one.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use bytes::Bytes;
use safetensors::tensor::View;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use super::store::{first_non_finite, StoredModel, StoredTensor};
pub use crate::rpc_error::CheckpointError;

pub const CONFIG_FILE_NAME: &str = "config.json";
pub const MODEL_FILE_NAME: &str = "model.safetensors";
pub const STATE_FILE_NAME: &str = "center_state.json";

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The counters that make a resumed model continue where it stopped (a
/// file written by an older broker, with local SGD's counters beside
/// these, reads the same).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelState {
    /// The committed steps the weights are trained for.
    pub version: u64,
    pub samples: u64,
}

/// Writes `model` to `dir` atomically, replacing what was there: every
/// file goes into a hidden staging sibling first, which then takes `dir`'s
/// place.
pub fn write_model(dir: &Path, model: &StoredModel) -> Result<(), CheckpointError> {
    // Never written unless finite: a saved model is what every later
    // resume and every user of the run trusts.
    for tensor in &model.tensors {
        if let Some((index, value)) = first_non_finite(&tensor.data) {
            return Err(CheckpointError::Format {
                path: dir.to_path_buf(),
                detail: format!(
                    "tensor {:?} is not finite ({value} at element {index}); the model is not written",
                    tensor.name
                ),
            });
        }
    }
    dflash_shell::replace_directory(dir, |staging| write_model_files(staging, model))
}

/// Writes the model's files into `staging`: the model config, the weights
/// and the counters.
fn write_model_files(staging: &Path, model: &StoredModel) -> Result<(), CheckpointError> {
    let config_path = staging.join(CONFIG_FILE_NAME);
    write_text(&config_path, &config_text(&config_path, model)?)?;
    let model_path = staging.join(MODEL_FILE_NAME);
    safetensors::serialize_to_file(
        f32_views(&model_path, model)?,
        Some(safetensors_metadata()),
        &model_path,
    )
    .map_err(|error| format_error(&model_path, error.to_string()))?;
    let state_path = staging.join(STATE_FILE_NAME);
    write_text(&state_path, &state_text(&state_path, model)?)
}

/// The files [`write_model`] writes, in memory, as (file name, bytes):
/// the same encoders, without the disk (the fuzz seeds and round trips;
/// small models only, the whole checkpoint is held twice).
pub fn encode_model_files(
    model: &StoredModel,
) -> Result<Vec<(&'static str, Vec<u8>)>, CheckpointError> {
    let config_path = Path::new(CONFIG_FILE_NAME);
    let model_path = Path::new(MODEL_FILE_NAME);
    let mut files = vec![
        (
            CONFIG_FILE_NAME,
            config_text(config_path, model)?.into_bytes(),
        ),
        (
            MODEL_FILE_NAME,
            safetensors::serialize(f32_views(model_path, model)?, Some(safetensors_metadata()))
                .map_err(|error| format_error(model_path, error.to_string()))?,
        ),
    ];
    let state_path = Path::new(STATE_FILE_NAME);
    files.push((STATE_FILE_NAME, state_text(state_path, model)?.into_bytes()));
    Ok(files)
}

fn format_error(path: &Path, detail: String) -> CheckpointError {
    CheckpointError::Format {
        path: path.to_path_buf(),
        detail,
    }
}

/// `config.json`: the model config, pretty-printed.
fn config_text(config_path: &Path, model: &StoredModel) -> Result<String, CheckpointError> {
    let config: serde_json::Value = serde_json::from_str(&model.config_json)
        .map_err(|error| format_error(config_path, format!("model config: {error}")))?;
    Ok(pretty(&config))
}

/// `center_state.json`: the counters a resumed model continues from.
fn state_text(state_path: &Path, model: &StoredModel) -> Result<String, CheckpointError> {
    let state = ModelState {
        version: model.version,
        samples: model.samples,
    };
    let state_json = serde_json::to_value(&state)
        .map_err(|error| format_error(state_path, error.to_string()))?;
    Ok(pretty(&state_json))
}

/// A model tensor as safetensors writes it: its f32 bytes as they are,
/// borrowed when they are one chunk, joined (one tensor at a time, never
/// under the model's lock) when they arrived in several.
struct ChunkedF32<'a> {
    shape: Vec<usize>,
    data: &'a [Bytes],
    length: usize,
}

impl View for ChunkedF32<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self.data {
            [one] => Cow::Borrowed(one),
            chunks => Cow::Owned(chunks.concat()),
        }
    }

    fn data_len(&self) -> usize {
        self.length
    }
}

fn safetensors_metadata() -> HashMap<String, String> {
    HashMap::from([("format".to_string(), "pt".to_string())])
}

/// The safetensors views of the model's tensors (f32), each checked
/// against its shape.
fn f32_views<'a>(
    path: &Path,
    model: &'a StoredModel,
) -> Result<Vec<(String, ChunkedF32<'a>)>, CheckpointError> {
    model
        .tensors
        .iter()
        .map(|tensor| {
            let shape: Vec<usize> = tensor.shape.iter().map(|&dim| dim as usize).collect();
            let length = tensor.byte_len() as usize;
            let expected = shape.iter().product::<usize>() * 4;
            if length != expected {
                return Err(format_error(
                    path,
                    format!(
                        "tensor {:?}: {length} bytes, expected {expected} for f32 {shape:?}",
                        tensor.name
                    ),
                ));
            }
            let view = ChunkedF32 {
                shape,
                data: &tensor.data,
                length,
            };
            Ok((tensor.name.clone(), view))
        })
        .collect()
}

/// A model checkpoint's files as read from its directory; the optional
/// ones `None` when absent.
#[derive(Debug, Clone, Copy)]
pub struct ModelFiles<'a> {
    pub config_json: &'a str,
    /// `model.safetensors`: the model's tensors are slices of it.
    pub model: &'a Bytes,
    pub state_json: Option<&'a str>,
}

/// One tensor of a checkpoint decoded to f32 (for tests and tools; the
/// broker itself never decodes the weights).
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Vec<f32>,
}

/// A model checkpoint decoded to f32: [`read_model`]'s answer.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedModel {
    pub version: u64,
    pub samples: u64,
    pub tensors: Vec<DecodedTensor>,
}

/// Reads a model written by [`write_model`] and decodes its weights to
/// f32, for tests and tools; `None` when `dir` holds no model yet.
pub fn read_model(dir: &Path) -> Result<Option<DecodedModel>, CheckpointError> {
    let Some(model) = read_stored_model(dir)? else {
        return Ok(None);
    };
    let tensors = model
        .tensors
        .into_iter()
        .map(|tensor| DecodedTensor {
            values: tensor
                .data
                .iter()
                .flat_map(|chunk| chunk.chunks_exact(4))
                .map(|raw| f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
                .collect(),
            name: tensor.name,
            shape: tensor.shape,
        })
        .collect();
    Ok(Some(DecodedModel {
        version: model.version,
        samples: model.samples,
        tensors,
    }))
}

/// Reads a model written by [`write_model`] as the broker keeps it (each
/// tensor a slice of the file's bytes, nothing decoded); `None` when `dir`
/// holds no model yet.
pub fn read_stored_model(dir: &Path) -> Result<Option<StoredModel>, CheckpointError> {
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
    let model = Bytes::from(std::fs::read(&model_path).map_err(io_error(&model_path))?);
    let files = ModelFiles {
        config_json: &config_json,
        model: &model,
        state_json: state_json.as_deref(),
    };
    decode_model(dir, files).map(Some)
}

/// The model in `files` (read from `dir`, which errors name): the
/// counters and the weights, each tensor a slice of the file's bytes,
/// checked finite. Every length in the files is checked before anything is
/// taken from it (the fuzz target `model_checkpoint` feeds it any bytes).
pub fn decode_model(dir: &Path, files: ModelFiles<'_>) -> Result<StoredModel, CheckpointError> {
    let state = decode_state(&dir.join(STATE_FILE_NAME), files.state_json)?;
    let tensors = f32_tensors(&dir.join(MODEL_FILE_NAME), files.model)?;
    let mut model = StoredModel::new(files.config_json.to_string(), tensors, state.version)
        .map_err(|error| format_error(dir, error.to_string()))?;
    model.samples = state.samples;
    Ok(model)
}

/// The model's counters; zero when the checkpoint has none (a drafter's
/// checkpoint used as the starting model).
fn decode_state(state_path: &Path, text: Option<&str>) -> Result<ModelState, CheckpointError> {
    match text {
        Some(text) => {
            serde_json::from_str(text).map_err(|error| format_error(state_path, error.to_string()))
        }
        None => Ok(ModelState {
            version: 0,
            samples: 0,
        }),
    }
}

/// Every tensor of a safetensors file as a slice of `bytes` (f32 tensors
/// only: the reference format's master weights), each checked finite.
/// safetensors checks the header against the data (offsets, and shapes
/// against byte lengths, without overflow) before any slice is taken.
fn f32_tensors(path: &Path, bytes: &Bytes) -> Result<Vec<StoredTensor>, CheckpointError> {
    let file =
        SafeTensors::deserialize(bytes).map_err(|error| format_error(path, error.to_string()))?;
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(format_error(
                path,
                format!("tensor {name:?} has dtype {:?}, expected F32", view.dtype()),
            ));
        }
        let data = bytes.slice_ref(view.data());
        super::store::check_finite(&name, std::slice::from_ref(&data))
            .map_err(|error| format_error(path, error.to_string()))?;
        let shape: Vec<u64> = view.shape().iter().map(|&dim| dim as u64).collect();
        tensors.push(StoredTensor {
            name,
            shape,
            data: vec![data],
        });
    }
    Ok(tensors)
}

fn pretty(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string()) + "\n"
}

fn write_text(path: &Path, text: &str) -> Result<(), CheckpointError> {
    Ok(dflash_shell::write_synced(path, text.as_bytes())?)
}
