//! Pinned steps: a vote's samples survive their stream's end, a commit
//! acks them with the record, an abort returns them uncharged, and the
//! log restores both the acks and H.

use std::time::{Duration, Instant};

use super::super::tests::{accept_all, credit, deliveries, ended, one_target, TestPayload};
use super::super::*;

const ROUND: StepRound = (3, 10);
const RECORD: CommitRecord = CommitRecord {
    step: 11,
    instance: 9,
    quorum_id: 3,
};

/// A delivery as a vote names it: (delivery id, target, seq).
type Delivered = (DeliveryId, &'static str, u64);

/// One target with items 0..4 accepted, one drafter holding all four; the
/// drafter's connection and deliveries.
fn leased_to_one_drafter(now: Instant) -> (Queue<TestPayload>, ConnectionId, Vec<Delivered>) {
    let (mut queue, producer) = one_target(now);
    queue.enable_journal();
    accept_all(&mut queue, producer, 0..4, now);
    let consumer = queue.open_consumer("d0", credit(8), now).unwrap();
    let delivered: Vec<Delivered> = deliveries(&queue.take_effects())
        .into_iter()
        .map(|(_, delivery_id, seq)| (delivery_id, "target-0", seq))
        .collect();
    assert_eq!(delivered.len(), 4);
    queue.take_journal();
    (queue, consumer, delivered)
}

#[test]
fn pinned_samples_survive_their_stream_and_a_commit_acks_them_with_the_record() {
    let now = Instant::now();
    let (mut queue, consumer, delivered) = leased_to_one_drafter(now);
    let keys = queue
        .pin_step("d0", &delivered[..3], ROUND, false, now)
        .unwrap();
    assert_eq!(keys.len(), 3);
    assert_eq!(
        queue.drafters["d0"].leases.len(),
        1,
        "the pinned left the credit window"
    );
    // The drafter dies: its one unpinned lease goes back, the pinned stay.
    queue.close_consumer(consumer, now);
    assert_eq!(queue.queue.len(), 1);
    assert_eq!(queue.pinned_items(), 3);
    // Nor does any lease timeout move them.
    queue.tick(now + Duration::from_secs(3600));
    assert_eq!(queue.pinned_items(), 3);
    let acked = queue.commit_step(ROUND, RECORD, now);
    assert_eq!(acked, keys);
    assert_eq!(queue.acked_items, 3);
    assert_eq!(queue.commit_record(), Some(RECORD));
    let journal = queue.take_journal();
    assert_eq!(
        journal,
        vec![JournalEntry::StepCommitted {
            record: RECORD,
            acked: keys
        }],
        "the acks and the record are one entry"
    );
    queue.check_invariants().unwrap();
}

#[test]
fn a_pin_of_a_delivery_not_held_is_refused_whole_and_changes_nothing() {
    let now = Instant::now();
    let (mut queue, _consumer, delivered) = leased_to_one_drafter(now);
    let error = queue
        .pin_step(
            "d0",
            &[delivered[0], (999, "target-0", 0)],
            ROUND,
            false,
            now,
        )
        .unwrap_err();
    assert!(error.to_string().contains("999 (target-0:0)"), "{error}");
    // A held delivery id that names another sample (an id of an earlier
    // broker process) is refused too.
    let (delivery_id, _, seq) = delivered[1];
    let error = queue
        .pin_step(
            "d0",
            &[(delivery_id, "target-0", seq + 1)],
            ROUND,
            false,
            now,
        )
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains(&format!("{delivery_id} (target-0:{})", seq + 1)),
        "{error}"
    );
    assert_eq!(queue.pinned_items(), 0);
    assert_eq!(queue.leases.len(), 4);
    let error = queue
        .pin_step("d1", &delivered, ROUND, false, now)
        .unwrap_err();
    assert!(error.to_string().contains("\"d1\""), "{error}");
    queue.check_invariants().unwrap();
}

