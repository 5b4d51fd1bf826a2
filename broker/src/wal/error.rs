//! [`WalError`]: why the write-ahead log cannot open, replay or append.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("state dir {path} is in use by another broker (it holds the lock on {lock}); two brokers on one state dir would interleave one log: stop the other one or give this one its own --state-dir")]
    Locked { path: PathBuf, lock: PathBuf },
    #[error("state dir {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state dir {path}: corrupt record at byte {offset}: {detail}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        detail: String,
    },
    #[error("state dir {path}: the log replays to a queue whose books do not add up ({detail}): records are missing or were altered; the broker refuses to start rather than run a queue that could never complete. Restore the state dir from a copy, or start a new run with a new --state-dir")]
    Inconsistent { path: PathBuf, detail: String },
    #[error("state dir {path}: segment format version {found}, this broker reads version {supported}; use the broker that wrote it")]
    Version {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("state dir {path}: the segment belongs to a run of another configuration (fingerprint {found:016x}, this state dir's is {expected:016x}): a segment copied in from another state dir?")]
    ForeignSegment {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error("state dir {path} was written for {stored}, and this broker is configured for {configured}: the resume points would be another run's. Start the broker with the run's own --target-ids/--expected-targets, give this run a new --state-dir, or pass --adopt-state-dir to keep the log under the new configuration")]
    ConfigMismatch {
        path: PathBuf,
        stored: String,
        configured: String,
    },
    #[error("state dir {path} records a run whose targets capture {stored} (its file target-capture), and this broker is configured with {}: the samples it holds and the run's drafters were made for {stored}. Restart it with {}, or give a new run a new --state-dir (--adopt-state-dir does not change the capture)", capture_flag(configured), capture_flag(stored))]
    CaptureMismatch {
        path: PathBuf,
        /// The state dir's record (`none`, or flag values joined by commas).
        stored: String,
        /// This broker's `--target-capture`, in the same form.
        configured: String,
    },
}

/// A recorded capture as the flag that asks for it: `none` is the flag's
/// absence.
fn capture_flag(capture: &str) -> String {
    if capture == "none" {
        "no --target-capture (none)".to_string()
    } else {
        format!("--target-capture {capture}")
    }
}

impl WalError {
    /// Whether a failed write may succeed later (no space, a quota, an I/O
    /// error the device may recover from): the writer rolls back and
    /// retries instead of failing the log.
    pub fn is_retryable_write(&self) -> bool {
        match self {
            WalError::Io { source, .. } => {
                matches!(
                    source.kind(),
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
                ) || source.raw_os_error() == Some(5)
            }
            _ => false,
        }
    }
}

pub(super) fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> WalError + '_ {
    move |source| WalError::Io {
        path: path.to_path_buf(),
        source,
    }
}
