//! The model-sync service: many drafters, one draft model.
//!
//! The drafters are one data-parallel trainer (`quorum`: the broker is only
//! their lighthouse; gradients never pass through it). Rank 0 sends the
//! trained model's weights every `--snapshot-every` committed steps and
//! every member sends its own when it stops: the broker keeps the latest
//! step's as the run's model (the "center"), writes it to `--model-output`,
//! serves it to the online evaluator and to drafters that start.
//!
//! - `arith`: the f32 and bf16 wire encodings of tensors.
//! - `center`: [`ModelSyncState`], the synchronous state machine (the
//!   center, the snapshot sessions' drafters, status) with no I/O or
//!   clock. Beneath it: `center::upload` (a snapshot as a session stages
//!   it, chunk by chunk), `center::weights` (the center's f32 tensors,
//!   their shared copies, the checks against them).
//! - `checkpoint`: the center on disk in the reference dflash format
//!   (safetensors, no libtorch), and reading it back on restart.
//! - `config`: the flags.
//! - `evaluation`: online evaluation's τ history, the best report, and the
//!   center versions kept for it between an evaluator's read
//!   (`ReadCenter`, read-only: no session, no effect on the run) and its
//!   report (`ReportTau`).
//! - `quorum`: the lighthouse of data-parallel drafters: which drafters
//!   take each optimizer step and whether it commits.
//! - `service`: the tonic adapter (shared state, sessions, replies), with
//!   `service::center_writer`, the background task that writes the center,
//!   and `service::evaluation`, the evaluator's two RPCs and the write of
//!   the best center.

pub mod arith;
pub mod center;
pub mod checkpoint;
pub mod config;
pub mod evaluation;
pub mod quorum;
pub mod service;

#[cfg(test)]
mod tests;

pub use center::{ModelSyncState, SyncError};
pub use config::ModelSyncConfig;
pub use service::{ModelSyncService, ModelSyncShared, CHUNK_BYTES};
