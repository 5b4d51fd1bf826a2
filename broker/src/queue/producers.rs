//! Producer streams: hellos, items, stats, ReportDone, and target liveness.

use super::*;

impl<P: Payload> Queue<P> {
    /// A target opens its Produce stream and gets the next epoch. A stream
    /// already open for the same target has an older epoch by construction:
    /// it is fenced (closed ABORTED) and its late items and ReportDone are
    /// refused, so a restarted target gets in at once and a zombie cannot
    /// finish for it.
    pub fn open_producer(
        &mut self,
        target_id: &str,
        now: Instant,
    ) -> Result<ProducerOpened, QueueError> {
        self.ensure_not_ended()?;
        let key = self.target_key(target_id)?;
        let connection = self.allocate_connection();
        let entry = Self::target_entry(&mut self.targets, key.clone(), now);
        if let TargetState::Failed { reason } = &entry.state {
            return Err(QueueError::TargetFailed {
                target_id: target_id.to_string(),
                reason: reason.clone(),
            });
        }
        entry.epoch += 1;
        let epoch = entry.epoch;
        entry.connected_at = now;
        entry.held_back = false;
        if entry.last_progress.is_some() {
            // A reconnect restarts the stall clock.
            entry.last_progress = Some(now);
        }
        let journal_epoch = JournalEntry::Epoch {
            target_id: key.clone(),
            epoch,
        };
        match &entry.state {
            TargetState::Failed { .. } => {}
            TargetState::Connected { connection: old } => {
                let old = *old;
                entry.state = TargetState::Connected { connection };
                self.producer_connections.remove(&old);
                self.effects.push(Effect::CloseProducer {
                    connection: old,
                    outcome: RunStatus::Aborted,
                    reason: format!(
                        "fenced: a newer Produce stream (epoch {epoch}) replaced this one for target {target_id:?}"
                    ),
                });
            }
            TargetState::Disconnected { .. } => entry.state = TargetState::Connected { connection },
            // A finished target may reconnect (a restarted pod): it learns that
            // everything is in and reports done again, which is idempotent.
            TargetState::Done => {}
        }
        let opened = ProducerOpened {
            connection,
            epoch,
            resume_after_seq: entry.highest_seq,
            accepted_items: entry.accepted_items,
        };
        let key_for_deadline = key.clone();
        self.producer_connections.insert(connection, key);
        self.record(journal_epoch);
        if let Some(deadline) = self.progress_deadline(&self.targets[&key_for_deadline]) {
            self.note_deadline(deadline);
        }
        self.debug_check_invariants();
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
        let limit = self.config.max_queue_bytes;
        let Some(entry) = self.targets.get_mut(&target_key) else {
            return Err(QueueError::StaleConnection { connection });
        };
        entry.last_seen = now;
        if entry.accepted_seqs.contains(seq) {
            entry.duplicate_items += 1;
            return Ok(ItemAccepted { duplicate: true });
        }
        if let Some(highest) = entry.highest_seq.filter(|&highest| seq < highest) {
            entry.rejected_items += 1;
            self.count_rejection(RejectReason::OutOfOrder);
            return Err(QueueError::OutOfOrderSeq {
                target_id: target_key.to_string(),
                seq,
                highest,
            });
        }
        if entry.state == TargetState::Done {
            entry.rejected_items += 1;
            self.count_rejection(RejectReason::TargetDone);
            return Err(QueueError::TargetAlreadyDone {
                target_id: target_key.to_string(),
                seq,
            });
        }
        if held.saturating_add(bytes) > limit {
            entry.held_back = true;
            return Err(QueueError::QueueFull { held, limit });
        }
        entry.held_back = false;
        entry.last_progress = Some(now);
        entry.highest_seq = Some(seq);
        entry.accepted_seqs.insert(seq);
        entry.accepted_items += 1;
        entry.accepted_bytes += bytes;
        let item_id = self.next_item;
        self.next_item += 1;
        if self.journal.is_some() {
            self.record(JournalEntry::Accepted {
                target_id: target_key.clone(),
                seq,
                payload: payload.clone(),
            });
        }
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
        if let Some(stall) = self.config.target_stall_timeout {
            self.note_deadline(now + stall);
        }
        self.accepted_items += 1;
        self.accepted_bytes += bytes;
        self.accepted_rate
            .record(now, self.accepted_items, self.accepted_bytes);
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
        self.debug_check_invariants();
    }

