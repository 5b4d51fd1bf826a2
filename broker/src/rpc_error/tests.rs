//! The table, case by case: each refusal's code, and its message naming
//! the value it refuses, byte for byte as clients match on it.

use std::collections::BTreeSet;
use std::time::Duration;

use tonic::{Code, Status};

use super::RpcError;
use crate::payload::DecodeFailure;
use crate::queue::{BrokerState, QueueError};
use crate::run_model::checkpoint::CheckpointError;
use crate::run_model::evaluation::ReportError;
use crate::run_model::store::SyncError;

/// The variant's name. Exhaustive on purpose: a new variant does not
/// compile here until it is named, and [`every_variant_has_its_code_and_message`]
/// then fails until it has a case.
fn variant(error: &RpcError) -> &'static str {
    use RpcError as E;
    match error {
        E::Queue(_) => "Queue",
        E::Sync(_) => "Sync",
        E::Report(_) => "Report",
        E::WrongToken => "WrongToken",
        E::MissingToken => "MissingToken",
        E::WrongRole { .. } => "WrongRole",
        E::OtherIdentity { .. } => "OtherIdentity",
        E::EmptyId { .. } => "EmptyId",
        E::IdTooLong { .. } => "IdTooLong",
        E::IdHasControlCharacters { .. } => "IdHasControlCharacters",
        E::NoHello(_) => "NoHello",
        E::StreamEndedBeforeHello => "StreamEndedBeforeHello",
        E::FirstMessageNotHello { .. } => "FirstMessageNotHello",
        E::OtherRun { .. } => "OtherRun",
        E::ShuttingDown => "ShuttingDown",
        E::CompressedStream { .. } => "CompressedStream",
        E::InvalidProduceMessage { .. } => "InvalidProduceMessage",
        E::ItemOverLimit { .. } => "ItemOverLimit",
        E::ControlMessageOverLimit { .. } => "ControlMessageOverLimit",
        E::TooManyDeliveryIds { .. } => "TooManyDeliveryIds",
        E::DoneNotLogged { .. } => "DoneNotLogged",
        E::ReplacedByNewerCall => "ReplacedByNewerCall",
        E::CommittedStepDiffers { .. } => "CommittedStepDiffers",
        E::CollectiveTimeoutOutOfRange { .. } => "CollectiveTimeoutOutOfRange",
        E::BadStoreAddress(_) => "BadStoreAddress",
        E::DeliveryListedTwice(_) => "DeliveryListedTwice",
        E::AnsweredToNonMember { .. } => "AnsweredToNonMember",
        E::ModelConfigNotJson(_) => "ModelConfigNotJson",
        E::BeginWhileSnapshotOpen => "BeginWhileSnapshotOpen",
        E::OutsideSnapshot { .. } => "OutsideSnapshot",
        E::UnexpectedSessionMessage => "UnexpectedSessionMessage",
        E::RetiredTensorChunk => "RetiredTensorChunk",
        E::SessionClosed => "SessionClosed",
        E::DrafterReadNamesEvaluator => "DrafterReadNamesEvaluator",
        E::VersionNotKept { .. } => "VersionNotKept",
        E::NoModelToRead => "NoModelToRead",
        E::PointOfOtherEvaluator { .. } => "PointOfOtherEvaluator",
        E::BestModelNotWritten(_) => "BestModelNotWritten",
        E::TaskFailed { .. } => "TaskFailed",
    }
}

/// How many variants [`variant`] names.
const VARIANTS: usize = 39;

fn json_error() -> serde_json::Error {
    serde_json::from_str::<serde_json::Value>("{").unwrap_err()
}

