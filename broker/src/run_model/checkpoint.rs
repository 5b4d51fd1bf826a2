//! The model on disk: its two files as rank 0 sent them (`config.json` and
//! `model.safetensors`, the reference `dflash` format the drafter's
//! checkpoint writer makes, so `DFlashDraftModel.from_pretrained` loads it
//! with no missing or unexpected keys), written verbatim, never decoded.
//! Beside them, for resuming after a broker restart, the broker's own
//! `center_state.json` (the step and the samples; the name kept so older
//! runs resume).
//!
//! Written into a hidden temporary sibling directory that is renamed into
//! place: a reader sees the whole previous model or the whole new one.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::store::files::{first_non_finite_tensor, parse_whole_file, ModelFile};
pub use super::store::files::{CONFIG_FILE_NAME, MODEL_FILE_NAME};
use super::store::StoredModel;
pub use crate::rpc_error::CheckpointError;

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

/// Writes `model` to `dir` atomically, replacing what was there: its files
/// as they arrived (the weights chunk after chunk, never joined) and the
/// counters go into a hidden staging sibling first, which then takes
/// `dir`'s place. The model is finite by construction (a commit takes only
/// a checked upload, a resume checks what it reads): nothing is decoded
/// here.
pub fn write_model(dir: &Path, model: &StoredModel) -> Result<(), CheckpointError> {
    dflash_shell::replace_directory(dir, |staging| write_model_files(staging, model))
}

/// Writes the model's files into `staging`: the config and the weights as
/// they arrived, and the counters.
fn write_model_files(staging: &Path, model: &StoredModel) -> Result<(), CheckpointError> {
    dflash_shell::write_synced(
        &staging.join(CONFIG_FILE_NAME),
        model.config_json.as_bytes(),
    )?;
    dflash_shell::write_parts_synced(&staging.join(MODEL_FILE_NAME), &model.weights.chunks)?;
    let state_path = staging.join(STATE_FILE_NAME);
    dflash_shell::write_synced(&state_path, state_text(&state_path, model)?.as_bytes())?;
    Ok(())
}

/// The files [`write_model`] writes, in memory, as (file name, bytes)
/// (the fuzz seeds and round trips; small models only, the weights are
/// joined).
pub fn encode_model_files(
    model: &StoredModel,
) -> Result<Vec<(&'static str, Vec<u8>)>, CheckpointError> {
    let state_path = Path::new(STATE_FILE_NAME);
    Ok(vec![
        (CONFIG_FILE_NAME, model.config_json.clone().into_bytes()),
        (MODEL_FILE_NAME, model.weights.joined()),
        (STATE_FILE_NAME, state_text(state_path, model)?.into_bytes()),
    ])
}

fn format_error(path: &Path, detail: String) -> CheckpointError {
    CheckpointError::Format {
        path: path.to_path_buf(),
        detail,
    }
}

/// `center_state.json`: the counters a resumed model continues from.
fn state_text(state_path: &Path, model: &StoredModel) -> Result<String, CheckpointError> {
    let state = ModelState {
        version: model.version,
        samples: model.samples,
    };
    let state_json = serde_json::to_value(&state)
        .map_err(|error| format_error(state_path, error.to_string()))?;
    Ok(serde_json::to_string_pretty(&state_json).unwrap_or_else(|_| state_json.to_string()) + "\n")
}

/// A model checkpoint's files as read from its directory; the optional
/// ones `None` when absent.
#[derive(Debug, Clone, Copy)]
pub struct ModelFiles<'a> {
    pub config_json: &'a str,
    /// `model.safetensors`: the model keeps it as it is.
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
    let bytes = model.weights.joined();
    let tensors = model
        .layout
        .tensors
        .iter()
        .map(|tensor| DecodedTensor {
            values: bytes[tensor.start as usize..tensor.end as usize]
                .chunks_exact(4)
                .map(|raw| f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
                .collect(),
            name: tensor.name.clone(),
            shape: tensor.shape.clone(),
        })
        .collect();
    Ok(Some(DecodedModel {
        version: model.version,
        samples: model.samples,
        tensors,
    }))
}

/// Reads a model written by [`write_model`] as the broker keeps it (the
/// files' bytes as they are, nothing decoded); `None` when `dir` holds no
/// model yet.
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
/// counters, the config (JSON) and the weights as they are, their header
/// checked as an upload's (f32 tensors inside the file) and every value
/// checked finite. Every length in the files is checked before anything
/// is taken from it (the fuzz target `model_checkpoint` feeds it any
/// bytes).
pub fn decode_model(dir: &Path, files: ModelFiles<'_>) -> Result<StoredModel, CheckpointError> {
    let state = decode_state(&dir.join(STATE_FILE_NAME), files.state_json)?;
    let config_path = dir.join(CONFIG_FILE_NAME);
    serde_json::from_str::<serde_json::Value>(files.config_json)
        .map_err(|error| format_error(&config_path, format!("model config: {error}")))?;
    let model_path = dir.join(MODEL_FILE_NAME);
    let layout =
        parse_whole_file(files.model).map_err(|detail| format_error(&model_path, detail))?;
    let weights = ModelFile::whole(files.model.clone());
    if let Some((name, index, value)) = first_non_finite_tensor(&weights, &layout) {
        return Err(format_error(
            &model_path,
            format!("tensor {name:?}: weights are not finite ({value} at element {index})"),
        ));
    }
    Ok(StoredModel {
        config_json: files.config_json.to_string(),
        weights,
        layout: Arc::new(layout),
        version: state.version,
        samples: state.samples,
    })
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
