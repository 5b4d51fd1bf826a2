//! The run's model's errors: why a snapshot, a report or a checkpoint was
//! refused. They belong to [`crate::run_model`] but are defined here,
//! beneath the one table that maps them to gRPC codes, so that the run's
//! model (its service included) imports [`RpcError`](super::RpcError) and
//! nothing here imports the run's model (as the lighthouse, whose
//! refusals are `RpcError` variants). `crate::run_model` re-exports each
//! where it is used.

use std::path::PathBuf;

/// Why a snapshot or a chunk was refused. Messages name the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    #[error("no model yet: the first snapshot must carry the model's weights")]
    NoModel,
    #[error("tensor {name:?}: {detail}")]
    BadTensor { name: String, detail: String },
    #[error("the model has no tensor {0:?}")]
    UnknownTensor(String),
    #[error("tensor {name:?} has shape {got:?}, the model has {model:?}")]
    ShapeMismatch {
        name: String,
        got: Vec<u64>,
        model: Vec<u64>,
    },
    #[error("the snapshot lacks tensor {0:?}")]
    MissingTensor(String),
    #[error("file {0:?} is not one of a snapshot's files (config.json, model.safetensors)")]
    FileName(String),
    #[error("file {file:?}: {detail}")]
    BadFile { file: String, detail: String },
    #[error("file {0:?} was sent twice in one snapshot")]
    DuplicateFile(String),
    #[error("the snapshot lacks file {0:?}")]
    MissingFile(&'static str),
    #[error("the snapshot sent {sent} files, the commit says {declared}")]
    FileCountMismatch { sent: usize, declared: u32 },
    #[error("sync kind {0} is not SNAPSHOT or FINAL_SNAPSHOT")]
    Kind(i32),
    /// A kind of asynchronous local SGD: the method was retired.
    #[error("{0}: asynchronous local SGD was removed; drafters are data-parallel and send SNAPSHOT or FINAL_SNAPSHOT")]
    RemovedKind(&'static str),
    #[error("model config is not valid JSON: {0}")]
    Config(String),
    #[error("model config {got} is not the run's {expected} (--model-config)")]
    ConfigMismatch { expected: String, got: String },
}

/// Why a report was refused. Messages name the bad value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReportError {
    #[error("the report carries no point (model version, τ, ...)")]
    MissingPoint,
    #[error("τ {0} is not finite")]
    NotFinite(f64),
    #[error("τ {0} is below 1 (the target's own token is always accepted)")]
    BelowOne(f64),
    #[error("τ {tau} exceeds the drafter's block size {block_size}")]
    AboveBlockSize { tau: f64, block_size: u64 },
    #[error("{field} is 0: an evaluation covers at least one prompt and one verification")]
    Empty { field: &'static str },
    #[error("eval_seconds {0} is not a finite duration >= 0")]
    BadSeconds(f64),
    #[error("model version {version} was not served to an evaluator (pending: {pending:?}); read it with ReadModel first")]
    NotServed { version: u64, pending: Vec<u64> },
    #[error("model version {version} is already reported (τ {tau})")]
    AlreadyReported { version: u64, tau: f64 },
    #[error("model_samples {got} is not the served version {version}'s {served}")]
    SamplesMismatch { version: u64, got: u64, served: u64 },
}

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
