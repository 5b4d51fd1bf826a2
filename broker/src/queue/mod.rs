//! The broker's queue as a synchronous state machine.
//!
//! No tonic, no tokio, no clock: every operation takes `now` as an argument
//! and records what the transport must do (deliver an item, end a drafter's
//! stream, close a producer's stream) in an outbox that the caller drains
//! with [`Queue::take_effects`]. That keeps every rule of the shared queue
//! testable exhaustively (see `tests.rs` and the property tests).
//!
//! The rules, in one place:
//! - One FIFO shared by every producer and consumer. A delivery goes to the
//!   next connected consumer (round robin) whose credit window has room.
//! - Memory is bounded: the bytes held (queued + leased) never exceed
//!   `max_queue_bytes`; [`Queue::accept_item`] answers `QueueFull` and the
//!   transport stops reading that producer until [`Queue::has_room_for`].
//! - Every delivery is a lease until acked. A consumer that goes away returns
//!   all its leases to the head of the queue; a lease not acked or extended
//!   within `lease_timeout` is taken back. An item returned after
//!   `max_deliveries` deliveries, or nacked as poison, is dead-lettered.
//! - (target_id, seq) is accepted once; a repeat is acknowledged as a
//!   duplicate and not queued. A newer producer stream for a target replaces
//!   the older one (fenced by epoch); a consumer stream for a drafter id
//!   whose stream is live is refused, and replaces it only once it stalled.
//! - The completion counter is the set of finished targets. End-of-stream
//!   COMPLETE goes to every consumer only when every expected target is
//!   finished, the queue is empty and nothing is leased.
//! - A target whose stream is gone for longer than `target_grace` without
//!   reporting done fails (counted from its last message, or from
//!   `keepalive_detection` before the drop if later); the failure policy
//!   aborts the run or counts it as finished-with-loss.
//!
//! Names: a *target* and a *drafter* are identities (an id, its entry, its
//! counters, its fate in the run); a *producer* and a *consumer* are one
//! stream of theirs (a connection: opened, fenced, closed). So
//! `open_producer` opens a stream for a target, and `drafter_of_connection`
//! finds the drafter a consumer stream belongs to.
//!
//! Modules: `types` (ids, config, policies, errors, operation answers),
//! `effects` (the outbox), `producers` and `consumers` (the stream
//! operations), `ledger` (items, the FIFO, leases, dead letters, dispatch,
//! `tick`, the run state and the one place a run ends), `status` (summary,
//! snapshot, invariants). [`Queue`] and its private books live here. In debug
//! builds every public operation ends by checking the ledger invariants.

mod consumers;
mod effects;
mod journal;
mod ledger;
mod producers;
#[cfg(test)]
mod proptests;
mod rate;
mod recovery;
mod snapshot;
mod status;
mod steps;
#[cfg(test)]
pub(crate) mod tests;
mod types;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use effects::*;
pub use rate::RateMeter;
use recovery::{AcceptedSeqs, MAX_LISTED_DEAD_LETTERS};
pub use recovery::{JournalEntry, Recovered, RecoveredTarget, TargetBooks};
pub use snapshot::*;
pub use types::*;

/// Disconnected drafters kept for status beyond this are forgotten, oldest first.
const MAX_REMEMBERED_DISCONNECTED_DRAFTERS: usize = 256;

/// Identifies an accepted item; increases in acceptance order.
type ItemId = u64;

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
    /// Extensions never push `deadline` past this (`max_lease_lifetime`).
    expires_at_latest: Instant,
}

