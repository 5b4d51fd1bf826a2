//! [`ClientError`], each naming what failed, and the statuses a client
//! retries after ([`RETRYABLE_CODES`]).

use dflash_proto::v1 as proto;

use crate::security;

/// Errors of the client, each naming what failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid broker address {address:?}: {source}")]
    InvalidAddress {
        address: String,
        source: tonic::transport::Error,
    },
    #[error("cannot connect to the broker at {address}: {source}")]
    Connect {
        address: String,
        source: tonic::transport::Error,
    },
    #[error(transparent)]
    Security(#[from] security::SecurityError),
    #[error("broker call {call} failed: {status}")]
    Call {
        call: &'static str,
        status: tonic::Status,
    },
    #[error("broker stream {stream} ended unexpectedly{}", if .detail.is_empty() { String::new() } else { format!(": {}", .detail) })]
    StreamEnded {
        stream: &'static str,
        detail: String,
    },
    #[error("broker sent an unexpected message on {stream}: {detail}")]
    Protocol {
        stream: &'static str,
        detail: String,
    },
    #[error("the broker closed this Produce stream ({status:?}): {reason}")]
    ProducerClosed {
        status: proto::RunStatus,
        reason: String,
    },
    #[error("the broker serves run {current:?}, this client was in run {remembered:?}: the broker lost that run's state; what it accepted cannot be accounted for")]
    RunChanged { remembered: String, current: String },
}

/// The statuses after which a client reconnects and tries again: the
/// broker went away, restarted or is shutting down, or the transport failed
/// (grpc-core reports those as UNAVAILABLE, INTERNAL, UNKNOWN, CANCELLED or
/// DEADLINE_EXCEEDED), or a reconnecting consumer's hello came while the
/// broker still held its old stream (ALREADY_EXISTS: it lets the id in once
/// that stream is gone). The Python client's `RETRYABLE_CODES`
/// (`clients/python/dflash_client/aio.py`) is the same set; a test on each
/// side reads the other's.
pub const RETRYABLE_CODES: [tonic::Code; 6] = [
    tonic::Code::Unavailable,
    tonic::Code::Internal,
    tonic::Code::Unknown,
    tonic::Code::Cancelled,
    tonic::Code::DeadlineExceeded,
    tonic::Code::AlreadyExists,
];

impl ClientError {
    /// The gRPC status behind this error, when the broker sent one.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            ClientError::Call { status, .. } => Some(status),
            _ => None,
        }
    }

    /// Whether reconnecting and trying again can help: a status in
    /// [`RETRYABLE_CODES`], a failed connection, a stream that ended without
    /// a status. Not what the broker refused on purpose (the run ended or
    /// was lost, a bad value, an unknown id, a fenced stream, an item over
    /// the limit, no credentials): retrying those only hides the reason.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Call { status, .. } => RETRYABLE_CODES.contains(&status.code()),
            ClientError::InvalidAddress { .. }
            | ClientError::Protocol { .. }
            | ClientError::ProducerClosed { .. }
            | ClientError::RunChanged { .. }
            // A bad certificate, key or token file does not fix itself.
            | ClientError::Security(_) => false,
            ClientError::Connect { .. } | ClientError::StreamEnded { .. } => true,
        }
    }
}
