//! The ledger: where every accepted item is (queued, leased, acked or
//! dead-lettered), dispatch to consumers, lease expiry, and the run state.

use super::*;

impl<P: Payload> Queue<P> {
    /// Takes back expired leases and fails targets gone past their grace
    /// period. Call it at [`Queue::next_deadline`].
    pub fn tick(&mut self, now: Instant) {
        self.expire_leases(now);
        if matches!(self.state, BrokerState::Running | BrokerState::Draining) {
            self.fail_lapsed_targets(now);
            self.fail_stalled_targets(now);
            self.fail_missing_targets(now);
        }
        self.dispatch(now);
    }

    /// Leases past their deadline go back to the head of the queue; their
    /// consumers count an expiry and are marked stalled.
    fn expire_leases(&mut self, now: Instant) {
        let expired: Vec<DeliveryId> = self
            .lease_deadlines
            .iter()
            .take_while(|(deadline, _)| *deadline <= now)
            .map(|&(_, delivery_id)| delivery_id)
            .collect();
        let mut returned = Vec::new();
        for delivery_id in expired {
            let Some(lease) = self.remove_lease(delivery_id) else {
                continue;
            };
            self.unlink_lease(lease.connection, delivery_id, lease.item_id);
            if let Some(entry) = self.drafter_of_connection(lease.connection) {
                entry.expired_leases += 1;
                entry.stalled = true;
            }
            returned.push(lease.item_id);
        }
        self.return_to_head(returned, "lease expired");
    }

    /// Targets disconnected for longer than `--target-grace` fail.
    fn fail_lapsed_targets(&mut self, now: Instant) {
        let grace = self.config.target_grace;
        let lapsed: Vec<Arc<str>> = self
            .targets
            .values()
            .filter(|entry| match entry.state {
                TargetState::Disconnected { since } => {
                    now.saturating_duration_since(since) >= grace
                }
                _ => false,
            })
            .map(|entry| entry.target_id.clone())
            .collect();
        for target_id in lapsed {
            let reason = format!(
                "stream gone for more than {:.1}s without ReportDone",
                grace.as_secs_f64()
            );
            self.fail_target(&target_id, reason, now);
        }
    }

    /// Connected targets past their progress deadline (no first item within
    /// `--target-load-timeout`, or none since for `--target-stall-timeout`)
    /// fail.
    fn fail_stalled_targets(&mut self, now: Instant) {
        let stalled: Vec<(Arc<str>, String)> = self
            .targets
            .values()
            .filter(|entry| matches!(entry.state, TargetState::Connected { .. }))
            .filter(|entry| self.progress_deadline(entry).is_some_and(|deadline| deadline <= now))
            .map(|entry| {
                let reason = match (entry.last_progress, self.config.target_stall_timeout, self.config.target_load_timeout) {
                    (Some(_), Some(stall), _) => format!(
                        "connected but no item accepted for {:.1}s (--target-stall-timeout; stats and pings are not progress)",
                        stall.as_secs_f64()
                    ),
                    (_, _, Some(load)) => format!(
                        "connected but no first item within {:.1}s of its hello (--target-load-timeout)",
                        load.as_secs_f64()
                    ),
                    _ => "made no progress".to_string(),
                };
                (entry.target_id.clone(), reason)
            })
            .collect();
        for (target_id, reason) in stalled {
            self.fail_target(&target_id, reason, now);
        }
    }

    /// Expected targets that never connected within
    /// `--target-startup-timeout` fail, and the failure policy applies.
    fn fail_missing_targets(&mut self, now: Instant) {
        let Some(timeout) = self.config.target_startup_timeout else {
            return;
        };
        let missing: Vec<String> = self
            .config
            .target_ids
            .iter()
            .filter(|target_id| !self.targets.contains_key(target_id.as_str()))
            .cloned()
            .collect();
        if missing.is_empty() || now.saturating_duration_since(self.started_at) < timeout {
            return;
        }
        for target_id in &missing {
            let entry = Self::target_entry(&mut self.targets, Arc::from(target_id.as_str()), now);
            let reason = format!("never connected within {:.1}s", timeout.as_secs_f64());
            entry.state = TargetState::Failed {
                reason: reason.clone(),
            };
            self.record(JournalEntry::TargetFailed {
                target_id: Arc::from(target_id.as_str()),
                reason,
            });
        }
        let reason = format!(
            "{} of {} expected targets never connected within {:.1}s: {}",
            missing.len(),
            self.config.expected_targets(),
            timeout.as_secs_f64(),
            missing.join(", ")
        );
        self.apply_failure_policy(reason, now);
    }