#[test]
fn an_abort_returns_samples_to_the_head_uncharged_unless_blamed() {
    let now = Instant::now();
    let (mut queue, consumer, delivered) = leased_to_one_drafter(now);
    queue
        .pin_step("d0", &delivered[..2], ROUND, false, now)
        .unwrap();
    queue
        .pin_step("d0", &delivered[2..], (4, 10), true, now)
        .unwrap();
    queue.close_consumer(consumer, now);
    queue.abort_step(ROUND, now);
    queue.abort_step((4, 10), now);
    let mut charges: Vec<(u64, u32)> = queue
        .queue
        .iter()
        .map(|id| (queue.items[id].seq, queue.items[id].deliveries))
        .collect();
    charges.sort_unstable();
    assert_eq!(
        charges,
        vec![(0, 0), (1, 0), (2, 1), (3, 1)],
        "all queued, blamed ones charged"
    );
    assert_eq!(queue.acked_items, 0);
    queue.check_invariants().unwrap();
}

#[test]
fn the_run_completes_only_once_no_sample_is_pinned() {
    let now = Instant::now();
    let (mut queue, _consumer, delivered) = leased_to_one_drafter(now);
    let epoch = queue.targets["target-0"].epoch;
    queue.report_done("target-0", 4, epoch, now).unwrap();
    queue.pin_step("d0", &delivered, ROUND, false, now).unwrap();
    queue.take_effects();
    assert_eq!(queue.state(), BrokerState::Draining);
    queue.tick(now + Duration::from_secs(1));
    assert_eq!(
        queue.state(),
        BrokerState::Draining,
        "nothing queued or leased, four pinned"
    );
    queue.commit_step(ROUND, RECORD, now);
    assert_eq!(queue.state(), BrokerState::Complete);
    assert!(ended(&queue.take_effects())
        .iter()
        .all(|(_, status)| *status == RunStatus::Complete));
}

#[test]
fn recovery_restores_the_record_and_the_steps_acks() {
    let now = Instant::now();
    let (mut queue, producer) = one_target(now);
    queue.enable_journal();
    accept_all(&mut queue, producer, 0..4, now);
    let consumer = queue.open_consumer("d0", credit(8), now).unwrap();
    let delivered: Vec<(DeliveryId, &str, u64)> = deliveries(&queue.take_effects())
        .into_iter()
        .map(|(_, delivery_id, seq)| (delivery_id, "target-0", seq))
        .collect();
    queue
        .pin_step("d0", &delivered[..2], ROUND, false, now)
        .unwrap();
    queue.commit_step(ROUND, RECORD, now);
    queue.close_consumer(consumer, now);
    let mut recovered = Recovered::default();
    for entry in queue.take_journal() {
        recovered.apply(entry);
    }
    let restored = Queue::recover(super::super::tests::config(1), recovered, now);
    assert_eq!(restored.commit_record(), Some(RECORD));
    assert_eq!(restored.acked_items, 2);
    assert_eq!(
        restored.queue.len(),
        2,
        "the two unpinned samples are queued again"
    );
    // A compaction image restates the record.
    let mut from_image = Recovered::default();
    for entry in restored.snapshot_entries() {
        from_image.apply(entry);
    }
    assert_eq!(from_image.commit_record, Some(RECORD));
}

#[test]
fn samples_of_a_vote_for_no_open_step_go_back_uncharged() {
    let now = Instant::now();
    let (mut queue, _consumer, delivered) = leased_to_one_drafter(now);
    let ids: Vec<DeliveryId> = delivered.iter().map(|(id, _, _)| *id).collect();
    assert_eq!(queue.release_step_samples("d0", &ids[..2], now), 2);
    assert_eq!(queue.release_step_samples("d0", &ids[..2], now), 0, "once");
    assert_eq!(
        queue.release_step_samples("d9", &ids[2..], now),
        0,
        "not d9's"
    );
    queue.take_effects();
    assert_eq!(queue.leases.len(), 4, "redelivered to d0, which has room");
    assert!(
        queue.items.values().all(|item| item.deliveries <= 1),
        "uncharged"
    );
    queue.check_invariants().unwrap();
}
