//! The error type of model loading and the target forward.

use std::path::PathBuf;

/// Everything that can go wrong loading a Hugging Face model directory or
/// running the target forward. Messages name the offending file, tensor or
/// value so a user can fix the input without reading code.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    InvalidConfig { path: PathBuf, message: String },
    #[error("{path}: unsupported architecture {value:?} (supported: Qwen3ForCausalLM / qwen3, LlamaForCausalLM / llama)")]
    UnsupportedArchitecture { path: PathBuf, value: String },
    #[error("{dir}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: missing tensor {tensor:?}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor {tensor:?} has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        actual: Vec<usize>,
        expected: Vec<i64>,
    },
    #[error("{path}: tensor {tensor:?} has unsupported dtype {dtype} (supported: bf16, f16, f32)")]
    UnsupportedTensorDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}