struct TargetEntry {
    target_id: Arc<str>,
    state: TargetState,
    /// The current Produce stream's epoch; 0 before the first hello.
    epoch: u64,
    /// Highest seq accepted; a new seq must be above it.
    highest_seq: Option<u64>,
    /// Every seq accepted, to tell a duplicate from an out-of-order seq.
    accepted_seqs: AcceptedSeqs,
    accepted_items: u64,
    accepted_bytes: u64,
    rejected_items: u64,
    duplicate_items: u64,
    last_seen: Instant,
    stats: Option<ProducerStats>,
    /// When the current stream said hello (the load timeout runs from it).
    connected_at: Instant,
    /// When an item was last accepted; `None` before the first. Stats and
    /// pings are not progress.
    last_progress: Option<Instant>,
    /// The broker is holding this target back (queue full): stall time
    /// does not run.
    held_back: bool,
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

/// The shared queue, completion counter and end-of-stream rules.
pub struct Queue<P: Payload> {
    config: QueueConfig,
    started_at: Instant,
    state: BrokerState,
    abort_reason: String,
    next_connection: ConnectionId,
    next_delivery: DeliveryId,
    next_item: ItemId,
    targets: BTreeMap<Arc<str>, TargetEntry>,
    producer_connections: HashMap<ConnectionId, Arc<str>>,
    drafters: BTreeMap<String, DrafterEntry>,
    consumer_connections: HashMap<ConnectionId, String>,
    /// Streams sent their end-of-stream, by drafter, until they close: a
    /// drafter's stats of its last step may still come on them (its final
    /// stats; nothing else is taken from an ended stream).
    ended_consumers: HashMap<ConnectionId, String>,
    /// Drafter id after which the round robin looks for the next consumer.
    round_robin_after: Option<String>,
    items: HashMap<ItemId, StoredItem<P>>,
    queue: VecDeque<ItemId>,
    queued_bytes: u64,
    leases: HashMap<DeliveryId, Lease>,
    /// Every lease by its deadline, so expiry and [`Queue::next_deadline`]
    /// look at the leases that are due, not at every lease under the lock.
    lease_deadlines: BTreeSet<(Instant, DeliveryId)>,
    leased_bytes: u64,
    /// Items pinned to data-parallel vote rounds (`steps`), by round.
    pinned: BTreeMap<StepRound, Vec<steps::PinnedItem>>,
    pinned_bytes: u64,
    /// The run's data-parallel commit record (H), committed or restored.
    commit_record: Option<CommitRecord>,
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
    /// Earliest deadline created since the transport last asked.
    new_deadline: Option<Instant>,
    /// Entries for the write-ahead log since the transport last took them;
    /// `None` when the broker keeps no state dir.
    journal: Option<Vec<JournalEntry<P>>>,
}

impl<P: Payload> Queue<P> {
    pub fn new(config: QueueConfig, now: Instant) -> Self {
        Queue {
            config,
            started_at: now,
            state: BrokerState::Running,
            abort_reason: String::new(),
            next_connection: 1,
            next_delivery: 1,
            next_item: 1,
            targets: BTreeMap::new(),
            producer_connections: HashMap::new(),
            drafters: BTreeMap::new(),
            consumer_connections: HashMap::new(),
            ended_consumers: HashMap::new(),
            round_robin_after: None,
            items: HashMap::new(),
            queue: VecDeque::new(),
            queued_bytes: 0,
            leases: HashMap::new(),
            lease_deadlines: BTreeSet::new(),
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
            new_deadline: None,
            pinned: BTreeMap::new(),
            pinned_bytes: 0,
            commit_record: None,
            journal: None,
        }
    }

    pub fn state(&self) -> BrokerState {
        self.state
    }

    /// Closes a consumer stream (as [`Queue::close_consumer`]) and says
    /// which drafter it was when that drafter has no stream left: it is no
    /// longer live for the lighthouse.
    pub fn close_consumer_of(&mut self, connection: ConnectionId, now: Instant) -> Option<String> {
        let drafter_id = self.consumer_connections.get(&connection).cloned();
        self.close_consumer(connection, now);
        let drafter_id = drafter_id?;
        let connected = self
            .drafters
            .get(&drafter_id)
            .is_some_and(|entry| entry.connection.is_some());
        (!connected).then_some(drafter_id)
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
        self.queued_bytes + self.leased_bytes + self.pinned_bytes
    }

    /// Whether this delivery is still an open lease (not acked, expired or returned).
    pub fn is_leased(&self, delivery_id: DeliveryId) -> bool {
        self.leases.contains_key(&delivery_id)
    }

    /// Whether an item of this size fits under the memory bound now.
    pub fn has_room_for(&self, bytes: u64) -> bool {
        self.held_bytes().saturating_add(bytes) <= self.config.max_queue_bytes
    }

    fn allocate_connection(&mut self) -> ConnectionId {
        let connection = self.next_connection;
        self.next_connection += 1;
        connection
    }
}
