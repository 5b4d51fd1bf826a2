//! Scenario tests of the queue's rules, one rule per test.

use super::*;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TestPayload(pub u64);

impl Payload for TestPayload {
    fn size_bytes(&self) -> u64 {
        self.0
    }
}

pub(crate) fn config(expected_targets: u32) -> QueueConfig {
    QueueConfig {
        target_ids: QueueConfig::default_target_ids(expected_targets),
        max_queue_bytes: 1_000,
        lease_timeout: Duration::from_secs(30),
        max_deliveries: 3,
        target_grace: Duration::from_secs(120),
        target_startup_timeout: None,
        on_target_failure: FailurePolicy::Abort,
        target_stall_timeout: None,
        target_load_timeout: None,
        max_lease_lifetime: None,
        keepalive_detection: None,
    }
}

/// A queue for one target, `target-0`, whose Produce stream is open.
pub(crate) fn one_target(now: Instant) -> (Queue<TestPayload>, ConnectionId) {
    let mut queue = Queue::new(config(1), now);
    let producer = queue.open_producer("target-0", now).unwrap().connection;
    (queue, producer)
}

/// Accepts items `seqs` of 10 bytes from `producer`.
pub(crate) fn accept_all(
    queue: &mut Queue<TestPayload>,
    producer: ConnectionId,
    seqs: std::ops::Range<u64>,
    now: Instant,
) {
    for seq in seqs {
        queue
            .accept_item(producer, seq, TestPayload(10), now)
            .unwrap();
    }
}

/// The epoch of the target's latest Produce stream, as its welcome said.
fn current_epoch(queue: &Queue<TestPayload>, target_id: &str) -> u64 {
    queue.targets.get(target_id).map_or(0, |entry| entry.epoch)
}

pub(crate) fn credit(items: u32) -> Credit {
    Credit { items, bytes: 0 }
}

/// Splits effects into deliveries (connection, delivery id, seq) and ended consumers.
pub(crate) fn deliveries(effects: &[Effect<TestPayload>]) -> Vec<(ConnectionId, DeliveryId, u64)> {
    effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Deliver {
                connection,
                delivery,
            } => Some((*connection, delivery.delivery_id, delivery.seq)),
            _ => None,
        })
        .collect()
}

pub(crate) fn ended(effects: &[Effect<TestPayload>]) -> Vec<(ConnectionId, RunStatus)> {
    effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::EndConsumer {
                connection,
                outcome,
                ..
            } => Some((*connection, *outcome)),
            _ => None,
        })
        .collect()
}

#[test]
fn shared_fifo_round_robins_across_drafters() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    let drafter_a = queue.open_consumer("drafter-a", credit(2), now).unwrap();
    let drafter_b = queue.open_consumer("drafter-b", credit(2), now).unwrap();
    accept_all(&mut queue, producer, 0..4, now);
    let delivered = deliveries(&queue.take_effects());
    assert_eq!(delivered.len(), 4);
    let to_a = delivered
        .iter()
        .filter(|(connection, ..)| *connection == drafter_a)
        .count();
    let to_b = delivered
        .iter()
        .filter(|(connection, ..)| *connection == drafter_b)
        .count();
    assert_eq!((to_a, to_b), (2, 2));
    // FIFO: seqs leave in acceptance order.
    let seqs: Vec<u64> = delivered.iter().map(|(_, _, seq)| *seq).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3]);
    queue.check_invariants().unwrap();
}

#[test]
fn credit_window_bounds_outstanding_items_and_bytes() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    let drafter = queue
        .open_consumer(
            "d",
            Credit {
                items: 10,
                bytes: 250,
            },
            now,
        )
        .unwrap();
    for seq in 0..5 {
        queue
            .accept_item(producer, seq, TestPayload(100), now)
            .unwrap();
    }
    let delivered = deliveries(&queue.take_effects());
    assert_eq!(
        delivered.len(),
        2,
        "250 bytes of credit hold two 100-byte items"
    );
    queue.ack(drafter, &[delivered[0].1], now);
    assert_eq!(
        deliveries(&queue.take_effects()).len(),
        1,
        "an ack frees room for one more"
    );
    // An item larger than the byte window still flows when nothing is held.
    let (mut queue, producer) = one_target(now);
    queue
        .open_consumer(
            "d",
            Credit {
                items: 4,
                bytes: 10,
            },
            now,
        )
        .unwrap();
    queue
        .accept_item(producer, 0, TestPayload(400), now)
        .unwrap();
    assert_eq!(deliveries(&queue.take_effects()).len(), 1);
}

