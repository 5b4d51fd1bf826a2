//! Consumer streams: hellos, credit, acks, nacks, lease extensions.

use super::*;

impl<P: Payload> Queue<P> {
    /// A drafter opens its Consume stream. A stream still live under the
    /// same drafter id is not displaced: the hello is refused
    /// ([`QueueError::DrafterAlreadyConnected`]) and changes nothing, so a
    /// second process that was given the same id cannot take over a working
    /// drafter's leases. The id is free again as soon as the old stream
    /// ends (a killed process closes its connection at once; a frozen or
    /// cut-off one is dropped by HTTP/2 keepalive), or when it stalled (a
    /// lease of it expired with no sign of life since): then the old stream
    /// is ended (its leases go back to the queue) and the new one takes the
    /// id. A drafter joining a finished run gets end-of-stream at once.
    pub fn open_consumer(
        &mut self,
        drafter_id: &str,
        credit: Credit,
        now: Instant,
    ) -> Result<ConnectionId, QueueError> {
        if drafter_id.is_empty() {
            return Err(QueueError::EmptyDrafterId);
        }
        if credit.items == 0 {
            return Err(QueueError::ZeroCredit);
        }
        let live = self.drafters.get(drafter_id).and_then(|entry| {
            entry
                .connection
                .map(|connection| (connection, entry.stalled, entry.last_seen))
        });
        if let Some((old, stalled, last_seen)) = live {
            if !stalled {
                return Err(QueueError::DrafterAlreadyConnected {
                    drafter_id: drafter_id.to_string(),
                    last_seen_ms_ago: u64::try_from(
                        now.saturating_duration_since(last_seen).as_millis(),
                    )
                    .unwrap_or(u64::MAX),
                });
            }
            self.release_consumer(old);
            self.effects.push(Effect::EndConsumer {
                connection: old,
                outcome: RunStatus::Aborted,
                reason: format!(
                    "replaced by a newer Consume stream for drafter {drafter_id:?}: this one stalled (a lease expired without an ack, nack or extension)"
                ),
                summary: self.summary(),
            });
        }
        let connection = self.allocate_connection();
        let entry = self
            .drafters
            .entry(drafter_id.to_string())
            .or_insert_with(|| DrafterEntry {
                connection: None,
                credit,
                leases: BTreeSet::new(),
                leased_bytes: 0,
                delivered_items: 0,
                acked_items: 0,
                nacked_items: 0,
                expired_leases: 0,
                last_seen: now,
                stats: None,
                stalled: false,
            });
        entry.connection = Some(connection);
        entry.credit = credit;
        entry.last_seen = now;
        entry.stalled = false;
        self.consumer_connections
            .insert(connection, drafter_id.to_string());
        self.forget_old_drafters();
        match self.state {
            BrokerState::Complete | BrokerState::Aborted => self.end_consumer(connection),
            BrokerState::Running | BrokerState::Draining => self.dispatch(now),
        }
        Ok(connection)
    }

    pub fn set_credit(&mut self, connection: ConnectionId, credit: Credit, now: Instant) {
        if let Some(entry) = self.drafter_of_connection(connection) {
            entry.credit = credit;
            entry.last_seen = now;
            self.dispatch(now);
        }
    }

    /// Takes a drafter's stats from its current stream, or from its stream
    /// that was sent end-of-stream (the stats of its last step come after
    /// the commit that ended the run) until the drafter closes that
    /// stream's request side ([`Queue::consumer_requests_ended`]), while it
    /// has no newer stream.
    pub fn consumer_stats(&mut self, connection: ConnectionId, stats: ConsumerStats, now: Instant) {
        if let Some(entry) = self.drafter_of_connection(connection) {
            entry.stats = Some(stats);
            entry.last_seen = now;
            return;
        }
        let Some(drafter_id) = self.ended_consumers.get(&connection) else {
            return;
        };
        if let Some(entry) = self.drafters.get_mut(drafter_id) {
            if entry.connection.is_none() {
                entry.stats = Some(stats);
            }
        }
    }

    /// Acks deliveries this stream holds; others are counted as stale.
    pub fn ack(
        &mut self,
        connection: ConnectionId,
        delivery_ids: &[DeliveryId],
        now: Instant,
    ) -> AckOutcome {
        let mut outcome = AckOutcome::default();
        for &delivery_id in delivery_ids {
            match self.take_lease(connection, delivery_id) {
                Some(item_id) => {
                    if let Some(item) = self.items.remove(&item_id) {
                        self.acked_items += 1;
                        self.acked_bytes += item.bytes;
                        self.acked_rate
                            .record(now, self.acked_items, self.acked_bytes);
                        self.record(JournalEntry::Acked {
                            target_id: item.target_id,
                            seq: item.seq,
                        });
                        if let Some(entry) = self.drafter_of_connection(connection) {
                            entry.acked_items += 1;
                        }
                    }
                    outcome.acked += 1;
                }
                None => outcome.stale += 1,
            }
        }
        self.consumer_alive(connection, now);
        self.dispatch(now);
        outcome
    }

