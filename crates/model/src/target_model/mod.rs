//! The frozen target LLM: Hugging Face config and safetensors loading, the
//! Qwen3 / Llama-3 forward, hidden-state capture at the DFlash layer ids,
//! and the key/value cache of incremental decoding (`cache`).
//!
//! # Layout
//! - `config`: [`TargetConfig`] from `config.json`, the [`Architecture`].
//! - [`weights`]: reading the requested tensors from (possibly sharded)
//!   safetensors files.
//! - `model`: [`TargetModel`], its full forward with hidden-state capture
//!   and its cached forward; its children `model::loading` (the tensor
//!   names a checkpoint must hold, and `TargetModel::load`) and
//!   `model::decoder_layer` (one decoder layer, shared by both forwards).
//! - `cache`: [`KeyValueCache`], the per-layer keys and values of
//!   incremental decoding.
//! - `layer_ids`: [`build_target_layer_ids`], which layers DFlash taps.
//! - `error`: [`ModelError`].

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
