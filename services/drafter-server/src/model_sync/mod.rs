//! The drafter's side of the broker's model sync (`dflash.v1.ModelSync`):
//! many drafters train one draft model.
//!
//! Asynchronous local SGD (DiLoCo's inner/outer split, asynchronous as in
//! Liu et al. 2024): the drafter keeps a copy of the center version it last
//! received (its base). Every `--sync-every` optimizer steps it uploads
//! `delta = weights − base` and continues from the center the broker sends
//! back (which already holds this delta and every other drafter's); its own
//! AdamW moments stay local, as DiLoCo's inner optimizer state does. No
//! barrier: the broker answers at once whatever the other drafters do.
//!
//! Everything here runs on the training thread, which owns the libtorch
//! state; the gRPC exchange is driven on the server's tokio runtime through
//! its handle, bounded by `--sync-timeout`. A failed exchange never stops
//! training: the drafter keeps its weights and re-joins at the next sync
//! point (taking the center, so its work since the last good sync is lost,
//! which bounds what a broker restart costs to `--sync-every` steps).
//!
//! Each exchange also brings back the center's sample count (every
//! drafter's applied deltas), which the link writes into the drafter's
//! [`RunClock`]: the learning-rate schedule is the run's, not this drafter's
//! (see [`crate::schedule`]). Each UPDATE's staleness goes there too: it
//! measures how many drafters share the center, and each of N drafters
//! runs AdamW with β1^N so the shared model's momentum is one drafter's
//! (asynchrony adds momentum of its own: Mitliagkas et al. 2016).
//!
//! # Layout
//! - this module: the flags, the errors and [`ModelSyncLink`], the
//!   training thread's side (when to join, exchange and finish; what a
//!   failure resets).
//! - `session`: the `Session` stream on the wire (hello and welcome, an
//!   upload in chunks, the result, the center in chunks), async, run on the
//!   server's runtime.
//! - `tensors`: the model's parameters to and from wire bytes (libtorch),
//!   deltas against the base, loading the center.

mod session;
mod tensors;

use std::time::{Duration, Instant};

use dflash_model::draft::DraftModel;
use dflash_proto::v1 as proto;
use tch::Tensor;
use tracing::{info, warn};

use crate::schedule::RunClock;
mod error;
mod settings;

pub use error::SyncClientError;
use session::{exchange, open, Session};
pub use settings::{ModelSyncMode, SyncConfig, SyncDtype};
use tensors::{delta_to_wire, load_center, sorted_parameters, tensor_to_wire, WireTensor};

/// What the last exchanges cost and did, for the report and the log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncTotals {
    pub exchanges: u64,
    pub failures: u64,
    /// Wall time the training thread spent in exchanges.
    pub time_in_sync: Duration,
    pub center_version: u64,
    pub last_staleness: u64,
    /// Samples in the center at the last exchange (every drafter's).
    pub center_samples: u64,
}

/// The model-sync client of one drafter (lives on its training thread).
pub struct ModelSyncLink {
    runtime: tokio::runtime::Handle,
    broker: String,
    drafter_id: String,
    config: SyncConfig,
    session: Option<Session>,
    /// TLS and the bearer token of the sync connection (as the Consume one).
    security: dflash_client::ClientSecurityArgs,
    /// The center version the weights started from and a copy of it (f32,
    /// on the model's device, sorted by name); `None` until joined.
    base: Option<(u64, Vec<(String, Tensor)>)>,
    steps_since_sync: u64,
    samples_since_sync: u64,
    tokens_since_sync: u64,
    pub totals: SyncTotals,
    /// Where the run is, for the run-wide learning-rate schedule.
    clock: RunClock,
}

impl ModelSyncLink {
    /// A link unless the drafter is independent (`--model-sync off` or
    /// `--sync-every 0`): local SGD's exchanges, or data parallelism's
    /// join, snapshots and final snapshot.
    pub fn new(
        runtime: tokio::runtime::Handle,
        broker: &str,
        drafter_id: &str,
        config: &SyncConfig,
    ) -> Option<Self> {
        (config.mode() != ModelSyncMode::Off).then(|| ModelSyncLink {
            runtime,
            broker: broker.to_string(),
            drafter_id: drafter_id.to_string(),
            config: config.clone(),
            session: None,
            security: dflash_client::ClientSecurityArgs::default(),
            base: None,
            steps_since_sync: 0,
            samples_since_sync: 0,
            tokens_since_sync: 0,
            totals: SyncTotals::default(),
            clock: RunClock::new(),
        })
    }