    /// The earliest time at which `tick` has something to do, if any: a
    /// lease deadline, a disconnected target's grace, the startup timeout.
    /// The transport sleeps until then instead of polling.
    pub fn next_deadline(&self) -> Option<Instant> {
        let lease = self.lease_deadlines.first().map(|&(deadline, _)| deadline);
        if matches!(self.state, BrokerState::Complete | BrokerState::Aborted) {
            return lease;
        }
        let target = self
            .targets
            .values()
            .filter_map(|entry| match entry.state {
                TargetState::Disconnected { since } => Some(since + self.config.target_grace),
                _ => None,
            })
            .min();
        let known = self.targets.len() as u32;
        let startup = self
            .config
            .target_startup_timeout
            .filter(|_| known < self.config.expected_targets())
            .map(|timeout| self.started_at + timeout);
        let progress = self
            .targets
            .values()
            .filter(|entry| matches!(entry.state, TargetState::Connected { .. }))
            .filter_map(|entry| self.progress_deadline(entry))
            .min();
        [lease, target, startup, progress]
            .into_iter()
            .flatten()
            .min()
    }

    /// When a connected target fails for lack of progress: its stall
    /// deadline after its last accepted item, or its load deadline before
    /// the first; none while the broker holds it back.
    pub(super) fn progress_deadline(&self, entry: &TargetEntry) -> Option<Instant> {
        if entry.held_back || !matches!(entry.state, TargetState::Connected { .. }) {
            return None;
        }
        match entry.last_progress {
            Some(last) => self.config.target_stall_timeout.map(|stall| last + stall),
            None => self
                .config
                .target_load_timeout
                .map(|load| entry.connected_at + load),
        }
    }

    /// The earliest deadline created since the last call (a new lease, a
    /// target that disconnected), so the transport can wake its timer when
    /// it sleeps past it. Cheap: no scan.
    pub fn take_new_deadline(&mut self) -> Option<Instant> {
        self.new_deadline.take()
    }

    /// Notes a deadline just created, for [`Queue::take_new_deadline`].
    pub(super) fn note_deadline(&mut self, deadline: Instant) {
        self.new_deadline = Some(
            self.new_deadline
                .map_or(deadline, |earliest| earliest.min(deadline)),
        );
    }

    pub(super) fn ensure_not_ended(&self) -> Result<(), QueueError> {
        match self.state {
            BrokerState::Complete | BrokerState::Aborted => Err(QueueError::RunEnded {
                state: self.state,
                reason: if self.abort_reason.is_empty() {
                    "every target is done and every item acked".to_string()
                } else {
                    self.abort_reason.clone()
                },
            }),
            BrokerState::Running | BrokerState::Draining => Ok(()),
        }
    }

    pub(super) fn apply_failure_policy(&mut self, reason: String, now: Instant) {
        match self.config.on_target_failure {
            FailurePolicy::Abort => self.abort(reason),
            FailurePolicy::Continue => self.dispatch(now),
        }
    }

    /// Ends the run as ABORTED: every consumer gets end-of-stream, every
    /// producer is closed. Items still queued stay counted in status.
    pub fn abort(&mut self, reason: String) {
        if matches!(self.state, BrokerState::Complete | BrokerState::Aborted) {
            return;
        }
        tracing::error!(%reason, "run aborted");
        self.record(JournalEntry::Aborted {
            reason: reason.clone(),
        });
        self.abort_reason = reason.clone();
        self.end_run(RunStatus::Aborted, reason);
        self.debug_check_invariants();
    }

    /// The one place a run ends: records the final state, sends end-of-stream
    /// to every consumer and closes every producer with the outcome.
    fn end_run(&mut self, outcome: RunStatus, producer_reason: String) {
        self.state = match outcome {
            RunStatus::Complete => BrokerState::Complete,
            RunStatus::Aborted => BrokerState::Aborted,
        };
        let consumers: Vec<ConnectionId> = self.consumer_connections.keys().copied().collect();
        for connection in consumers {
            self.end_consumer(connection);
        }
        let producers: Vec<ConnectionId> = self.producer_connections.keys().copied().collect();
        for connection in producers {
            self.effects.push(Effect::CloseProducer {
                connection,
                outcome,
                reason: producer_reason.clone(),
            });
        }
    }

