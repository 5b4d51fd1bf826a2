//! Property tests: random interleavings of produce, deliver, ack, nack,
//! disconnect, lease expiry, target failure and done, checked against a
//! Jepsen-style ledger: every accepted (target, seq) ends acked exactly once
//! or dead-lettered, never lost, and end-of-stream COMPLETE comes only after.

use super::tests::{config, TestPayload};
use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

const TARGETS: usize = 3;
const DRAFTERS: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    Produce {
        target: usize,
        bytes: u64,
    },
    /// Repeat the last seq of a target (a retry).
    Retry {
        target: usize,
    },
    ReconnectTarget {
        target: usize,
    },
    DisconnectTarget {
        target: usize,
    },
    Done {
        target: usize,
    },
    OpenDrafter {
        drafter: usize,
        credit: u32,
    },
    CloseDrafter {
        drafter: usize,
    },
    Ack {
        drafter: usize,
        count: usize,
    },
    Nack {
        drafter: usize,
        poison: bool,
    },
    SetCredit {
        drafter: usize,
        credit: u32,
    },
    Advance {
        seconds: u64,
    },
    /// The broker restarts: the queue is dropped and rebuilt from the log;
    /// every stream is gone.
    Restart,
    /// The log is replaced by the queue's snapshot.
    Compact,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..TARGETS, 1..300u64).prop_map(|(target, bytes)| Op::Produce { target, bytes }),
        1 => (0..TARGETS).prop_map(|target| Op::Retry { target }),
        1 => (0..TARGETS).prop_map(|target| Op::ReconnectTarget { target }),
        1 => (0..TARGETS).prop_map(|target| Op::DisconnectTarget { target }),
        1 => (0..TARGETS).prop_map(|target| Op::Done { target }),
        2 => (0..DRAFTERS, 0..4u32).prop_map(|(drafter, credit)| Op::OpenDrafter { drafter, credit }),
        1 => (0..DRAFTERS).prop_map(|drafter| Op::CloseDrafter { drafter }),
        6 => (0..DRAFTERS, 1..4usize).prop_map(|(drafter, count)| Op::Ack { drafter, count }),
        1 => (0..DRAFTERS, proptest::bool::weighted(0.2)).prop_map(|(drafter, poison)| Op::Nack { drafter, poison }),
        1 => (0..DRAFTERS, 0..5u32).prop_map(|(drafter, credit)| Op::SetCredit { drafter, credit }),
        1 => (0..40u64).prop_map(|seconds| Op::Advance { seconds }),
    ]
}

fn op_with_restarts() -> impl Strategy<Value = Op> {
    prop_oneof![
        24 => op(),
        1 => Just(Op::Restart),
        1 => Just(Op::Compact),
    ]
}

/// The test's own bookkeeping, independent of the queue's.
#[derive(Default)]
struct Ledger {
    accepted: BTreeSet<(usize, u64)>,
    acked: BTreeMap<(usize, u64), u32>,
    /// Delivery id → (drafter slot, target, seq) for deliveries a drafter holds.
    held: HashMap<DeliveryId, (usize, usize, u64)>,
    completed: bool,
}

struct World {
    queue: Queue<TestPayload>,
    config: QueueConfig,
    /// The write-ahead log so far, when the queue keeps one.
    log: Option<Vec<JournalEntry<TestPayload>>>,
    now: Instant,
    ledger: Ledger,
    producer: [Option<ConnectionId>; TARGETS],
    /// The epoch of each target's latest Produce stream (0: none yet).
    epoch: [u64; TARGETS],
    next_seq: [u64; TARGETS],
    consumer: [Option<ConnectionId>; DRAFTERS],
    target_done: [bool; TARGETS],
}

impl World {
    /// A fresh queue under `policy` (keeping a write-ahead log when
    /// `journal`) with every target's Produce stream open.
    fn start(policy: FailurePolicy, journal: bool) -> Result<Self, TestCaseError> {
        let start = Instant::now();
        let mut queue_config = config(TARGETS as u32);
        queue_config.on_target_failure = policy;
        let mut queue = Queue::new(queue_config.clone(), start);
        if journal {
            queue.enable_journal();
        }
        let mut world = World {
            queue,
            config: queue_config,
            log: journal.then(Vec::new),
            now: start,
            ledger: Ledger::default(),
            producer: [None; TARGETS],
            epoch: [0; TARGETS],
            next_seq: [0; TARGETS],
            consumer: [None; DRAFTERS],
            target_done: [false; TARGETS],
        };
        for target in 0..TARGETS {
            world.step(&Op::ReconnectTarget { target })?;
        }
        Ok(world)
    }

