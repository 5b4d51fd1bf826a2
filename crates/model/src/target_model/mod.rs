//! The frozen target LLM: Hugging Face config and safetensors loading, the
//! Qwen3 / Llama-3 forward, hidden-state capture at the DFlash layer ids,
//! and the key/value cache of incremental decoding (`cache`).

mod cache;
mod config;
mod error;
mod layer_ids;
mod model;
pub mod weights;

pub use cache::KeyValueCache;
pub use config::{Architecture, TargetConfig};
pub use error::ModelError;
pub use layer_ids::build_target_layer_ids;
pub use model::{CachedForward, TargetModel, CONFIG_FILE_NAME};
