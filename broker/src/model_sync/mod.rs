//! The model-sync service: many drafters, one draft model.
//!
//! The drafters are one data-parallel trainer ([`crate::lighthouse`]: the
//! broker is only their lighthouse; gradients never pass through it). The run's model
//! itself (the store, the checkpoint, the τ curve) is [`crate::run_model`]'s;
//! this module is the flags and the gRPC adapter that serves both.
//!
//! - its flags are [`crate::config::ModelSyncConfig`] (the run model's;
//!   the lighthouse's are `crate::lighthouse::config`), in `config/` with
//!   every other flag, so that `config/` needs no module of this one.
//! - `service`: the tonic adapter (shared state, snapshot sessions), with
//!   `service::center_writer`, the background task that writes the center,
//!   `service::evaluation`, the evaluator's two RPCs and the write of the
//!   best center; the lighthouse's two RPCs are `crate::lighthouse::rpc`.

pub mod service;

pub use crate::config::ModelSyncConfig;
pub use service::{ModelSyncService, ModelSyncShared, CHUNK_BYTES};
