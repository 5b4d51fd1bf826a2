//! The queue's vocabulary: identifiers, configuration, policies, the
//! per-stream statistics, errors, and what each operation answers.

use std::time::{Duration, Instant};

/// Identifies one Produce or Consume stream. Assigned by the queue, never
/// reused, so a late message from a replaced stream is recognisable.
pub type ConnectionId = u64;
/// Identifies one delivery (one lease) of an item. Never reused.
pub type DeliveryId = u64;

/// What the queue needs to know about a payload: its size, for the memory
/// bound and the credit windows. The transport's payload carries the tensors.
pub trait Payload: Clone {
    fn size_bytes(&self) -> u64;
}

/// What to do when a target fails (its stream gone past the grace period).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailurePolicy {
    /// End the run: every drafter gets end-of-stream ABORTED.
    Abort,
    /// Count the target as finished-with-loss and let the run complete.
    Continue,
}

#[derive(Debug, Clone)]
pub struct QueueConfig {
    /// The targets that must finish before the run can complete; any other
    /// id is refused.
    pub target_ids: Vec<String>,
    /// Bound on bytes held in memory: queued plus leased.
    pub max_queue_bytes: u64,
    /// A lease neither acked nor extended within this is taken back.
    pub lease_timeout: Duration,
    /// An item returned after this many deliveries is dead-lettered.
    pub max_deliveries: u32,
    /// How long a target's stream may be gone before the target fails.
    pub target_grace: Duration,
    /// How long after start every expected target must have connected once;
    /// `None` waits forever.
    pub target_startup_timeout: Option<Duration>,
    pub on_target_failure: FailurePolicy,
    /// A connected target with no item accepted for this long (not counting
    /// time the broker held it back) fails; `None` never.
    pub target_stall_timeout: Option<Duration>,
    /// A connected target must have its first item accepted within this
    /// after its hello (model loading); `None` waits forever.
    pub target_load_timeout: Option<Duration>,
    /// Extensions never keep a lease longer than this after its delivery;
    /// `None` no cap.
    pub max_lease_lifetime: Option<Duration>,
    /// How long a dead peer's stream can stay open before HTTP/2 keepalive
    /// drops it (keepalive interval plus timeout). A target's grace counts
    /// from its last message, or from this long before its stream was
    /// dropped if that is later, so a frozen target fails `target_grace`
    /// after it froze, not keepalive plus grace. `None`: from the drop.
    pub keepalive_detection: Option<Duration>,
}

impl QueueConfig {
    /// How many targets must finish before the run can complete.
    pub fn expected_targets(&self) -> u32 {
        u32::try_from(self.target_ids.len()).unwrap_or(u32::MAX)
    }

    /// The StatefulSet-style ids `target-0` .. `target-{count-1}`.
    pub fn default_target_ids(count: u32) -> Vec<String> {
        (0..count).map(|index| format!("target-{index}")).collect()
    }
}

/// A consumer's credit window: the most unacked items and bytes it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Credit {
    pub items: u32,
    /// 0 means no byte limit.
    pub bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProducerStats {
    pub tokens_per_second: f64,
    pub busy_fraction: f64,
    pub device: String,
    pub samples_done: u64,
    pub samples_total: u64,
    pub tokens_done: u64,
    pub trace_export: Option<TraceExport>,
}

/// What a process's span exporter did (its own count, passed through).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TraceExport {
    pub exported_spans: u64,
    pub dropped_spans: u64,
    pub failed_spans: u64,
    pub failing: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConsumerStats {
    pub tokens_per_second: f64,
    pub loss: f64,
    pub busy_fraction: f64,
    pub device: String,
    pub steps: u64,
    pub samples_trained: u64,
    pub accuracy: f64,
    pub skipped_steps: u64,
    pub non_finite_samples: u64,
    pub trace_export: Option<TraceExport>,
}

/// Where the run stands, as status shows it (the wire's `BrokerState`
/// without its unspecified value): targets producing, every target finished
/// and the rest draining, or ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerState {
    Running,
    Draining,
    Complete,
    Aborted,
}

/// How a run ended, as end-of-stream tells every consumer (the wire's
/// `RunStatus` without its unspecified value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    Complete,
    Aborted,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetState {
    Connected { connection: ConnectionId },
    Disconnected { since: Instant },
    Done,
    Failed { reason: String },
}

/// Why an item was rejected: the label of the rejected-items metric, so an
/// operator can tell a misbehaving target (malformed) from a misconfigured
/// limit (too large).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RejectReason {
    /// The sample failed validation: missing, or tensors of the wrong size.
    Malformed,
    /// Larger than the broker's `--max-item-bytes`; checked by the transport
    /// before the item reaches the queue.
    TooLarge,
    /// A new seq from a target that already reported done.
    TargetDone,
    /// A message other than an item or stats on a producer stream after its
    /// hello (a second hello, an empty message).
    UnexpectedMessage,
    /// A seq below the target's highest accepted one that was never
    /// accepted: seqs must increase along a target's streams.
    OutOfOrder,
}

