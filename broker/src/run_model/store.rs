//! The run's model and the drafters' snapshot sessions, as a synchronous
//! state machine: no gRPC, no tokio, no clock of its own (time comes in as
//! an argument).
//!
//! Rank 0 of the data-parallel drafters sends the trained model (a
//! snapshot: its checkpoint's two files, `config.json` and
//! `model.safetensors`, as the drafter's checkpoint writer made them) every
//! `--snapshot-every` committed steps and every member sends its own when
//! it stops; the model becomes the snapshot of the latest step, with no
//! arithmetic. A snapshot is staged chunk by chunk in an [`Upload`] that
//! belongs to the session, not to the model; only
//! [`ModelSyncState::commit`] touches the model, all at once and after
//! every check passed. A drafter that dies mid-upload therefore leaves the
//! model exactly as it was. The model keeps the files as they arrived
//! (never decoded): the commit moves the chunks' handles in.
//!
//! - `files`: the two files, the weights' header ([`WeightsLayout`]) and
//!   the finite check in place.
//! - `upload`: the [`Upload`] a session stages, and the wire enums.
//! - `weights`: the [`StoredModel`], and the checks an upload must pass
//!   against it. [`SyncError`] is defined beneath `crate::rpc_error`, its
//!   gRPC table.

pub mod files;
mod upload;
mod weights;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;

pub use crate::rpc_error::SyncError;
pub use files::{ModelFile, TensorLayout, WeightsLayout};
pub use upload::{FiniteUpload, SnapshotKind, Upload};
use weights::check_layout_against_model;
pub use weights::StoredModel;

/// What a committed snapshot did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitOutcome {
    pub model_version: u64,
    /// The snapshot became the model (false: it holds that step or a
    /// later one already).
    pub applied: bool,
    /// Why a snapshot was not applied ("" when it was).
    pub reason: String,
    /// This snapshot made the first model.
    pub initialised: bool,
    pub model_samples: u64,
}

/// One drafter as the model knows it (by drafter id, across sessions).
#[derive(Debug, Clone, Default)]
pub struct DrafterRecord {
    pub open_sessions: u32,
    pub last_sync: Option<Instant>,
    /// Its FINAL_SNAPSHOT arrived.
    pub finished: bool,
}

/// The model (once a snapshot made it) and the drafters that sent them.
#[derive(Debug, Default)]
pub struct ModelSyncState {
    model: Option<StoredModel>,
    /// `--model-config`: the one `config.json` every snapshot must carry.
    pinned_config: Option<serde_json::Value>,
    drafters: BTreeMap<String, DrafterRecord>,
    /// The newest version written to disk, where, and whether as final.
    pub saved_version: Option<u64>,
    pub saved_path: String,
    pub final_saved: bool,
}

impl ModelSyncState {
    pub fn new(model: Option<StoredModel>) -> Self {
        ModelSyncState {
            model,
            ..ModelSyncState::default()
        }
    }

    /// Fixes the run's model: every snapshot (the first one, which defines
    /// an empty model, included) must carry this `config.json` (compared
    /// as JSON values), so no drafter can make the run's model another one.
    pub fn pin_config(&mut self, config_json: &str) -> Result<(), SyncError> {
        let value = serde_json::from_str::<serde_json::Value>(config_json)
            .map_err(|error| SyncError::Config(error.to_string()))?;
        self.pinned_config = Some(value);
        // A model resumed from --model-output must be that model too.
        match &self.model {
            Some(model) => {
                let resumed = model.config_json.clone();
                self.check_pinned_config(&resumed)
            }
            None => Ok(()),
        }
    }

    fn check_pinned_config(&self, model_config_json: &str) -> Result<(), SyncError> {
        let Some(expected) = &self.pinned_config else {
            return Ok(());
        };
        let got = serde_json::from_str::<serde_json::Value>(model_config_json)
            .map_err(|error| SyncError::Config(error.to_string()))?;
        if &got == expected {
            return Ok(());
        }
        let short = |value: &serde_json::Value| {
            let text = value.to_string();
            match text.char_indices().nth(300) {
                Some((end, _)) => format!("{}...", &text[..end]),
                None => text,
            }
        };
        Err(SyncError::ConfigMismatch {
            expected: short(expected),
            got: short(&got),
        })
    }