#[test]
fn memory_bound_refuses_without_changing_anything() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    queue
        .accept_item(producer, 0, TestPayload(500), now)
        .unwrap();
    queue
        .accept_item(producer, 1, TestPayload(400), now)
        .unwrap();
    assert!(!queue.has_room_for(200));
    let error = queue
        .accept_item(producer, 2, TestPayload(200), now)
        .unwrap_err();
    assert_eq!(
        error,
        QueueError::QueueFull {
            held: 900,
            limit: 1000
        }
    );
    assert_eq!(queue.snapshot(now).accepted_items, 2);
    // The same seq is accepted once room exists (not treated as a duplicate).
    let drafter = queue.open_consumer("d", credit(1), now).unwrap();
    let delivered = deliveries(&queue.take_effects());
    queue.ack(drafter, &[delivered[0].1], now);
    assert_eq!(
        queue.accept_item(producer, 2, TestPayload(200), now),
        Ok(ItemAccepted { duplicate: false })
    );
    queue.check_invariants().unwrap();
}

#[test]
fn disconnect_returns_leases_to_the_head_in_order() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    let drafter_a = queue.open_consumer("a", credit(2), now).unwrap();
    accept_all(&mut queue, producer, 0..4, now);
    let first = deliveries(&queue.take_effects());
    assert_eq!(first.iter().map(|d| d.2).collect::<Vec<_>>(), vec![0, 1]);
    queue.close_consumer(drafter_a, now);
    let drafter_b = queue.open_consumer("b", credit(10), now).unwrap();
    let redelivered = deliveries(&queue.take_effects());
    assert_eq!(
        redelivered.iter().map(|d| d.2).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert!(redelivered.iter().all(|d| d.0 == drafter_b));
    assert_eq!(queue.snapshot(now).redelivered_items, 2);
    queue.check_invariants().unwrap();
}

#[test]
fn expired_lease_moves_on_and_late_ack_is_stale() {
    let start = Instant::now();
    let (mut queue, producer) = one_target(start);
    let silent = queue.open_consumer("silent", credit(1), start).unwrap();
    accept_all(&mut queue, producer, 0..1, start);
    let first = deliveries(&queue.take_effects());
    // Zero credit is refused at the hello (INVALID_ARGUMENT); a window of 1
    // has no room while the only item is leased elsewhere.
    let other = queue.open_consumer("other", credit(1), start).unwrap();
    queue.set_credit(other, credit(1), start);
    assert!(deliveries(&queue.take_effects()).is_empty());
    // Extending keeps the lease alive past the original deadline.
    queue.extend_leases(silent, &[], start + Duration::from_secs(20));
    queue.tick(start + Duration::from_secs(31));
    assert!(deliveries(&queue.take_effects()).is_empty());
    queue.tick(start + Duration::from_secs(51));
    let moved = deliveries(&queue.take_effects());
    assert_eq!(moved.len(), 1);
    assert_eq!(moved[0].0, other);
    let late = queue.ack(silent, &[first[0].1], start + Duration::from_secs(52));
    assert_eq!(late, AckOutcome { acked: 0, stale: 1 });
    assert_eq!(
        queue
            .ack(other, &[moved[0].1], start + Duration::from_secs(52))
            .acked,
        1
    );
    let snapshot = queue.snapshot(start + Duration::from_secs(52));
    assert_eq!(snapshot.acked_items, 1);
    assert_eq!(
        snapshot
            .drafters
            .iter()
            .find(|d| d.drafter_id == "silent")
            .unwrap()
            .expired_leases,
        1
    );
    queue.check_invariants().unwrap();
}

