//! [`DrafterError`]: what stops a drafter-server. At the bottom of the
//! crate: every step may fail, none of them is imported here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use dflash_telemetry::RegistryError;

use crate::engine::EngineError;
use crate::settings::ConfigError;

/// Errors that stop a drafter-server.
#[derive(Debug, thiserror::Error)]
pub enum DrafterError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("loading the model: {0}")]
    Engine(#[from] EngineError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("broker at {address} unreachable for {seconds:.0} s: {detail}")]
    BrokerUnavailable {
        address: String,
        seconds: f64,
        detail: String,
    },
    #[error("the broker refused this drafter (not retried): {0}")]
    BrokerRefused(String),
    #[error("the training thread stopped unexpectedly")]
    TrainerGone,
    #[error("the finite check of a delivery failed: {0}")]
    FiniteCheck(String),
    #[error("graceful stop did not finish within {0:?}")]
    ShutdownTimedOut(Duration),
    #[error("final checkpoint failed: {0}")]
    FinalCheckpoint(String),
    #[error("{count} optimizer steps in a row were skipped (--max-skipped-steps); the last: {last_reason}; this drafter's model or device is broken, stopping it")]
    SkippedSteps { count: u64, last_reason: String },
    #[error("cannot listen for metrics on {address}: {source}")]
    MetricsListen {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(#[from] RegistryError),
    #[error("data parallelism: {0}")]
    DataParallel(Box<crate::data_parallel::DataParallelError>),
}
