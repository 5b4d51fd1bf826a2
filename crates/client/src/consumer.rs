//! A drafter's Consume stream. Deliveries arrive through [`Consumer::next`];
//! acks, nacks, credit and stats go out through a [`ConsumerHandle`], whose
//! methods are synchronous so a training thread can ack after its step.

use dflash_proto::frames::{Copies, PieceBody};
use dflash_proto::v1 as proto;
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::wire::{self, ResponseMessages};
use crate::ClientError;

/// What the broker sent next.
#[derive(Debug, Clone)]
pub enum ConsumerEvent {
    Delivery(proto::Delivery),
    /// The last message: the run is COMPLETE or ABORTED.
    EndOfStream(proto::EndOfStream),
}

/// Sends acks, nacks, credit, stats and lease extensions on a Consume stream.
/// Cloneable and usable from any thread; sends never block. Returns false
/// once the stream is gone (the broker then returns unacked leases itself).
#[derive(Clone)]
pub struct ConsumerHandle {
    requests: mpsc::UnboundedSender<proto::ConsumeRequest>,
}

impl ConsumerHandle {
    fn send(&self, kind: proto::consume_request::Kind) -> bool {
        self.requests
            .send(proto::ConsumeRequest { kind: Some(kind) })
            .is_ok()
    }

    pub fn ack(&self, delivery_ids: Vec<u64>) -> bool {
        self.send(proto::consume_request::Kind::Ack(proto::Ack {
            delivery_ids,
        }))
    }

    pub fn nack(
        &self,
        delivery_ids: Vec<u64>,
        reason: String,
        disposition: proto::NackDisposition,
    ) -> bool {
        self.send(proto::consume_request::Kind::Nack(proto::Nack {
            delivery_ids,
            reason,
            disposition: disposition as i32,
        }))
    }

    pub fn set_credit(&self, credit: proto::Credit) -> bool {
        self.send(proto::consume_request::Kind::Credit(credit))
    }

    pub fn send_stats(&self, stats: proto::ConsumerStats) -> bool {
        self.send(proto::consume_request::Kind::Stats(stats))
    }

    /// Renews these leases (all of this stream's when empty).
    pub fn extend_leases(&self, delivery_ids: Vec<u64>) -> bool {
        self.send(proto::consume_request::Kind::ExtendLeases(
            proto::ExtendLeases { delivery_ids },
        ))
    }
}

pub struct Consumer {
    drafter_id: String,
    welcome: proto::ConsumerWelcome,
    handle: ConsumerHandle,
    responses: ResponseMessages,
    ended: bool,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Consumer")
            .field("drafter_id", &self.drafter_id)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// Opens the stream on `channel`. Deliveries are decoded from the
    /// received frames (`wire`): a tensor that arrived within one frame is
    /// a view on it, one that spanned frames is joined once.
    pub(crate) async fn open(
        mut channel: crate::AuthChannel,
        drafter_id: &str,
        credit: proto::Credit,
        run_id: &str,
        max_message_bytes: usize,
    ) -> Result<Self, ClientError> {
        let (requests, receiver) = mpsc::unbounded_channel();
        let hello = proto::ConsumeRequest {
            kind: Some(proto::consume_request::Kind::Hello(proto::ConsumerHello {
                drafter_id: drafter_id.to_string(),
                credit: Some(credit),
                run_id: run_id.to_string(),
            })),
        };
        let _ = requests.send(hello);
        let body = PieceBody::request(
            tokio_stream::wrappers::UnboundedReceiverStream::new(receiver).map(Ok),
            |request: proto::ConsumeRequest| wire::whole(&request),
        );
        let mut responses = wire::call(
            &mut channel,
            wire::CONSUME_PATH,
            tonic::body::Body::new(body),
            max_message_bytes,
        )
        .await
        .map_err(|status| ClientError::Call {
            call: "Consume",
            status,
        })?;
        let welcome = match responses.message::<proto::ConsumeResponse>().await {
            Ok(Some(proto::ConsumeResponse {
                kind: Some(proto::consume_response::Kind::Welcome(welcome)),
            })) => welcome,
            Ok(other) => {
                return Err(ClientError::Protocol {
                    stream: "Consume",
                    detail: format!("expected welcome, got {other:?}"),
                })
            }
            Err(status) => {
                return Err(ClientError::Call {
                    call: "Consume",
                    status,
                })
            }
        };
        Ok(Consumer {
            drafter_id: drafter_id.to_string(),
            welcome,
            handle: ConsumerHandle { requests },
            responses,
            ended: false,
        })
    }

    pub fn drafter_id(&self) -> &str {
        &self.drafter_id
    }

    /// The broker's welcome: the run summary so far and the lease timeout.
    pub fn welcome(&self) -> &proto::ConsumerWelcome {
        &self.welcome
    }

    pub fn handle(&self) -> ConsumerHandle {
        self.handle.clone()
    }

    /// How the tensors received so far came out: views on the frame they
    /// arrived in, or joined once from several frames.
    pub fn copies(&self) -> Copies {
        self.responses.copies()
    }

    /// The next delivery, or the end-of-stream. An error means the stream
    /// broke without end-of-stream (the broker went away): reconnect.
    pub async fn next(&mut self) -> Result<ConsumerEvent, ClientError> {
        if self.ended {
            return Err(ClientError::StreamEnded {
                stream: "Consume",
                detail: "after end-of-stream".to_string(),
            });
        }
        loop {
            match self.responses.message::<proto::ConsumeResponse>().await {
                Ok(Some(response)) => match response.kind {
                    Some(proto::consume_response::Kind::Delivery(delivery)) => {
                        return Ok(ConsumerEvent::Delivery(delivery))
                    }
                    Some(proto::consume_response::Kind::EndOfStream(end)) => {
                        self.ended = true;
                        return Ok(ConsumerEvent::EndOfStream(end));
                    }
                    Some(proto::consume_response::Kind::Welcome(_)) | None => continue,
                },
                Ok(None) => {
                    return Err(ClientError::StreamEnded {
                        stream: "Consume",
                        detail: "no end-of-stream was sent".to_string(),
                    })
                }
                Err(status) => {
                    return Err(ClientError::Call {
                        call: "Consume",
                        status,
                    })
                }
            }
        }
    }
}