    /// Keeps `clock` current with the center's sample count and this
    /// drafter's samples since its last exchange.
    pub fn with_run_clock(mut self, clock: RunClock) -> Self {
        self.clock = clock;
        self
    }

    /// The run clock this link keeps current.
    pub fn run_clock(&self) -> &RunClock {
        &self.clock
    }

    /// Connects with this TLS and token (the broker's flags of the drafter).
    pub fn with_security(mut self, security: dflash_client::ClientSecurityArgs) -> Self {
        self.security = security;
        self
    }

    fn timeout(&self) -> Duration {
        self.config.sync_timeout.max(Duration::from_millis(1))
    }

    /// Starts from the center (or initialises it with this model's weights
    /// when there is none yet). A failure is logged; training continues and
    /// the next sync point tries again.
    pub fn join(&mut self, model: &DraftModel) {
        let started = Instant::now();
        let outcome = self.try_join(model);
        self.account(started, outcome, "join");
    }

    /// Counts a step of `samples` and `tokens`; every `--sync-every` steps
    /// exchanges with the center.
    pub fn after_step(&mut self, model: &DraftModel, samples: usize, tokens: usize) {
        self.steps_since_sync += 1;
        self.samples_since_sync += samples as u64;
        self.tokens_since_sync += tokens as u64;
        self.clock.trained(samples as u64);
        if self.steps_since_sync < self.config.sync_every {
            return;
        }
        let started = Instant::now();
        let outcome = if self.base.is_none() {
            self.try_join(model)
        } else {
            self.try_exchange(model, proto::SyncKind::Update)
        };
        self.account(started, outcome, "sync");
    }

    /// The last delta before the drafter stops; nothing comes back, so the
    /// drafter's own checkpoint keeps its own weights.
    pub fn finish(&mut self, model: &DraftModel) {
        if self.base.is_none() {
            return;
        }
        let started = Instant::now();
        let outcome = self.try_exchange(model, proto::SyncKind::Final);
        self.account(started, outcome, "final sync");
        self.session = None;
    }