    /// Panics when a ledger invariant is broken; debug builds only, after
    /// every public operation, so tests catch a broken rule where it breaks.
    pub(super) fn debug_check_invariants(&self) {
        debug_assert_eq!(
            self.check_invariants(),
            Ok(()),
            "queue ledger invariant broken"
        );
    }

    /// Sends end-of-stream for the run's outcome and forgets the connection;
    /// its leases (none when complete) go back to the queue.
    pub(super) fn end_consumer(&mut self, connection: ConnectionId) {
        let (outcome, reason) = match self.state {
            BrokerState::Complete => (RunStatus::Complete, String::new()),
            _ => (RunStatus::Aborted, self.abort_reason.clone()),
        };
        if let Some(drafter_id) = self.consumer_connections.get(&connection) {
            self.ended_consumers.insert(connection, drafter_id.clone());
        }
        self.release_consumer(connection);
        let summary = self.summary();
        self.effects.push(Effect::EndConsumer {
            connection,
            outcome,
            reason,
            summary,
        });
    }

    /// Moves RUNNING → DRAINING once every expected target is finished, and
    /// to COMPLETE (end-of-stream to every consumer) once nothing is queued
    /// or leased either.
    pub(super) fn update_broker_state(&mut self) {
        if matches!(self.state, BrokerState::Complete | BrokerState::Aborted) {
            return;
        }
        let all_finished = self.finished_targets() >= self.config.expected_targets();
        if !all_finished {
            return;
        }
        if self.queue.is_empty() && self.leases.is_empty() && self.pinned.is_empty() {
            tracing::info!(
                accepted = self.accepted_items,
                acked = self.acked_items,
                dead = self.dead_letter_count,
                "run complete"
            );
            self.end_run(RunStatus::Complete, "run complete".to_string());
        } else {
            self.state = BrokerState::Draining;
        }
    }

    /// Removes a lease held by `connection`; the item id when it was held.
    pub(super) fn take_lease(
        &mut self,
        connection: ConnectionId,
        delivery_id: DeliveryId,
    ) -> Option<ItemId> {
        match self.leases.get(&delivery_id) {
            Some(lease) if lease.connection == connection => {}
            _ => return None,
        }
        let lease = self.remove_lease(delivery_id)?;
        self.unlink_lease(connection, delivery_id, lease.item_id);
        Some(lease.item_id)
    }

    // The lease table and its deadline index change only through these
    // three, so the index cannot drift from the table.

    /// Adds a lease to the lease table and its deadline index.
    fn insert_lease(&mut self, delivery_id: DeliveryId, lease: Lease) {
        self.lease_deadlines.insert((lease.deadline, delivery_id));
        self.leases.insert(delivery_id, lease);
    }

    /// Moves a lease's deadline, in the table and in the index.
    pub(super) fn set_lease_deadline(&mut self, delivery_id: DeliveryId, deadline: Instant) {
        if let Some(lease) = self.leases.get_mut(&delivery_id) {
            self.lease_deadlines.remove(&(lease.deadline, delivery_id));
            lease.deadline = deadline;
            self.lease_deadlines.insert((deadline, delivery_id));
        }
    }

    /// Removes a lease from the lease table and its deadline index.
    fn remove_lease(&mut self, delivery_id: DeliveryId) -> Option<Lease> {
        let lease = self.leases.remove(&delivery_id)?;
        self.lease_deadlines.remove(&(lease.deadline, delivery_id));
        Some(lease)
    }

    /// Drops a removed lease from its drafter's books and the leased bytes.
    pub(super) fn unlink_lease(
        &mut self,
        connection: ConnectionId,
        delivery_id: DeliveryId,
        item_id: ItemId,
    ) {
        let bytes = self.items.get(&item_id).map_or(0, |item| item.bytes);
        self.leased_bytes -= bytes;
        if let Some(drafter_id) = self.consumer_connections.get(&connection) {
            if let Some(entry) = self.drafters.get_mut(drafter_id) {
                if entry.leases.remove(&delivery_id) {
                    entry.leased_bytes -= bytes;
                }
            }
        }
    }

    /// Puts returned items back at the head of the queue in acceptance order,
    /// dead-lettering those that used up their deliveries.
    pub(super) fn return_to_head(&mut self, mut item_ids: Vec<ItemId>, reason: &str) {
        item_ids.sort_unstable();
        for item_id in item_ids.into_iter().rev() {
            let Some(item) = self.items.get(&item_id) else {
                continue;
            };
            if item.deliveries >= self.config.max_deliveries {
                let deliveries = item.deliveries;
                self.dead_letter(
                    item_id,
                    format!(
                        "{reason} after {deliveries} deliveries (max {})",
                        self.config.max_deliveries
                    ),
                );
            } else {
                self.queued_bytes += item.bytes;
                self.queue.push_front(item_id);
            }
        }
    }

