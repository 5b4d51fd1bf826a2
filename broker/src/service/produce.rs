//! A Produce stream on the broker: the hello and its welcome (sent once
//! the new epoch is logged), the reader task that checks each item, waits
//! for room under `--max-queue-bytes` and accepts it, and the ways a
//! stream is refused or ended.

use crate::roles::{Principal, Role};
use std::sync::Arc;

use dflash_proto::v1 as proto;
use dflash_telemetry::TRACE_TARGET;
use tonic::Status;
use tracing::{info, warn, Instrument};

use crate::config::CapturedTensor;
use crate::convert;
use crate::payload::{ProduceIn, WireItem};
use crate::queue::{ConnectionId, QueueError, RejectReason};
use crate::rpc_error::RpcError;

use super::{
    check_run_id, first_message, is_oversized_message, next_request, validate_id, BrokerService,
    ConnectionGuard, GuardedStream, InboundProduce, Outgoing, StreamKind,
};

/// `--target-capture` as the welcome's `capture`: each tensor once, in the
/// proto's order, whatever the flag's order or repeats.
fn captured_tensors_to_proto(capture: &[CapturedTensor]) -> Vec<i32> {
    let mut values: Vec<i32> = capture
        .iter()
        .map(|tensor| match tensor {
            CapturedTensor::LastHiddenStates => proto::CapturedTensor::LastHiddenStates as i32,
        })
        .collect();
    values.sort_unstable();
    values.dedup();
    values
}

impl BrokerService {
    /// Opens a Produce stream on `inbound` (however it is decoded): the
    /// hello, the welcome, then a reader task accepting its items.
    pub(crate) async fn open_produce(
        &self,
        mut inbound: InboundProduce,
        principal: Principal,
    ) -> Result<GuardedStream<proto::ProduceResponse>, Status> {
        let hello = match first_message(&mut inbound, self.shared.config.hello_timeout).await? {
            ProduceIn::Hello(hello) => hello,
            _ => {
                return Err(RpcError::FirstMessageNotHello {
                    stream: "Produce",
                    id_field: "target_id",
                }
                .into())
            }
        };
        validate_id("target_id", &hello.target_id)?;
        principal.authorize(Role::Target, &hello.target_id, "Produce")?;
        check_run_id(
            &format!("target {:?}", hello.target_id),
            &hello.run_id,
            &self.shared.run_id,
        )?;
        let (outbox, stream, unread) = super::outbox::outbox();
        let (connection, epoch) = self.shared.with_queue(|locked, now| {
            let opened = locked.queue.open_producer(&hello.target_id, now)?;
            // Sent once the new epoch is durable (`finish_operation`).
            let welcome = proto::produce_response::Kind::Welcome(proto::ProducerWelcome {
                resume_after_seq: opened.resume_after_seq,
                accepted_items: opened.accepted_items,
                epoch: opened.epoch,
                run_id: self.shared.run_id.clone(),
                capture: captured_tensors_to_proto(&self.shared.config.target_capture),
            });
            let message = proto::ProduceResponse {
                kind: Some(welcome),
            };
            locked.post(Outgoing::Producer(outbox.clone(), Ok(message)));
            locked.producer_outboxes.insert(opened.connection, outbox);
            Ok::<_, QueueError>((opened.connection, opened.epoch))
        })?;
        info!(target_id = %hello.target_id, connection, epoch, "target connected");
        let guard = ConnectionGuard {
            shared: self.shared.clone(),
            connection,
            kind: StreamKind::Producer,
        };
        let target_id: Arc<str> = Arc::from(hello.target_id.as_str());
        self.shared.tasks.spawn(
            self.clone()
                .read_producer(target_id, connection, inbound, unread),
        );
        Ok(GuardedStream {
            inner: stream,
            _guard: guard,
        })
    }

