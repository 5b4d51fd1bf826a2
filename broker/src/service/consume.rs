//! A Consume stream on the broker: the hello and its welcome, and the
//! reader task that applies a drafter's acks, nacks, credit, lease
//! extensions and stats.

use crate::roles::{Principal, Role};

use dflash_proto::v1 as proto;
use tonic::{Status, Streaming};
use tracing::{debug, info, warn};

use crate::convert::{self};
use crate::queue::{ConnectionId, QueueError};
use crate::rpc_error::RpcError;

use super::{
    check_run_id, first_message, is_oversized_message, next_request, validate_id, BrokerService,
    ConnectionGuard, ConsumeOut, GuardedStream, Outgoing, StreamKind,
};

impl BrokerService {
    /// Opens a Consume stream: the hello, the welcome, then a reader task
    /// for acks and credit; deliveries leave through the returned stream.
    pub(crate) async fn open_consume(
        &self,
        mut inbound: Streaming<proto::ConsumeRequest>,
        principal: Principal,
    ) -> Result<GuardedStream<ConsumeOut>, Status> {
        let hello = match first_message(&mut inbound, self.shared.config.hello_timeout)
            .await?
            .kind
        {
            Some(proto::consume_request::Kind::Hello(hello)) => hello,
            _ => {
                return Err(RpcError::FirstMessageNotHello {
                    stream: "Consume",
                    id_field: "drafter_id",
                }
                .into())
            }
        };
        validate_id("drafter_id", &hello.drafter_id)?;
        principal.authorize(Role::Drafter, &hello.drafter_id, "Consume")?;
        check_run_id(
            &format!("drafter {:?}", hello.drafter_id),
            &hello.run_id,
            &self.shared.run_id,
        )?;
        let credit = convert::credit_from_proto(hello.credit);
        let (outbox, stream, _unread) = super::outbox::outbox();
        let lease_timeout_ms =
            u64::try_from(self.shared.config.lease_timeout.as_millis()).unwrap_or(u64::MAX);
        let connection = self
            .shared
            .with_queue(|locked, now| {
                let welcome = proto::consume_response::Kind::Welcome(proto::ConsumerWelcome {
                    summary: Some(convert::summary_to_proto(&locked.queue.summary())),
                    lease_timeout_ms,
                    run_id: self.shared.run_id.clone(),
                });
                let message = ConsumeOut::Message(proto::ConsumeResponse {
                    kind: Some(welcome),
                });
                locked.post(Outgoing::Consumer(outbox.clone(), Ok(message)));
                let connection = locked.queue.open_consumer(&hello.drafter_id, credit, now)?;
                locked.consumer_outboxes.insert(connection, outbox);
                Ok::<_, QueueError>(connection)
            })
            .inspect_err(
                |error| warn!(drafter_id = %hello.drafter_id, %error, "Consume hello refused"),
            )?;
        info!(drafter_id = %hello.drafter_id, connection, credit_items = credit.items, "drafter connected");
        self.shared.drafter_back(&hello.drafter_id);
        let guard = ConnectionGuard {
            shared: self.shared.clone(),
            connection,
            kind: StreamKind::Consumer,
        };
        self.shared
            .tasks
            .spawn(self.clone().read_consumer(connection, inbound));
        Ok(GuardedStream {
            inner: stream,
            _guard: guard,
        })
    }

    /// A Consume message over the control limit broke the stream: the
    /// drafter gets RESOURCE_EXHAUSTED with the limit (its leases go back
    /// when the stream closes).
    pub(super) fn refuse_oversized_control(&self, connection: ConnectionId, status: &Status) {
        let reason = RpcError::ControlMessageOverLimit {
            limit: dflash_proto::transport::CONTROL_MESSAGE_BYTES,
            detail: status.message().to_string(),
        };
        self.refuse_consumer(connection, reason.into());
    }

    /// Ends a Consume stream with `status` (the caller stops reading it;
    /// closing the consumer then returns its leases).
    fn refuse_consumer(&self, connection: ConnectionId, status: Status) {
        warn!(connection, reason = %status.message(), "Consume stream ended");
        self.shared.with_queue(|locked, _now| {
            if let Some(outbox) = locked.consumer_outboxes.remove(&connection) {
                locked.post(Outgoing::Consumer(outbox, Err(status)));
            }
        });
    }

    pub(super) async fn read_consumer(
        self,
        connection: ConnectionId,
        mut inbound: Streaming<proto::ConsumeRequest>,
    ) {
        let shared = self.shared.clone();
        loop {
            let request =
                match next_request(&shared.shutdown, &mut inbound, connection, "consumer").await {
                    Ok(Some(request)) => request,
                    Ok(None) => break,
                    Err(status) => {
                        if is_oversized_message(&status) {
                            self.refuse_oversized_control(connection, &status);
                        }
                        break;
                    }
                };
            use proto::consume_request::Kind;
            if let Some((what, ids)) = match &request.kind {
                Some(Kind::Ack(ack)) => Some(("Ack", ack.delivery_ids.len())),
                Some(Kind::Nack(nack)) => Some(("Nack", nack.delivery_ids.len())),
                Some(Kind::ExtendLeases(extend)) => {
                    Some(("ExtendLeases", extend.delivery_ids.len()))
                }
                _ => None,
            } {
                if ids > dflash_proto::transport::MAX_IDS_PER_MESSAGE {
                    self.refuse_consumer(
                        connection,
                        RpcError::TooManyDeliveryIds {
                            what,
                            ids,
                            limit: dflash_proto::transport::MAX_IDS_PER_MESSAGE,
                        }
                        .into(),
                    );
                    break;
                }
            }
            match request.kind {
                Some(Kind::Ack(ack)) => {
                    shared.with_queue(|locked, now| {
                        locked.queue.ack(connection, &ack.delivery_ids, now)
                    });
                }
                Some(Kind::Nack(nack)) => {
                    let disposition = convert::nack_disposition_from_proto(nack.disposition);
                    shared.with_queue(|locked, now| {
                        locked.queue.nack(
                            connection,
                            &nack.delivery_ids,
                            disposition,
                            &dflash_proto::transport::bounded_control_string(&nack.reason),
                            now,
                        )
                    });
                }
                Some(Kind::Credit(credit)) => shared.with_queue(|locked, now| {
                    locked.queue.set_credit(
                        connection,
                        convert::credit_from_proto(Some(credit)),
                        now,
                    )
                }),
                Some(Kind::Stats(stats)) => shared.with_queue(|locked, now| {
                    locked.queue.consumer_stats(
                        connection,
                        convert::consumer_stats_from_proto(stats),
                        now,
                    )
                }),
                Some(Kind::ExtendLeases(extend)) => shared.with_queue(|locked, now| {
                    locked
                        .queue
                        .extend_leases(connection, &extend.delivery_ids, now)
                }),
                Some(Kind::Hello(_)) | None => {
                    debug!(connection, "ignoring a repeated hello or empty message")
                }
            }
        }
        let gone = shared.with_queue(|locked, now| {
            locked.consumer_outboxes.remove(&connection);
            locked.queue.consumer_requests_ended(connection);
            locked.queue.close_consumer_of(connection, now)
        });
        shared.drafter_gone(gone);
    }
}
