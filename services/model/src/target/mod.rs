//! The frozen target LLM: Hugging Face config and safetensors loading, the
//! Qwen3 / Llama-3 forward, hidden-state capture at the DFlash layer ids.

mod config;
mod error;
mod layer_ids;
mod model;
pub mod weights;

pub use config::{Architecture, TargetConfig};
pub use error::ModelError;
pub use layer_ids::build_target_layer_ids;
pub use model::{TargetModel, CONFIG_FILE_NAME};