    /// Validates a producer's item; the message names the bad value.
    pub(super) fn check_item(&self, item: &WireItem) -> Result<u64, (RejectReason, String)> {
        let Some(sample) = &item.sample else {
            return Err((
                RejectReason::Malformed,
                format!("item seq {} has no sample", item.seq),
            ));
        };
        sample.validate().map_err(|error| {
            (
                RejectReason::Malformed,
                format!("item seq {}: {error}", item.seq),
            )
        })?;
        item.check_trace_context().map_err(|error| {
            (
                RejectReason::Malformed,
                format!("item seq {}: {error}", item.seq),
            )
        })?;
        // Every byte the broker keeps for the item, not only its tensors'
        // data: an item of empty tensors with a large trace context counts.
        let bytes = item.held_bytes();
        if bytes > self.shared.config.max_item_bytes {
            return Err((
                RejectReason::TooLarge,
                format!(
                    "item seq {}: {bytes} bytes exceeds the limit of {} bytes",
                    item.seq, self.shared.config.max_item_bytes
                ),
            ));
        }
        Ok(bytes)
    }

    /// Reads a producer stream until it ends: accepts items (waiting for room
    /// without reading further while the queue is full), records stats.
    pub(super) async fn read_producer(
        self,
        target_id: Arc<str>,
        connection: ConnectionId,
        mut inbound: InboundProduce,
        unread: Arc<super::outbox::Unread>,
    ) {
        let shared = self.shared.clone();
        loop {
            // A producer that does not read its answers is not read either
            // (HTTP/2 flow control then holds it back) until half of what
            // waits for it is taken.
            if unread.count() > super::outbox::MAX_UNREAD_ANSWERS {
                tokio::select! {
                    () = unread.wait_for_at_most(super::outbox::MAX_UNREAD_ANSWERS / 2) => {}
                    () = shared.shutdown.cancelled() => break,
                }
            }
            let request =
                match next_request(&shared.shutdown, &mut inbound, connection, "producer").await {
                    Ok(Some(request)) => request,
                    Ok(None) => break,
                    Err(status) => {
                        if is_oversized_message(&status) {
                            self.refuse_oversized(&target_id, connection, &status);
                        } else {
                            self.end_broken_producer(&target_id, connection, status);
                        }
                        break;
                    }
                };
            match request {
                ProduceIn::Item(item) => {
                    if !self.accept_item(&target_id, connection, item).await {
                        break;
                    }
                }
                ProduceIn::Stats(stats) => shared.with_queue(|locked, now| {
                    locked.queue.producer_stats(
                        connection,
                        convert::producer_stats_from_proto(stats),
                        now,
                    )
                }),
                ProduceIn::Hello(_) | ProduceIn::Empty => {
                    shared.with_queue(|locked, now| {
                        locked.queue.count_rejected(
                            connection,
                            RejectReason::UnexpectedMessage,
                            now,
                        );
                        locked.send_to_producer(
                            connection,
                            proto::produce_response::Kind::Rejected(proto::ItemRejected {
                                seq: 0,
                                reason: "unexpected message: hello was already sent, expected an item or stats"
                                    .to_string(),
                            }),
                        );
                    });
                }
            }
        }
        shared.with_queue(|locked, now| {
            locked.remove_producer_outbox(connection);
            locked.queue.close_producer(connection, now);
        });
    }

    /// An item over the gRPC message limit broke the stream before its body
    /// was read: the target gets RESOURCE_EXHAUSTED with the limit (its
    /// stream cannot continue), and the rejection is counted and logged.
    pub(super) fn refuse_oversized(
        &self,
        target_id: &str,
        connection: ConnectionId,
        status: &Status,
    ) {
        let reason = RpcError::ItemOverLimit {
            max_item_bytes: self.shared.config.max_item_bytes,
            detail: status.message().to_string(),
        };
        warn!(target_id, connection, %reason, "item rejected; Produce stream ended");
        self.shared.with_queue(|locked, now| {
            locked
                .queue
                .count_rejected(connection, RejectReason::TooLarge, now);
            if let Some(outbox) = locked.remove_producer_outbox(connection) {
                locked.post(Outgoing::Producer(outbox, Err(reason.into())));
            }
        });
    }

