//! The queue's types and its state machine, [`Queue`].

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::rate::RateMeter;

/// Identifies one Produce or Consume stream. Assigned by the queue, never
/// reused, so a late message from a replaced stream is recognisable.
pub type ConnectionId = u64;
/// Identifies one delivery (one lease) of an item. Never reused.
pub type DeliveryId = u64;
/// Identifies an accepted item; increases in acceptance order.
type ItemId = u64;

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
    /// How many targets must finish before the run can complete.
    pub expected_targets: u32,
    /// Bound on bytes held in memory: queued plus leased.
    pub max_held_bytes: u64,
    /// Largest accepted item.
    pub max_item_bytes: u64,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    Running,
    Draining,
    Complete,
    Aborted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOutcome {
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
    /// Larger than `max_item_bytes`.
    TooLarge,
    /// A new seq from a target that already reported done.
    TargetDone,
    /// A message other than an item or stats on a producer stream after its
    /// hello (a second hello, an empty message).
    UnexpectedMessage,
}

impl RejectReason {
    pub const ALL: [RejectReason; 4] = [
        RejectReason::Malformed,
        RejectReason::TooLarge,
        RejectReason::TargetDone,
        RejectReason::UnexpectedMessage,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::Malformed => "malformed",
            RejectReason::TooLarge => "too_large",
            RejectReason::TargetDone => "target_done",
            RejectReason::UnexpectedMessage => "unexpected_message",
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
    #[error("target {target_id:?} is not one of the {expected} expected targets (already known: {known})")]
    TooManyTargets {
        target_id: String,
        expected: u32,
        known: String,
    },
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
    #[error("item seq {seq}: {bytes} bytes exceeds the limit of {limit} bytes")]
    ItemTooLarge { seq: u64, bytes: u64, limit: u64 },
    #[error("queue full: {held} of {limit} bytes held")]
    QueueFull { held: u64, limit: u64 },
    #[error("stream {connection} is no longer current (replaced or closed)")]
    StaleConnection { connection: ConnectionId },
    #[error("the run has ended ({state:?}): {reason}")]
    RunEnded { state: RunState, reason: String },
}

/// One delivery for the transport to send.
#[derive(Debug, Clone)]
pub struct Delivery<P> {
    pub delivery_id: DeliveryId,
    pub target_id: Arc<str>,
    pub seq: u64,
    pub payload: P,
    /// 1 on the first delivery, 2 on the first redelivery, ...
    pub delivery_count: u32,
}

/// What the transport must do after an operation.
#[derive(Debug, Clone)]
pub enum Effect<P> {
    Deliver {
        connection: ConnectionId,
        delivery: Delivery<P>,
    },
    /// Send end-of-stream and close this consumer's stream.
    EndConsumer {
        connection: ConnectionId,
        outcome: RunOutcome,
        reason: String,
        summary: RunSummary,
    },
    /// Tell this producer why and close its stream.
    CloseProducer {
        connection: ConnectionId,
        outcome: RunOutcome,
        reason: String,
    },
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    pub expected_targets: u32,
    pub done_targets: u32,
    pub failed_targets: Vec<String>,
    pub accepted_items: u64,
    pub accepted_bytes: u64,
    pub acked_items: u64,
    pub dead_letters: u64,
    pub expected_items: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerOpened {
    pub connection: ConnectionId,
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

#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    pub target_id: Arc<str>,
    pub seq: u64,
    pub deliveries: u32,
    pub reason: String,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TargetSnapshot {
    pub target_id: String,
    pub state: TargetState,
    pub accepted_items: u64,
    pub accepted_bytes: u64,
    pub rejected_items: u64,
    pub duplicate_items: u64,
    pub last_seen_ago: Duration,
    pub stats: Option<ProducerStats>,
    pub highest_seq: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DrafterSnapshot {
    pub drafter_id: String,
    pub connected: bool,
    pub leased_items: u64,
    pub leased_bytes: u64,
    pub delivered_items: u64,
    pub acked_items: u64,
    pub nacked_items: u64,
    pub expired_leases: u64,
    pub last_seen_ago: Duration,
    pub stats: Option<ConsumerStats>,
    pub credit: Credit,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub state: RunState,
    pub expected_targets: u32,
    pub done_targets: u32,
    pub queued_items: u64,
    pub queued_bytes: u64,
    pub leased_items: u64,
    pub leased_bytes: u64,
    pub max_held_bytes: u64,
    pub dead_letters: Vec<DeadLetter>,
    pub targets: Vec<TargetSnapshot>,
    pub drafters: Vec<DrafterSnapshot>,
    pub accepted_items: u64,
    pub accepted_bytes: u64,
    pub delivered_items: u64,
    pub acked_items: u64,
    pub redelivered_items: u64,
    pub rejected_items: u64,
    /// `rejected_items` by reason; every reason is present, 0 when none.
    pub rejected_by_reason: BTreeMap<RejectReason, u64>,
    pub acked_items_per_second: f64,
    pub acked_bytes_per_second: f64,
    pub accepted_items_per_second: f64,
    pub accepted_bytes_per_second: f64,
    pub abort_reason: String,
    pub uptime: Duration,
    pub summary: RunSummary,
}

struct StoredItem<P> {
    target_id: Arc<str>,
    seq: u64,
    payload: P,
    bytes: u64,
    /// How many times the item was delivered so far.
    deliveries: u32,
}

struct Lease {
    item_id: ItemId,
    connection: ConnectionId,
    deadline: Instant,
}

struct TargetEntry {
    target_id: Arc<str>,
    state: TargetState,
    /// Highest seq accepted; seqs at or below it are duplicates.
    highest_seq: Option<u64>,
    accepted_items: u64,
    accepted_bytes: u64,
    rejected_items: u64,
    duplicate_items: u64,
    last_seen: Instant,
    stats: Option<ProducerStats>,
}

impl TargetEntry {
    fn is_finished(&self) -> bool {
        matches!(self.state, TargetState::Done | TargetState::Failed { .. })
    }
}

struct DrafterEntry {
    /// The drafter's current stream, when connected.
    connection: Option<ConnectionId>,
    credit: Credit,
    leases: BTreeSet<DeliveryId>,
    leased_bytes: u64,
    delivered_items: u64,
    acked_items: u64,
    nacked_items: u64,
    expired_leases: u64,
    last_seen: Instant,
    stats: Option<ConsumerStats>,
    /// A lease of this stream expired: it gets no new deliveries until it
    /// shows it is alive again (ack, nack or extend), so a hung drafter does
    /// not keep swallowing items until they are dead-lettered.
    stalled: bool,
}

/// Disconnected drafters kept for status beyond this are forgotten, oldest first.
const MAX_REMEMBERED_DISCONNECTED_DRAFTERS: usize = 256;
/// Dead letters listed individually in status (all are counted).
const MAX_LISTED_DEAD_LETTERS: usize = 100;

/// The shared queue, completion counter and end-of-stream rules.
pub struct Queue<P: Payload> {
    config: QueueConfig,
    started_at: Instant,
    state: RunState,
    abort_reason: String,
    next_connection: ConnectionId,
    next_delivery: DeliveryId,
    next_item: ItemId,
    targets: BTreeMap<Arc<str>, TargetEntry>,
    producer_connections: HashMap<ConnectionId, Arc<str>>,
    /// Targets failed because they never connected before the startup timeout.
    never_connected_failures: u32,
    drafters: BTreeMap<String, DrafterEntry>,
    consumer_connections: HashMap<ConnectionId, String>,
    /// Drafter id after which the round robin looks for the next consumer.
    round_robin_after: Option<String>,
    items: HashMap<ItemId, StoredItem<P>>,
    queue: VecDeque<ItemId>,
    queued_bytes: u64,
    leases: HashMap<DeliveryId, Lease>,
    leased_bytes: u64,
    dead_letters: Vec<DeadLetter>,
    dead_letter_count: u64,
    accepted_items: u64,
    accepted_bytes: u64,
    delivered_items: u64,
    acked_items: u64,
    acked_bytes: u64,
    redelivered_items: u64,
    rejected_items: u64,
    rejected_by_reason: BTreeMap<RejectReason, u64>,
    acked_rate: RateMeter,
    accepted_rate: RateMeter,
    effects: Vec<Effect<P>>,
}

impl<P: Payload> Queue<P> {
    pub fn new(config: QueueConfig, now: Instant) -> Self {
        Queue {
            config,
            started_at: now,
            state: RunState::Running,
            abort_reason: String::new(),
            next_connection: 1,
            next_delivery: 1,
            next_item: 1,
            targets: BTreeMap::new(),
            producer_connections: HashMap::new(),
            never_connected_failures: 0,
            drafters: BTreeMap::new(),
            consumer_connections: HashMap::new(),
            round_robin_after: None,
            items: HashMap::new(),
            queue: VecDeque::new(),
            queued_bytes: 0,
            leases: HashMap::new(),
            leased_bytes: 0,
            dead_letters: Vec::new(),
            dead_letter_count: 0,
            accepted_items: 0,
            accepted_bytes: 0,
            delivered_items: 0,
            acked_items: 0,
            acked_bytes: 0,
            redelivered_items: 0,
            rejected_items: 0,
            rejected_by_reason: RejectReason::ALL
                .into_iter()
                .map(|reason| (reason, 0))
                .collect(),
            acked_rate: RateMeter::new(Duration::from_secs(10), now),
            accepted_rate: RateMeter::new(Duration::from_secs(10), now),
            effects: Vec::new(),
        }
    }

    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    pub fn state(&self) -> RunState {
        self.state
    }

    /// The drafter whose stream `connection` is, for logs and traces.
    pub fn drafter_id_of(&self, connection: ConnectionId) -> Option<&str> {
        self.consumer_connections
            .get(&connection)
            .map(String::as_str)
    }

    /// What the transport must do since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<Effect<P>> {
        std::mem::take(&mut self.effects)
    }

    /// Bytes held in memory: queued plus leased.
    pub fn held_bytes(&self) -> u64 {
        self.queued_bytes + self.leased_bytes
    }

    /// Whether this delivery is still an open lease (not acked, expired or returned).
    pub fn is_leased(&self, delivery_id: DeliveryId) -> bool {
        self.leases.contains_key(&delivery_id)
    }

    /// Whether an item of this size fits under the memory bound now.
    pub fn has_room_for(&self, bytes: u64) -> bool {
        self.held_bytes().saturating_add(bytes) <= self.config.max_held_bytes
    }

    // ------------------------------------------------------------ producers

    /// A target opens its Produce stream. A stream already open for the same
    /// target is closed (ABORTED, replaced).
    pub fn open_producer(
        &mut self,
        target_id: &str,
        now: Instant,
    ) -> Result<ProducerOpened, QueueError> {
        self.ensure_not_ended()?;
        let key = self.target_key(target_id)?;
        let connection = self.allocate_connection();
        let entry = Self::target_entry(&mut self.targets, key.clone(), now);
        match &entry.state {
            TargetState::Failed { reason } => {
                return Err(QueueError::TargetFailed {
                    target_id: target_id.to_string(),
                    reason: reason.clone(),
                })
            }
            TargetState::Connected { connection: old } => {
                let old = *old;
                entry.state = TargetState::Connected { connection };
                self.producer_connections.remove(&old);
                self.effects.push(Effect::CloseProducer {
                    connection: old,
                    outcome: RunOutcome::Aborted,
                    reason: format!("replaced by a newer Produce stream for target {target_id:?}"),
                });
            }
            TargetState::Disconnected { .. } => entry.state = TargetState::Connected { connection },
            // A finished target may reconnect (a restarted pod): it learns that
            // everything is in and reports done again, which is idempotent.
            TargetState::Done => {}
        }
        let opened = ProducerOpened {
            connection,
            resume_after_seq: entry.highest_seq,
            accepted_items: entry.accepted_items,
        };
        self.producer_connections.insert(connection, key);
        Ok(opened)
    }

    /// Accepts one item from a producer stream. `QueueFull` changes nothing:
    /// the transport waits for room and calls again.
    pub fn accept_item(
        &mut self,
        connection: ConnectionId,
        seq: u64,
        payload: P,
        now: Instant,
    ) -> Result<ItemAccepted, QueueError> {
        let target_key = self.producer_target(connection)?;
        self.ensure_not_ended()?;
        let bytes = payload.size_bytes();
        let held = self.held_bytes();
        let limit = self.config.max_held_bytes;
        let max_item_bytes = self.config.max_item_bytes;
        let Some(entry) = self.targets.get_mut(&target_key) else {
            return Err(QueueError::StaleConnection { connection });
        };
        entry.last_seen = now;
        if entry.highest_seq.is_some_and(|highest| seq <= highest) {
            entry.duplicate_items += 1;
            return Ok(ItemAccepted { duplicate: true });
        }
        if entry.state == TargetState::Done {
            entry.rejected_items += 1;
            self.count_rejection(RejectReason::TargetDone);
            return Err(QueueError::TargetAlreadyDone {
                target_id: target_key.to_string(),
                seq,
            });
        }
        if bytes > max_item_bytes {
            entry.rejected_items += 1;
            self.count_rejection(RejectReason::TooLarge);
            return Err(QueueError::ItemTooLarge {
                seq,
                bytes,
                limit: max_item_bytes,
            });
        }
        if held.saturating_add(bytes) > limit {
            return Err(QueueError::QueueFull { held, limit });
        }
        entry.highest_seq = Some(seq);
        entry.accepted_items += 1;
        entry.accepted_bytes += bytes;
        let item_id = self.next_item;
        self.next_item += 1;
        self.items.insert(
            item_id,
            StoredItem {
                target_id: target_key,
                seq,
                payload,
                bytes,
                deliveries: 0,
            },
        );
        self.queue.push_back(item_id);
        self.queued_bytes += bytes;
        self.accepted_items += 1;
        self.accepted_bytes += bytes;
        self.dispatch(now);
        Ok(ItemAccepted { duplicate: false })
    }

    /// Counts an item the transport rejected before it reached the queue
    /// (a malformed sample), so status and metrics show it.
    pub fn count_rejected(&mut self, connection: ConnectionId, reason: RejectReason, now: Instant) {
        if let Some(entry) = self
            .producer_connections
            .get(&connection)
            .and_then(|key| self.targets.get_mut(key))
        {
            entry.rejected_items += 1;
            entry.last_seen = now;
        }
        self.count_rejection(reason);
    }

    fn count_rejection(&mut self, reason: RejectReason) {
        self.rejected_items += 1;
        *self.rejected_by_reason.entry(reason).or_insert(0) += 1;
    }

    pub fn producer_stats(&mut self, connection: ConnectionId, stats: ProducerStats, now: Instant) {
        if let Some(entry) = self
            .producer_connections
            .get(&connection)
            .and_then(|key| self.targets.get_mut(key))
        {
            entry.stats = Some(stats);
            entry.last_seen = now;
        }
    }

    /// A producer stream ended (cleanly or not). Idempotent.
    pub fn close_producer(&mut self, connection: ConnectionId, now: Instant) {
        let Some(key) = self.producer_connections.remove(&connection) else {
            return;
        };
        if let Some(entry) = self.targets.get_mut(&key) {
            entry.last_seen = now;
            if entry.state == (TargetState::Connected { connection }) {
                entry.state = TargetState::Disconnected { since: now };
            }
        }
    }

    /// A target reports it is finished. Idempotent; a count that differs from
    /// what was accepted changes nothing.
    pub fn report_done(
        &mut self,
        target_id: &str,
        total_items: u64,
        now: Instant,
    ) -> Result<DoneAccepted, QueueError> {
        if self.state == RunState::Aborted {
            return Err(QueueError::RunEnded {
                state: self.state,
                reason: self.abort_reason.clone(),
            });
        }
        let key = self.target_key(target_id)?;
        let accepted = self
            .targets
            .get(&key)
            .map_or(0, |entry| entry.accepted_items);
        if let Some(entry) = self.targets.get(&key) {
            if let TargetState::Failed { reason } = &entry.state {
                return Err(QueueError::TargetFailed {
                    target_id: target_id.to_string(),
                    reason: reason.clone(),
                });
            }
        }
        if accepted != total_items {
            return Err(QueueError::DoneCountMismatch {
                target_id: target_id.to_string(),
                reported: total_items,
                accepted,
            });
        }
        let entry = Self::target_entry(&mut self.targets, key.clone(), now);
        let already_done = entry.state == TargetState::Done;
        // A stream still open stays usable (late duplicates are answered) until
        // the target closes it; it no longer decides the target's liveness.
        entry.state = TargetState::Done;
        self.dispatch(now);
        Ok(DoneAccepted {
            done_targets: self.finished_targets(),
            expected_targets: self.config.expected_targets,
            already_done,
        })
    }

    // ------------------------------------------------------------ consumers

    /// A drafter opens its Consume stream. A stream already open under the
    /// same drafter id is ended (its leases go back to the queue). A drafter
    /// joining a finished run gets end-of-stream at once.
    pub fn open_consumer(
        &mut self,
        drafter_id: &str,
        credit: Credit,
        now: Instant,
    ) -> Result<ConnectionId, QueueError> {
        if drafter_id.is_empty() {
            return Err(QueueError::EmptyDrafterId);
        }
        let connection = self.allocate_connection();
        if let Some(old) = self
            .drafters
            .get(drafter_id)
            .and_then(|entry| entry.connection)
        {
            self.release_consumer(old);
            self.effects.push(Effect::EndConsumer {
                connection: old,
                outcome: RunOutcome::Aborted,
                reason: format!("replaced by a newer Consume stream for drafter {drafter_id:?}"),
                summary: self.summary(),
            });
        }
        let entry = self
            .drafters
            .entry(drafter_id.to_string())
            .or_insert_with(|| DrafterEntry {
                connection: None,
                credit,
                leases: BTreeSet::new(),
                leased_bytes: 0,
                delivered_items: 0,
                acked_items: 0,
                nacked_items: 0,
                expired_leases: 0,
                last_seen: now,
                stats: None,
                stalled: false,
            });
        entry.connection = Some(connection);
        entry.credit = credit;
        entry.last_seen = now;
        entry.stalled = false;
        self.consumer_connections
            .insert(connection, drafter_id.to_string());
        self.forget_old_drafters();
        match self.state {
            RunState::Complete | RunState::Aborted => self.end_consumer(connection),
            RunState::Running | RunState::Draining => self.dispatch(now),
        }
        Ok(connection)
    }

    pub fn set_credit(&mut self, connection: ConnectionId, credit: Credit, now: Instant) {
        if let Some(entry) = self.consumer_entry(connection) {
            entry.credit = credit;
            entry.last_seen = now;
            self.dispatch(now);
        }
    }

    pub fn consumer_stats(&mut self, connection: ConnectionId, stats: ConsumerStats, now: Instant) {
        if let Some(entry) = self.consumer_entry(connection) {
            entry.stats = Some(stats);
            entry.last_seen = now;
        }
    }

    /// Acks deliveries this stream holds; others are counted as stale.
    pub fn ack(
        &mut self,
        connection: ConnectionId,
        delivery_ids: &[DeliveryId],
        now: Instant,
    ) -> AckOutcome {
        let mut outcome = AckOutcome::default();
        for &delivery_id in delivery_ids {
            match self.take_lease(connection, delivery_id) {
                Some(item_id) => {
                    if let Some(item) = self.items.remove(&item_id) {
                        self.acked_items += 1;
                        self.acked_bytes += item.bytes;
                        if let Some(entry) = self.consumer_entry(connection) {
                            entry.acked_items += 1;
                        }
                    }
                    outcome.acked += 1;
                }
                None => outcome.stale += 1,
            }
        }
        self.consumer_alive(connection, now);
        self.dispatch(now);
        outcome
    }

    /// Returns deliveries to the queue (or dead-letters them). Ids the stream
    /// does not hold are ignored and counted as stale.
    pub fn nack(
        &mut self,
        connection: ConnectionId,
        delivery_ids: &[DeliveryId],
        disposition: NackDisposition,
        reason: &str,
        now: Instant,
    ) -> AckOutcome {
        let mut outcome = AckOutcome::default();
        let mut returned = Vec::new();
        for &delivery_id in delivery_ids {
            match self.take_lease(connection, delivery_id) {
                Some(item_id) => {
                    outcome.acked += 1;
                    if let Some(entry) = self.consumer_entry(connection) {
                        entry.nacked_items += 1;
                    }
                    match disposition {
                        NackDisposition::Requeue => returned.push(item_id),
                        NackDisposition::DeadLetter => self.dead_letter(
                            item_id,
                            format!("nacked as bad by the drafter: {reason}"),
                        ),
                    }
                }
                None => outcome.stale += 1,
            }
        }
        self.return_to_head(returned, reason);
        self.consumer_alive(connection, now);
        self.dispatch(now);
        outcome
    }

    /// Renews leases of this stream (all of them when `delivery_ids` is empty).
    pub fn extend_leases(
        &mut self,
        connection: ConnectionId,
        delivery_ids: &[DeliveryId],
        now: Instant,
    ) {
        let deadline = now + self.config.lease_timeout;
        if !self.consumer_alive(connection, now) {
            return;
        }
        let Some(entry) = self.consumer_entry(connection) else {
            return;
        };
        let held: Vec<DeliveryId> = if delivery_ids.is_empty() {
            entry.leases.iter().copied().collect()
        } else {
            delivery_ids.to_vec()
        };
        for delivery_id in held {
            if let Some(lease) = self.leases.get_mut(&delivery_id) {
                if lease.connection == connection {
                    lease.deadline = deadline;
                }
            }
        }
    }

    /// A consumer stream ended: all its leases go back to the head of the
    /// queue at once. Idempotent.
    pub fn close_consumer(&mut self, connection: ConnectionId, now: Instant) {
        if self.consumer_connections.contains_key(&connection) {
            self.release_consumer(connection);
            self.dispatch(now);
        }
    }

    // ------------------------------------------------------------ time

    /// Takes back expired leases, fails targets gone past their grace period,
    /// and samples throughput. Call it periodically.
    pub fn tick(&mut self, now: Instant) {
        let expired: Vec<DeliveryId> = self
            .leases
            .iter()
            .filter(|(_, lease)| lease.deadline <= now)
            .map(|(&delivery_id, _)| delivery_id)
            .collect();
        let mut returned = Vec::new();
        for delivery_id in expired {
            let Some(lease) = self.leases.remove(&delivery_id) else {
                continue;
            };
            self.unlink_lease(lease.connection, delivery_id, lease.item_id);
            if let Some(entry) = self.consumer_entry(lease.connection) {
                entry.expired_leases += 1;
                entry.stalled = true;
            }
            returned.push(lease.item_id);
        }
        self.return_to_head(returned, "lease expired");

        if matches!(self.state, RunState::Running | RunState::Draining) {
            let grace = self.config.target_grace;
            let lapsed: Vec<Arc<str>> = self
                .targets
                .values()
                .filter(|entry| match entry.state {
                    TargetState::Disconnected { since } => {
                        now.saturating_duration_since(since) > grace
                    }
                    _ => false,
                })
                .map(|entry| entry.target_id.clone())
                .collect();
            for target_id in lapsed {
                let reason = format!(
                    "stream gone for more than {:.1}s without ReportDone",
                    grace.as_secs_f64()
                );
                self.fail_target(&target_id, reason, now);
            }
            if let Some(timeout) = self.config.target_startup_timeout {
                let known = self.targets.len() as u32 + self.never_connected_failures;
                if known < self.config.expected_targets
                    && now.saturating_duration_since(self.started_at) >= timeout
                {
                    let missing = self.config.expected_targets - known;
                    self.never_connected_failures += missing;
                    let reason = format!(
                        "{missing} of {} expected targets never connected within {:.1}s",
                        self.config.expected_targets,
                        timeout.as_secs_f64()
                    );
                    self.apply_failure_policy(reason, now);
                }
            }
        }
        self.acked_rate
            .record(now, self.acked_items, self.acked_bytes);
        self.accepted_rate
            .record(now, self.accepted_items, self.accepted_bytes);
        self.dispatch(now);
    }

    /// The earliest time at which `tick` has something to do, if any.
    pub fn next_deadline(&self) -> Option<Instant> {
        let lease = self.leases.values().map(|lease| lease.deadline).min();
        let target = self
            .targets
            .values()
            .filter_map(|entry| match entry.state {
                TargetState::Disconnected { since } => Some(since + self.config.target_grace),
                _ => None,
            })
            .min();
        [lease, target].into_iter().flatten().min()
    }

    // ------------------------------------------------------------ status

    pub fn summary(&self) -> RunSummary {
        let failed_targets: Vec<String> = self
            .targets
            .values()
            .filter(|entry| matches!(entry.state, TargetState::Failed { .. }))
            .map(|entry| entry.target_id.to_string())
            .chain(
                (0..self.never_connected_failures)
                    .map(|index| format!("<never connected #{}>", index + 1)),
            )
            .collect();
        let announced: Vec<u64> = self
            .targets
            .values()
            .filter_map(|entry| entry.stats.as_ref().map(|stats| stats.samples_total))
            .filter(|&total| total > 0)
            .collect();
        let expected_items = if announced.len() as u32 == self.config.expected_targets {
            announced.iter().sum()
        } else {
            0
        };
        RunSummary {
            expected_targets: self.config.expected_targets,
            done_targets: self.finished_targets(),
            failed_targets,
            accepted_items: self.accepted_items,
            accepted_bytes: self.accepted_bytes,
            acked_items: self.acked_items,
            dead_letters: self.dead_letter_count,
            expected_items,
        }
    }

    pub fn snapshot(&self, now: Instant) -> Snapshot {
        let (acked_items_per_second, acked_bytes_per_second) =
            self.acked_rate
                .rate(now, self.acked_items, self.acked_bytes);
        let (accepted_items_per_second, accepted_bytes_per_second) =
            self.accepted_rate
                .rate(now, self.accepted_items, self.accepted_bytes);
        Snapshot {
            state: self.state,
            expected_targets: self.config.expected_targets,
            done_targets: self.finished_targets(),
            queued_items: self.queue.len() as u64,
            queued_bytes: self.queued_bytes,
            leased_items: self.leases.len() as u64,
            leased_bytes: self.leased_bytes,
            max_held_bytes: self.config.max_held_bytes,
            dead_letters: self.dead_letters.clone(),
            targets: self
                .targets
                .values()
                .map(|entry| TargetSnapshot {
                    target_id: entry.target_id.to_string(),
                    state: entry.state.clone(),
                    accepted_items: entry.accepted_items,
                    accepted_bytes: entry.accepted_bytes,
                    rejected_items: entry.rejected_items,
                    duplicate_items: entry.duplicate_items,
                    last_seen_ago: now.saturating_duration_since(entry.last_seen),
                    stats: entry.stats.clone(),
                    highest_seq: entry.highest_seq,
                })
                .collect(),
            drafters: self
                .drafters
                .iter()
                .map(|(drafter_id, entry)| DrafterSnapshot {
                    drafter_id: drafter_id.clone(),
                    connected: entry.connection.is_some(),
                    leased_items: entry.leases.len() as u64,
                    leased_bytes: entry.leased_bytes,
                    delivered_items: entry.delivered_items,
                    acked_items: entry.acked_items,
                    nacked_items: entry.nacked_items,
                    expired_leases: entry.expired_leases,
                    last_seen_ago: now.saturating_duration_since(entry.last_seen),
                    stats: entry.stats.clone(),
                    credit: entry.credit,
                })
                .collect(),
            accepted_items: self.accepted_items,
            accepted_bytes: self.accepted_bytes,
            delivered_items: self.delivered_items,
            acked_items: self.acked_items,
            redelivered_items: self.redelivered_items,
            rejected_items: self.rejected_items,
            rejected_by_reason: self.rejected_by_reason.clone(),
            acked_items_per_second,
            acked_bytes_per_second,
            accepted_items_per_second,
            accepted_bytes_per_second,
            abort_reason: self.abort_reason.clone(),
            uptime: now.saturating_duration_since(self.started_at),
            summary: self.summary(),
        }
    }

    /// Every accepted item is in exactly one place: queued, leased, acked or
    /// dead-lettered; byte counters match. For tests and debug assertions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let queued: u64 = self.queue.len() as u64;
        let leased: u64 = self.leases.len() as u64;
        if queued + leased + self.acked_items + self.dead_letter_count != self.accepted_items {
            return Err(format!(
                "accounting: queued {queued} + leased {leased} + acked {} + dead {} != accepted {}",
                self.acked_items, self.dead_letter_count, self.accepted_items
            ));
        }
        if self.items.len() as u64 != queued + leased {
            return Err(format!(
                "{} stored items, {queued} queued + {leased} leased",
                self.items.len()
            ));
        }
        let queued_bytes: u64 = self
            .queue
            .iter()
            .filter_map(|id| self.items.get(id))
            .map(|item| item.bytes)
            .sum();
        if queued_bytes != self.queued_bytes {
            return Err(format!(
                "queued bytes {} != sum {queued_bytes}",
                self.queued_bytes
            ));
        }
        let leased_bytes: u64 = self
            .leases
            .values()
            .filter_map(|lease| self.items.get(&lease.item_id))
            .map(|item| item.bytes)
            .sum();
        if leased_bytes != self.leased_bytes {
            return Err(format!(
                "leased bytes {} != sum {leased_bytes}",
                self.leased_bytes
            ));
        }
        if self.held_bytes() > self.config.max_held_bytes {
            return Err(format!(
                "held {} > cap {}",
                self.held_bytes(),
                self.config.max_held_bytes
            ));
        }
        let mut leased_items: Vec<ItemId> =
            self.leases.values().map(|lease| lease.item_id).collect();
        leased_items.extend(self.queue.iter().copied());
        leased_items.sort_unstable();
        if leased_items.windows(2).any(|pair| pair[0] == pair[1]) {
            return Err("an item is queued or leased twice".to_string());
        }
        for (drafter_id, entry) in &self.drafters {
            for delivery_id in &entry.leases {
                match self.leases.get(delivery_id) {
                    Some(lease) if Some(lease.connection) == entry.connection => {}
                    _ => {
                        return Err(format!(
                            "drafter {drafter_id} lists lease {delivery_id} it does not hold"
                        ))
                    }
                }
            }
        }
        if self.state == RunState::Complete && (queued > 0 || leased > 0) {
            return Err("complete with items outstanding".to_string());
        }
        let rejected_by_reason: u64 = self.rejected_by_reason.values().sum();
        if rejected_by_reason != self.rejected_items {
            return Err(format!(
                "rejections by reason sum to {rejected_by_reason}, rejected items are {}",
                self.rejected_items
            ));
        }
        Ok(())
    }

    // ------------------------------------------------------------ internals

    fn allocate_connection(&mut self) -> ConnectionId {
        let connection = self.next_connection;
        self.next_connection += 1;
        connection
    }

    fn ensure_not_ended(&self) -> Result<(), QueueError> {
        match self.state {
            RunState::Complete | RunState::Aborted => Err(QueueError::RunEnded {
                state: self.state,
                reason: if self.abort_reason.is_empty() {
                    "every target is done and every item acked".to_string()
                } else {
                    self.abort_reason.clone()
                },
            }),
            RunState::Running | RunState::Draining => Ok(()),
        }
    }

    /// The shared key for a target id, registering a new target only while
    /// fewer than the expected number are known.
    fn target_key(&self, target_id: &str) -> Result<Arc<str>, QueueError> {
        if target_id.is_empty() {
            return Err(QueueError::EmptyTargetId);
        }
        if let Some((key, _)) = self.targets.get_key_value(target_id) {
            return Ok(key.clone());
        }
        let known = self.targets.len() as u32 + self.never_connected_failures;
        if known >= self.config.expected_targets {
            let known_ids: Vec<&str> = self.targets.keys().map(|key| key.as_ref()).collect();
            return Err(QueueError::TooManyTargets {
                target_id: target_id.to_string(),
                expected: self.config.expected_targets,
                known: known_ids.join(", "),
            });
        }
        Ok(Arc::from(target_id))
    }

    /// The target's entry, registered (disconnected, nothing accepted) on
    /// first sight; either way marked as seen now.
    fn target_entry(
        targets: &mut BTreeMap<Arc<str>, TargetEntry>,
        key: Arc<str>,
        now: Instant,
    ) -> &mut TargetEntry {
        let entry = targets.entry(key.clone()).or_insert_with(|| TargetEntry {
            target_id: key,
            state: TargetState::Disconnected { since: now },
            highest_seq: None,
            accepted_items: 0,
            accepted_bytes: 0,
            rejected_items: 0,
            duplicate_items: 0,
            last_seen: now,
            stats: None,
        });
        entry.last_seen = now;
        entry
    }

    fn producer_target(&self, connection: ConnectionId) -> Result<Arc<str>, QueueError> {
        self.producer_connections
            .get(&connection)
            .cloned()
            .ok_or(QueueError::StaleConnection { connection })
    }

    fn consumer_entry(&mut self, connection: ConnectionId) -> Option<&mut DrafterEntry> {
        let drafter_id = self.consumer_connections.get(&connection)?;
        let entry = self.drafters.get_mut(drafter_id)?;
        (entry.connection == Some(connection)).then_some(entry)
    }

    /// The consumer acked, nacked or extended: it is seen now and no longer
    /// stalled. False when the connection is not current.
    fn consumer_alive(&mut self, connection: ConnectionId, now: Instant) -> bool {
        match self.consumer_entry(connection) {
            Some(entry) => {
                entry.last_seen = now;
                entry.stalled = false;
                true
            }
            None => false,
        }
    }

    fn finished_targets(&self) -> u32 {
        self.targets
            .values()
            .filter(|entry| entry.is_finished())
            .count() as u32
            + self.never_connected_failures
    }

    /// Removes a lease held by `connection`; the item id when it was held.
    fn take_lease(&mut self, connection: ConnectionId, delivery_id: DeliveryId) -> Option<ItemId> {
        match self.leases.get(&delivery_id) {
            Some(lease) if lease.connection == connection => {}
            _ => return None,
        }
        let lease = self.leases.remove(&delivery_id)?;
        self.unlink_lease(connection, delivery_id, lease.item_id);
        Some(lease.item_id)
    }

    /// Drops a removed lease from its drafter's books and the leased bytes.
    fn unlink_lease(&mut self, connection: ConnectionId, delivery_id: DeliveryId, item_id: ItemId) {
        let bytes = self.items.get(&item_id).map_or(0, |item| item.bytes);
        self.leased_bytes -= bytes;
        if let Some(drafter_id) = self.consumer_connections.get(&connection) {
            if let Some(entry) = self.drafters.get_mut(drafter_id) {
                if entry.leases.remove(&delivery_id) {
                    entry.leased_bytes -= bytes;
                }
            }
        }
    }

    /// Puts returned items back at the head of the queue in acceptance order,
    /// dead-lettering those that used up their deliveries.
    fn return_to_head(&mut self, mut item_ids: Vec<ItemId>, reason: &str) {
        item_ids.sort_unstable();
        for item_id in item_ids.into_iter().rev() {
            let Some(item) = self.items.get(&item_id) else {
                continue;
            };
            if item.deliveries >= self.config.max_deliveries {
                let deliveries = item.deliveries;
                self.dead_letter(
                    item_id,
                    format!(
                        "{reason} after {deliveries} deliveries (max {})",
                        self.config.max_deliveries
                    ),
                );
            } else {
                self.queued_bytes += item.bytes;
                self.queue.push_front(item_id);
            }
        }
    }

    fn dead_letter(&mut self, item_id: ItemId, reason: String) {
        let Some(item) = self.items.remove(&item_id) else {
            return;
        };
        tracing::warn!(target_id = %item.target_id, seq = item.seq, deliveries = item.deliveries, %reason, "item dead-lettered");
        self.dead_letter_count += 1;
        if self.dead_letters.len() < MAX_LISTED_DEAD_LETTERS {
            self.dead_letters.push(DeadLetter {
                target_id: item.target_id,
                seq: item.seq,
                deliveries: item.deliveries,
                reason,
                bytes: item.bytes,
            });
        }
    }

    /// Returns a consumer's leases to the queue and marks it disconnected.
    fn release_consumer(&mut self, connection: ConnectionId) {
        let Some(drafter_id) = self.consumer_connections.get(&connection).cloned() else {
            return;
        };
        let held: Vec<DeliveryId> = match self.drafters.get(&drafter_id) {
            Some(entry) if entry.connection == Some(connection) => {
                entry.leases.iter().copied().collect()
            }
            _ => Vec::new(),
        };
        let mut returned = Vec::new();
        for delivery_id in held {
            if let Some(item_id) = self.take_lease(connection, delivery_id) {
                returned.push(item_id);
            }
        }
        self.return_to_head(returned, "drafter disconnected");
        if let Some(entry) = self.drafters.get_mut(&drafter_id) {
            if entry.connection == Some(connection) {
                entry.connection = None;
            }
        }
        self.consumer_connections.remove(&connection);
    }

    fn forget_old_drafters(&mut self) {
        let disconnected: Vec<(Instant, String)> = self
            .drafters
            .iter()
            .filter(|(_, entry)| entry.connection.is_none())
            .map(|(drafter_id, entry)| (entry.last_seen, drafter_id.clone()))
            .collect();
        if disconnected.len() > MAX_REMEMBERED_DISCONNECTED_DRAFTERS {
            let mut oldest_first = disconnected;
            oldest_first.sort();
            let excess = oldest_first.len() - MAX_REMEMBERED_DISCONNECTED_DRAFTERS;
            for (_, drafter_id) in oldest_first.into_iter().take(excess) {
                self.drafters.remove(&drafter_id);
            }
        }
    }

    fn fail_target(&mut self, target_id: &Arc<str>, reason: String, now: Instant) {
        let Some(entry) = self.targets.get_mut(target_id) else {
            return;
        };
        if entry.is_finished() {
            return;
        }
        tracing::warn!(target_id = %target_id, %reason, "target failed");
        entry.state = TargetState::Failed {
            reason: reason.clone(),
        };
        self.apply_failure_policy(format!("target {target_id:?} failed: {reason}"), now);
    }

    fn apply_failure_policy(&mut self, reason: String, now: Instant) {
        match self.config.on_target_failure {
            FailurePolicy::Abort => self.abort(reason),
            FailurePolicy::Continue => self.dispatch(now),
        }
    }

    /// Ends the run as ABORTED: every consumer gets end-of-stream, every
    /// producer is closed. Items still queued stay counted in status.
    pub fn abort(&mut self, reason: String) {
        if matches!(self.state, RunState::Complete | RunState::Aborted) {
            return;
        }
        tracing::error!(%reason, "run aborted");
        self.state = RunState::Aborted;
        self.abort_reason = reason.clone();
        let consumers: Vec<ConnectionId> = self.consumer_connections.keys().copied().collect();
        for connection in consumers {
            self.end_consumer(connection);
        }
        let producers: Vec<ConnectionId> = self.producer_connections.keys().copied().collect();
        for connection in producers {
            self.effects.push(Effect::CloseProducer {
                connection,
                outcome: RunOutcome::Aborted,
                reason: reason.clone(),
            });
        }
    }

    /// Sends end-of-stream for the run's outcome and forgets the connection;
    /// its leases (none when complete) go back to the queue.
    fn end_consumer(&mut self, connection: ConnectionId) {
        let (outcome, reason) = match self.state {
            RunState::Complete => (RunOutcome::Complete, String::new()),
            _ => (RunOutcome::Aborted, self.abort_reason.clone()),
        };
        self.release_consumer(connection);
        let summary = self.summary();
        self.effects.push(Effect::EndConsumer {
            connection,
            outcome,
            reason,
            summary,
        });
    }

    /// Moves RUNNING → DRAINING once every expected target is finished, and
    /// to COMPLETE (end-of-stream to every consumer) once nothing is queued
    /// or leased either.
    fn update_run_state(&mut self) {
        if matches!(self.state, RunState::Complete | RunState::Aborted) {
            return;
        }
        let all_finished = self.finished_targets() >= self.config.expected_targets;
        if !all_finished {
            return;
        }
        if self.queue.is_empty() && self.leases.is_empty() {
            tracing::info!(
                accepted = self.accepted_items,
                acked = self.acked_items,
                dead = self.dead_letter_count,
                "run complete"
            );
            self.state = RunState::Complete;
            let consumers: Vec<ConnectionId> = self.consumer_connections.keys().copied().collect();
            for connection in consumers {
                self.end_consumer(connection);
            }
            let producers: Vec<ConnectionId> = self.producer_connections.keys().copied().collect();
            for connection in producers {
                self.effects.push(Effect::CloseProducer {
                    connection,
                    outcome: RunOutcome::Complete,
                    reason: "run complete".to_string(),
                });
            }
        } else {
            self.state = RunState::Draining;
        }
    }

    /// Hands queued items to consumers with room, round robin, then checks
    /// whether the run is complete.
    fn dispatch(&mut self, now: Instant) {
        if matches!(self.state, RunState::Running | RunState::Draining) {
            while let Some(&item_id) = self.queue.front() {
                let Some(bytes) = self.items.get(&item_id).map(|item| item.bytes) else {
                    self.queue.pop_front();
                    continue;
                };
                let Some(connection) = self.next_consumer_with_room(bytes) else {
                    break;
                };
                self.queue.pop_front();
                self.queued_bytes -= bytes;
                self.deliver(item_id, connection, now);
            }
        }
        self.update_run_state();
    }

    fn next_consumer_with_room(&mut self, bytes: u64) -> Option<ConnectionId> {
        let has_room = |entry: &DrafterEntry| {
            let items = entry.leases.len() as u64;
            entry.connection.is_some()
                && !entry.stalled
                && items < u64::from(entry.credit.items)
                && (items == 0
                    || entry.credit.bytes == 0
                    || entry.leased_bytes + bytes <= entry.credit.bytes)
        };
        let after = self.round_robin_after.clone();
        let candidate = match &after {
            Some(last) => self
                .drafters
                .range::<String, _>((
                    std::ops::Bound::Excluded(last.clone()),
                    std::ops::Bound::Unbounded,
                ))
                .chain(self.drafters.range::<String, _>(..=last.clone()))
                .find(|(_, entry)| has_room(entry)),
            None => self.drafters.iter().find(|(_, entry)| has_room(entry)),
        };
        let (drafter_id, entry) = candidate?;
        let connection = entry.connection?;
        self.round_robin_after = Some(drafter_id.clone());
        Some(connection)
    }

    fn deliver(&mut self, item_id: ItemId, connection: ConnectionId, now: Instant) {
        let delivery_id = self.next_delivery;
        self.next_delivery += 1;
        let Some(item) = self.items.get_mut(&item_id) else {
            return;
        };
        item.deliveries += 1;
        if item.deliveries > 1 {
            self.redelivered_items += 1;
        }
        let delivery = Delivery {
            delivery_id,
            target_id: item.target_id.clone(),
            seq: item.seq,
            payload: item.payload.clone(),
            delivery_count: item.deliveries,
        };
        let bytes = item.bytes;
        self.leases.insert(
            delivery_id,
            Lease {
                item_id,
                connection,
                deadline: now + self.config.lease_timeout,
            },
        );
        self.leased_bytes += bytes;
        self.delivered_items += 1;
        if let Some(entry) = self.consumer_entry(connection) {
            entry.leases.insert(delivery_id);
            entry.leased_bytes += bytes;
            entry.delivered_items += 1;
        }
        self.effects.push(Effect::Deliver {
            connection,
            delivery,
        });
    }
}