    pub(super) fn count_rejection(&mut self, reason: RejectReason) {
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

    /// A producer stream ended (cleanly or not). Idempotent. The target's
    /// grace counts from the last moment it was known alive: its last
    /// message, or `keepalive_detection` before now if that is later (a
    /// stream that stayed open that long answered keepalive pings until
    /// then), so a frozen target that keepalive dropped late still fails one
    /// grace after it froze.
    pub fn close_producer(&mut self, connection: ConnectionId, now: Instant) {
        let Some(key) = self.producer_connections.remove(&connection) else {
            return;
        };
        let mut disconnected_since = None;
        let keepalive_detection = self.config.keepalive_detection;
        if let Some(entry) = self.targets.get_mut(&key) {
            if entry.state == (TargetState::Connected { connection }) {
                let since = match keepalive_detection.and_then(|bound| now.checked_sub(bound)) {
                    Some(alive_at_least_until) => entry.last_seen.max(alive_at_least_until),
                    None => now,
                };
                entry.state = TargetState::Disconnected { since };
                disconnected_since = Some(since);
            }
            entry.last_seen = now;
        }
        if let Some(since) = disconnected_since {
            self.note_deadline(since + self.config.target_grace);
        }
        self.debug_check_invariants();
    }

    /// A target reports it is finished, with the epoch of its current
    /// Produce stream (open or already closed): a caller that never had a
    /// stream, or whose stream a newer one fenced, is refused. Idempotent; a
    /// count that differs from what was accepted changes nothing.
    pub fn report_done(
        &mut self,
        target_id: &str,
        total_items: u64,
        epoch: u64,
        now: Instant,
    ) -> Result<DoneAccepted, QueueError> {
        if self.state == BrokerState::Aborted {
            return Err(QueueError::RunEnded {
                state: self.state,
                reason: self.abort_reason.clone(),
            });
        }
        let key = self.target_key(target_id)?;
        let Some(entry) = self.targets.get(&key) else {
            return Err(QueueError::NoProduceStream {
                target_id: target_id.to_string(),
            });
        };
        if let TargetState::Failed { reason } = &entry.state {
            return Err(QueueError::TargetFailed {
                target_id: target_id.to_string(),
                reason: reason.clone(),
            });
        }
        if entry.epoch == 0 {
            return Err(QueueError::NoProduceStream {
                target_id: target_id.to_string(),
            });
        }
        if epoch != entry.epoch {
            return Err(QueueError::StaleEpoch {
                target_id: target_id.to_string(),
                epoch,
                current: entry.epoch,
            });
        }
        let accepted = entry.accepted_items;
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
        if !already_done {
            self.record(JournalEntry::Done {
                target_id: key.clone(),
            });
        }
        self.dispatch(now);
        Ok(DoneAccepted {
            done_targets: self.finished_targets(),
            expected_targets: self.config.expected_targets(),
            already_done,
        })
    }

    /// The shared key for a target id; only the configured ids exist.
    pub(super) fn target_key(&self, target_id: &str) -> Result<Arc<str>, QueueError> {
        if target_id.is_empty() {
            return Err(QueueError::EmptyTargetId);
        }
        if let Some((key, _)) = self.targets.get_key_value(target_id) {
            return Ok(key.clone());
        }
        if !self
            .config
            .target_ids
            .iter()
            .any(|known| known == target_id)
        {
            return Err(QueueError::UnknownTarget {
                target_id: target_id.to_string(),
                expected: self.config.target_ids.join(", "),
            });
        }
        Ok(Arc::from(target_id))
    }

    /// The target's entry, registered (disconnected, nothing accepted) on
    /// first sight; either way marked as seen now.
    pub(super) fn target_entry(
        targets: &mut BTreeMap<Arc<str>, TargetEntry>,
        key: Arc<str>,
        now: Instant,
    ) -> &mut TargetEntry {
        let entry = targets.entry(key.clone()).or_insert_with(|| TargetEntry {
            target_id: key,
            state: TargetState::Disconnected { since: now },
            epoch: 0,
            highest_seq: None,
            accepted_seqs: AcceptedSeqs::default(),
            accepted_items: 0,
            accepted_bytes: 0,
            rejected_items: 0,
            duplicate_items: 0,
            last_seen: now,
            stats: None,
            connected_at: now,
            last_progress: None,
            held_back: false,
        });
        entry.last_seen = now;
        entry
    }

    pub(super) fn producer_target(&self, connection: ConnectionId) -> Result<Arc<str>, QueueError> {
        self.producer_connections
            .get(&connection)
            .cloned()
            .ok_or(QueueError::StaleConnection { connection })
    }

    pub(super) fn finished_targets(&self) -> u32 {
        self.targets
            .values()
            .filter(|entry| entry.is_finished())
            .count() as u32
    }

    pub(super) fn fail_target(&mut self, target_id: &Arc<str>, reason: String, now: Instant) {
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
        self.record(JournalEntry::TargetFailed {
            target_id: target_id.clone(),
            reason: reason.clone(),
        });
        self.apply_failure_policy(format!("target {target_id:?} failed: {reason}"), now);
    }
}
