//! The center and the drafters' sync records, as a synchronous state machine:
//! no gRPC, no tokio, no clock of its own (time comes in as an argument).
//!
//! An exchange is staged chunk by chunk in an [`Upload`] that belongs to the
//! session, not to the center; only [`ModelSyncState::commit`] touches the
//! center, all at once and after every check passed. A drafter that dies
//! mid-upload therefore leaves the center exactly as it was, and a slow one
//! never holds anything another drafter needs.
//!
//! The rules of an exchange are here; their parts are apart:
//! - `upload`: the [`Upload`] a session stages, and the wire enums.
//! - `weights`: the [`Center`]'s tensors, their snapshots, and the checks
//!   an upload must pass against them.
//! - `settings`: the outer optimizer's settings ([`OuterSettings`]) and
//!   the bounds a delta is held to; `error`: [`SyncError`].
//! - `outer`: the guards against a non-finite or outlier delta, and the
//!   step that applies one.
//! - `exchanges`: what each kind of exchange (join, snapshot, update) does
//!   once [`ModelSyncState::commit`] dispatched it.

mod error;
mod exchanges;
mod outer;
mod settings;
mod upload;
mod weights;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;

use super::arith::WireDtype;
use upload::decode_chunks;

pub use error::SyncError;
pub use settings::{
    MagnitudeBounds, OuterSettings, StalenessScaling, DEFAULT_MAX_DELTA_NORM_RATIO,
    DELTA_NORM_FLOOR, DELTA_NORM_WARMUP, DELTA_NORM_WINDOW, MAGNITUDE_LIMIT,
};
pub use upload::{dtype_from_proto, dtype_to_proto, ExchangeKind, Upload, UploadedTensor};
pub use weights::{Center, CenterSnapshot, CenterTensor, EncodedTensor};

/// What a committed exchange did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitOutcome {
    pub center_version: u64,
    pub staleness: u64,
    pub applied: bool,
    /// Why a delta was not applied ("" when it was or for a JOIN).
    pub reason: String,
    pub initialised: bool,
    /// The drafter gets the center back (JOIN and UPDATE).
    pub send_center: bool,
    pub center_samples: u64,
}

impl CommitOutcome {
    /// A delta refused (too stale, not finite, an outlier, or one that
    /// could overflow the center): the center as it was, and why.
    fn not_applied(center: &Center, staleness: u64, send_center: bool, reason: String) -> Self {
        CommitOutcome {
            center_version: center.version,
            staleness,
            applied: false,
            reason,
            initialised: false,
            send_center,
            center_samples: center.samples,
        }
    }
}

/// One drafter as the center knows it (by drafter id, across sessions).
#[derive(Debug, Clone, Default)]
pub struct DrafterRecord {
    pub open_sessions: u32,
    pub last_sync: Option<Instant>,
    pub base_version: u64,
    pub last_update_staleness: u64,
    pub updates_applied: u64,
    pub updates_discarded: u64,
    /// Its FINAL exchange arrived (cleared by a later JOIN).
    pub finished: bool,
    pub samples: u64,
}

/// The center (once initialised), the outer optimizer and the drafters.
#[derive(Debug)]
pub struct ModelSyncState {
    settings: OuterSettings,
    center: Option<Center>,
    /// Norms of the last applied deltas (the norm bound's reference); starts
    /// empty after a restart, so the bound waits for its warm-up again.
    recent_delta_norms: std::collections::VecDeque<f64>,
    /// The L2 norm of the center's weights when it was made or resumed:
    /// the scale below which no delta is an outlier (see [`refuse_delta`]).
    weights_norm_at_start: Option<f64>,
    /// `--model-config`: the one `config.json` every JOIN must carry.
    pinned_config: Option<serde_json::Value>,
    /// Deltas refused as not finite, and as over the norm bound.
    pub non_finite_deltas: u64,
    pub outlier_deltas: u64,
    drafters: BTreeMap<String, DrafterRecord>,
    /// Whether local SGD's deltas reached the center: a run never mixes
    /// them with data-parallel snapshots.
    deltas: bool,
    /// Whether data-parallel snapshots made the center (never mixed with
    /// deltas).
    snapshots: bool,
    /// The newest version written to disk, where, and whether as final.
    pub saved_version: Option<u64>,
    pub saved_path: String,
    pub final_saved: bool,
}

