//! [`TargetServerError`]: why a target-server run failed. At the bottom of
//! the crate: every step may fail, none of them is imported here.

use crate::capture::CaptureError;
use crate::compute::ComputeError;
use crate::reader::ReaderError;
use crate::shard::ShardError;
use dflash_client::ClientError;
use dflash_device::WorkerError;
use dflash_model::chat::EncoderError;
use dflash_model::ModelError;
use dflash_telemetry::RegistryError;
use std::net::SocketAddr;

/// Why a target-server run failed.
#[derive(Debug, thiserror::Error)]
pub enum TargetServerError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("model: {0}")]
    Model(#[from] ModelError),
    #[error("tokenizer: {0}")]
    Encoder(#[from] EncoderError),
    #[error("data: {0}")]
    Reader(#[from] ReaderError),
    #[error("shard: {0}")]
    Shard(#[from] ShardError),
    #[error("broker: {0}")]
    Broker(#[from] ClientError),
    #[error(transparent)]
    Capture(#[from] CaptureError),
    #[error("compute: {0}")]
    Compute(#[from] ComputeError),
    #[error(transparent)]
    Thread(#[from] WorkerError),
    #[error("watchdog: the compute pipeline produced no batch for {seconds:.0} s (--watchdog-timeout) with the shard not done; a compute thread is stuck")]
    Stalled { seconds: f64 },
    #[error("cannot listen for metrics on {address}: {source}")]
    MetricsListen {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(#[from] RegistryError),
}