    pub fn model(&self) -> Option<&StoredModel> {
        self.model.as_ref()
    }

    pub fn version(&self) -> Option<u64> {
        self.model.as_ref().map(|model| model.version)
    }

    pub fn drafter(&self, drafter_id: &str) -> Option<&DrafterRecord> {
        self.drafters.get(drafter_id)
    }

    pub fn open_session(&mut self, drafter_id: &str) {
        self.drafters
            .entry(drafter_id.to_string())
            .or_default()
            .open_sessions += 1;
    }

    pub fn close_session(&mut self, drafter_id: &str) {
        if let Some(record) = self.drafters.get_mut(drafter_id) {
            record.open_sessions = record.open_sessions.saturating_sub(1);
        }
    }

    /// Drafters with an open session that have not sent their
    /// FINAL_SNAPSHOT: the final model waits for them (bounded).
    pub fn awaiting_final(&self) -> Vec<String> {
        self.drafters
            .iter()
            .filter(|(_, record)| record.open_sessions > 0 && !record.finished)
            .map(|(drafter_id, _)| drafter_id.clone())
            .collect()
    }

    /// Applies a whole snapshot whose values were checked finite
    /// ([`Upload::into_finite`], before the lock). Nothing changes when it
    /// is refused; nothing is copied when it is applied.
    pub fn commit(
        &mut self,
        drafter_id: &str,
        upload: FiniteUpload,
        now: Instant,
    ) -> Result<CommitOutcome, SyncError> {
        let kind = upload.kind;
        let outcome = self.snapshot(upload)?;
        let record = self.drafters.entry(drafter_id.to_string()).or_default();
        record.last_sync = Some(now);
        if kind == SnapshotKind::FinalSnapshot {
            record.finished = true;
        }
        Ok(outcome)
    }

    /// The trained model after `upload.steps` committed steps becomes the
    /// model, unless it already holds that step or a later one (a member
    /// behind the others, or a repeat). The model's version is the step;
    /// no arithmetic.
    fn snapshot(&mut self, upload: FiniteUpload) -> Result<CommitOutcome, SyncError> {
        self.check_pinned_config(&upload.config_json)?;
        if let Some(model) = &self.model {
            check_layout_against_model(&model.layout, &upload.layout)?;
            if upload.steps <= model.version {
                return Ok(CommitOutcome {
                    model_version: model.version,
                    applied: false,
                    reason: format!(
                        "the model holds step {} already; this snapshot is of step {}",
                        model.version, upload.steps
                    ),
                    initialised: false,
                    model_samples: model.samples,
                });
            }
        } else if upload.layout.tensors.is_empty() {
            return Err(SyncError::NoModel);
        }
        let model = StoredModel {
            config_json: upload.config_json,
            weights: upload.weights,
            layout: Arc::new(upload.layout),
            version: upload.steps,
            samples: upload.samples,
        };
        let outcome = CommitOutcome {
            model_version: model.version,
            applied: true,
            reason: String::new(),
            initialised: self.model.is_none(),
            model_samples: model.samples,
        };
        self.model = Some(model);
        Ok(outcome)
    }

    /// The status for `GetStatus`.
    pub fn status(&self, now: Instant) -> proto::ModelSyncStatus {
        let drafters = self
            .drafters
            .iter()
            .map(|(drafter_id, record)| proto::DrafterSyncStatus {
                drafter_id: drafter_id.clone(),
                connected: record.open_sessions > 0,
                last_sync_ms_ago: record
                    .last_sync
                    .map_or(0, |at| millis(now.saturating_duration_since(at))),
                finished: record.finished,
            })
            .collect();
        proto::ModelSyncStatus {
            has_model: self.model.is_some(),
            model_version: self.version().unwrap_or(0),
            model_bytes: self.model.as_ref().map_or(0, StoredModel::memory_bytes),
            parameters: self.model.as_ref().map_or(0, StoredModel::parameters),
            model_samples: self.model.as_ref().map_or(0, |model| model.samples),
            saved_version: self.saved_version.unwrap_or(0),
            saved_path: self.saved_path.clone(),
            final_saved: self.final_saved,
            drafters,
            // Online evaluation's fields: the service fills them from its
            // own book (`run_model::evaluation`), not the model's state.
            ..proto::ModelSyncStatus::default()
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