    /// A Produce stream that broke on something other than an oversized
    /// message (a malformed message, a reset): the target gets that status
    /// as the stream's end, so it learns what was wrong. A stream the
    /// target reset itself is gone, and the status goes nowhere.
    pub(super) fn end_broken_producer(
        &self,
        target_id: &str,
        connection: ConnectionId,
        status: Status,
    ) {
        if matches!(
            status.code(),
            tonic::Code::InvalidArgument | tonic::Code::Internal
        ) {
            warn!(target_id, connection, %status, "malformed Produce stream; ended");
        }
        self.shared.with_queue(|locked, _now| {
            if let Some(outbox) = locked.remove_producer_outbox(connection) {
                locked.post(Outgoing::Producer(outbox, Err(status)));
            }
        });
    }

    /// Accepts one item; false when the stream must end (replaced, run over).
    /// The `enqueue` span joins the trace of the span that made the sample
    /// and lasts until the item is queued, so time spent waiting for room
    /// (backpressure) shows in the trace.
    pub(super) async fn accept_item(
        &self,
        target_id: &str,
        connection: ConnectionId,
        item: WireItem,
    ) -> bool {
        let span = tracing::debug_span!(
            target: TRACE_TARGET,
            "enqueue",
            target_id,
            seq = item.seq,
            connection,
            outcome = tracing::field::Empty,
        );
        if !span.is_disabled() {
            dflash_telemetry::set_parent_from(&span, &item.trace_context);
        }
        self.enqueue(connection, item).instrument(span).await
    }

    /// Queues one item of a producer's stream, waiting for room while the
    /// queue is full; answers the producer (accepted, duplicate or rejected)
    /// and records the outcome on the `enqueue` span. False when the stream
    /// must end.
    pub(super) async fn enqueue(&self, connection: ConnectionId, item: WireItem) -> bool {
        let shared = &self.shared;
        let seq = item.seq;
        let bytes = match self.check_item(&item) {
            Ok(bytes) => bytes,
            Err((reject_reason, reason)) => {
                self.reject_item(connection, seq, reject_reason, reason);
                return true;
            }
        };
        shared.received.record(&item);
        let payload = Arc::new(item);
        // Counted while this stream's reader holds the decoded item waiting
        // for room; a fenced or closed stream wakes it (see `with_queue`).
        let mut waiting = None;
        loop {
            let room = shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            let outcome = shared.with_queue(|locked, now| {
                locked.accept_and_answer(connection, seq, payload.clone(), now)
            });
            match outcome {
                Ok(accepted) => {
                    let outcome = if accepted.duplicate {
                        "duplicate"
                    } else {
                        "accepted"
                    };
                    tracing::Span::current().record("outcome", outcome);
                    return true;
                }
                Err(QueueError::QueueFull { .. }) => {
                    // Stop reading this stream until room is freed: HTTP/2
                    // flow control then holds the target back.
                    waiting.get_or_insert_with(|| shared.received.wait_for_room(bytes));
                    tokio::select! {
                        _ = shared.shutdown.cancelled() => return false,
                        _ = &mut room => {}
                    }
                }
                Err(QueueError::StaleConnection { .. } | QueueError::RunEnded { .. }) => {
                    tracing::Span::current().record("outcome", "stream_ended");
                    return false;
                }
                Err(_) => {
                    tracing::Span::current().record("outcome", "rejected");
                    return true;
                }
            }
        }
    }

    /// Rejects an item that failed [`Self::check_item`]: logs it, counts it
    /// and tells the producer why (its stream goes on).
    pub(super) fn reject_item(
        &self,
        connection: ConnectionId,
        seq: u64,
        reject_reason: RejectReason,
        reason: String,
    ) {
        warn!(connection, seq, %reason, "item rejected");
        tracing::Span::current().record("outcome", "rejected");
        self.shared.with_queue(|locked, now| {
            locked.queue.count_rejected(connection, reject_reason, now);
            locked.send_to_producer(
                connection,
                proto::produce_response::Kind::Rejected(proto::ItemRejected { seq, reason }),
            );
        });
    }
}
