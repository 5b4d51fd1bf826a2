//! [`SyncClientError`]: why a call to the broker's model sync failed.

use std::time::Duration;

/// Why a read or a snapshot failed (training continues).
#[derive(Debug, thiserror::Error)]
pub enum SyncClientError {
    #[error("connecting to {address}: {detail}")]
    Connect { address: String, detail: String },
    #[error("broker: {0}")]
    Status(#[from] tonic::Status),
    #[error("the sync session closed mid-snapshot")]
    Closed,
    #[error("unexpected reply: {0}")]
    Protocol(String),
    #[error("the call took longer than {0:?}")]
    Timeout(Duration),
    #[error("tensor {name:?}: {detail}")]
    Tensor { name: String, detail: String },
    /// The model's files: writing them, or reading the run's.
    #[error("model files: {0}")]
    Model(String),
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}
