//! The run's one draft model as the broker keeps it, and the
//! `dflash.v1.ModelSync` service that serves it; the lighthouse that
//! decides the steps is [`crate::lighthouse`] (this service forwards its
//! two RPCs to `lighthouse::rpc`).
//!
//! The drafters are one data-parallel trainer: rank 0 sends the trained
//! model every `--snapshot-every` committed steps and every member sends
//! its own when it stops, as its checkpoint's files (`config.json`,
//! `model.safetensors`: the reference layout the drafter's one checkpoint
//! writer makes); the broker keeps the latest step's files as they arrived
//! (the run's model, an opaque store: it reads the weights' header and
//! checks the values finite in place, never decodes them), writes them to
//! `--model-output` verbatim, serves them to the online evaluator and to
//! drafters that start, and keeps the evaluator's τ curve. Everything but
//! `service` is synchronous and does no gRPC (the checkpoint's files are
//! its only I/O).
//!
//! # Layout
//! Bottom first:
//! - `settings`: [`RunModelSettings`], the typed part of the broker's flags
//!   this room takes.
//! - `store`: [`ModelSyncState`], the synchronous state machine (the
//!   model, the snapshot sessions' drafters, status) with no I/O or
//!   clock. Beneath it: `store::files` (the two files as chunks, the
//!   weights' safetensors header, the finite check in place),
//!   `store::upload` (a snapshot as a session stages it, chunk by chunk),
//!   `store::weights` (the model: its files as they arrived, shared, never
//!   decoded; the checks against them).
//! - `checkpoint`: the model on disk, its files written verbatim beside
//!   the broker's `center_state.json`, and read back on restart.
//! - `evaluation`: online evaluation's τ curve, the best report, and the
//!   registry of the versions kept for the evaluator between its read
//!   (`ReadModel`) and its report (`ReportTau`).
//! - `mod.rs`: [`resume`], the state a broker starts with.
//! - `service`: the gRPC adapter ([`service::ModelSyncShared`], the
//!   snapshot sessions), then `service::writer` (the task that writes the
//!   model to disk) and `service::evaluation` (`ReadModel`, `ReportTau`,
//!   the best version's write), which import `service`.
//!
//! Its errors (`SyncError`, `ReportError`, `CheckpointError`) are defined
//! beneath `crate::rpc_error`, the one table of gRPC codes, and re-exported
//! here: `service` imports that table, so the table must not import this
//! room. Must not depend on: `crate::config` (it gets [`RunModelSettings`]),
//! `crate::service`.

pub mod checkpoint;
pub mod evaluation;
pub mod service;
pub mod settings;
pub mod store;

#[cfg(test)]
mod tests;

pub use settings::RunModelSettings;
pub use store::{ModelSyncState, SyncError};

/// The state a broker starts with: the model resumed from
/// `--model-output` when one was written there, pinned to `--model-config`
/// when given (a resumed model of another config is refused).
pub fn resume(settings: &RunModelSettings) -> Result<ModelSyncState, checkpoint::CheckpointError> {
    let resumed = match &settings.model_output {
        Some(dir) => checkpoint::read_stored_model(dir)?,
        None => None,
    };
    let mut state = ModelSyncState::new(resumed);
    if let Some(path) = &settings.model_config {
        let text =
            std::fs::read_to_string(path).map_err(|source| checkpoint::CheckpointError::Io {
                path: path.clone(),
                source,
            })?;
        state
            .pin_config(&text)
            .map_err(|error| checkpoint::CheckpointError::Format {
                path: path.clone(),
                detail: format!("--model-config: {error}"),
            })?;
    }
    if let (Some(model), Some(dir)) = (state.model(), &settings.model_output) {
        tracing::info!(path = %dir.display(), version = model.version, parameters = model.parameters(), "model resumed from its last checkpoint");
        state.saved_version = Some(model.version);
        state.saved_path = dir.display().to_string();
    }
    Ok(state)
}
