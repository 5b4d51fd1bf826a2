//! Data-parallel steps: the samples of a step's vote are pinned to its
//! round (neither queued nor leased: no stream's end and no lease timeout
//! moves them), and the lighthouse's decision settles them at once: a
//! commit acks every one in the journal entry that records the step as the
//! run's H, an abort returns them to the head of the queue, uncharged
//! unless their member blamed its own share.

use super::*;

#[cfg(test)]
mod tests;

/// An item pinned to a step's vote round.
pub(super) struct PinnedItem {
    pub(super) item_id: ItemId,
    /// The drafter whose share it was (its books count the ack).
    pub(super) drafter_id: String,
    /// Whether an abort charges the delivery (the member blamed its share).
    pub(super) charge_on_abort: bool,
}

impl<P: Payload> Queue<P> {
    /// Pins the deliveries `drafter_id`'s current stream holds to `round`,
    /// each given with the (target, seq) it delivered, all or none: a
    /// delivery it no longer holds (its stream closed or the lease expired,
    /// so the item may be anywhere), or one of another sample (a delivery
    /// id of an earlier broker process), refuses the whole pin and changes
    /// nothing. The (target, seq) of each pinned item.
    pub fn pin_step(
        &mut self,
        drafter_id: &str,
        samples: &[(DeliveryId, &str, u64)],
        round: StepRound,
        charge_on_abort: bool,
        now: Instant,
    ) -> Result<Vec<(Arc<str>, u64)>, QueueError> {
        let connection = self
            .drafters
            .get(drafter_id)
            .and_then(|entry| entry.connection);
        let not_held: Vec<String> = samples
            .iter()
            .filter(|(delivery_id, target_id, seq)| {
                !self.leases.get(delivery_id).is_some_and(|lease| {
                    Some(lease.connection) == connection
                        && self
                            .items
                            .get(&lease.item_id)
                            .is_some_and(|item| &*item.target_id == *target_id && item.seq == *seq)
                })
            })
            .map(|(delivery_id, target_id, seq)| format!("{delivery_id} ({target_id}:{seq})"))
            .collect();
        if !not_held.is_empty() {
            return Err(QueueError::StepDeliveriesNotHeld {
                drafter_id: drafter_id.to_string(),
                delivery_ids: not_held.join(", "),
            });
        }
        let mut keys = Vec::with_capacity(samples.len());
        if let Some(connection) = connection {
            for &(delivery_id, _, _) in samples {
                let Some(item_id) = self.take_lease(connection, delivery_id) else {
                    continue;
                };
                if let Some(item) = self.items.get(&item_id) {
                    self.pinned_bytes += item.bytes;
                    keys.push((item.target_id.clone(), item.seq));
                }
                self.pinned.entry(round).or_default().push(PinnedItem {
                    item_id,
                    drafter_id: drafter_id.to_string(),
                    charge_on_abort,
                });
            }
            self.consumer_alive(connection, now);
        }
        // The pinned leases left the drafter's credit window: it has room
        // for the next items while the step is decided.
        self.dispatch(now);
        self.debug_check_invariants();
        Ok(keys)
    }

    /// A step committed: every item pinned to `round` is acked, and the
    /// one journal entry that acks them records `record` as the run's H.
    /// The (target, seq) acked.
    pub fn commit_step(
        &mut self,
        round: StepRound,
        record: CommitRecord,
        now: Instant,
    ) -> Vec<(Arc<str>, u64)> {
        let pinned = self.pinned.remove(&round).unwrap_or_default();
        let mut acked = Vec::with_capacity(pinned.len());
        for PinnedItem {
            item_id,
            drafter_id,
            ..
        } in pinned
        {
            let Some(item) = self.items.remove(&item_id) else {
                continue;
            };
            self.pinned_bytes -= item.bytes;
            self.acked_items += 1;
            self.acked_bytes += item.bytes;
            if let Some(entry) = self.drafters.get_mut(&drafter_id) {
                entry.acked_items += 1;
            }
            acked.push((item.target_id, item.seq));
        }
        self.acked_rate
            .record(now, self.acked_items, self.acked_bytes);
        self.commit_record = Some(record);
        self.record(JournalEntry::StepCommitted {
            record,
            acked: acked.clone(),
        });
        self.dispatch(now);
        self.debug_check_invariants();
        acked
    }

    /// A step did not commit: its pinned items go back to the head of the
    /// queue; a delivery is charged only to items whose member blamed its
    /// own share (so a faulty member cannot dead-letter healthy samples).
    pub fn abort_step(&mut self, round: StepRound, now: Instant) {
        let pinned = self.pinned.remove(&round).unwrap_or_default();
        let mut returned = Vec::with_capacity(pinned.len());
        for PinnedItem {
            item_id,
            charge_on_abort,
            ..
        } in pinned
        {
            let Some(item) = self.items.get_mut(&item_id) else {
                continue;
            };
            self.pinned_bytes -= item.bytes;
            if !charge_on_abort {
                item.deliveries = item.deliveries.saturating_sub(1);
            }
            returned.push(item_id);
        }
        self.return_to_head(returned, "its data-parallel step did not commit");
        self.dispatch(now);
        self.debug_check_invariants();
    }

    /// A vote that reached no open round (decided already, or another
    /// round's): the deliveries it names that `drafter_id` still holds go
    /// back to the head of the queue, uncharged (nobody settles them
    /// otherwise, and the drafter lets them go). The number returned.
    pub fn release_step_samples(
        &mut self,
        drafter_id: &str,
        delivery_ids: &[DeliveryId],
        now: Instant,
    ) -> usize {
        let Some(connection) = self
            .drafters
            .get(drafter_id)
            .and_then(|entry| entry.connection)
        else {
            return 0;
        };
        let mut returned = Vec::new();
        for &delivery_id in delivery_ids {
            if let Some(item_id) = self.take_lease(connection, delivery_id) {
                if let Some(item) = self.items.get_mut(&item_id) {
                    item.deliveries = item.deliveries.saturating_sub(1);
                }
                returned.push(item_id);
            }
        }
        let count = returned.len();
        self.return_to_head(returned, "its vote reached no open step");
        self.dispatch(now);
        self.debug_check_invariants();
        count
    }

    /// The run's commit record (H), as committed here or restored from the
    /// log; `None` before the first data-parallel commit.
    pub fn commit_record(&self) -> Option<CommitRecord> {
        self.commit_record
    }

    /// Items pinned to vote rounds, across rounds.
    pub fn pinned_items(&self) -> usize {
        self.pinned.values().map(Vec::len).sum()
    }
}