#[test]
fn max_deliveries_and_poison_nack_dead_letter() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    let drafter = queue.open_consumer("d", credit(1), now).unwrap();
    accept_all(&mut queue, producer, 0..1, now);
    for _ in 0..3 {
        let delivered = deliveries(&queue.take_effects());
        assert_eq!(delivered.len(), 1);
        queue.nack(
            drafter,
            &[delivered[0].1],
            NackDisposition::Requeue,
            "oom",
            now,
        );
    }
    assert!(deliveries(&queue.take_effects()).is_empty());
    let snapshot = queue.snapshot(now);
    assert_eq!(snapshot.dead_letters.len(), 1);
    assert_eq!(snapshot.dead_letters[0].deliveries, 3);
    assert!(
        snapshot.dead_letters[0]
            .reason
            .contains("after 3 deliveries"),
        "{}",
        snapshot.dead_letters[0].reason
    );

    accept_all(&mut queue, producer, 1..2, now);
    let delivered = deliveries(&queue.take_effects());
    queue.nack(
        drafter,
        &[delivered[0].1],
        NackDisposition::DeadLetter,
        "hidden size 64, model wants 128",
        now,
    );
    let snapshot = queue.snapshot(now);
    assert_eq!(snapshot.dead_letters.len(), 2);
    assert!(snapshot.dead_letters[1].reason.contains("hidden size 64"));
    queue.check_invariants().unwrap();
}

#[test]
fn duplicates_are_acknowledged_not_queued_and_resume_point_is_reported() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(1), now);
    let producer = queue.open_producer("target-0", now).unwrap();
    assert_eq!(producer.resume_after_seq, None);
    queue
        .accept_item(producer.connection, 0, TestPayload(10), now)
        .unwrap();
    queue
        .accept_item(producer.connection, 1, TestPayload(10), now)
        .unwrap();
    queue.close_producer(producer.connection, now);
    let again = queue.open_producer("target-0", now).unwrap();
    assert_eq!(again.resume_after_seq, Some(1));
    assert_eq!(
        queue.accept_item(again.connection, 1, TestPayload(10), now),
        Ok(ItemAccepted { duplicate: true })
    );
    assert_eq!(queue.snapshot(now).accepted_items, 2);
}

#[test]
fn newer_producer_stream_replaces_older() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(1), now);
    let old = queue.open_producer("target-0", now).unwrap().connection;
    let new = queue.open_producer("target-0", now).unwrap().connection;
    let effects = queue.take_effects();
    assert!(
        matches!(effects.as_slice(), [Effect::CloseProducer { connection, outcome: RunStatus::Aborted, .. }] if *connection == old)
    );
    assert_eq!(
        queue.accept_item(old, 0, TestPayload(1), now),
        Err(QueueError::StaleConnection { connection: old })
    );
    assert!(queue.accept_item(new, 0, TestPayload(1), now).is_ok());
    // Closing the replaced stream later does not mark the target disconnected.
    queue.close_producer(old, now);
    assert_eq!(
        queue.snapshot(now).targets[0].state,
        TargetState::Connected { connection: new }
    );
}

#[test]
fn report_done_is_idempotent_and_checks_the_count() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(2), now);
    let producer = queue.open_producer("target-0", now).unwrap().connection;
    queue.accept_item(producer, 0, TestPayload(1), now).unwrap();
    let mismatch = queue
        .report_done("target-0", 5, current_epoch(&queue, "target-0"), now)
        .unwrap_err();
    assert_eq!(
        mismatch.to_string(),
        "target \"target-0\": report says 5 items, broker accepted 1"
    );
    assert_eq!(queue.snapshot(now).done_targets, 0);
    let first = queue
        .report_done("target-0", 1, current_epoch(&queue, "target-0"), now)
        .unwrap();
    assert_eq!((first.done_targets, first.already_done), (1, false));
    let second = queue
        .report_done("target-0", 1, current_epoch(&queue, "target-0"), now)
        .unwrap();
    assert_eq!((second.done_targets, second.already_done), (1, true));
    // A target with an empty shard may report done without producing, once
    // it has a stream (and so an epoch).
    assert_eq!(
        queue.report_done("target-1", 0, 0, now).unwrap_err(),
        QueueError::NoProduceStream {
            target_id: "target-1".to_string()
        }
    );
    queue.open_producer("target-1", now).unwrap();
    assert_eq!(
        queue
            .report_done("target-1", 0, current_epoch(&queue, "target-1"), now)
            .unwrap()
            .done_targets,
        2
    );
}

