//! Draft checkpoints: a directory that is both a Hugging Face model
//! directory for the reference `DFlashDraftModel.from_pretrained`
//! (`config.json` + `model.safetensors`, draft parameters only) and a
//! resumable training state (`optimizer.safetensors` + `trainer_state.json`).
//!
//! A checkpoint is written into a hidden temporary sibling directory and
//! renamed into place, so a reader (or `--resume` after a crash) sees either
//! the whole previous checkpoint or the whole new one, never a torn one.
//!
//! One writer: [`model_files`] makes the model's two files in memory
//! (`config.json`, `model.safetensors`), byte for byte what a checkpoint
//! directory holds; a checkpoint writes them, and a drafter sends them as
//! the run's model (the broker keeps and writes them as they are). Beside
//! the path reader, [`read_safetensors_bytes`] reads the weights back from
//! bytes (the run's model as the broker serves it).

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::View;
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::config::DraftConfig;
use super::error::DraftError;
use super::model::{
    add_named_variable, parameter_shapes, PREDECESSOR_CODEBOOK_NAME, SUCCESSOR_CODEBOOK_NAME,
};
use super::model::{DraftModel, FrozenTargetHeads};
use super::optim::AdamW;

pub const CONFIG_FILE_NAME: &str = "config.json";
pub const MODEL_FILE_NAME: &str = "model.safetensors";
pub const OPTIMIZER_FILE_NAME: &str = "optimizer.safetensors";
pub const TRAINER_STATE_FILE_NAME: &str = "trainer_state.json";

/// Where training stood when the checkpoint was taken; with the optimizer
/// moments it is everything `--resume` needs (anchor sampling is seeded per
/// step from `seed`, so no RNG state is stored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingProgress {
    /// Optimizer steps completed.
    pub step: u64,
    /// Schedule length the learning rate was computed against.
    pub total_steps: u64,
    pub samples_trained: u64,
    pub tokens_trained: u64,
    /// Base seed of anchor sampling.
    pub seed: u64,
    /// Learning rate used by the last step (informational).
    pub learning_rate: f64,
    /// Loss of the last step (informational).
    pub last_loss: f64,
}

