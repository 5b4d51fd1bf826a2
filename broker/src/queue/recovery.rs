//! What the write-ahead log keeps ([`JournalEntry`]) and how a stream of
//! entries folds back into the books a queue is rebuilt from
//! ([`Recovered`]); no I/O, so the property tests replay logs at random
//! points. The queue's side (recording entries, rebuilding from
//! [`Recovered`]) is in `journal`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::snapshot::DeadLetter;
use super::types::*;

/// Dead letters listed individually in status (all are counted).
pub(super) const MAX_LISTED_DEAD_LETTERS: usize = 100;

/// A set of seqs kept as disjoint inclusive ranges: a target's seqs are
/// nearly contiguous, so this stays a handful of entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AcceptedSeqs {
    /// start → end (inclusive); ranges neither overlap nor touch.
    pub(super) ranges: BTreeMap<u64, u64>,
}

impl AcceptedSeqs {
    pub(super) fn contains(&self, seq: u64) -> bool {
        self.ranges
            .range(..=seq)
            .next_back()
            .is_some_and(|(_, &end)| seq <= end)
    }

    pub(super) fn insert(&mut self, seq: u64) {
        if self.contains(seq) {
            return;
        }
        let joins_before = self
            .ranges
            .range(..seq)
            .next_back()
            .filter(|(_, &end)| end.checked_add(1) == Some(seq))
            .map(|(&start, _)| start);
        let joins_after = seq
            .checked_add(1)
            .and_then(|next| self.ranges.get(&next).copied().map(|end| (next, end)));
        let start = joins_before.unwrap_or(seq);
        let end = match joins_after {
            Some((next, end)) => {
                self.ranges.remove(&next);
                end
            }
            None => seq,
        };
        self.ranges.insert(start, end);
    }
}

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
    /// A data-parallel step committed: `record` is the run's H from now on
    /// and its samples (target, seq) are acked, in one entry so that a
    /// crash keeps both or neither. A snapshot restates the record with no
    /// samples.
    StepCommitted {
        record: CommitRecord,
        acked: Vec<(Arc<str>, u64)>,
    },
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
    pub(super) accepted_seqs: AcceptedSeqs,
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
    pub(super) items: BTreeMap<u64, (Arc<str>, u64, P)>,
    /// (target, seq) → key in `items`.
    pub(super) item_keys: HashMap<(Arc<str>, u64), u64>,
    /// Key in `items` → how many times the item was delivered (absent: 0).
    pub(super) delivery_counts: HashMap<u64, u32>,
    pub(super) next_key: u64,
    pub acked_items: u64,
    pub acked_bytes: u64,
    pub dead_letters: Vec<DeadLetter>,
    pub dead_letter_count: u64,
    pub aborted: Option<String>,
    /// The run's data-parallel commit record (H), if a step committed.
    pub commit_record: Option<CommitRecord>,
    /// Inside a snapshot, `Accepted` entries restore items without
    /// counting them again (their target snapshot counted them).
    pub(super) in_snapshot: bool,
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
            commit_record: None,
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

    fn apply_acked(&mut self, target_id: Arc<str>, seq: u64) {
        if let Some((_, payload)) = self.remove_item(target_id, seq) {
            self.acked_items += 1;
            self.acked_bytes += payload.size_bytes();
        }
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
            JournalEntry::Acked { target_id, seq } => self.apply_acked(target_id, seq),
            JournalEntry::StepCommitted { record, acked } => {
                for (target_id, seq) in acked {
                    self.apply_acked(target_id, seq);
                }
                self.commit_record = Some(record);
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
