//! The drafter's side of the broker's model sync (`dflash.v1.ModelSync`):
//! the run's one model as the broker keeps it.
//!
//! The drafters are one data-parallel trainer ([`crate::data_parallel`]);
//! this link is what each has to do with the broker's copy of the model:
//! - when it starts, it reads the run's model (`ReadModel` as a drafter)
//!   and continues from it, or, when the broker holds none yet, sends its
//!   own initial weights as the snapshot of step 0;
//! - rank 0 sends the trained weights every `--snapshot-every` committed
//!   steps, and every member when it stops (`SNAPSHOT`, `FINAL_SNAPSHOT`);
//!   the broker keeps the latest step's.
//!
//! Everything here runs on the training thread, which owns the libtorch
//! state; the gRPC calls are driven on the server's tokio runtime through
//! its handle, bounded by `--sync-timeout`. A failed call never stops
//! training: it is logged and counted, and the next snapshot tries again.
//!
//! # Layout
//! - this module: the errors, the flags and [`ModelSyncLink`], the
//!   training thread's side.
//! - `session`: the streams on the wire (the `Session`: hello and welcome,
//!   a snapshot's files in chunks, the result; the read of the run's
//!   model's files), async, run on the server's runtime.
//! - `tensors`: the model to and from its checkpoint's files in memory
//!   (the drafter's one checkpoint writer and its from-bytes reader;
//!   libtorch).

mod session;
mod tensors;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_model::draft::DraftModel;
use dflash_proto::v1 as proto;
use tracing::{info, warn};

use crate::broker_link::BrokerLink;

mod error;
mod settings;

pub use error::SyncClientError;
use session::{open, read_model, Session};
pub use settings::{ModelSyncMode, SyncConfig};
use tensors::{load_model, snapshot_files};

/// What the link's calls cost and did, for the log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncTotals {
    /// Snapshots the broker answered.
    pub snapshots: u64,
    pub failures: u64,
    /// Wall time the training thread spent in calls to the broker.
    pub time_in_sync: Duration,
    /// The run model's step at the last answer (the model's version).
    pub model_version: u64,
    /// Samples in the run's model at the last answer.
    pub model_samples: u64,
}

/// The model-sync client of one drafter (lives on its training thread).
pub struct ModelSyncLink {
    runtime: tokio::runtime::Handle,
    /// The member's one connection to the broker, shared with its
    /// lighthouse link.
    link: Arc<BrokerLink>,
    drafter_id: String,
    config: SyncConfig,
    session: Option<Session>,
    pub totals: SyncTotals,
}

impl ModelSyncLink {
    /// The link of a data-parallel member (an independent drafter has
    /// none: `crate::settings::TrainingMode`).
    pub fn new(
        runtime: tokio::runtime::Handle,
        link: Arc<BrokerLink>,
        drafter_id: &str,
        config: &SyncConfig,
    ) -> Self {
        ModelSyncLink {
            runtime,
            link,
            drafter_id: drafter_id.to_string(),
            config: config.clone(),
            session: None,
            totals: SyncTotals::default(),
        }
    }

    fn timeout(&self) -> Duration {
        self.config.sync_timeout.max(Duration::from_millis(1))
    }

    /// Starts from the run's model (the broker's, when it has one: a run
    /// whose drafters all stopped resumes from it) or makes this drafter's
    /// initial weights the run's (a snapshot of step 0). The step count
    /// comes from the others at the first quorum. Returns the run model's
    /// step and samples (0 when this drafter made it or the join failed,
    /// which is logged: training goes on from this drafter's weights).
    pub fn join_run(&mut self, model: &DraftModel) -> (u64, u64) {
        let started = Instant::now();
        let outcome = self.try_join(model);
        self.totals.time_in_sync += started.elapsed();
        match outcome {
            Ok(joined) => joined,
            Err(error) => {
                self.totals.failures += 1;
                warn!(%error, "reading the run's model failed; training starts from this drafter's weights");
                (0, 0)
            }
        }
    }

    fn try_join(&mut self, model: &DraftModel) -> Result<(u64, u64), SyncClientError> {
        let read = read_model(self.link.clone(), self.drafter_id.clone());
        let Some(run_model) = self.block_on(self.timeout(), read)? else {
            // No model yet: this drafter's weights become the run's.
            let result = self.try_snapshot(model, 0, 0, false)?;
            self.totals.model_version = result.model_version;
            self.totals.model_samples = result.model_samples;
            info!(
                initialised = result.initialised,
                "model sync: this drafter's initial weights sent as the run's model"
            );
            return Ok((0, 0));
        };
        load_model(model, &run_model.weights)?;
        self.totals.model_version = run_model.step;
        self.totals.model_samples = run_model.samples;
        info!(
            step = run_model.step,
            samples = run_model.samples,
            "model sync: started from the run's model"
        );
        Ok((run_model.step, run_model.samples))
    }

    /// Sends the trained model's weights after `steps` committed steps
    /// (`samples` trained in them, every member's) to the broker, where
    /// they become the run's model unless it holds a later step. `last`:
    /// this drafter stops (its final snapshot). A failure is logged; the
    /// next snapshot tries again.
    pub fn snapshot(&mut self, model: &DraftModel, steps: u64, samples: u64, last: bool) {
        let started = Instant::now();
        let outcome = self.try_snapshot(model, steps, samples, last);
        self.totals.time_in_sync += started.elapsed();
        match outcome {
            Ok(result) => {
                self.totals.snapshots += 1;
                self.totals.model_version = result.model_version;
                self.totals.model_samples = result.model_samples;
            }
            Err(error) => {
                self.totals.failures += 1;
                self.session = None;
                warn!(%error, steps, "model snapshot to the broker failed");
            }
        }
        if last {
            self.session = None;
        }
    }

    fn try_snapshot(
        &mut self,
        model: &DraftModel,
        steps: u64,
        samples: u64,
        last: bool,
    ) -> Result<proto::SyncResult, SyncClientError> {
        if self.session.is_none() {
            let config_json = model.config().to_hf_json("float32").to_string();
            self.open_session(config_json)?;
        }
        let files = snapshot_files(model)?;
        let kind = if last {
            proto::SyncKind::FinalSnapshot
        } else {
            proto::SyncKind::Snapshot
        };
        let begin = proto::SyncBegin {
            kind: kind as i32,
            steps,
            samples,
            ..proto::SyncBegin::default()
        };
        let timeout = self.timeout();
        let mut session = self.session.take().ok_or(SyncClientError::Closed)?;
        let outcome = self.block_on(timeout, session::snapshot(&mut session, begin, files));
        if outcome.is_ok() {
            self.session = Some(session);
        }
        outcome
    }

    fn open_session(&mut self, config_json: String) -> Result<(), SyncClientError> {
        let hello = proto::SyncHello {
            drafter_id: self.drafter_id.clone(),
            model_config_json: config_json,
        };
        let timeout = self.timeout();
        let session = self.block_on(timeout, open(self.link.clone(), hello))?;
        self.session = Some(session);
        Ok(())
    }

    /// Runs `future` on the server's runtime from this (non-runtime) thread.
    fn block_on<T>(
        &self,
        timeout: Duration,
        future: impl std::future::Future<Output = Result<T, SyncClientError>>,
    ) -> Result<T, SyncClientError> {
        self.runtime.block_on(async move {
            tokio::time::timeout(timeout, future)
                .await
                .map_err(|_| SyncClientError::Timeout(timeout))?
        })
    }
}