impl From<dflash_shell::DurableError> for DraftError {
    fn from(error: dflash_shell::DurableError) -> Self {
        DraftError::Io {
            path: error.path,
            source: error.source,
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> DraftError + '_ {
    move |source| DraftError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a checkpoint of `model` (and, when given, the optimizer and
/// progress) to `dir` atomically. An existing `dir` is replaced.
pub fn save_draft_checkpoint(
    dir: &Path,
    model: &DraftModel,
    training: Option<(&AdamW, &TrainingProgress)>,
) -> Result<(), DraftError> {
    dflash_shell::replace_directory(dir, |staging| {
        write_checkpoint_files(staging, model, training)
    })
}

/// A model's two files in the reference format, in memory: what a
/// checkpoint directory holds of it, byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFiles {
    /// `config.json`: the model config, pretty-printed.
    pub config_json: String,
    /// `model.safetensors`: the parameters (f32 master weights), sorted by
    /// name, with the `{"format": "pt"}` metadata.
    pub weights: Vec<u8>,
}

/// The model's trainable parameters, sorted by name (the checkpoint order).
pub fn sorted_parameters(model: &DraftModel) -> Vec<(String, Tensor)> {
    let mut variables: Vec<(String, Tensor)> = model.var_store().variables().into_iter().collect();
    variables.sort_by(|left, right| left.0.cmp(&right.0));
    variables
}

/// The model's `config.json` and `model.safetensors`, in memory: the one
/// encoding of the reference format, which a checkpoint writes to disk
/// and a drafter sends as the run's model. The weights are encoded into
/// one buffer, each parameter copied to the host only as it is written.
pub fn model_files(model: &DraftModel) -> Result<ModelFiles, DraftError> {
    Ok(ModelFiles {
        config_json: json_text(&model.config().to_hf_json("float32"))?,
        weights: safetensors_bytes(&sorted_parameters(model))?,
    })
}

/// Writes a checkpoint's files into the empty directory `staging`.
fn write_checkpoint_files(
    staging: &Path,
    model: &DraftModel,
    training: Option<(&AdamW, &TrainingProgress)>,
) -> Result<(), DraftError> {
    let files = model_files(model)?;
    dflash_shell::write_synced(
        &staging.join(CONFIG_FILE_NAME),
        files.config_json.as_bytes(),
    )?;
    dflash_shell::write_synced(&staging.join(MODEL_FILE_NAME), &files.weights)?;
    drop(files);
    if let Some((optimizer, progress)) = training {
        write_safetensors(
            &staging.join(OPTIMIZER_FILE_NAME),
            &optimizer.state_tensors(),
        )?;
        let progress_json = serde_json::to_value(progress)
            .map_err(|error| DraftError::Checkpoint(format!("trainer state: {error}")))?;
        write_json(&staging.join(TRAINER_STATE_FILE_NAME), &progress_json)?;
    }
    Ok(())
}

/// Reads a checkpoint's `config.json`.
pub fn load_draft_config(dir: &Path) -> Result<DraftConfig, DraftError> {
    let path = dir.join(CONFIG_FILE_NAME);
    let text = std::fs::read_to_string(&path).map_err(io_error(&path))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| DraftError::Json {
            path: path.clone(),
            source,
        })?;
    DraftConfig::from_hf_json(&value)
}

/// Loads a draft model from a checkpoint directory. Every parameter of the
/// configuration must be present with its shape, and nothing else may be:
/// the same strictness as the reference loader's missing/unexpected keys.
pub fn load_draft_model(
    dir: &Path,
    frozen: FrozenTargetHeads,
    device: Device,
    compute_kind: Kind,
) -> Result<DraftModel, DraftError> {
    let config = load_draft_config(dir)?;
    let path = dir.join(MODEL_FILE_NAME);
    let stored = read_safetensors(&path)?;
    draft_model_from_tensors(
        config,
        stored,
        &path.display().to_string(),
        frozen,
        device,
        compute_kind,
    )
}

/// A draft model from its parameters in memory (the online evaluator's
/// model, read over the network): every parameter of `config` with its
/// shape, and nothing else, as [`load_draft_model`] requires of a file.
/// `origin` names where the tensors came from in errors.
pub fn draft_model_from_tensors(
    config: DraftConfig,
    mut tensors: HashMap<String, Tensor>,
    origin: &str,
    frozen: FrozenTargetHeads,
    device: Device,
    compute_kind: Kind,
) -> Result<DraftModel, DraftError> {
    let var_store = VarStore::new(device);
    for (name, shape) in parameter_shapes(&config) {
        // The selector's codebooks are stored without `.weight` (what
        // `DFlash2DraftModel.from_pretrained` maps); the reference's own
        // `save_pretrained` writes them with it: read both.
        let tensor = tensors
            .remove(&name)
            .or_else(|| {
                let is_codebook =
                    name == PREDECESSOR_CODEBOOK_NAME || name == SUCCESSOR_CODEBOOK_NAME;
                is_codebook
                    .then(|| tensors.remove(&format!("{name}.weight")))
                    .flatten()
            })
            .ok_or_else(|| DraftError::Checkpoint(format!("{origin}: missing tensor {name:?}")))?;
        if tensor.size() != shape {
            return Err(DraftError::Checkpoint(format!(
                "{origin}: tensor {name:?} has shape {:?}, the config implies {shape:?}",
                tensor.size()
            )));
        }
        add_named_variable(&var_store, &name, &tensor.to_kind(Kind::Float))?;
    }
    if let Some(unexpected) = tensors.keys().next() {
        return Err(DraftError::Checkpoint(format!(
            "{origin}: unexpected tensor {unexpected:?} ({} unexpected in all)",
            tensors.len()
        )));
    }
    DraftModel::from_var_store(config, var_store, frozen, compute_kind)
}

/// The optimizer moments and progress of a checkpoint written with training state.
pub fn load_training_state(
    dir: &Path,
) -> Result<(TrainingProgress, BTreeMap<String, Tensor>), DraftError> {
    let progress_path = dir.join(TRAINER_STATE_FILE_NAME);
    let text = std::fs::read_to_string(&progress_path).map_err(io_error(&progress_path))?;
    let progress: TrainingProgress =
        serde_json::from_str(&text).map_err(|source| DraftError::Json {
            path: progress_path,
            source,
        })?;
    let moments = read_safetensors(&dir.join(OPTIMIZER_FILE_NAME))?
        .into_iter()
        .collect();
    Ok((progress, moments))
}

/// Writes named tensors with the `{"format": "pt"}` metadata transformers
/// checks for ([`safetensors_bytes`], then the file, synced).
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), DraftError> {
    let bytes = safetensors_bytes(tensors)?;
    Ok(dflash_shell::write_synced(path, &bytes)?)
}

/// The safetensors encoding of named tensors (f32, bf16, f16, i64, i32 or
/// u8, as they are), with the `{"format": "pt"}` metadata transformers
/// checks for. Each tensor is copied to the host only while the encoder
/// writes it: the encoding is the only whole copy.
pub fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, DraftError> {
    let failure = RefCell::new(None);
    let views = tensors
        .iter()
        .map(|(name, tensor)| {
            let dtype = match tensor.kind() {
                Kind::Float => safetensors::Dtype::F32,
                Kind::BFloat16 => safetensors::Dtype::BF16,
                Kind::Half => safetensors::Dtype::F16,
                Kind::Int64 => safetensors::Dtype::I64,
                Kind::Int => safetensors::Dtype::I32,
                Kind::Uint8 => safetensors::Dtype::U8,
                other => {
                    return Err(DraftError::Checkpoint(format!(
                        "tensor {name:?}: cannot store kind {other:?}"
                    )));
                }
            };
            let view = HostTensor {
                name,
                tensor: tensor.detach(),
                dtype,
                shape: tensor.size().iter().map(|&dim| dim as usize).collect(),
                length: tensor.numel() * tensor.kind().elt_size_in_bytes(),
                failure: &failure,
            };
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|error| DraftError::Checkpoint(format!("safetensors: {error}")))?;
    match failure.into_inner() {
        Some(error) => Err(error),
        None => Ok(bytes),
    }
}

/// A tensor as the safetensors encoder takes it: its bytes copied to the
/// host when the encoder asks for them (one tensor at a time), a failed
/// copy kept in `failure` (the encoder's view cannot fail) and returned.
struct HostTensor<'a> {
    name: &'a str,
    tensor: Tensor,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    length: usize,
    failure: &'a RefCell<Option<DraftError>>,
}

impl HostTensor<'_> {
    fn host_bytes(&self) -> Result<Vec<u8>, DraftError> {
        let host = self.tensor.f_to_device(Device::Cpu)?.contiguous();
        let mut bytes = vec![0u8; self.length];
        host.f_copy_data_u8(&mut bytes, host.numel())?;
        Ok(bytes)
    }
}