#[test]
fn unexpected_extra_target_is_refused() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(1), now);
    queue.open_producer("target-0", now).unwrap();
    let error = queue.open_producer("target-1", now).unwrap_err();
    assert!(matches!(error, QueueError::UnknownTarget { .. }));
    assert_eq!(
        error.to_string(),
        "target \"target-1\" is not one of the expected targets (target-0)"
    );
    // ReportDone for an id never configured is refused the same way, and
    // completes nothing.
    assert!(matches!(
        queue.report_done("stray", 0, 1, now),
        Err(QueueError::UnknownTarget { .. })
    ));
    assert_eq!(queue.state(), BrokerState::Running);
    assert_eq!(
        queue.open_producer("", now).unwrap_err(),
        QueueError::EmptyTargetId
    );
}

#[test]
fn end_of_stream_waits_for_every_target_and_every_ack() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(2), now);
    let p0 = queue.open_producer("target-0", now).unwrap().connection;
    let drafter_a = queue.open_consumer("a", credit(4), now).unwrap();
    queue.accept_item(p0, 0, TestPayload(10), now).unwrap();
    let delivered = deliveries(&queue.take_effects());
    queue
        .report_done("target-0", 1, current_epoch(&queue, "target-0"), now)
        .unwrap();
    // One of two expected targets finished: the run goes on, whatever the
    // queue holds; a repeated report does not count it twice.
    assert_eq!(queue.state(), BrokerState::Running);
    let again = queue
        .report_done("target-0", 1, current_epoch(&queue, "target-0"), now)
        .unwrap();
    assert_eq!((again.done_targets, again.already_done), (1, true));
    assert_eq!(queue.state(), BrokerState::Running);
    queue.open_producer("target-1", now).unwrap();
    queue
        .report_done("target-1", 0, current_epoch(&queue, "target-1"), now)
        .unwrap();
    assert_eq!(queue.state(), BrokerState::Draining);
    assert!(
        ended(&queue.take_effects()).is_empty(),
        "an item is still leased"
    );
    // The drafter holding it dies after the last target finished: the item
    // must reach another drafter before anyone gets end-of-stream.
    queue.close_consumer(drafter_a, now);
    let drafter_b = queue.open_consumer("b", credit(4), now).unwrap();
    let redelivered = deliveries(&queue.take_effects());
    assert_eq!(redelivered.len(), 1);
    assert_ne!(redelivered[0].1, delivered[0].1);
    queue.ack(drafter_b, &[redelivered[0].1], now);
    assert_eq!(
        ended(&queue.take_effects()),
        vec![(drafter_b, RunStatus::Complete)]
    );
    assert_eq!(queue.state(), BrokerState::Complete);
    // A drafter that connects later gets end-of-stream at once.
    let late = queue.open_consumer("late", credit(4), now).unwrap();
    assert_eq!(
        ended(&queue.take_effects()),
        vec![(late, RunStatus::Complete)]
    );
    queue.check_invariants().unwrap();
}

