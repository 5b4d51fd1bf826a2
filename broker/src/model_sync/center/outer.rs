//! The outer optimizer (its settings in `settings`): the guards a delta
//! must pass before it may touch the center (not finite, or far over the recent deltas'
//! norms), and the step that applies one (`center += η·delta`, then the
//! delayed Nesterov momentum step every N deltas).
//!
//! Apart from [`super::ModelSyncState`] because this is the method, not the
//! bookkeeping: what a delta does to the weights, with the raw-buffer loops
//! themselves in [`crate::model_sync::arith`].

use std::sync::Arc;

use super::error::SyncError;
use super::settings::{OuterSettings, DELTA_NORM_FLOOR, DELTA_NORM_WARMUP, EARLY_DELTA_NORM_BOUND};
use super::upload::Upload;
use super::weights::Center;
use crate::model_sync::arith;

/// Deltas averaged per momentum step: the setting, or else the number of
/// drafters with an open session (at least 1).
pub(super) fn momentum_delay(settings: &OuterSettings, open_sessions: u32) -> u32 {
    match settings.momentum_delay {
        0 => open_sessions.max(1),
        delay => delay,
    }
}

/// Why a delta of this `norm` must not reach the center, if it must not:
/// a NaN or an infinity in it, or a norm over `max_delta_norm_ratio` times
/// the largest of the recent applied deltas' norms and over
/// [`DELTA_NORM_FLOOR`] × `weights_norm` (the weights' own norm, under a
/// small fraction of which a delta is never an outlier: the first deltas of
/// a run, at a warming-up learning rate, can be a hundred times smaller than
/// the next ones); before the recent norms exist, a norm over
/// [`EARLY_DELTA_NORM_BOUND`] × `weights_norm`.
pub(super) fn refuse_delta(
    settings: &OuterSettings,
    recent_norms: &std::collections::VecDeque<f64>,
    norm: f64,
    weights_norm: f64,
) -> Option<String> {
    if !norm.is_finite() {
        return Some("the delta holds a NaN or an infinity".to_string());
    }
    let ratio = f64::from(settings.max_delta_norm_ratio);
    if ratio <= 0.0 {
        return None;
    }
    if recent_norms.len() < DELTA_NORM_WARMUP {
        let bound = EARLY_DELTA_NORM_BOUND * weights_norm;
        return (weights_norm > 0.0 && norm > bound).then(|| {
            format!(
                "delta norm {norm:.4e} is over {EARLY_DELTA_NORM_BOUND} x the weights' norm {weights_norm:.4e} before {DELTA_NORM_WARMUP} deltas were applied (--max-delta-norm-ratio)"
            )
        });
    }
    if norm <= DELTA_NORM_FLOOR * weights_norm {
        return None;
    }
    let largest = recent_norms.iter().copied().fold(0.0, f64::max);
    (norm > ratio * largest).then(|| {
        format!(
            "delta norm {norm:.4e} is over {ratio} x the largest {largest:.4e} of the last {} applied deltas (--max-delta-norm-ratio)",
            recent_norms.len()
        )
    })
}

/// Adds `learning_rate · weight` times the uploaded delta to the center's
/// values, chunk by chunk, and (with momentum) `weight` times it to each
/// tensor's running delta sum.
pub(super) fn add_delta(
    center: &mut Center,
    upload: &Upload,
    learning_rate: f32,
    weight: f32,
    momentum: bool,
) -> Result<(), SyncError> {
    for uploaded in &upload.tensors {
        let index = center.by_name[&uploaded.name];
        let tensor = &mut center.tensors[index];
        // Copies a buffer only while a snapshot (a save in progress) holds it.
        let values = Arc::make_mut(&mut tensor.values);
        let mut delta_sum = momentum.then(|| Arc::make_mut(&mut tensor.delta_sum));
        uploaded.for_each_chunk(|range, chunk| {
            let sum = delta_sum.as_deref_mut().map(|sum| &mut sum[range.clone()]);
            arith::add_scaled(
                &mut values[range],
                sum,
                chunk,
                uploaded.dtype,
                learning_rate * weight,
                weight,
            )
        })?;
    }
    Ok(())
}

/// Counts one more applied delta towards the delayed Nesterov step, and
/// takes the step once the delay (the setting, or else the number of open
/// sessions) is reached.
pub(super) fn count_delta_for_momentum(
    center: &mut Center,
    settings: &OuterSettings,
    open_sessions: u32,
) {
    center.pending_deltas += 1;
    if center.pending_deltas >= momentum_delay(settings, open_sessions) {
        let count = center.pending_deltas;
        for tensor in &mut center.tensors {
            arith::delayed_nesterov_step(
                Arc::<Vec<f32>>::make_mut(&mut tensor.values).as_mut_slice(),
                Arc::<Vec<f32>>::make_mut(&mut tensor.velocity).as_mut_slice(),
                Arc::<Vec<f32>>::make_mut(&mut tensor.delta_sum).as_mut_slice(),
                count,
                settings.learning_rate,
                settings.momentum,
            );
        }
        center.pending_deltas = 0;
    }
}