    /// Data parallelism: sends the trained model's weights after `steps`
    /// committed steps (`samples` trained in them, every member's) to the
    /// broker, where they become the run's model unless it holds a later
    /// step. `last`: this drafter stops (its final exchange). A failure is
    /// logged; the next snapshot tries again.
    pub fn snapshot(&mut self, model: &DraftModel, steps: u64, samples: u64, last: bool) {
        let started = Instant::now();
        let outcome = self.try_snapshot(model, steps, samples, last);
        self.totals.time_in_sync += started.elapsed();
        match outcome {
            Ok(result) => {
                self.totals.exchanges += 1;
                self.totals.center_version = result.center_version;
                self.totals.center_samples = result.center_samples;
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
        let tensors = sorted_parameters(model)
            .iter()
            .map(|(name, tensor)| tensor_to_wire(name, tensor, SyncDtype::F32))
            .collect::<Result<Vec<_>, _>>()?;
        let kind = if last {
            proto::SyncKind::FinalSnapshot
        } else {
            proto::SyncKind::Snapshot
        };
        let begin = proto::SyncBegin {
            kind: kind as i32,
            base_version: 0,
            steps,
            samples,
            tokens: 0,
            reply_dtype: proto::Dtype::F32 as i32,
            gradient_step: None,
        };
        let (result, _) = self.run_exchange(begin, tensors)?;
        Ok(result)
    }

    /// Data parallelism: starts from the run's model (the broker's, when it
    /// has one: a run whose drafters all stopped resumes from it) or makes
    /// this drafter's initial weights the run's. The step count comes from
    /// the others at the first quorum.
    /// Returns the run model's step and samples (0 when this drafter made
    /// it or the join failed).
    pub fn join_run(&mut self, model: &DraftModel) -> (u64, u64) {
        self.join(model);
        // Local SGD's base is not needed: snapshots carry whole weights.
        self.base = None;
        (self.totals.center_version, self.totals.center_samples)
    }

    fn account(&mut self, started: Instant, outcome: Result<(), SyncClientError>, what: &str) {
        self.totals.time_in_sync += started.elapsed();
        match outcome {
            Ok(()) => {
                self.totals.exchanges += 1;
                self.clock.synced(self.totals.center_samples);
                self.steps_since_sync = 0;
                self.samples_since_sync = 0;
                self.tokens_since_sync = 0;
            }
            Err(error) => {
                self.totals.failures += 1;
                // Re-join at the next sync point: the broker may have
                // restarted with an older center.
                self.session = None;
                self.base = None;
                // The samples since the last exchange never reach the center:
                // the re-join starts from the center's weights.
                self.steps_since_sync = 0;
                self.samples_since_sync = 0;
                self.tokens_since_sync = 0;
                warn!(%error, what, "model sync failed; training continues on this drafter's weights");
            }
        }
    }

    fn try_join(&mut self, model: &DraftModel) -> Result<(), SyncClientError> {
        let parameters = sorted_parameters(model);
        let config_json = model.config().to_hf_json("float32").to_string();
        let has_center = self.open_session(config_json)?.welcome.has_center;
        // Weights go up only when there is no center to start from.
        let upload = if has_center {
            Vec::new()
        } else {
            parameters
                .iter()
                .map(|(name, tensor)| tensor_to_wire(name, tensor, self.config.sync_dtype))
                .collect::<Result<Vec<_>, _>>()?
        };
        let begin = self.begin(proto::SyncKind::Join, 0);
        let (result, center) = self.run_exchange(begin, upload)?;
        let base = if result.initialised {
            info!(
                version = result.center_version,
                "model sync: this drafter initialised the center"
            );
            parameters
                .iter()
                .map(|(name, tensor)| (name.clone(), tensor.detach().copy()))
                .collect()
        } else {
            let center = center.ok_or_else(|| {
                SyncClientError::Protocol("a JOIN answered without the center".to_string())
            })?;
            let base = load_center(&parameters, center)?;
            info!(
                version = result.center_version,
                "model sync: started from the center"
            );
            base
        };
        self.totals.center_version = result.center_version;
        self.totals.center_samples = result.center_samples;
        self.base = Some((result.center_version, base));
        Ok(())
    }

    fn try_exchange(
        &mut self,
        model: &DraftModel,
        kind: proto::SyncKind,
    ) -> Result<(), SyncClientError> {
        let Some((base_version, base)) = self.base.take() else {
            return Err(SyncClientError::Protocol("not joined".to_string()));
        };
        if self.session.is_none() {
            return Err(SyncClientError::Closed);
        }
        let parameters = sorted_parameters(model);
        let deltas = if kind == proto::SyncKind::Final && self.steps_since_sync == 0 {
            Vec::new()
        } else {
            delta_to_wire(&parameters, &base, self.config.sync_dtype)?
        };
        let begin = self.begin(kind, base_version);
        let (result, center) = self.run_exchange(begin, deltas)?;
        self.totals.center_version = result.center_version;
        self.totals.center_samples = result.center_samples;
        self.totals.last_staleness = result.staleness;
        if kind == proto::SyncKind::Update && result.applied {
            self.clock.staleness_observed(result.staleness);
        }
        if !result.applied && !result.reason.is_empty() && kind == proto::SyncKind::Update {
            info!(reason = %result.reason, "model sync: delta not applied; continuing from the center");
        }
        let base = match center {
            Some(center) => load_center(&parameters, center)?,
            None => base,
        };
        self.base = Some((result.center_version, base));
        Ok(())
    }

    fn begin(&self, kind: proto::SyncKind, base_version: u64) -> proto::SyncBegin {
        proto::SyncBegin {
            kind: kind as i32,
            base_version,
            steps: self.steps_since_sync,
            samples: self.samples_since_sync,
            tokens: self.tokens_since_sync,
            reply_dtype: self.config.sync_dtype.proto() as i32,
            gradient_step: None,
        }
    }

    fn open_session(&mut self, config_json: String) -> Result<&Session, SyncClientError> {
        let broker = self.broker.clone();
        let hello = proto::SyncHello {
            drafter_id: self.drafter_id.clone(),
            model_config_json: config_json,
        };
        let timeout = self.timeout();
        let security = self.security.clone();
        let session = self.block_on(timeout, open(broker, hello, security))?;
        Ok(self.session.insert(session))
    }

    /// Sends one exchange and reads its answer, bounded by the timeout.
    fn run_exchange(
        &mut self,
        begin: proto::SyncBegin,
        tensors: Vec<WireTensor>,
    ) -> Result<(proto::SyncResult, Option<Vec<WireTensor>>), SyncClientError> {
        let timeout = self.timeout();
        let mut session = self.session.take().ok_or(SyncClientError::Closed)?;
        let outcome = self.block_on(timeout, exchange(&mut session, begin, tensors));
        if outcome.is_ok() {
            self.session = Some(session);
        }
        outcome
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
