//! Read-only views of the queue: the run summary, the status snapshot and
//! the ledger invariants.

use super::*;

impl<P: Payload> Queue<P> {
    pub fn summary(&self) -> RunSummary {
        let failed_targets: Vec<String> = self
            .targets
            .values()
            .filter(|entry| matches!(entry.state, TargetState::Failed { .. }))
            .map(|entry| entry.target_id.to_string())
            .collect();
        let announced: Vec<u64> = self
            .targets
            .values()
            .filter_map(|entry| entry.stats.as_ref().map(|stats| stats.samples_total))
            .filter(|&total| total > 0)
            .collect();
        let expected_items = if announced.len() as u32 == self.config.expected_targets() {
            announced.iter().sum()
        } else {
            0
        };
        RunSummary {
            expected_targets: self.config.expected_targets(),
            done_targets: self.finished_targets(),
            failed_targets,
            accepted_items: self.accepted_items,
            accepted_bytes: self.accepted_bytes,
            acked_items: self.acked_items,
            dead_letter_count: self.dead_letter_count,
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
            expected_targets: self.config.expected_targets(),
            done_targets: self.finished_targets(),
            queued_items: self.queue.len() as u64,
            queued_bytes: self.queued_bytes,
            leased_items: self.leases.len() as u64,
            leased_bytes: self.leased_bytes,
            max_queue_bytes: self.config.max_queue_bytes,
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
        let pinned = self.pinned_items() as u64;
        if queued + leased + pinned + self.acked_items + self.dead_letter_count
            != self.accepted_items
        {
            return Err(format!(
                "accounting: queued {queued} + leased {leased} + pinned {pinned} + acked {} + dead {} != accepted {}",
                self.acked_items, self.dead_letter_count, self.accepted_items
            ));
        }
        if self.items.len() as u64 != queued + leased + pinned {
            return Err(format!(
                "{} stored items, {queued} queued + {leased} leased + {pinned} pinned",
                self.items.len()
            ));
        }
        let pinned_bytes: u64 = self
            .pinned
            .values()
            .flatten()
            .filter_map(|pinned| self.items.get(&pinned.item_id))
            .map(|item| item.bytes)
            .sum();
        if pinned_bytes != self.pinned_bytes {
            return Err(format!(
                "pinned bytes {} != sum {pinned_bytes}",
                self.pinned_bytes
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
        self.check_leases(leased)?;
        if self.held_bytes() > self.config.max_queue_bytes {
            return Err(format!(
                "held {} > cap {}",
                self.held_bytes(),
                self.config.max_queue_bytes
            ));
        }
        let mut leased_items: Vec<ItemId> =
            self.leases.values().map(|lease| lease.item_id).collect();
        leased_items.extend(self.queue.iter().copied());
        leased_items.extend(self.pinned.values().flatten().map(|pinned| pinned.item_id));
        leased_items.sort_unstable();
        if leased_items.windows(2).any(|pair| pair[0] == pair[1]) {
            return Err("an item is queued, leased or pinned twice".to_string());
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
        if self.state == BrokerState::Complete && (queued > 0 || leased > 0 || pinned > 0) {
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

    /// The leased bytes and the deadline index agree with the lease table.
    fn check_leases(&self, leased: u64) -> Result<(), String> {
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
        let indexed = self.lease_deadlines.len() as u64;
        if indexed != leased
            || self
                .leases
                .iter()
                .any(|(&id, lease)| !self.lease_deadlines.contains(&(lease.deadline, id)))
        {
            return Err(format!(
                "lease deadline index ({indexed} entries) does not match the {leased} leases"
            ));
        }
        Ok(())
    }
}