#[test]
fn target_gone_past_grace_aborts_the_run() {
    let start = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(2), start);
    let p0 = queue.open_producer("target-0", start).unwrap().connection;
    let drafter = queue.open_consumer("d", credit(4), start).unwrap();
    queue.close_producer(p0, start);
    queue.tick(start + Duration::from_secs(119));
    assert_eq!(queue.state(), BrokerState::Running);
    // Back within the grace period: resumes, nothing failed.
    let p0 = queue
        .open_producer("target-0", start + Duration::from_secs(119))
        .unwrap()
        .connection;
    queue.close_producer(p0, start + Duration::from_secs(130));
    queue.tick(start + Duration::from_secs(249));
    assert_eq!(queue.state(), BrokerState::Running);
    // The grace ends at 130 + 120 s: a tick at that deadline acts.
    queue.tick(start + Duration::from_secs(250));
    assert_eq!(queue.state(), BrokerState::Aborted);
    let effects = queue.take_effects();
    assert_eq!(ended(&effects), vec![(drafter, RunStatus::Aborted)]);
    let reason = effects
        .iter()
        .find_map(|effect| match effect {
            Effect::EndConsumer { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .unwrap();
    assert!(
        reason.contains("\"target-0\"") && reason.contains("without ReportDone"),
        "{reason}"
    );
}

#[test]
fn continue_policy_counts_failed_target_as_finished_with_loss() {
    let start = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(
        QueueConfig {
            on_target_failure: FailurePolicy::Continue,
            lease_timeout: Duration::from_secs(1000),
            ..config(2)
        },
        start,
    );
    let p0 = queue.open_producer("target-0", start).unwrap().connection;
    let drafter = queue.open_consumer("d", credit(4), start).unwrap();
    queue.accept_item(p0, 0, TestPayload(10), start).unwrap();
    queue.close_producer(p0, start);
    queue.open_producer("target-1", start).unwrap();
    queue
        .report_done("target-1", 0, current_epoch(&queue, "target-1"), start)
        .unwrap();
    queue.tick(start + Duration::from_secs(121));
    assert_eq!(queue.state(), BrokerState::Draining);
    let delivered = deliveries(&queue.take_effects());
    let latest = delivered.last().unwrap().1;
    queue.ack(drafter, &[latest], start + Duration::from_secs(121));
    assert_eq!(queue.state(), BrokerState::Complete);
    assert_eq!(queue.summary().failed_targets, vec!["target-0".to_string()]);
    assert!(
        queue
            .report_done("target-0", 1, current_epoch(&queue, "target-0"), start)
            .is_err(),
        "a failed target cannot report done later"
    );
}

#[test]
fn targets_that_never_connect_fail_after_the_startup_timeout() {
    let start = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(
        QueueConfig {
            target_startup_timeout: Some(Duration::from_secs(60)),
            ..config(3)
        },
        start,
    );
    queue.open_producer("target-0", start).unwrap();
    queue.tick(start + Duration::from_secs(59));
    assert_eq!(queue.state(), BrokerState::Running);
    queue.tick(start + Duration::from_secs(60));
    assert_eq!(queue.state(), BrokerState::Aborted);
    assert!(queue
        .snapshot(start)
        .abort_reason
        .contains("2 of 3 expected targets never connected"));
}

#[test]
fn a_second_hello_for_a_live_drafter_is_refused_and_changes_nothing() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    let first = queue.open_consumer("d", credit(1), now).unwrap();
    accept_all(&mut queue, producer, 0..1, now);
    let delivered = deliveries(&queue.take_effects());
    assert_eq!(
        delivered.iter().map(|d| d.0).collect::<Vec<_>>(),
        vec![first]
    );
    let later = now + Duration::from_secs(2);
    assert_eq!(
        queue.open_consumer("d", credit(1), later),
        Err(QueueError::DrafterAlreadyConnected {
            drafter_id: "d".to_string(),
            last_seen_ms_ago: 2_000,
        })
    );
    assert!(
        queue.take_effects().is_empty(),
        "the live stream was touched"
    );
    assert!(
        queue.is_leased(delivered[0].1),
        "the live stream lost its lease"
    );
    // The live stream goes on as before: its ack counts.
    assert_eq!(queue.ack(first, &[delivered[0].1], later).acked, 1);
    queue.check_invariants().unwrap();
}

#[test]
fn a_restarted_drafter_gets_in_at_once_when_its_old_stream_is_gone() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    let first = queue.open_consumer("d", credit(1), now).unwrap();
    accept_all(&mut queue, producer, 0..1, now);
    queue.take_effects();
    queue.close_consumer(first, now);
    let second = queue.open_consumer("d", credit(1), now).unwrap();
    let effects = queue.take_effects();
    assert_eq!(
        deliveries(&effects).iter().map(|d| d.0).collect::<Vec<_>>(),
        vec![second],
        "the old stream's lease went to the new one"
    );
    queue.check_invariants().unwrap();
}

#[test]
fn a_stalled_drafter_stream_is_replaced_and_returns_its_leases() {
    let start = Instant::now();
    let (mut queue, producer) = one_target(start);
    let first = queue.open_consumer("d", credit(2), start).unwrap();
    accept_all(&mut queue, producer, 0..1, start);
    queue.take_effects();
    // Its one lease expires (30 s): the stream is stalled, not live.
    let later = start + Duration::from_secs(31);
    queue.tick(later);
    accept_all(&mut queue, producer, 1..2, later);
    assert!(deliveries(&queue.take_effects()).is_empty());
    let second = queue.open_consumer("d", credit(2), later).unwrap();
    let effects = queue.take_effects();
    assert_eq!(ended(&effects), vec![(first, RunStatus::Aborted)]);
    assert_eq!(
        deliveries(&effects)
            .iter()
            .map(|d| (d.0, d.2))
            .collect::<Vec<_>>(),
        vec![(second, 0), (second, 1)]
    );
    queue.check_invariants().unwrap();
}

