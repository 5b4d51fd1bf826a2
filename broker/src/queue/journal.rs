//! What the queue must remember across a restart, as a stream of entries,
//! and how a stream of entries folds back into a queue.
//!
//! The queue records an entry for every change a restart must not lose (an
//! accepted item with its payload, an ack, a dead letter, a target's epoch,
//! done or failure, an abort); the transport appends them to the write-ahead
//! log before it answers anyone (`crate::wal`). Leases are not recorded: after
//! a restart every unacked item is queued again, so the duplicates a crash
//! causes are bounded by what was leased at that moment. Each delivery is
//! recorded too (a small `Delivered` entry with the item's new count), so an item keeps
//! its delivery count across restarts: one that kills every drafter it
//! reaches is still dead-lettered after `--max-deliveries`, however often the
//! broker restarts in between.
//!
//! [`Recovered`] folds entries back (no I/O, so the property tests replay
//! logs at random points), and [`Queue::snapshot_entries`] writes the whole
//! state as a short stream, which compaction puts in place of a long log.

use super::*;

impl<P: Payload> Queue<P> {
    /// Starts recording journal entries (for a broker with a state dir).
    pub fn enable_journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// Stops recording (the log failed; the run is aborted).
    pub fn disable_journal(&mut self) {
        self.journal = None;
    }

    /// Entries recorded since the last call, in order; empty when the
    /// journal is off.
    pub fn take_journal(&mut self) -> Vec<JournalEntry<P>> {
        match &mut self.journal {
            Some(journal) => std::mem::take(journal),
            None => Vec::new(),
        }
    }

    pub(super) fn record(&mut self, entry: JournalEntry<P>) {
        if let Some(journal) = &mut self.journal {
            journal.push(entry);
        }
    }

    /// A queue rebuilt from the log: every target resumes after its highest
    /// accepted seq, every unacked item (queued or leased before) is queued
    /// again in acceptance order with its delivery count, done and failed
    /// targets stay so. The
    /// journal is on. Targets that were connected count as disconnected
    /// since `now` (their grace starts again).
    pub fn recover(config: QueueConfig, recovered: Recovered<P>, now: Instant) -> Self {
        let mut queue = Queue::new(config, now);
        queue.enable_journal();
        for (target_id, target) in &recovered.targets {
            let entry = Self::target_entry(&mut queue.targets, target_id.clone(), now);
            entry.epoch = target.epoch;
            entry.highest_seq = target.highest_seq();
            entry.accepted_seqs = target.accepted_seqs.clone();
            entry.accepted_items = target.accepted_items;
            entry.accepted_bytes = target.accepted_bytes;
            entry.state = match (&target.failed, target.done) {
                (Some(reason), _) => TargetState::Failed {
                    reason: reason.clone(),
                },
                (None, true) => TargetState::Done,
                (None, false) => TargetState::Disconnected { since: now },
            };
            queue.accepted_items += target.accepted_items;
            queue.accepted_bytes += target.accepted_bytes;
        }
        let mut delivery_counts = recovered.delivery_counts;
        for (key, (target_id, seq, payload)) in recovered.items {
            let bytes = payload.size_bytes();
            let deliveries = delivery_counts.remove(&key).unwrap_or(0);
            let item_id = queue.next_item;
            queue.next_item += 1;
            queue.items.insert(
                item_id,
                StoredItem {
                    target_id,
                    seq,
                    payload,
                    bytes,
                    deliveries,
                },
            );
            queue.queue.push_back(item_id);
            queue.queued_bytes += bytes;
        }
        queue.acked_items = recovered.acked_items;
        queue.acked_bytes = recovered.acked_bytes;
        queue.dead_letters = recovered.dead_letters;
        queue.dead_letter_count = recovered.dead_letter_count;
        queue.commit_record = recovered.commit_record;
        if let Some(reason) = recovered.aborted {
            queue.abort_reason = reason;
            queue.state = BrokerState::Aborted;
        }
        queue.update_broker_state();
        queue
    }

    /// The whole durable state as a short stream (starting with `Reset`):
    /// what compaction writes in place of the log so far.
    pub fn snapshot_entries(&self) -> Vec<JournalEntry<P>> {
        let mut entries = vec![JournalEntry::Reset];
        for entry in self.targets.values() {
            entries.push(JournalEntry::SnapshotTarget(TargetBooks {
                target_id: entry.target_id.clone(),
                epoch: entry.epoch,
                accepted_items: entry.accepted_items,
                accepted_bytes: entry.accepted_bytes,
                seq_ranges: entry
                    .accepted_seqs
                    .ranges
                    .iter()
                    .map(|(&start, &end)| (start, end))
                    .collect(),
                done: entry.state == TargetState::Done,
                failed: match &entry.state {
                    TargetState::Failed { reason } => Some(reason.clone()),
                    _ => None,
                },
            }));
        }
        if let Some(record) = self.commit_record {
            entries.push(JournalEntry::StepCommitted {
                record,
                acked: Vec::new(),
            });
        }
        entries.push(JournalEntry::SnapshotCounters {
            acked_items: self.acked_items,
            acked_bytes: self.acked_bytes,
            dead_letter_count: self.dead_letter_count,
        });
        entries.extend(
            self.dead_letters
                .iter()
                .cloned()
                .map(JournalEntry::SnapshotDeadLetter),
        );
        let mut held: Vec<ItemId> = self.items.keys().copied().collect();
        held.sort_unstable();
        for item_id in held {
            if let Some(item) = self.items.get(&item_id) {
                entries.push(JournalEntry::Accepted {
                    target_id: item.target_id.clone(),
                    seq: item.seq,
                    payload: item.payload.clone(),
                });
                if item.deliveries > 0 {
                    entries.push(JournalEntry::Delivered {
                        target_id: item.target_id.clone(),
                        seq: item.seq,
                        deliveries: item.deliveries,
                    });
                }
            }
        }
        entries.push(JournalEntry::SnapshotEnd);
        if self.state == BrokerState::Aborted {
            entries.push(JournalEntry::Aborted {
                reason: self.abort_reason.clone(),
            });
        }
        entries
    }
}
