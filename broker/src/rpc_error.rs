//! [`RpcError`]: everything the broker's RPCs refuse, and the one table
//! that turns it into a gRPC status (`impl From<RpcError> for Status`).
//!
//! No other code of the crate builds a [`Status`]: a handler returns a
//! variant here, or a domain error ([`QueueError`], [`SyncError`],
//! [`ReportError`]) that folds into one, so each refusal has one code
//! wherever it is answered. The messages are what clients and operators
//! match on (the Python client, the tests, logs): they name the bad value
//! and do not change.
//!
//! It sits beneath every module that answers an RPC (`roles`, `auth`,
//! `lighthouse`, `run_model`, `service`, `zero_copy`) and imports only the
//! domain errors it folds in (`queue`, `payload`); the run model's are
//! defined beneath it (`run_model` here) and re-exported by that room.

use std::time::Duration;

use tonic::{Code, Status};

use crate::payload::DecodeFailure;
use crate::queue::QueueError;

mod run_model;

pub use run_model::{CheckpointError, ReportError, SyncError};

/// Why an RPC (or a stream of one) is refused or ended. Messages are
/// lowercase, without a trailing period, and name the offending value.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// A refusal of the queue's state machine.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// A refused model snapshot or chunk.
    #[error(transparent)]
    Sync(#[from] SyncError),
    /// A refused τ report.
    #[error(transparent)]
    Report(#[from] ReportError),

    // Who is calling (`auth`, `roles`).
    #[error("wrong bearer token")]
    WrongToken,
    #[error("missing bearer token (authorization: Bearer <token>)")]
    MissingToken,
    /// The credential is of another role than the RPC needs.
    #[error("{action} needs a {needed} credential; this one is a {held} credential")]
    WrongRole {
        action: &'static str,
        needed: &'static str,
        held: &'static str,
    },
    /// The credential stands for another id of the right role.
    #[error("{action}: this credential stands for {role} {own:?}, not {identity:?}")]
    OtherIdentity {
        action: &'static str,
        role: &'static str,
        own: String,
        identity: String,
    },

    // Hellos and ids, in every service.
    /// An id field (`drafter_id`, `evaluator_id`) left empty.
    #[error("{field} is empty")]
    EmptyId { field: &'static str },
    #[error("{field} is {length} bytes long, the limit is {limit}")]
    IdTooLong {
        field: &'static str,
        length: usize,
        limit: usize,
    },
    #[error("{field} {id:?} contains control characters")]
    IdHasControlCharacters { field: &'static str, id: String },
    /// No hello within `--hello-timeout`.
    #[error("no hello within {0:?} (--hello-timeout)")]
    NoHello(Duration),
    #[error("stream ended before its hello")]
    StreamEndedBeforeHello,
    /// A stream (`Produce`, `Consume`, `Session`) opened with something
    /// else than its hello.
    #[error("the first {stream} message must be a hello with {id_field}")]
    FirstMessageNotHello {
        stream: &'static str,
        id_field: &'static str,
    },
    /// A hello or ReportDone from a run this broker does not hold.
    #[error(
        "{caller} was in run {remembered:?}, this broker serves run {current:?}: \
         the broker lost that run's state (restarted without --state-dir?); \
         what was accepted there cannot be accounted for"
    )]
    OtherRun {
        caller: String,
        remembered: String,
        current: String,
    },

    // The broker's own streams (`service`, `zero_copy`).
    #[error("broker is shutting down")]
    ShuttingDown,
    #[error(
        "the request stream is compressed with {encoding:?}; this broker accepts uncompressed streams only"
    )]
    CompressedStream { encoding: http::HeaderValue },
    #[error("Produce message {message_number} is not a valid ProduceRequest: {failure}")]
    InvalidProduceMessage {
        message_number: u64,
        failure: DecodeFailure,
    },
    /// An item over `--max-item-bytes`; `detail` is the decoder's message.
    #[error("item over the broker's message limit (--max-item-bytes {max_item_bytes} plus framing): {detail}")]
    ItemOverLimit { max_item_bytes: u64, detail: String },
    /// A Consume message over the control limit; `detail` is the decoder's
    /// message.
    #[error("Consume message over the control limit of {limit} bytes (acks, nacks, credit and stats only): {detail}")]
    ControlMessageOverLimit { limit: usize, detail: String },
    #[error("{what} names {ids} delivery ids, more than the {limit} one message may: send them in several")]
    TooManyDeliveryIds {
        what: &'static str,
        ids: usize,
        limit: usize,
    },
    /// The write-ahead log failed before `done` was durable.
    #[error(
        "ReportDone for target {target_id:?} was not logged: the broker's write-ahead log failed"
    )]
    DoneNotLogged { target_id: String },

    // The lighthouse (`Lighthouse.Quorum`, `Lighthouse.Commit`).
    #[error("a newer call of the same drafter replaced this one")]
    ReplacedByNewerCall,
    #[error(
        "committed.step {committed} differs from step {step}: send the commit the model last applied"
    )]
    CommittedStepDiffers { committed: u64, step: u64 },
    #[error("collective_timeout_ms {collective_timeout_ms} is not in 1..={limit_ms}")]
    CollectiveTimeoutOutOfRange {
        collective_timeout_ms: u64,
        limit_ms: u128,
    },
    #[error("store_address {0:?} is not host:port with a port in 1..=65535")]
    BadStoreAddress(String),
    #[error("samples lists delivery {0} twice")]
    DeliveryListedTwice(u64),
    /// A quorum answered to a drafter that is not its member: a bug.
    #[error("quorum {quorum_id} answered to {drafter_id} which is not one of its members")]
    AnsweredToNonMember { quorum_id: u64, drafter_id: String },

    // The run's model (`ModelSync.Session`, `ReadModel`, `ReportTau`).
    #[error("model_config_json is not valid JSON: {0}")]
    ModelConfigNotJson(serde_json::Error),
    #[error("begin while a snapshot is open: commit it first")]
    BeginWhileSnapshotOpen,
    /// A `file_chunk` or `commit` with no snapshot begun.
    #[error("{what} outside a snapshot")]
    OutsideSnapshot { what: &'static str },
    #[error("unexpected message: hello was already sent, expected begin, file_chunk or commit")]
    UnexpectedSessionMessage,
    /// A message whose kind prost does not know: its field is reserved
    /// (an old drafter's tensor `chunk`, field 3) or it has none.
    #[error("session message of no kind this broker takes: a tensor `chunk` (TensorChunk, SyncRequest field 3) is retired, send the model's files as `file_chunk`s; or the message is empty")]
    RetiredTensorChunk,
    #[error("the drafter closed its session")]
    SessionClosed,
    #[error("a drafter's ReadModel names drafter_id alone (no evaluator_id, no model_version)")]
    DrafterReadNamesEvaluator,
    #[error("model version {version} is not kept for evaluation (kept: {kept:?}); read the current model")]
    VersionNotKept { version: u64, kept: Vec<u64> },
    #[error("no model yet: no drafter has sent a snapshot")]
    NoModelToRead,
    #[error("the point's evaluator_id {point:?} is not the report's {report:?}")]
    PointOfOtherEvaluator { point: String, report: String },
    #[error("writing the best model failed: {0}")]
    BestModelNotWritten(CheckpointError),
    /// A blocking task of the broker's that panicked or was cancelled:
    /// `what` it did, `detail` the join error's message.
    #[error("{what}: {detail}")]
    TaskFailed { what: &'static str, detail: String },
}

/// The table: each refusal's code, and its message as the status message.
/// The only place in the crate that builds a [`Status`].
impl From<RpcError> for Status {
    fn from(error: RpcError) -> Status {
        use RpcError as E;
        let code = match &error {
            E::Queue(queue) => match queue {
                QueueError::EmptyTargetId
                | QueueError::EmptyDrafterId
                | QueueError::ZeroCredit
                | QueueError::OutOfOrderSeq { .. } => Code::InvalidArgument,
                QueueError::UnknownTarget { .. } => Code::NotFound,
                // A newer stream fenced the caller: a concurrency conflict,
                // so ABORTED (the fenced process must not retry; its
                // successor reports).
                QueueError::StaleEpoch { .. } => Code::Aborted,
                QueueError::NoProduceStream { .. }
                | QueueError::TargetFailed { .. }
                | QueueError::TargetAlreadyDone { .. }
                | QueueError::DoneCountMismatch { .. }
                | QueueError::RunEnded { .. }
                | QueueError::StepDeliveriesNotHeld { .. } => Code::FailedPrecondition,
                QueueError::QueueFull { .. } => Code::ResourceExhausted,
                // Retryable on purpose: a restarted drafter whose old stream
                // the broker has not seen end yet gets in once it has.
                QueueError::DrafterAlreadyConnected { .. } => Code::AlreadyExists,
                QueueError::StaleConnection { .. } => Code::Aborted,
            },
            E::Sync(sync) => match sync {
                SyncError::NoModel | SyncError::ConfigMismatch { .. } => Code::FailedPrecondition,
                SyncError::BadTensor { .. }
                | SyncError::UnknownTensor(_)
                | SyncError::ShapeMismatch { .. }
                | SyncError::MissingTensor(_)
                | SyncError::FileName(_)
                | SyncError::BadFile { .. }
                | SyncError::DuplicateFile(_)
                | SyncError::MissingFile(_)
                | SyncError::FileCountMismatch { .. }
                | SyncError::Kind(_)
                | SyncError::RemovedKind(_)
                | SyncError::Config(_) => Code::InvalidArgument,
            },
            E::Report(report) => match report {
                ReportError::NotServed { .. } | ReportError::AlreadyReported { .. } => {
                    Code::FailedPrecondition
                }
                ReportError::MissingPoint
                | ReportError::NotFinite(_)
                | ReportError::BelowOne(_)
                | ReportError::AboveBlockSize { .. }
                | ReportError::Empty { .. }
                | ReportError::BadSeconds(_)
                | ReportError::SamplesMismatch { .. } => Code::InvalidArgument,
            },
            E::WrongToken | E::MissingToken => Code::Unauthenticated,
            E::WrongRole { .. } | E::OtherIdentity { .. } => Code::PermissionDenied,
            E::EmptyId { .. }
            | E::IdTooLong { .. }
            | E::IdHasControlCharacters { .. }
            | E::StreamEndedBeforeHello
            | E::FirstMessageNotHello { .. }
            | E::InvalidProduceMessage { .. }
            | E::TooManyDeliveryIds { .. }
            | E::CommittedStepDiffers { .. }
            | E::CollectiveTimeoutOutOfRange { .. }
            | E::BadStoreAddress(_)
            | E::DeliveryListedTwice(_)
            | E::ModelConfigNotJson(_)
            | E::UnexpectedSessionMessage
            | E::RetiredTensorChunk
            | E::DrafterReadNamesEvaluator
            | E::PointOfOtherEvaluator { .. } => Code::InvalidArgument,
            E::NoHello(_) => Code::DeadlineExceeded,
            E::OtherRun { .. }
            | E::BeginWhileSnapshotOpen
            | E::OutsideSnapshot { .. }
            | E::VersionNotKept { .. }
            | E::NoModelToRead => Code::FailedPrecondition,
            E::ShuttingDown | E::DoneNotLogged { .. } | E::BestModelNotWritten(_) => {
                Code::Unavailable
            }
            E::CompressedStream { .. } => Code::Unimplemented,
            E::ItemOverLimit { .. } | E::ControlMessageOverLimit { .. } => Code::ResourceExhausted,
            E::ReplacedByNewerCall => Code::Aborted,
            E::AnsweredToNonMember { .. } | E::TaskFailed { .. } => Code::Internal,
            E::SessionClosed => Code::Cancelled,
        };
        Status::new(code, error.to_string())
    }
}

/// The queue's refusals answer through the table.
impl From<QueueError> for Status {
    fn from(error: QueueError) -> Status {
        RpcError::from(error).into()
    }
}

/// A refused snapshot answers through the table.
impl From<SyncError> for Status {
    fn from(error: SyncError) -> Status {
        RpcError::from(error).into()
    }
}

/// A refused τ report answers through the table.
impl From<ReportError> for Status {
    fn from(error: ReportError) -> Status {
        RpcError::from(error).into()
    }
}

#[cfg(test)]
mod tests;
