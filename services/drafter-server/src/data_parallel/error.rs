//! Why data parallelism could not start, or a call to the broker failed.

use std::time::Duration;

/// Why data parallelism could not start or a call to the broker failed.
#[derive(Debug, thiserror::Error)]
pub enum DataParallelError {
    #[error("hosting the c10d store on {host}:{port}: {source}")]
    Store {
        host: String,
        port: u16,
        #[source]
        source: dflash_collective::CollectiveError,
    },
    #[error("connecting to {address}: {detail}")]
    Connect { address: String, detail: String },
    #[error("broker: {0}")]
    Status(#[from] tonic::Status),
    #[error("{what} took longer than {limit:?}")]
    Timeout { what: &'static str, limit: Duration },
    #[error("{what} was lost")]
    Lost { what: &'static str },
}
