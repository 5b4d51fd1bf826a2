//! [`SyncClientError`]: why a model-sync exchange failed.

use std::time::Duration;

/// Why an exchange failed (training continues).
#[derive(Debug, thiserror::Error)]
pub enum SyncClientError {
    #[error("connecting to {address}: {detail}")]
    Connect { address: String, detail: String },
    #[error("broker: {0}")]
    Status(#[from] tonic::Status),
    #[error("the sync session closed mid-exchange")]
    Closed,
    #[error("unexpected reply: {0}")]
    Protocol(String),
    #[error("exchange took longer than {0:?}")]
    Timeout(Duration),
    #[error("tensor {name:?}: {detail}")]
    Tensor { name: String, detail: String },
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}