/// Each variant of the broker's own, its code and its whole message.
fn own_cases() -> Vec<(RpcError, Code, String)> {
    let case = |error, code, message: &str| (error, code, message.to_string());
    vec![
        case(
            RpcError::WrongToken,
            Code::Unauthenticated,
            "wrong bearer token",
        ),
        case(
            RpcError::MissingToken,
            Code::Unauthenticated,
            "missing bearer token (authorization: Bearer <token>)",
        ),
        case(
            RpcError::WrongRole {
                action: "ReportDone",
                needed: "target",
                held: "drafter",
            },
            Code::PermissionDenied,
            "ReportDone needs a target credential; this one is a drafter credential",
        ),
        case(
            RpcError::OtherIdentity {
                action: "ReportDone",
                role: "target",
                own: "target-0".to_string(),
                identity: "target-1".to_string(),
            },
            Code::PermissionDenied,
            "ReportDone: this credential stands for target \"target-0\", not \"target-1\"",
        ),
        case(
            RpcError::EmptyId {
                field: "evaluator_id",
            },
            Code::InvalidArgument,
            "evaluator_id is empty",
        ),
        case(
            RpcError::IdTooLong {
                field: "drafter_id",
                length: 300,
                limit: 256,
            },
            Code::InvalidArgument,
            "drafter_id is 300 bytes long, the limit is 256",
        ),
        case(
            RpcError::IdHasControlCharacters {
                field: "target_id",
                id: "t\n0".to_string(),
            },
            Code::InvalidArgument,
            "target_id \"t\\n0\" contains control characters",
        ),
        case(
            RpcError::NoHello(Duration::from_millis(1500)),
            Code::DeadlineExceeded,
            "no hello within 1.5s (--hello-timeout)",
        ),
        case(
            RpcError::StreamEndedBeforeHello,
            Code::InvalidArgument,
            "stream ended before its hello",
        ),
        case(
            RpcError::FirstMessageNotHello {
                stream: "Consume",
                id_field: "drafter_id",
            },
            Code::InvalidArgument,
            "the first Consume message must be a hello with drafter_id",
        ),
        case(
            RpcError::OtherRun {
                caller: "target \"t0\"".to_string(),
                remembered: "run-a".to_string(),
                current: "run-b".to_string(),
            },
            Code::FailedPrecondition,
            "target \"t0\" was in run \"run-a\", this broker serves run \"run-b\": the broker \
             lost that run's state (restarted without --state-dir?); what was accepted there \
             cannot be accounted for",
        ),
        case(
            RpcError::ShuttingDown,
            Code::Unavailable,
            "broker is shutting down",
        ),
        case(
            RpcError::CompressedStream {
                encoding: http::HeaderValue::from_static("gzip"),
            },
            Code::Unimplemented,
            "the request stream is compressed with \"gzip\"; this broker accepts uncompressed \
             streams only",
        ),
        case(
            RpcError::InvalidProduceMessage {
                message_number: 4,
                failure: DecodeFailure::Underflow {
                    field: "Tensor.data",
                    declared: 1000,
                    remaining: 3,
                },
            },
            Code::InvalidArgument,
            "Produce message 4 is not a valid ProduceRequest: Tensor.data declares 1000 bytes, \
             but only 3 remain in its message",
        ),
        case(
            RpcError::ItemOverLimit {
                max_item_bytes: 1024,
                detail: "message too large".to_string(),
            },
            Code::ResourceExhausted,
            "item over the broker's message limit (--max-item-bytes 1024 plus framing): message \
             too large",
        ),
        case(
            RpcError::ControlMessageOverLimit {
                limit: 1 << 20,
                detail: "message too large".to_string(),
            },
            Code::ResourceExhausted,
            "Consume message over the control limit of 1048576 bytes (acks, nacks, credit and \
             stats only): message too large",
        ),
        case(
            RpcError::TooManyDeliveryIds {
                what: "Ack",
                ids: 70_000,
                limit: 65_536,
            },
            Code::InvalidArgument,
            "Ack names 70000 delivery ids, more than the 65536 one message may: send them in \
             several",
        ),
        case(
            RpcError::DoneNotLogged {
                target_id: "t0".to_string(),
            },
            Code::Unavailable,
            "ReportDone for target \"t0\" was not logged: the broker's write-ahead log failed",
        ),
        case(
            RpcError::ReplacedByNewerCall,
            Code::Aborted,
            "a newer call of the same drafter replaced this one",
        ),
        case(
            RpcError::CommittedStepDiffers {
                committed: 3,
                step: 4,
            },
            Code::InvalidArgument,
            "committed.step 3 differs from step 4: send the commit the model last applied",
        ),
        case(
            RpcError::CollectiveTimeoutOutOfRange {
                collective_timeout_ms: 0,
                limit_ms: 86_400_000,
            },
            Code::InvalidArgument,
            "collective_timeout_ms 0 is not in 1..=86400000",
        ),
        case(
            RpcError::BadStoreAddress("host:0".to_string()),
            Code::InvalidArgument,
            "store_address \"host:0\" is not host:port with a port in 1..=65535",
        ),
        case(
            RpcError::DeliveryListedTwice(7),
            Code::InvalidArgument,
            "samples lists delivery 7 twice",
        ),
        case(
            RpcError::AnsweredToNonMember {
                quorum_id: 5,
                drafter_id: "d9".to_string(),
            },
            Code::Internal,
            "quorum 5 answered to d9 which is not one of its members",
        ),
        (
            RpcError::ModelConfigNotJson(json_error()),
            Code::InvalidArgument,
            format!("model_config_json is not valid JSON: {}", json_error()),
        ),
        case(
            RpcError::BeginWhileSnapshotOpen,
            Code::FailedPrecondition,
            "begin while a snapshot is open: commit it first",
        ),
        case(
            RpcError::OutsideSnapshot { what: "commit" },
            Code::FailedPrecondition,
            "commit outside a snapshot",
        ),
        case(
            RpcError::UnexpectedSessionMessage,
            Code::InvalidArgument,
            "unexpected message: hello was already sent, expected begin, file_chunk or commit",
        ),
        case(
            RpcError::RetiredTensorChunk,
            Code::InvalidArgument,
            "session message of no kind this broker takes: a tensor `chunk` (TensorChunk, SyncRequest field 3) is retired, send the model's files as `file_chunk`s; or the message is empty",
        ),
        case(
            RpcError::SessionClosed,
            Code::Cancelled,
            "the drafter closed its session",
        ),
        case(
            RpcError::DrafterReadNamesEvaluator,
            Code::InvalidArgument,
            "a drafter's ReadModel names drafter_id alone (no evaluator_id, no model_version)",
        ),
        case(
            RpcError::VersionNotKept {
                version: 3,
                kept: vec![4, 5],
            },
            Code::FailedPrecondition,
            "model version 3 is not kept for evaluation (kept: [4, 5]); read the current model",
        ),
        case(
            RpcError::NoModelToRead,
            Code::FailedPrecondition,
            "no model yet: no drafter has sent a snapshot",
        ),
        case(
            RpcError::PointOfOtherEvaluator {
                point: "e1".to_string(),
                report: "e0".to_string(),
            },
            Code::InvalidArgument,
            "the point's evaluator_id \"e1\" is not the report's \"e0\"",
        ),
        case(
            RpcError::BestModelNotWritten(CheckpointError::Format {
                path: "/runs/model-best".into(),
                detail: "no space left".to_string(),
            }),
            Code::Unavailable,
            "writing the best model failed: /runs/model-best: no space left",
        ),
        case(
            RpcError::TaskFailed {
                what: "checking the snapshot",
                detail: "task 7 panicked".to_string(),
            },
            Code::Internal,
            "checking the snapshot: task 7 panicked",
        ),
    ]
}