impl ModelSyncState {
    pub fn new(settings: OuterSettings, center: Option<Center>) -> Self {
        ModelSyncState {
            settings,
            weights_norm_at_start: center.as_ref().map(Center::weights_norm),
            center,
            recent_delta_norms: std::collections::VecDeque::with_capacity(DELTA_NORM_WINDOW),
            pinned_config: None,
            non_finite_deltas: 0,
            outlier_deltas: 0,
            drafters: BTreeMap::new(),
            deltas: false,
            snapshots: false,
            saved_version: None,
            saved_path: String::new(),
            final_saved: false,
        }
    }

    pub fn settings(&self) -> OuterSettings {
        self.settings
    }

    /// Fixes the run's model: every JOIN (the first one, which defines an
    /// empty center, included) must carry this `config.json` (compared as
    /// JSON values), so no drafter can make the center another model.
    pub fn pin_config(&mut self, config_json: &str) -> Result<(), SyncError> {
        let value = serde_json::from_str::<serde_json::Value>(config_json)
            .map_err(|error| SyncError::Config(error.to_string()))?;
        self.pinned_config = Some(value);
        // A center resumed from --model-output must be that model too.
        match &self.center {
            Some(center) => {
                let resumed = center.config_json.clone();
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

    pub fn center(&self) -> Option<&Center> {
        self.center.as_ref()
    }

    pub fn version(&self) -> Option<u64> {
        self.center.as_ref().map(|center| center.version)
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

    /// Drafters with an open session that have not sent their FINAL
    /// exchange: the final center waits for them (bounded).
    pub fn awaiting_final(&self) -> Vec<String> {
        self.drafters
            .iter()
            .filter(|(_, record)| record.open_sessions > 0 && !record.finished)
            .map(|(drafter_id, _)| drafter_id.clone())
            .collect()
    }

    /// Applies a complete exchange. Nothing changes when it is refused.
    pub fn commit(
        &mut self,
        drafter_id: &str,
        upload: Upload,
        declared_tensors: u32,
        model_config_json: &str,
        now: Instant,
    ) -> Result<CommitOutcome, SyncError> {
        upload.check_complete(declared_tensors)?;
        let kind = upload.kind;
        let carried_delta = !upload.tensors.is_empty();
        let mut upload = upload;
        // The samples a drafter claims never exceed what the broker saw it
        // ack (in all its exchanges): a claim cannot advance the run's
        // schedule. Acks that have not landed yet are credited at the next
        // exchange, when they have. A data-parallel snapshot's samples are
        // every member's (the run's count, shown beside the model, not a
        // schedule's input): one drafter's acks do not bound them.
        let snapshot = matches!(kind, ExchangeKind::Snapshot | ExchangeKind::FinalSnapshot);
        if let Some(acked) = upload.acked_by_drafter.filter(|_| !snapshot) {
            let credited = self
                .drafters
                .get(drafter_id)
                .map_or(0, |record| record.samples);
            let allowed = acked.saturating_sub(credited);
            if upload.samples > allowed {
                tracing::debug!(
                    drafter_id,
                    claimed = upload.samples,
                    allowed,
                    "samples claimed beyond the drafter's acks; credited up to them"
                );
                upload.samples = allowed;
            }
        }
        let samples = upload.samples;
        let outcome = match upload.kind {
            ExchangeKind::Join => self.join(upload, model_config_json)?,
            // A drafter that stops without a step since its last sync has
            // no delta: it only says it is finished.
            ExchangeKind::Final if upload.tensors.is_empty() => {
                let center = self.center.as_ref().ok_or(SyncError::NoCenter)?;
                CommitOutcome {
                    center_version: center.version,
                    staleness: center.version.saturating_sub(upload.base_version),
                    applied: false,
                    reason: "no delta".to_string(),
                    initialised: false,
                    send_center: false,
                    center_samples: center.samples,
                }
            }
            ExchangeKind::Update | ExchangeKind::Final => {
                let norm = upload.measured_norm.unwrap_or_else(|| upload.norm());
                self.update(drafter_id, &upload, norm)?
            }
            ExchangeKind::Snapshot | ExchangeKind::FinalSnapshot => {
                self.snapshot(upload, model_config_json)?
            }
        };
        let record = self.drafters.entry(drafter_id.to_string()).or_default();
        record.last_sync = Some(now);
        match kind {
            ExchangeKind::Join => {
                record.finished = false;
                record.base_version = outcome.center_version;
            }
            ExchangeKind::Update | ExchangeKind::Snapshot => {
                record.base_version = outcome.center_version;
            }
            ExchangeKind::Final | ExchangeKind::FinalSnapshot => record.finished = true,
        }
        let delta = matches!(kind, ExchangeKind::Update | ExchangeKind::Final);
        if delta && carried_delta {
            record.last_update_staleness = outcome.staleness;
            if outcome.applied {
                record.updates_applied += 1;
                record.samples += samples;
            } else {
                record.updates_discarded += 1;
            }
        }
        Ok(outcome)
    }

    /// The center encoded as `dtype`, one buffer per tensor (name, shape,
    /// bytes), in checkpoint order. Taken under the lock so a reply is one
    /// version, never torn between two.
    pub fn encode_center(&self, dtype: WireDtype) -> Option<(u64, Vec<EncodedTensor>)> {
        self.center_snapshot()
            .map(|snapshot| snapshot.encode(dtype))
    }

    /// The center's weights at this version, sharing their buffers: taken
    /// under the lock (cheap), encoded after it ([`CenterSnapshot::encode`]).
    pub fn center_snapshot(&self) -> Option<CenterSnapshot> {
        let center = self.center.as_ref()?;
        Some(CenterSnapshot {
            version: center.version,
            tensors: center
                .tensors
                .iter()
                .map(|tensor| {
                    (
                        tensor.name.clone(),
                        tensor.shape.clone(),
                        tensor.values.clone(),
                    )
                })
                .collect(),
        })
    }

    /// The status for `GetStatus`.
    pub fn status(&self, now: Instant) -> proto::ModelSyncStatus {
        let version = self.version().unwrap_or(0);
        let drafters = self
            .drafters
            .iter()
            .map(|(drafter_id, record)| proto::DrafterSyncStatus {
                drafter_id: drafter_id.clone(),
                connected: record.open_sessions > 0,
                last_sync_ms_ago: record
                    .last_sync
                    .map_or(0, |at| millis(now.saturating_duration_since(at))),
                base_version: record.base_version,
                staleness: version.saturating_sub(record.base_version),
                last_update_staleness: record.last_update_staleness,
                updates_applied: record.updates_applied,
                updates_discarded: record.updates_discarded,
                finished: record.finished,
                samples: record.samples,
            })
            .collect();
        proto::ModelSyncStatus {
            has_center: self.center.is_some(),
            center_version: version,
            method: self.settings.describe(),
            center_bytes: self.center.as_ref().map_or(0, Center::memory_bytes),
            parameters: self.center.as_ref().map_or(0, Center::parameters),
            updates_applied: self
                .center
                .as_ref()
                .map_or(0, |center| center.updates_applied),
            updates_discarded: self
                .center
                .as_ref()
                .map_or(0, |center| center.updates_discarded),
            center_samples: self.center.as_ref().map_or(0, |center| center.samples),
            saved_version: self.saved_version.unwrap_or(0),
            saved_path: self.saved_path.clone(),
            final_saved: self.final_saved,
            drafters,
            non_finite_deltas: self.non_finite_deltas,
            outlier_deltas: self.outlier_deltas,
            // Online evaluation's fields: the service fills them from its
            // own book (`model_sync::evaluation`), not the center's state.
            ..proto::ModelSyncStatus::default()
        }
    }
}

/// The center's tensors from a complete upload of whole weights (a JOIN
/// that initialises it, or a snapshot), with empty or zeroed outer buffers.
fn decode_center_tensors(
    uploaded: Vec<UploadedTensor>,
    momentum: bool,
) -> Result<Vec<CenterTensor>, SyncError> {
    let mut tensors = Vec::with_capacity(uploaded.len());
    for uploaded in uploaded {
        let elements = uploaded.shape.iter().product::<u64>() as usize;
        let mut values = vec![0.0f32; elements];
        decode_chunks(&mut values, &uploaded)?;
        let optimizer_buffer = || {
            Arc::new(if momentum {
                vec![0.0; elements]
            } else {
                Vec::new()
            })
        };
        tensors.push(CenterTensor {
            velocity: optimizer_buffer(),
            delta_sum: optimizer_buffer(),
            name: uploaded.name,
            shape: uploaded.shape,
            values: Arc::new(values),
        });
    }
    Ok(tensors)
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Keeps `norm` among the last [`DELTA_NORM_WINDOW`] applied norms (the
/// outlier bound's reference).
fn remember_norm(recent: &mut std::collections::VecDeque<f64>, norm: f64) {
    if recent.len() == DELTA_NORM_WINDOW {
        recent.pop_front();
    }
    recent.push_back(norm);
}