#[test]
fn a_drafter_whose_lease_expired_gets_nothing_new_until_it_acks() {
    let start = Instant::now();
    let (mut queue, producer) = one_target(start);
    let hung = queue.open_consumer("hung", credit(1), start).unwrap();
    accept_all(&mut queue, producer, 0..2, start);
    let first = deliveries(&queue.take_effects());
    assert_eq!(first.len(), 1);
    queue.tick(start + Duration::from_secs(31));
    assert!(
        deliveries(&queue.take_effects()).is_empty(),
        "the hung drafter was fed again"
    );
    // Signs of life: an (even stale) ack makes it eligible again.
    queue.ack(hung, &[first[0].1], start + Duration::from_secs(32));
    assert_eq!(deliveries(&queue.take_effects()).len(), 1);
    queue.check_invariants().unwrap();
}

#[test]
fn rejections_are_counted_by_reason() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(2), now);
    let producer = queue.open_producer("target-0", now).unwrap().connection;
    queue.count_rejected(producer, RejectReason::TooLarge, now);
    queue.count_rejected(producer, RejectReason::Malformed, now);
    queue.count_rejected(producer, RejectReason::Malformed, now);
    accept_all(&mut queue, producer, 1..2, now);
    queue
        .report_done("target-0", 1, current_epoch(&queue, "target-0"), now)
        .unwrap();
    assert!(matches!(
        queue.accept_item(producer, 2, TestPayload(10), now),
        Err(QueueError::TargetAlreadyDone { .. })
    ));
    let snapshot = queue.snapshot(now);
    let count = |reason| snapshot.rejected_by_reason.get(&reason).copied();
    assert_eq!(count(RejectReason::TooLarge), Some(1));
    assert_eq!(count(RejectReason::Malformed), Some(2));
    assert_eq!(count(RejectReason::TargetDone), Some(1));
    assert_eq!(count(RejectReason::UnexpectedMessage), Some(0));
    assert_eq!(
        snapshot.rejected_by_reason.values().sum::<u64>(),
        snapshot.rejected_items
    );
    queue.check_invariants().unwrap();
}

#[test]
fn report_done_needs_the_current_epoch() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(1), now);
    let first = queue.open_producer("target-0", now).unwrap();
    assert_eq!(first.epoch, 1);
    queue
        .accept_item(first.connection, 0, TestPayload(1), now)
        .unwrap();
    // A stray call without the epoch (0) while the stream produces.
    assert_eq!(
        queue.report_done("target-0", 1, 0, now).unwrap_err(),
        QueueError::StaleEpoch {
            target_id: "target-0".to_string(),
            epoch: 0,
            current: 1
        }
    );
    // A newer hello fences the first stream.
    let second = queue.open_producer("target-0", now).unwrap();
    assert_eq!(second.epoch, 2);
    assert!(queue.take_effects().iter().any(|effect| matches!(
        effect,
        Effect::CloseProducer { connection, outcome: RunStatus::Aborted, reason }
            if *connection == first.connection && reason.starts_with("fenced")
    )));
    assert!(matches!(
        queue.accept_item(first.connection, 1, TestPayload(1), now),
        Err(QueueError::StaleConnection { .. })
    ));
    assert!(matches!(
        queue.report_done("target-0", 1, first.epoch, now),
        Err(QueueError::StaleEpoch { current: 2, .. })
    ));
    assert_eq!(queue.summary().done_targets, 0);
    // The current epoch, even after its stream closed, is accepted.
    queue.close_producer(second.connection, now);
    let done = queue.report_done("target-0", 1, second.epoch, now).unwrap();
    assert_eq!(done.done_targets, 1);
}

#[test]
fn out_of_order_seq_is_rejected_and_duplicates_are_not() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    for seq in [0, 1, 5] {
        queue
            .accept_item(producer, seq, TestPayload(1), now)
            .unwrap();
    }
    // 1 was accepted: a duplicate. 3 never was: out of order, not "duplicate".
    assert_eq!(
        queue.accept_item(producer, 1, TestPayload(1), now),
        Ok(ItemAccepted { duplicate: true })
    );
    assert_eq!(
        queue.accept_item(producer, 3, TestPayload(1), now),
        Err(QueueError::OutOfOrderSeq {
            target_id: "target-0".to_string(),
            seq: 3,
            highest: 5
        })
    );
    let snapshot = queue.snapshot(now);
    assert_eq!(snapshot.rejected_by_reason[&RejectReason::OutOfOrder], 1);
    assert_eq!(snapshot.accepted_items, 3);
    assert_eq!(snapshot.targets[0].duplicate_items, 1);
}