/// Every refusal of the queue, the run's model and the τ reports, with its
/// code; their messages are their own `Display`, unchanged.
fn domain_cases() -> Vec<(RpcError, Code)> {
    let target_id = || "t0".to_string();
    let queue = [
        (QueueError::EmptyTargetId, Code::InvalidArgument),
        (QueueError::EmptyDrafterId, Code::InvalidArgument),
        (QueueError::ZeroCredit, Code::InvalidArgument),
        (
            QueueError::OutOfOrderSeq {
                target_id: target_id(),
                seq: 3,
                highest: 9,
            },
            Code::InvalidArgument,
        ),
        (
            QueueError::UnknownTarget {
                target_id: "t9".to_string(),
                expected: "t0, t1".to_string(),
            },
            Code::NotFound,
        ),
        (
            QueueError::StaleEpoch {
                target_id: target_id(),
                epoch: 1,
                current: 2,
            },
            Code::Aborted,
        ),
        (
            QueueError::NoProduceStream {
                target_id: target_id(),
            },
            Code::FailedPrecondition,
        ),
        (
            QueueError::TargetFailed {
                target_id: target_id(),
                reason: "gone".to_string(),
            },
            Code::FailedPrecondition,
        ),
        (
            QueueError::TargetAlreadyDone {
                target_id: target_id(),
                seq: 12,
            },
            Code::FailedPrecondition,
        ),
        (
            QueueError::DoneCountMismatch {
                target_id: target_id(),
                reported: 10,
                accepted: 9,
            },
            Code::FailedPrecondition,
        ),
        (
            QueueError::RunEnded {
                state: BrokerState::Aborted,
                reason: "target t1 failed".to_string(),
            },
            Code::FailedPrecondition,
        ),
        (
            QueueError::StepDeliveriesNotHeld {
                drafter_id: "d0".to_string(),
                delivery_ids: "[4, 5]".to_string(),
            },
            Code::FailedPrecondition,
        ),
        (
            QueueError::QueueFull {
                held: 2048,
                limit: 1024,
            },
            Code::ResourceExhausted,
        ),
        (
            QueueError::DrafterAlreadyConnected {
                drafter_id: "d0".to_string(),
                last_seen_ms_ago: 40,
            },
            Code::AlreadyExists,
        ),
        (
            QueueError::StaleConnection { connection: 17 },
            Code::Aborted,
        ),
    ];
    let sync = [
        (SyncError::NoModel, Code::FailedPrecondition),
        (
            SyncError::BadTensor {
                name: "fc.weight".to_string(),
                detail: "7 bytes".to_string(),
            },
            Code::InvalidArgument,
        ),
        (
            SyncError::UnknownTensor("fc.bias".to_string()),
            Code::InvalidArgument,
        ),
        (
            SyncError::ShapeMismatch {
                name: "fc.weight".to_string(),
                got: vec![2, 3],
                model: vec![3, 2],
            },
            Code::InvalidArgument,
        ),
        (
            SyncError::FileCountMismatch {
                sent: 1,
                declared: 2,
            },
            Code::InvalidArgument,
        ),
        (
            SyncError::FileName("optimizer.safetensors".to_string()),
            Code::InvalidArgument,
        ),
        (
            SyncError::BadFile {
                file: "model.safetensors".to_string(),
                detail: "chunk at offset 9, expected 8".to_string(),
            },
            Code::InvalidArgument,
        ),
        (
            SyncError::DuplicateFile("config.json".to_string()),
            Code::InvalidArgument,
        ),
        (SyncError::MissingFile("config.json"), Code::InvalidArgument),
        (
            SyncError::MissingTensor("fc.bias".to_string()),
            Code::InvalidArgument,
        ),
        (SyncError::Kind(9), Code::InvalidArgument),
        (SyncError::RemovedKind("JOIN"), Code::InvalidArgument),
        (
            SyncError::Config("expected value".to_string()),
            Code::InvalidArgument,
        ),
        (
            SyncError::ConfigMismatch {
                expected: "{\"a\":1}".to_string(),
                got: "{\"a\":2}".to_string(),
            },
            Code::FailedPrecondition,
        ),
    ];
    let report = [
        (ReportError::MissingPoint, Code::InvalidArgument),
        (ReportError::NotFinite(f64::NAN), Code::InvalidArgument),
        (ReportError::BelowOne(0.5), Code::InvalidArgument),
        (
            ReportError::AboveBlockSize {
                tau: 17.0,
                block_size: 16,
            },
            Code::InvalidArgument,
        ),
        (
            ReportError::Empty { field: "prompts" },
            Code::InvalidArgument,
        ),
        (ReportError::BadSeconds(-1.0), Code::InvalidArgument),
        (
            ReportError::NotServed {
                version: 3,
                pending: vec![4],
            },
            Code::FailedPrecondition,
        ),
        (
            ReportError::AlreadyReported {
                version: 3,
                tau: 2.5,
            },
            Code::FailedPrecondition,
        ),
        (
            ReportError::SamplesMismatch {
                version: 3,
                got: 10,
                served: 12,
            },
            Code::InvalidArgument,
        ),
    ];
    let queue = queue
        .into_iter()
        .map(|(error, code)| (RpcError::from(error), code));
    let sync = sync
        .into_iter()
        .map(|(error, code)| (RpcError::from(error), code));
    let report = report
        .into_iter()
        .map(|(error, code)| (RpcError::from(error), code));
    queue.chain(sync).chain(report).collect()
}