impl View for HostTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self.host_bytes() {
            Ok(bytes) => Cow::Owned(bytes),
            Err(error) => {
                let mut failure = self.failure.borrow_mut();
                if failure.is_none() {
                    *failure = Some(DraftError::Checkpoint(format!(
                        "tensor {:?}: {error}",
                        self.name
                    )));
                }
                Cow::Owned(vec![0u8; self.length])
            }
        }
    }

    fn data_len(&self) -> usize {
        self.length
    }
}

/// Every tensor of a safetensors file held in memory, as CPU tensors of
/// their dtype (`origin` names the bytes in errors): the header checked
/// against the bytes by the `safetensors` crate before any is read.
pub fn read_safetensors_bytes(
    bytes: &[u8],
    origin: &str,
) -> Result<HashMap<String, Tensor>, DraftError> {
    let mut tensors = HashMap::new();
    visit_safetensors_bytes(bytes, origin, |name, tensor| {
        tensors.insert(name.to_string(), tensor);
        Ok(())
    })?;
    Ok(tensors)
}

/// The name and shape of every tensor of a safetensors file held in
/// memory, read from its header (checked against the bytes): what a caller
/// checks before it copies anything.
pub fn safetensors_shapes(
    bytes: &[u8],
    origin: &str,
) -> Result<Vec<(String, Vec<i64>)>, DraftError> {
    let file = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|error| DraftError::Checkpoint(format!("{origin}: {error}")))?;
    Ok(file
        .iter()
        .map(|(name, view)| {
            let shape = view.shape().iter().map(|&dim| dim as i64).collect();
            (name.to_string(), shape)
        })
        .collect())
}

/// Hands each tensor of a safetensors file held in memory to `visit`, one
/// at a time, as a CPU tensor of its dtype: a caller that copies each into
/// its place holds the file and one tensor, not the file twice.
pub fn visit_safetensors_bytes(
    bytes: &[u8],
    origin: &str,
    mut visit: impl FnMut(&str, Tensor) -> Result<(), DraftError>,
) -> Result<(), DraftError> {
    let file = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|error| DraftError::Checkpoint(format!("{origin}: {error}")))?;
    for (name, view) in file.iter() {
        let kind = match view.dtype() {
            safetensors::Dtype::F32 => Kind::Float,
            safetensors::Dtype::BF16 => Kind::BFloat16,
            safetensors::Dtype::F16 => Kind::Half,
            safetensors::Dtype::I64 => Kind::Int64,
            safetensors::Dtype::I32 => Kind::Int,
            safetensors::Dtype::U8 => Kind::Uint8,
            other => {
                return Err(DraftError::Checkpoint(format!(
                "{origin}: tensor {name:?} has dtype {other:?}, which a draft model does not hold"
            )))
            }
        };
        let shape: Vec<i64> = view.shape().iter().map(|&dim| dim as i64).collect();
        visit(name, Tensor::f_from_data_size(view.data(), &shape, kind)?)?;
    }
    Ok(())
}

/// Reads every tensor of a safetensors file onto the CPU.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, Tensor>, DraftError> {
    let tensors = Tensor::read_safetensors(path)
        .map_err(|error| DraftError::Checkpoint(format!("{}: {error}", path.display())))?;
    Ok(tensors.into_iter().collect())
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), DraftError> {
    let text = serde_json::to_string_pretty(value).map_err(|source| DraftError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(dflash_shell::write_synced(path, (text + "\n").as_bytes())?)
}

/// A JSON file's text as the checkpoint writes it: pretty, one newline.
fn json_text(value: &serde_json::Value) -> Result<String, DraftError> {
    let text = serde_json::to_string_pretty(value).map_err(|source| DraftError::Json {
        path: Path::new(CONFIG_FILE_NAME).to_path_buf(),
        source,
    })?;
    Ok(text + "\n")
}
