//! The model-sync service: many drafters, one draft model.
//!
//! The broker keeps the run's shared ("center") draft weights in f32 and
//! every drafter exchanges with them over its own `dflash.v1.ModelSync`
//! session, without any barrier between drafters. The method is
//! asynchronous local SGD with a delayed Nesterov outer step (DiLoCo,
//! Douillard et al. 2023; asynchronous, with the delayed momentum of Liu et
//! al. 2024): a drafter trains `--sync-every` optimizer steps from the
//! center version it last received, uploads its delta, and the broker
//! applies `center += η·delta` at once; the mean of every N deltas also
//! feeds a Nesterov velocity (`--outer-momentum` μ), so momentum never
//! amplifies a single stale delta. Staleness (center updates between a
//! drafter's base and its delta) is recorded and, past
//! `--sync-max-staleness`, the delta is discarded and the drafter restarts
//! from the center.
//!
//! - `arith`: the vectorisable loops on raw bf16/f32 buffers.
//! - `center`: [`ModelSyncState`], the synchronous state machine (joins,
//!   commits, staleness, claims against acks, drafter records, status)
//!   with no I/O or clock. Beneath it: `center::upload` (an exchange as a
//!   session stages it, chunk by chunk), `center::weights` (the center's
//!   f32 tensors, their snapshots, the checks against them),
//!   `center::outer` (the outer optimizer's settings, the guards against
//!   non-finite and outlier deltas, and the step).
//! - `checkpoint`: the center on disk in the reference dflash format
//!   (safetensors, no libtorch), and reading it back on restart.
//! - `config`: the flags.
//! - `evaluation`: online evaluation's τ history, the best report, and the
//!   center versions kept for it between an evaluator's read
//!   (`ReadCenter`, read-only: no session, no effect on the run) and its
//!   report (`ReportTau`).
//! - `service`: the tonic adapter (shared state, sessions, replies), with
//!   `service::center_writer`, the background task that writes the center,
//!   and `service::evaluation`, the evaluator's two RPCs and the write of
//!   the best center.

pub mod arith;
pub mod center;
pub mod checkpoint;
pub mod config;
pub mod evaluation;
pub mod service;

#[cfg(test)]
mod tests;

pub use center::{ModelSyncState, OuterSettings, StalenessScaling, SyncError};
pub use config::ModelSyncConfig;
pub use service::{ModelSyncService, ModelSyncShared, CHUNK_BYTES};
