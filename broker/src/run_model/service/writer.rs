//! The background writer of the model: when to write it to
//! `--model-output` (periodically while it changes, and once more as the
//! final model after the run is COMPLETE and every open session's
//! FINAL_SNAPSHOT arrived, or its bound passed), the write itself on a blocking
//! thread, and the back-off of a failed write.
//!
//! Apart from the sessions in [`super`] because it runs on its own task,
//! owns the only disk I/O of the service, and shares nothing with a
//! session but the state's lock and the `sync_changed` wake-up.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::ModelSyncShared;
use crate::queue::BrokerState;
use crate::run_model::checkpoint::{write_model, CheckpointError};

impl ModelSyncShared {
    /// Writes the model to `--model-output` when it changed since the last
    /// write (or when `final_model` and the final one is not written yet).
    /// `None` when nothing was written.
    pub async fn save(&self, final_model: bool) -> Result<Option<PathBuf>, CheckpointError> {
        let Some(dir) = self.settings.model_output.clone() else {
            return Ok(None);
        };
        let writing = self.save_lock.clone().lock_owned().await;
        let model = {
            let state = self.state.lock();
            let Some(model) = state.model() else {
                return Ok(None);
            };
            let unchanged = state.saved_version == Some(model.version);
            if unchanged && (!final_model || state.final_saved) {
                return Ok(None);
            }
            model.clone()
        };
        let version = model.version;
        let started = Instant::now();
        let target = dir.clone();
        tokio::task::spawn_blocking(move || {
            let outcome = write_model(&target, &model);
            drop(writing);
            outcome
        })
        .await
        .map_err(|join_error| CheckpointError::Io {
            path: dir.clone(),
            source: std::io::Error::other(join_error.to_string()),
        })??;
        let mut state = self.state.lock();
        state.saved_version = Some(version);
        state.saved_path = dir.display().to_string();
        if final_model {
            state.final_saved = true;
        }
        info!(path = %dir.display(), version, final_model, seconds = started.elapsed().as_secs_f64(), "model written");
        Ok(Some(dir))
    }

    /// Writes the model periodically and, once the run is COMPLETE, waits
    /// (bounded by --model-final-sync-timeout) for the final snapshot of every
    /// drafter with an open session, then writes the final model.
    ///
    /// It sleeps until something it waits for can have happened: the run
    /// state changed, a snapshot committed or a session closed
    /// (`sync_changed`), the periodic save of a changed model is due, the
    /// final-sync bound passed, or a failed save's retry is due. An idle
    /// broker does not wake it.
    pub async fn run_background(
        self: Arc<Self>,
        mut run_state: tokio::sync::watch::Receiver<BrokerState>,
    ) {
        let mut last_periodic = Instant::now();
        let mut complete_since: Option<Instant> = None;
        let mut warned_final = false;
        let mut retry = SaveRetry::default();
        loop {
            let (final_pending, model_changed) = {
                let state = self.state.lock();
                let model_version = state.model().map(|model| model.version);
                (
                    model_version.is_some() && !state.final_saved,
                    model_version.is_some() && model_version != state.saved_version,
                )
            };
            let complete = *run_state.borrow_and_update() == BrokerState::Complete;
            let now = Instant::now();
            // A failed save is retried when its back-off has passed.
            let retry_due = retry.due.is_none_or(|due| now >= due);
            let mut wake_at: Option<Instant> = None;
            if complete && final_pending {
                let since = *complete_since.get_or_insert(now);
                let awaiting = self.state.lock().awaiting_final();
                let deadline = since + self.settings.final_snapshot_timeout;
                let ready = awaiting.is_empty() || now >= deadline;
                if ready && retry_due {
                    if !awaiting.is_empty() && !warned_final {
                        warn!(?awaiting, timeout = ?self.settings.final_snapshot_timeout, "writing the final model without these drafters' final snapshot");
                        warned_final = true;
                    }
                    match self.save(true).await {
                        Ok(_) => {
                            // Without --model-output there is nothing to
                            // write; the final model is the one in memory.
                            self.state.lock().final_saved = true;
                            retry = SaveRetry::default();
                        }
                        Err(error) => retry.failed("final", &error),
                    }
                    continue;
                }
                wake_at = if ready { retry.due } else { Some(deadline) };
            } else if model_changed
                && self.settings.model_output.is_some()
                && !self.settings.save_every.is_zero()
            {
                let due = last_periodic + self.settings.save_every;
                if now >= due && retry_due {
                    last_periodic = now;
                    match self.save(false).await {
                        Ok(_) => retry = SaveRetry::default(),
                        Err(error) => retry.failed("periodic", &error),
                    }
                    continue;
                }
                wake_at = if now >= due { retry.due } else { Some(due) };
            }
            let sleep = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.shutdown.cancelled() => break,
                changed = run_state.changed() => {
                    if changed.is_err() {
                        // The broker is going away; shutdown follows.
                        self.shutdown.cancelled().await;
                        break;
                    }
                }
                () = self.sync_changed.notified() => {}
                () = sleep => {}
            }
        }
    }
}

/// Back-off of a failed model save: 1 s, doubling to at most 60 s, each
/// failure logged with the next attempt's delay (no copy, no write until
/// then).
#[derive(Default)]
struct SaveRetry {
    failures: u32,
    due: Option<Instant>,
}

impl SaveRetry {
    const FIRST: Duration = Duration::from_secs(1);
    const LONGEST: Duration = Duration::from_secs(60);

    fn failed(&mut self, which: &str, error: &CheckpointError) {
        self.failures += 1;
        let delay = Self::FIRST
            .saturating_mul(1 << self.failures.saturating_sub(1).min(6))
            .min(Self::LONGEST);
        self.due = Some(Instant::now() + delay);
        warn!(%error, which, failures = self.failures, retry_in = ?delay, "writing the model failed; retrying");
    }
}