    pub(super) fn dead_letter(&mut self, item_id: ItemId, reason: String) {
        let Some(item) = self.items.remove(&item_id) else {
            return;
        };
        tracing::warn!(target_id = %item.target_id, seq = item.seq, deliveries = item.deliveries, %reason, "item dead-lettered");
        self.record(JournalEntry::DeadLettered {
            target_id: item.target_id.clone(),
            seq: item.seq,
            reason: reason.clone(),
        });
        self.dead_letter_count += 1;
        if self.dead_letters.len() < MAX_LISTED_DEAD_LETTERS {
            self.dead_letters.push(DeadLetter {
                target_id: item.target_id,
                seq: item.seq,
                deliveries: item.deliveries,
                reason,
                bytes: item.bytes,
            });
        }
    }

    /// Hands queued items to consumers with room, round robin, then checks
    /// whether the run is complete.
    pub(super) fn dispatch(&mut self, now: Instant) {
        if matches!(self.state, BrokerState::Running | BrokerState::Draining) {
            while let Some(&item_id) = self.queue.front() {
                let Some(bytes) = self.items.get(&item_id).map(|item| item.bytes) else {
                    self.queue.pop_front();
                    continue;
                };
                let Some(connection) = self.next_consumer_with_room(bytes) else {
                    break;
                };
                self.queue.pop_front();
                self.queued_bytes -= bytes;
                self.deliver(item_id, connection, now);
            }
        }
        self.update_broker_state();
        self.debug_check_invariants();
    }

    pub(super) fn next_consumer_with_room(&mut self, bytes: u64) -> Option<ConnectionId> {
        let has_room = |entry: &DrafterEntry| {
            let items = entry.leases.len() as u64;
            entry.connection.is_some()
                && !entry.stalled
                && items < u64::from(entry.credit.items)
                && (items == 0
                    || entry.credit.bytes == 0
                    || entry.leased_bytes + bytes <= entry.credit.bytes)
        };
        let after = self.round_robin_after.clone();
        let candidate = match &after {
            Some(last) => self
                .drafters
                .range::<String, _>((
                    std::ops::Bound::Excluded(last.clone()),
                    std::ops::Bound::Unbounded,
                ))
                .chain(self.drafters.range::<String, _>(..=last.clone()))
                .find(|(_, entry)| has_room(entry)),
            None => self.drafters.iter().find(|(_, entry)| has_room(entry)),
        };
        let (drafter_id, entry) = candidate?;
        let connection = entry.connection?;
        self.round_robin_after = Some(drafter_id.clone());
        Some(connection)
    }

    pub(super) fn deliver(&mut self, item_id: ItemId, connection: ConnectionId, now: Instant) {
        let delivery_id = self.next_delivery;
        self.next_delivery += 1;
        let Some(item) = self.items.get_mut(&item_id) else {
            return;
        };
        item.deliveries += 1;
        if item.deliveries > 1 {
            self.redelivered_items += 1;
        }
        let delivery = Delivery {
            delivery_id,
            target_id: item.target_id.clone(),
            seq: item.seq,
            payload: item.payload.clone(),
            delivery_count: item.deliveries,
        };
        let bytes = item.bytes;
        if self.journal.is_some() {
            self.record(JournalEntry::Delivered {
                target_id: delivery.target_id.clone(),
                seq: delivery.seq,
                deliveries: delivery.delivery_count,
            });
        }
        let expires_at_latest = self
            .config
            .max_lease_lifetime
            .map_or(now + self.config.lease_timeout, |lifetime| now + lifetime);
        let deadline = (now + self.config.lease_timeout).min(expires_at_latest);
        self.insert_lease(
            delivery_id,
            Lease {
                item_id,
                connection,
                deadline,
                expires_at_latest: expires_at_latest.max(deadline),
            },
        );
        self.note_deadline(deadline);
        self.leased_bytes += bytes;
        self.delivered_items += 1;
        if let Some(entry) = self.drafter_of_connection(connection) {
            entry.leases.insert(delivery_id);
            entry.leased_bytes += bytes;
            entry.delivered_items += 1;
        }
        self.effects.push(Effect::Deliver {
            connection,
            delivery,
        });
    }
}