impl RejectReason {
    pub const ALL: [RejectReason; 5] = [
        RejectReason::Malformed,
        RejectReason::TooLarge,
        RejectReason::TargetDone,
        RejectReason::UnexpectedMessage,
        RejectReason::OutOfOrder,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::Malformed => "malformed",
            RejectReason::TooLarge => "too_large",
            RejectReason::TargetDone => "target_done",
            RejectReason::UnexpectedMessage => "unexpected_message",
            RejectReason::OutOfOrder => "out_of_order",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NackDisposition {
    Requeue,
    DeadLetter,
}

/// Errors the queue answers; each maps to one gRPC status in the service.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error("target_id is empty")]
    EmptyTargetId,
    #[error("drafter_id is empty")]
    EmptyDrafterId,
    #[error("target {target_id:?} is not one of the expected targets ({expected})")]
    UnknownTarget { target_id: String, expected: String },
    #[error("target {target_id:?} has no Produce stream yet: open one, its welcome carries the epoch ReportDone needs")]
    NoProduceStream { target_id: String },
    #[error("target {target_id:?}: epoch {epoch} is not the current Produce stream's epoch {current}; a newer stream fenced this one")]
    StaleEpoch {
        target_id: String,
        epoch: u64,
        current: u64,
    },
    #[error("target {target_id:?}: seq {seq} is out of order (highest accepted {highest}) and was never accepted")]
    OutOfOrderSeq {
        target_id: String,
        seq: u64,
        highest: u64,
    },
    #[error("drafter {drafter_id:?} already has a live Consume stream (last message {last_seen_ms_ago} ms ago): a second stream for the same id is refused until that one ends or stalls; give each drafter its own id")]
    DrafterAlreadyConnected {
        drafter_id: String,
        last_seen_ms_ago: u64,
    },
    #[error("credit of 0 items: the drafter would never get a delivery; send at least 1")]
    ZeroCredit,
    #[error("target {target_id:?} has failed ({reason}); it can no longer produce or report done")]
    TargetFailed { target_id: String, reason: String },
    #[error("target {target_id:?} already reported done; item seq {seq} is new")]
    TargetAlreadyDone { target_id: String, seq: u64 },
    #[error("target {target_id:?}: report says {reported} items, broker accepted {accepted}")]
    DoneCountMismatch {
        target_id: String,
        reported: u64,
        accepted: u64,
    },
    #[error("queue full: {held} of {limit} bytes held")]
    QueueFull { held: u64, limit: u64 },
    #[error("stream {connection} is no longer current (replaced or closed)")]
    StaleConnection { connection: ConnectionId },
    #[error("the run has ended ({state:?}): {reason}")]
    RunEnded { state: BrokerState, reason: String },
    #[error("drafter {drafter_id:?} does not hold deliveries {delivery_ids} (their leases ended: the stream closed or they expired), so they cannot join its step's vote")]
    StepDeliveriesNotHeld {
        drafter_id: String,
        delivery_ids: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerOpened {
    pub connection: ConnectionId,
    /// Increases with every hello for the target; ReportDone must carry the
    /// current one.
    pub epoch: u64,
    pub resume_after_seq: Option<u64>,
    pub accepted_items: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemAccepted {
    pub duplicate: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoneAccepted {
    pub done_targets: u32,
    pub expected_targets: u32,
    pub already_done: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AckOutcome {
    pub acked: u32,
    /// Acks for leases this stream no longer holds (expired, or unknown ids):
    /// ignored, so an item is never acked twice.
    pub stale: u32,
}

/// The run's commit record: the highest committed step `step` (H) and the
/// commit that made it (the lighthouse instance and the quorum that
/// decided it). A drafter holds H when it applied exactly that commit; two
/// models at the same step with different records are two histories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct CommitRecord {
    pub step: u64,
    pub instance: u64,
    pub quorum_id: u64,
}

impl CommitRecord {
    /// Step 0: every model before its first step.
    pub const GENESIS: CommitRecord = CommitRecord {
        step: 0,
        instance: 0,
        quorum_id: 0,
    };
}

impl std::fmt::Display for CommitRecord {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == CommitRecord::GENESIS {
            return formatter.write_str("step 0 (genesis)");
        }
        write!(
            formatter,
            "step {} (lighthouse {:016x}, quorum {})",
            self.step, self.instance, self.quorum_id
        )
    }
}

/// A data-parallel step's vote round: (quorum id, step).
pub type StepRound = (u64, u64);
