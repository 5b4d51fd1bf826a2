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

/// One change the write-ahead log keeps.
#[derive(Debug, Clone, PartialEq)]
pub enum JournalEntry<P> {
    /// Forget everything folded so far: a snapshot follows, up to
    /// `SnapshotEnd`.
    Reset,
    SnapshotEnd,
    Accepted {
        target_id: Arc<str>,
        seq: u64,
        payload: P,
    },
    Acked {
        target_id: Arc<str>,
        seq: u64,
    },
    /// The item was delivered; `deliveries` is its count now (absolute, so
    /// a snapshot restates it with one entry).
    Delivered {
        target_id: Arc<str>,
        seq: u64,
        deliveries: u32,
    },
    DeadLettered {
        target_id: Arc<str>,
        seq: u64,
        reason: String,
    },
    /// A Produce hello got this epoch.
    Epoch {
        target_id: Arc<str>,
        epoch: u64,
    },
    Done {
        target_id: Arc<str>,
    },
    TargetFailed {
        target_id: Arc<str>,
        reason: String,
    },
    Aborted {
        reason: String,
    },
    /// A target's books at a snapshot (its items follow as `Accepted`
    /// entries, which do not count again).
    SnapshotTarget(TargetBooks),
    /// The run's counters at a snapshot.
    SnapshotCounters {
        acked_items: u64,
        acked_bytes: u64,
        dead_letter_count: u64,
    },
    /// A listed dead letter at a snapshot (status shows them).
    SnapshotDeadLetter(DeadLetter),
}

/// A target's books, as a snapshot restates them.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetBooks {
    pub target_id: Arc<str>,
    pub epoch: u64,
    pub accepted_items: u64,
    pub accepted_bytes: u64,
    /// Accepted seqs as inclusive ranges.
    pub seq_ranges: Vec<(u64, u64)>,
    pub done: bool,
    pub failed: Option<String>,
}

/// A target's books rebuilt from the log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecoveredTarget {
    pub epoch: u64,
    pub accepted_items: u64,
    pub accepted_bytes: u64,
    accepted_seqs: AcceptedSeqs,
    pub done: bool,
    pub failed: Option<String>,
}

impl From<TargetBooks> for RecoveredTarget {
    fn from(books: TargetBooks) -> Self {
        let mut accepted_seqs = AcceptedSeqs::default();
        accepted_seqs.ranges.extend(books.seq_ranges);
        RecoveredTarget {
            epoch: books.epoch,
            accepted_items: books.accepted_items,
            accepted_bytes: books.accepted_bytes,
            accepted_seqs,
            done: books.done,
            failed: books.failed,
        }
    }
}

impl RecoveredTarget {
    /// The highest accepted seq: where the target resumes.
    pub fn highest_seq(&self) -> Option<u64> {
        self.accepted_seqs
            .ranges
            .last_key_value()
            .map(|(_, &end)| end)
    }
}

/// The queue's durable state, folded from journal entries.
#[derive(Debug, Clone)]
pub struct Recovered<P> {
    pub targets: BTreeMap<Arc<str>, RecoveredTarget>,
    /// Unacked items in acceptance order, keyed by that order.
    items: BTreeMap<u64, (Arc<str>, u64, P)>,
    /// (target, seq) → key in `items`.
    item_keys: HashMap<(Arc<str>, u64), u64>,
    /// Key in `items` → how many times the item was delivered (absent: 0).
    delivery_counts: HashMap<u64, u32>,
    next_key: u64,
    pub acked_items: u64,
    pub acked_bytes: u64,
    pub dead_letters: Vec<DeadLetter>,
    pub dead_letter_count: u64,
    pub aborted: Option<String>,
    /// Inside a snapshot, `Accepted` entries restore items without
    /// counting them again (their target snapshot counted them).
    in_snapshot: bool,
}

impl<P> Default for Recovered<P> {
    fn default() -> Self {
        Recovered {
            targets: BTreeMap::new(),
            items: BTreeMap::new(),
            item_keys: HashMap::new(),
            delivery_counts: HashMap::new(),
            next_key: 0,
            acked_items: 0,
            acked_bytes: 0,
            dead_letters: Vec::new(),
            dead_letter_count: 0,
            aborted: None,
            in_snapshot: false,
        }
    }
}