#[test]
fn zero_credit_is_refused() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(1), now);
    assert_eq!(
        queue.open_consumer("drafter", credit(0), now),
        Err(QueueError::ZeroCredit)
    );
    assert!(queue.snapshot(now).drafters.is_empty());
}

#[test]
fn accepted_seqs_merge_into_ranges() {
    let mut seqs = AcceptedSeqs::default();
    for seq in [0, 1, 2, 4, 3, 10, u64::MAX] {
        seqs.insert(seq);
    }
    assert_eq!(
        seqs.ranges
            .iter()
            .map(|(&start, &end)| (start, end))
            .collect::<Vec<_>>(),
        vec![(0, 4), (10, 10), (u64::MAX, u64::MAX)]
    );
    assert!(seqs.contains(3) && seqs.contains(10) && seqs.contains(u64::MAX));
    assert!(!seqs.contains(5) && !seqs.contains(9) && !seqs.contains(11));
}

#[test]
fn next_deadline_covers_leases_grace_and_startup() {
    let start = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(
        QueueConfig {
            target_startup_timeout: Some(Duration::from_secs(600)),
            ..config(1)
        },
        start,
    );
    assert_eq!(
        queue.next_deadline(),
        Some(start + Duration::from_secs(600))
    );
    let producer = queue.open_producer("target-0", start).unwrap().connection;
    assert_eq!(queue.next_deadline(), None);
    let drafter = queue.open_consumer("drafter", credit(1), start).unwrap();
    queue
        .accept_item(producer, 0, TestPayload(1), start)
        .unwrap();
    let lease_deadline = start + Duration::from_secs(30);
    assert_eq!(queue.take_new_deadline(), Some(lease_deadline));
    assert_eq!(queue.next_deadline(), Some(lease_deadline));
    let later = start + Duration::from_secs(5);
    queue.close_producer(producer, later);
    assert_eq!(
        queue.take_new_deadline(),
        Some(later + Duration::from_secs(120))
    );
    assert_eq!(queue.next_deadline(), Some(lease_deadline));
    queue.close_consumer(drafter, later);
    assert_eq!(
        queue.next_deadline(),
        Some(later + Duration::from_secs(120))
    );
    // Ticking exactly at the deadline acts on it (no busy loop).
    queue.tick(later + Duration::from_secs(120));
    assert_eq!(queue.state(), BrokerState::Aborted);
}

/// Delivery counts of the deliveries among `effects`, by seq.
fn delivery_counts(effects: &[Effect<TestPayload>]) -> Vec<(u64, u32)> {
    effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Deliver { delivery, .. } => Some((delivery.seq, delivery.delivery_count)),
            _ => None,
        })
        .collect()
}

/// A queue rebuilt from `journal` (what the write-ahead log replays).
fn recovered_from(journal: Vec<JournalEntry<TestPayload>>, now: Instant) -> Queue<TestPayload> {
    let mut recovered = Recovered::default();
    for entry in journal {
        recovered.apply(entry);
    }
    Queue::recover(config(1), recovered, now)
}