    /// A drafter acks everything until the run ends (or 10,000 rounds).
    fn drain(&mut self) -> Result<(), TestCaseError> {
        self.step(&Op::OpenDrafter {
            drafter: 0,
            credit: 3,
        })?;
        for _ in 0..10_000 {
            if self.queue.state() != BrokerState::Running
                && self.queue.state() != BrokerState::Draining
            {
                break;
            }
            self.step(&Op::Ack {
                drafter: 0,
                count: 3,
            })?;
        }
        Ok(())
    }

    fn target_name(target: usize) -> String {
        format!("target-{target}")
    }

    fn drafter_of(&self, connection: ConnectionId) -> Option<usize> {
        self.consumer
            .iter()
            .position(|slot| *slot == Some(connection))
    }

    fn apply_effects(&mut self) -> Result<(), TestCaseError> {
        for effect in self.queue.take_effects() {
            match effect {
                Effect::Deliver {
                    connection,
                    delivery,
                } => {
                    let drafter = self.drafter_of(connection);
                    prop_assert!(drafter.is_some(), "delivery to a closed connection");
                    prop_assert!(!self.ledger.completed, "delivery after end-of-stream");
                    let target: usize = delivery.target_id["target-".len()..].parse().unwrap();
                    prop_assert!(self.ledger.accepted.contains(&(target, delivery.seq)));
                    prop_assert!(
                        !self.ledger.acked.contains_key(&(target, delivery.seq)),
                        "delivered after ack"
                    );
                    self.ledger.held.insert(
                        delivery.delivery_id,
                        (drafter.unwrap(), target, delivery.seq),
                    );
                }
                Effect::EndConsumer {
                    connection,
                    outcome,
                    ..
                } => {
                    if outcome == RunStatus::Complete {
                        for key in &self.ledger.accepted {
                            prop_assert!(
                                self.ledger.acked.contains_key(key) || self.dead_lettered(key),
                                "end-of-stream COMPLETE while {key:?} is neither acked nor dead-lettered"
                            );
                        }
                        self.ledger.completed = true;
                    }
                    if let Some(drafter) = self.drafter_of(connection) {
                        self.consumer[drafter] = None;
                        self.ledger.held.retain(|_, (slot, ..)| *slot != drafter);
                    }
                }
                Effect::CloseProducer { connection, .. } => {
                    for slot in self.producer.iter_mut() {
                        if *slot == Some(connection) {
                            *slot = None;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Up to `count` of the deliveries `drafter` holds.
    fn held_by(&self, drafter: usize, count: usize) -> Vec<DeliveryId> {
        self.ledger
            .held
            .iter()
            .filter(|(_, (slot, ..))| *slot == drafter)
            .map(|(&id, _)| id)
            .take(count)
            .collect()
    }

    fn dead_lettered(&self, key: &(usize, u64)) -> bool {
        self.queue
            .snapshot(self.now)
            .dead_letters
            .iter()
            .any(|dead| dead.target_id.as_ref() == World::target_name(key.0) && dead.seq == key.1)
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let now = self.now;
        match *op {
            Op::Produce { target, bytes } => {
                if let Some(connection) = self.producer[target] {
                    let seq = self.next_seq[target];
                    match self
                        .queue
                        .accept_item(connection, seq, TestPayload(bytes), now)
                    {
                        Ok(accepted) => {
                            prop_assert!(!accepted.duplicate);
                            self.ledger.accepted.insert((target, seq));
                            self.next_seq[target] += 1;
                        }
                        Err(QueueError::QueueFull { .. }) => {
                            prop_assert!(!self.queue.has_room_for(bytes))
                        }
                        Err(QueueError::TargetAlreadyDone { .. })
                        | Err(QueueError::RunEnded { .. }) => {}
                        Err(other) => prop_assert!(false, "unexpected {other}"),
                    }
                }
            }
            Op::Retry { target } => {
                if let (Some(connection), Some(seq)) =
                    (self.producer[target], self.next_seq[target].checked_sub(1))
                {
                    if let Ok(accepted) =
                        self.queue.accept_item(connection, seq, TestPayload(1), now)
                    {
                        prop_assert!(accepted.duplicate, "a retried seq was queued twice");
                    }
                }
            }
            Op::ReconnectTarget { target } => {
                if let Ok(opened) = self.queue.open_producer(&World::target_name(target), now) {
                    let expected = self.next_seq[target].checked_sub(1);
                    prop_assert_eq!(opened.resume_after_seq, expected);
                    prop_assert!(opened.epoch > self.epoch[target], "epochs must increase");
                    self.epoch[target] = opened.epoch;
                    self.producer[target] = Some(opened.connection);
                }
            }
            Op::DisconnectTarget { target } => {
                if let Some(connection) = self.producer[target].take() {
                    self.queue.close_producer(connection, now);
                }
            }
            Op::Done { target } => {
                let accepted = self
                    .ledger
                    .accepted
                    .iter()
                    .filter(|(t, _)| *t == target)
                    .count() as u64;
                if self
                    .queue
                    .report_done(
                        &World::target_name(target),
                        accepted,
                        self.epoch[target],
                        now,
                    )
                    .is_ok()
                {
                    self.target_done[target] = true;
                }
                if accepted > 0 {
                    let wrong = self.queue.report_done(
                        &World::target_name(target),
                        accepted + 1,
                        self.epoch[target],
                        now,
                    );
                    prop_assert!(wrong.is_err());
                    if self.epoch[target] > 0 {
                        let stale = self.queue.report_done(
                            &World::target_name(target),
                            accepted,
                            self.epoch[target] - 1,
                            now,
                        );
                        prop_assert!(stale.is_err(), "a fenced epoch reported done");
                    }
                }
            }
            Op::OpenDrafter { drafter, credit } => {
                let connection = self.queue.open_consumer(
                    &format!("drafter-{drafter}"),
                    Credit {
                        items: credit,
                        bytes: 0,
                    },
                    now,
                );
                match connection {
                    Ok(connection) => {
                        // A replaced (stalled) stream's leases are returned;
                        // forget them first.
                        self.ledger.held.retain(|_, (slot, ..)| *slot != drafter);
                        self.consumer[drafter] = Some(connection);
                    }
                    // A live stream under the id is not displaced: refused,
                    // nothing changes.
                    Err(QueueError::DrafterAlreadyConnected { .. }) => {
                        prop_assert!(self.consumer[drafter].is_some());
                    }
                    // Zero credit is refused and changes nothing.
                    Err(error) => prop_assert_eq!(error, QueueError::ZeroCredit),
                }
            }
            Op::CloseDrafter { drafter } => {
                if let Some(connection) = self.consumer[drafter].take() {
                    self.queue.close_consumer(connection, now);
                    self.ledger.held.retain(|_, (slot, ..)| *slot != drafter);
                }
            }
            Op::Ack { drafter, count } => {
                if let Some(connection) = self.consumer[drafter] {
                    let mine = self.held_by(drafter, count);
                    let outcome = self.queue.ack(connection, &mine, now);
                    let mut acked_now = 0;
                    for id in mine {
                        let (_, target, seq) = self.ledger.held.remove(&id).unwrap();
                        *self.ledger.acked.entry((target, seq)).or_default() += 1;
                        acked_now += 1;
                    }
                    prop_assert_eq!(outcome.acked, acked_now);
                }
            }
            Op::Nack { drafter, poison } => {
                if let Some(connection) = self.consumer[drafter] {
                    let mine = self.held_by(drafter, 1);
                    let disposition = if poison {
                        NackDisposition::DeadLetter
                    } else {
                        NackDisposition::Requeue
                    };
                    self.queue.nack(connection, &mine, disposition, "test", now);
                    for id in mine {
                        self.ledger.held.remove(&id);
                    }
                }
            }
            Op::SetCredit { drafter, credit } => {
                if let Some(connection) = self.consumer[drafter] {
                    self.queue.set_credit(
                        connection,
                        Credit {
                            items: credit,
                            bytes: 0,
                        },
                        now,
                    );
                }
            }
            Op::Advance { seconds } => {
                self.now += Duration::from_secs(seconds);
                // Expired leases are taken back; the ledger forgets them below.
                self.queue.tick(self.now);
            }
            Op::Restart => {
                if let Some(log) = &self.log {
                    let before = self.queue.snapshot(now);
                    let counts_before: BTreeMap<(Arc<str>, u64), u32> = self
                        .queue
                        .items
                        .values()
                        .map(|item| ((item.target_id.clone(), item.seq), item.deliveries))
                        .collect();
                    let mut recovered = Recovered::default();
                    for entry in log.iter().cloned() {
                        recovered.apply(entry);
                    }
                    self.queue = Queue::recover(self.config.clone(), recovered, now);
                    self.producer = [None; TARGETS];
                    self.consumer = [None; DRAFTERS];
                    self.ledger.held.clear();
                    let after = self.queue.snapshot(now);
                    prop_assert_eq!(after.accepted_items, before.accepted_items);
                    prop_assert_eq!(after.acked_items, before.acked_items);
                    prop_assert_eq!(
                        after.summary.dead_letter_count,
                        before.summary.dead_letter_count
                    );
                    prop_assert_eq!(after.done_targets, before.done_targets);
                    // Nothing accepted is lost: every (target, seq) neither
                    // acked nor dead-lettered is queued again.
                    let queued: BTreeSet<(usize, u64)> = self
                        .queue
                        .items
                        .values()
                        .map(|item| (item.target_id["target-".len()..].parse().unwrap(), item.seq))
                        .collect();
                    for key in &self.ledger.accepted {
                        if !self.ledger.acked.contains_key(key) && !self.dead_lettered(key) {
                            prop_assert!(queued.contains(key), "{key:?} lost in the restart");
                        }
                    }
                    prop_assert_eq!(
                        after.queued_items,
                        before.queued_items + before.leased_items
                    );
                    // Every item keeps its delivery count (max-deliveries
                    // holds across restarts and compactions).
                    let counts_after: BTreeMap<(Arc<str>, u64), u32> = self
                        .queue
                        .items
                        .values()
                        .map(|item| ((item.target_id.clone(), item.seq), item.deliveries))
                        .collect();
                    prop_assert_eq!(counts_after, counts_before);
                    for target in &after.targets {
                        let index: usize = target.target_id["target-".len()..].parse().unwrap();
                        prop_assert_eq!(target.highest_seq, self.next_seq[index].checked_sub(1));
                    }
                }
            }
            Op::Compact => {
                if self.log.is_some() {
                    self.log = Some(self.queue.snapshot_entries());
                }
            }
        }
        if let Some(log) = &mut self.log {
            log.extend(self.queue.take_journal());
        }
        self.apply_effects()?;
        let stale: Vec<DeliveryId> = self
            .ledger
            .held
            .keys()
            .copied()
            .filter(|id| !self.queue_holds(*id))
            .collect();
        for id in stale {
            self.ledger.held.remove(&id);
        }
        if let Err(broken) = self.queue.check_invariants() {
            prop_assert!(false, "invariant broken after {op:?}: {broken}");
        }
        for (key, count) in &self.ledger.acked {
            prop_assert_eq!(*count, 1, "{:?} acked {} times", key, count);
        }
        Ok(())
    }

    fn queue_holds(&self, delivery_id: DeliveryId) -> bool {
        self.queue.is_leased(delivery_id)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn no_item_lost_or_acked_twice_and_complete_only_at_the_end(
        ops in proptest::collection::vec(op(), 1..200),
        continue_on_failure in any::<bool>(),
    ) {
        let policy = if continue_on_failure { FailurePolicy::Continue } else { FailurePolicy::Abort };
        let mut world = World::start(policy, false)?;
        for op in &ops {
            world.step(op)?;
        }
        // Drain: every target reports done, one drafter acks everything.
        for target in 0..TARGETS {
            world.step(&Op::Done { target })?;
        }
        // A fresh stream for the drain: the old one must end first (a live
        // stream keeps its id).
        for drafter in 0..DRAFTERS {
            world.step(&Op::CloseDrafter { drafter })?;
        }
        world.drain()?;
        match world.queue.state() {
            BrokerState::Complete => {
                prop_assert!(world.ledger.completed);
                for key in &world.ledger.accepted {
                    prop_assert!(world.ledger.acked.contains_key(key) || world.dead_lettered(key), "{key:?} lost");
                }
                let snapshot = world.queue.snapshot(world.now);
                prop_assert_eq!(snapshot.acked_items + snapshot.summary.dead_letter_count, snapshot.accepted_items);
            }
            BrokerState::Aborted => prop_assert!(!continue_on_failure, "aborted under the continue policy"),
            other => prop_assert!(false, "run stuck in {other:?}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// The same workload with broker restarts from the write-ahead log (and
    /// log compactions) at random points: the ledger invariants hold after
    /// every step, nothing accepted is lost, resume points and epochs carry
    /// over, and the run still completes with every item acked or
    /// dead-lettered.
    #[test]
    fn restarts_from_the_log_lose_nothing(
        ops in proptest::collection::vec(op_with_restarts(), 1..200),
    ) {
        let mut world = World::start(FailurePolicy::Continue, true)?;
        for op in &ops {
            world.step(op)?;
            if matches!(op, Op::Restart) {
                for target in 0..TARGETS {
                    world.step(&Op::ReconnectTarget { target })?;
                }
            }
        }
        world.step(&Op::Restart)?;
        for target in 0..TARGETS {
            world.step(&Op::ReconnectTarget { target })?;
            world.step(&Op::Done { target })?;
        }
        world.drain()?;
        prop_assert_eq!(world.queue.state(), BrokerState::Complete);
        for key in &world.ledger.accepted {
            prop_assert!(world.ledger.acked.contains_key(key) || world.dead_lettered(key), "{key:?} lost");
        }
    }
}