impl<P: Payload> Recovered<P> {
    /// Whether the entries so far end inside a snapshot (a `Reset` without
    /// its `SnapshotEnd`): a log that ends so is damaged, since a snapshot
    /// is written whole before it joins the log.
    pub fn is_mid_snapshot(&self) -> bool {
        self.in_snapshot
    }

    /// Unacked items, in acceptance order.
    pub fn items(&self) -> impl Iterator<Item = &(Arc<str>, u64, P)> {
        self.items.values()
    }

    /// How many times an unacked item was delivered before the restart.
    pub fn deliveries_of(&self, target_id: &str, seq: u64) -> u32 {
        self.item_keys
            .get(&(Arc::from(target_id), seq))
            .and_then(|key| self.delivery_counts.get(key))
            .copied()
            .unwrap_or(0)
    }

    /// An accepted item is held again; outside a snapshot it also counts
    /// for its target (once: a seq seen before is a duplicate).
    fn apply_accepted(&mut self, target_id: Arc<str>, seq: u64, payload: P) {
        if !self.in_snapshot {
            let target = self.targets.entry(target_id.clone()).or_default();
            if target.accepted_seqs.contains(seq) {
                return;
            }
            target.accepted_seqs.insert(seq);
            target.accepted_items += 1;
            target.accepted_bytes += payload.size_bytes();
        }
        let key = self.next_key;
        self.next_key += 1;
        self.item_keys.insert((target_id.clone(), seq), key);
        self.items.insert(key, (target_id, seq, payload));
    }

    /// Forgets a held item (acked or dead-lettered): its delivery count and
    /// payload, or `None` when it is not held.
    fn remove_item(&mut self, target_id: Arc<str>, seq: u64) -> Option<(u32, P)> {
        let key = self.item_keys.remove(&(target_id, seq))?;
        let deliveries = self.delivery_counts.remove(&key).unwrap_or(0);
        self.items
            .remove(&key)
            .map(|(_, _, payload)| (deliveries, payload))
    }

    /// Folds one entry into the state.
    pub fn apply(&mut self, entry: JournalEntry<P>) {
        match entry {
            JournalEntry::Reset => {
                *self = Recovered {
                    in_snapshot: true,
                    ..Recovered::default()
                }
            }
            JournalEntry::SnapshotEnd => self.in_snapshot = false,
            JournalEntry::Accepted {
                target_id,
                seq,
                payload,
            } => self.apply_accepted(target_id, seq, payload),
            JournalEntry::Acked { target_id, seq } => {
                if let Some((_, payload)) = self.remove_item(target_id, seq) {
                    self.acked_items += 1;
                    self.acked_bytes += payload.size_bytes();
                }
            }
            JournalEntry::DeadLettered {
                target_id,
                seq,
                reason,
            } => {
                if let Some((deliveries, payload)) = self.remove_item(target_id.clone(), seq) {
                    self.dead_letter_count += 1;
                    if self.dead_letters.len() < MAX_LISTED_DEAD_LETTERS {
                        self.dead_letters.push(DeadLetter {
                            target_id,
                            seq,
                            deliveries,
                            reason,
                            bytes: payload.size_bytes(),
                        });
                    }
                }
            }
            JournalEntry::Delivered {
                target_id,
                seq,
                deliveries,
            } => {
                if let Some(&key) = self.item_keys.get(&(target_id, seq)) {
                    let count = self.delivery_counts.entry(key).or_default();
                    *count = (*count).max(deliveries);
                }
            }
            JournalEntry::Epoch { target_id, epoch } => {
                let target = self.targets.entry(target_id).or_default();
                target.epoch = target.epoch.max(epoch);
            }
            JournalEntry::Done { target_id } => {
                self.targets.entry(target_id).or_default().done = true;
            }
            JournalEntry::TargetFailed { target_id, reason } => {
                self.targets.entry(target_id).or_default().failed = Some(reason);
            }
            JournalEntry::Aborted { reason } => {
                self.aborted = Some(reason);
            }
            JournalEntry::SnapshotTarget(books) => {
                self.targets
                    .insert(books.target_id.clone(), RecoveredTarget::from(books));
            }
            JournalEntry::SnapshotCounters {
                acked_items,
                acked_bytes,
                dead_letter_count,
            } => {
                self.acked_items = acked_items;
                self.acked_bytes = acked_bytes;
                self.dead_letter_count = dead_letter_count;
            }
            JournalEntry::SnapshotDeadLetter(dead_letter) => self.dead_letters.push(dead_letter),
        }
    }
}

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