    /// Returns deliveries to the queue (or dead-letters them). Ids the stream
    /// does not hold are ignored and counted as stale.
    pub fn nack(
        &mut self,
        connection: ConnectionId,
        delivery_ids: &[DeliveryId],
        disposition: NackDisposition,
        reason: &str,
        now: Instant,
    ) -> AckOutcome {
        let mut outcome = AckOutcome::default();
        let mut returned = Vec::new();
        for &delivery_id in delivery_ids {
            match self.take_lease(connection, delivery_id) {
                Some(item_id) => {
                    outcome.acked += 1;
                    if let Some(entry) = self.drafter_of_connection(connection) {
                        entry.nacked_items += 1;
                    }
                    match disposition {
                        NackDisposition::Requeue => returned.push(item_id),
                        NackDisposition::DeadLetter => self.dead_letter(
                            item_id,
                            format!("nacked as bad by the drafter: {reason}"),
                        ),
                    }
                }
                None => outcome.stale += 1,
            }
        }
        self.return_to_head(returned, reason);
        self.consumer_alive(connection, now);
        self.dispatch(now);
        outcome
    }

    /// Renews leases of this stream (all of them when `delivery_ids` is empty).
    pub fn extend_leases(
        &mut self,
        connection: ConnectionId,
        delivery_ids: &[DeliveryId],
        now: Instant,
    ) {
        let deadline = now + self.config.lease_timeout;
        if !self.consumer_alive(connection, now) {
            return;
        }
        let Some(entry) = self.drafter_of_connection(connection) else {
            return;
        };
        let held: Vec<DeliveryId> = if delivery_ids.is_empty() {
            entry.leases.iter().copied().collect()
        } else {
            delivery_ids.to_vec()
        };
        for delivery_id in held {
            let Some(lease) = self.leases.get(&delivery_id) else {
                continue;
            };
            if lease.connection != connection {
                continue;
            }
            let extended = match self.config.max_lease_lifetime {
                Some(_) => deadline.min(lease.expires_at_latest),
                None => deadline,
            };
            self.set_lease_deadline(delivery_id, extended);
        }
        self.debug_check_invariants();
    }

    /// A consumer stream ended: all its leases go back to the head of the
    /// queue at once. Idempotent.
    pub fn close_consumer(&mut self, connection: ConnectionId, now: Instant) {
        if self.consumer_connections.contains_key(&connection) {
            self.release_consumer(connection);
            self.dispatch(now);
        }
    }

    /// Nothing more comes from a consumer stream (its request side ended):
    /// stats sent after its end-of-stream are no longer taken.
    pub fn consumer_requests_ended(&mut self, connection: ConnectionId) {
        self.ended_consumers.remove(&connection);
    }

    /// The drafter a consumer stream belongs to, while that stream is its current one.
    pub(super) fn drafter_of_connection(
        &mut self,
        connection: ConnectionId,
    ) -> Option<&mut DrafterEntry> {
        let drafter_id = self.consumer_connections.get(&connection)?;
        let entry = self.drafters.get_mut(drafter_id)?;
        (entry.connection == Some(connection)).then_some(entry)
    }

    /// The consumer acked, nacked or extended: it is seen now and no longer
    /// stalled. False when the connection is not current.
    pub(super) fn consumer_alive(&mut self, connection: ConnectionId, now: Instant) -> bool {
        match self.drafter_of_connection(connection) {
            Some(entry) => {
                entry.last_seen = now;
                entry.stalled = false;
                true
            }
            None => false,
        }
    }

    /// Returns a consumer's leases to the queue and marks it disconnected.
    pub(super) fn release_consumer(&mut self, connection: ConnectionId) {
        let Some(drafter_id) = self.consumer_connections.get(&connection).cloned() else {
            return;
        };
        let held: Vec<DeliveryId> = match self.drafters.get(&drafter_id) {
            Some(entry) if entry.connection == Some(connection) => {
                entry.leases.iter().copied().collect()
            }
            _ => Vec::new(),
        };
        let mut returned = Vec::new();
        for delivery_id in held {
            if let Some(item_id) = self.take_lease(connection, delivery_id) {
                returned.push(item_id);
            }
        }
        self.return_to_head(returned, "drafter disconnected");
        if let Some(entry) = self.drafters.get_mut(&drafter_id) {
            if entry.connection == Some(connection) {
                entry.connection = None;
            }
        }
        self.consumer_connections.remove(&connection);
    }

    pub(super) fn forget_old_drafters(&mut self) {
        let disconnected: Vec<(Instant, String)> = self
            .drafters
            .iter()
            .filter(|(_, entry)| entry.connection.is_none())
            .map(|(drafter_id, entry)| (entry.last_seen, drafter_id.clone()))
            .collect();
        if disconnected.len() > MAX_REMEMBERED_DISCONNECTED_DRAFTERS {
            let mut oldest_first = disconnected;
            oldest_first.sort();
            let excess = oldest_first.len() - MAX_REMEMBERED_DISCONNECTED_DRAFTERS;
            for (_, drafter_id) in oldest_first.into_iter().take(excess) {
                self.drafters.remove(&drafter_id);
            }
        }
    }
}
