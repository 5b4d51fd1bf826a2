//! The three kinds of exchange [`ModelSyncState::commit`] dispatches: a
//! join (the center back), a snapshot (a data-parallel member's weights
//! replace the center) and an update (a local-SGD delta through the outer
//! step).

use super::outer::{add_delta, count_delta_for_momentum, momentum_delay, refuse_delta};
use super::upload::ExchangeKind;
use super::weights::Center;
use super::weights::{check_against_center, check_upload_against_center};
use super::{
    decode_center_tensors, remember_norm, CommitOutcome, ModelSyncState, SyncError, Upload,
};

impl ModelSyncState {
    pub(super) fn join(
        &mut self,
        upload: Upload,
        model_config_json: &str,
    ) -> Result<CommitOutcome, SyncError> {
        self.check_pinned_config(model_config_json)?;
        if let Some(center) = &self.center {
            // The drafter's own weights are not needed: it starts from the
            // center. They must still be the same model when sent.
            for tensor in &upload.tensors {
                check_against_center(center, &tensor.name, &tensor.shape)?;
            }
            return Ok(CommitOutcome {
                center_version: center.version,
                staleness: 0,
                applied: false,
                reason: String::new(),
                initialised: false,
                send_center: true,
                center_samples: center.samples,
            });
        }
        if upload.tensors.is_empty() {
            return Err(SyncError::NoCenter);
        }
        let tensors = decode_center_tensors(upload.tensors, self.settings.momentum > 0.0)?;
        let center = Center::new(model_config_json.to_string(), tensors, 0)?;
        let outcome = CommitOutcome {
            center_version: 0,
            staleness: 0,
            applied: false,
            reason: String::new(),
            initialised: true,
            send_center: false,
            center_samples: 0,
        };
        self.weights_norm_at_start = Some(center.weights_norm());
        self.center = Some(center);
        Ok(outcome)
    }

    /// Data parallelism: the trained model's weights after `upload.steps`
    /// committed steps become the center, unless it already holds that
    /// step or a later one (a member behind the others, or a repeat). The
    /// center's version is the step; no arithmetic.
    pub(super) fn snapshot(
        &mut self,
        upload: Upload,
        model_config_json: &str,
    ) -> Result<CommitOutcome, SyncError> {
        self.check_pinned_config(model_config_json)?;
        if self.deltas {
            return Err(SyncError::MixedMethods(
                "this run's drafters exchange deltas with the center (local SGD): a data-parallel snapshot cannot replace it; start every drafter with the same --model-sync".to_string(),
            ));
        }
        if let Some(center) = &self.center {
            check_upload_against_center(center, &upload)?;
            if upload.steps <= center.version {
                return Ok(CommitOutcome::not_applied(
                    center,
                    0,
                    false,
                    format!(
                        "the center holds step {} already; this snapshot is of step {}",
                        center.version, upload.steps
                    ),
                ));
            }
        } else if upload.tensors.is_empty() {
            return Err(SyncError::NoCenter);
        }
        let tensors = decode_center_tensors(upload.tensors, self.settings.momentum > 0.0)?;
        let mut center = Center::new(model_config_json.to_string(), tensors, upload.steps)?;
        center.samples = upload.samples;
        center.updates_applied = upload.steps;
        let outcome = CommitOutcome {
            center_version: center.version,
            staleness: 0,
            applied: true,
            reason: String::new(),
            initialised: self.center.is_none(),
            send_center: false,
            center_samples: center.samples,
        };
        self.snapshots = true;
        self.weights_norm_at_start
            .get_or_insert_with(|| center.weights_norm());
        self.center = Some(center);
        Ok(outcome)
    }

    /// Applies one drafter's delta to the center: checks the upload against
    /// the center, discards it when it is too stale, else adds it (scaled by
    /// the outer learning rate) and takes a momentum step when enough deltas
    /// have come in.
    pub(super) fn update(
        &mut self,
        drafter_id: &str,
        upload: &Upload,
        norm: f64,
    ) -> Result<CommitOutcome, SyncError> {
        if self.snapshots {
            return Err(SyncError::MixedMethods(
                "this run's drafters are data-parallel (their snapshots are the center): a delta cannot join; start every drafter with the same --model-sync".to_string(),
            ));
        }
        let open_sessions = self
            .drafters
            .values()
            .filter(|record| record.open_sessions > 0)
            .count() as u32;
        let settings = self.settings;
        let center = self.center.as_mut().ok_or(SyncError::NoCenter)?;
        check_upload_against_center(center, upload)?;
        let send_center = upload.kind == ExchangeKind::Update;
        let staleness = center.version - upload.base_version;
        if settings.max_staleness > 0 && staleness > settings.max_staleness {
            center.updates_discarded += 1;
            tracing::info!(
                drafter_id,
                staleness,
                max_staleness = settings.max_staleness,
                "delta discarded as too stale; the drafter restarts from the center"
            );
            let reason = format!(
                "staleness {staleness} exceeds the bound {}",
                settings.max_staleness
            );
            return Ok(CommitOutcome::not_applied(
                center,
                staleness,
                send_center,
                reason,
            ));
        }
        let weights_norm = self.weights_norm_at_start.unwrap_or(0.0);
        if let Some(reason) = refuse_delta(&settings, &self.recent_delta_norms, norm, weights_norm)
        {
            center.updates_discarded += 1;
            if norm.is_finite() {
                self.outlier_deltas += 1;
            } else {
                self.non_finite_deltas += 1;
            }
            tracing::warn!(drafter_id, norm, %reason, "delta discarded; the drafter restarts from the center");
            return Ok(CommitOutcome::not_applied(
                center,
                staleness,
                send_center,
                reason,
            ));
        }
        self.deltas = true;
        let momentum = settings.momentum > 0.0;
        let momentum_step = Some(center.pending_deltas.saturating_add(1))
            .filter(|&count| momentum && count >= momentum_delay(&settings, open_sessions));
        let mut magnitudes =
            center
                .magnitudes
                .after_delta(&settings, norm, momentum, momentum_step);
        if !magnitudes.within_limit() {
            // The carried bounds only grow: measure the buffers before
            // refusing on their account.
            center.magnitudes = center.measure_magnitudes();
            magnitudes = center
                .magnitudes
                .after_delta(&settings, norm, momentum, momentum_step);
        }
        if !magnitudes.within_limit() {
            center.updates_discarded += 1;
            self.outlier_deltas += 1;
            let reason = format!(
                "delta norm {norm:.4e} could take the center to {:.4e}, past half of f32's range",
                magnitudes.largest()
            );
            tracing::warn!(drafter_id, norm, %reason, "delta discarded; the drafter restarts from the center");
            return Ok(CommitOutcome::not_applied(
                center,
                staleness,
                send_center,
                reason,
            ));
        }
        remember_norm(&mut self.recent_delta_norms, norm);
        let weight = settings.staleness_scaling.weight(staleness);
        add_delta(center, upload, settings.learning_rate, weight, momentum)?;
        center.magnitudes = magnitudes;
        center.version += 1;
        center.updates_applied += 1;
        center.samples += upload.samples;
        if momentum {
            count_delta_for_momentum(center, &settings, open_sessions);
        }
        Ok(CommitOutcome {
            center_version: center.version,
            staleness,
            applied: true,
            reason: String::new(),
            initialised: false,
            send_center,
            center_samples: center.samples,
        })
    }
}