#[test]
fn delivery_counts_survive_a_restart_and_still_dead_letter() {
    let now = Instant::now();
    let mut queue: Queue<TestPayload> = Queue::new(config(1), now);
    queue.enable_journal();
    let producer = queue.open_producer("target-0", now).unwrap().connection;
    let drafter = queue.open_consumer("d", credit(1), now).unwrap();
    accept_all(&mut queue, producer, 0..1, now);
    let first = queue.take_effects();
    assert_eq!(delivery_counts(&first), vec![(0, 1)]);
    queue.nack(
        drafter,
        &[deliveries(&first)[0].1],
        NackDisposition::Requeue,
        "oom",
        now,
    );
    assert_eq!(delivery_counts(&queue.take_effects()), vec![(0, 2)]);
    let mut journal = queue.take_journal();

    // The broker dies with the item leased: it comes back with its count,
    // and its third delivery (max 3) is its last.
    let mut queue = recovered_from(journal.clone(), now);
    let drafter = queue.open_consumer("d", credit(1), now).unwrap();
    assert_eq!(delivery_counts(&queue.take_effects()), vec![(0, 3)]);
    journal.extend(queue.take_journal());
    // The count also survives a compaction (snapshot) of the log: a
    // restart from it delivers the item a fourth time (a lease lost in a
    // crash is not a return; the next return dead-letters it).
    let mut compacted = recovered_from(queue.snapshot_entries(), now);
    compacted.open_consumer("e", credit(1), now).unwrap();
    assert_eq!(delivery_counts(&compacted.take_effects()), vec![(0, 4)]);
    queue.close_consumer(drafter, now);
    let snapshot = queue.snapshot(now);
    assert_eq!(
        snapshot.dead_letters.len(),
        1,
        "{:?}",
        snapshot.dead_letters
    );
    assert_eq!(snapshot.dead_letters[0].deliveries, 3);
    queue.check_invariants().unwrap();
}

#[test]
fn a_frozen_target_fails_one_grace_after_its_last_message_not_after_keepalive() {
    let start = Instant::now();
    let config = QueueConfig {
        keepalive_detection: Some(Duration::from_secs(30)),
        ..config(2)
    };
    let mut queue: Queue<TestPayload> = Queue::new(config, start);
    let frozen = queue.open_producer("target-0", start).unwrap().connection;
    queue.accept_item(frozen, 0, TestPayload(1), start).unwrap();
    // Frozen right after its item; keepalive drops the stream 25 s later.
    queue.close_producer(frozen, start + Duration::from_secs(25));
    assert_eq!(
        queue.take_new_deadline(),
        Some(start + Duration::from_secs(120))
    );
    queue.tick(start + Duration::from_secs(119));
    assert_eq!(queue.state(), BrokerState::Running);
    queue.tick(start + Duration::from_secs(120));
    assert_eq!(queue.state(), BrokerState::Aborted);

    // A stream that stayed open longer than keepalive could hide a dead
    // peer answered its pings until 30 s before it was dropped.
    let mut queue: Queue<TestPayload> = Queue::new(
        QueueConfig {
            keepalive_detection: Some(Duration::from_secs(30)),
            ..self::config(2)
        },
        start,
    );
    let quiet = queue.open_producer("target-0", start).unwrap().connection;
    queue.close_producer(quiet, start + Duration::from_secs(100));
    assert_eq!(
        queue.take_new_deadline(),
        Some(start + Duration::from_secs(70 + 120))
    );
    queue.tick(start + Duration::from_secs(189));
    assert_eq!(queue.state(), BrokerState::Running);
}

/// The stats a drafter sends after its end-of-stream (those of the step
/// whose commit ended the run) are taken until the drafter closes its side
/// of that stream.
#[test]
fn final_stats_on_an_ended_stream_are_taken_until_the_drafter_closes_it() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    let drafter = queue.open_consumer("a", credit(4), now).unwrap();
    accept_all(&mut queue, producer, 0..1, now);
    let delivered = deliveries(&queue.take_effects());
    queue.ack(drafter, &[delivered[0].1], now);
    queue
        .report_done("target-0", 1, current_epoch(&queue, "target-0"), now)
        .unwrap();
    assert_eq!(
        ended(&queue.take_effects()),
        vec![(drafter, RunStatus::Complete)]
    );
    let stats = |steps| ConsumerStats {
        steps,
        ..ConsumerStats::default()
    };
    let steps_of = |queue: &Queue<TestPayload>| {
        let snapshot = queue.snapshot(now);
        snapshot.drafters[0].stats.as_ref().map(|stats| stats.steps)
    };
    // The response side is gone with the end-of-stream (the transport
    // closes the connection): the request side is still read.
    queue.close_consumer(drafter, now);
    queue.consumer_stats(drafter, stats(5), now);
    assert_eq!(steps_of(&queue), Some(5), "the last step's stats");
    queue.consumer_requests_ended(drafter);
    queue.consumer_stats(drafter, stats(6), now);
    assert_eq!(
        steps_of(&queue),
        Some(5),
        "nothing once the drafter closed its side"
    );
}