#[test]
fn every_variant_has_its_code_and_message() {
    let mut named = BTreeSet::new();
    for (error, code, message) in own_cases() {
        named.insert(variant(&error));
        let status = Status::from(error);
        assert_eq!(status.code(), code, "{message}");
        assert_eq!(status.message(), message);
    }
    for (error, code) in domain_cases() {
        named.insert(variant(&error));
        let message = error.to_string();
        let status = Status::from(error);
        assert_eq!(status.code(), code, "{message}");
        assert_eq!(status.message(), message);
    }
    assert_eq!(named.len(), VARIANTS, "variants with a case: {named:?}");
}

#[test]
fn domain_errors_answer_through_the_table() {
    let queue = QueueError::QueueFull {
        held: 2048,
        limit: 1024,
    };
    let status = Status::from(queue.clone());
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(status.message(), "queue full: 2048 of 1024 bytes held");
    assert_eq!(
        Status::from(RpcError::from(queue)).message(),
        status.message()
    );

    let sync = SyncError::UnknownTensor("fc.bias".to_string());
    let status = Status::from(sync);
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "the model has no tensor \"fc.bias\"");

    let report = ReportError::AlreadyReported {
        version: 3,
        tau: 2.5,
    };
    let status = Status::from(report);
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        status.message(),
        "model version 3 is already reported (τ 2.5)"
    );
}
