//! The Produce and Consume routes without copying payloads: a tensor's
//! bytes leave for the drafter's HTTP/2 stream from the very memory h2
//! received them into from the producer's.
//!
//! tonic would copy each payload twice inside the broker: it assembles every
//! received message from its DATA frames into one decode buffer, and it
//! encodes every outgoing message into one buffer. These routes serve
//! `/dflash.v1.Broker/Produce` and `/dflash.v1.Broker/Consume` themselves
//! and hand the messages to the same handlers ([`BrokerService`]'s
//! `open_produce` and `open_consume`, which the generated trait methods
//! call too):
//! - Produce: the request body is read as gRPC messages made of slices of
//!   the received frames ([`MessageReader`]), each decoded by
//!   [`decode_produce_request`] so every large tensor's data stays those
//!   slices (one when it came in one frame, several when it spanned
//!   frames: never joined). Responses are small, one buffer each.
//! - Consume: the request stream is decoded by tonic (small messages); each
//!   delivery goes out as the gRPC prefix and small fields in buffers with
//!   every slice of every large payload as its own chunk ([`grpc_frame`]).
//!
//! The wire format is prost's, byte for byte (tested), so any gRPC client
//! or server on the other end reads and writes it. Every other method goes
//! to the generated server unchanged.

use crate::roles::Principal;
use crate::rpc_error::RpcError;
use dflash_proto::fields::{
    CONSUME_RESPONSE_DELIVERY, DELIVERY_COUNT, DELIVERY_ID, DELIVERY_SAMPLE, DELIVERY_SEQ,
    DELIVERY_TARGET_ID, DELIVERY_TRACE_CONTEXT,
};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes};
use dflash_proto::frames::{self, Direction, MessageReader, PieceBody, Pieces};
use dflash_proto::v1 as proto;
use dflash_proto::v1::broker_server::BrokerServer;
use prost::encoding::{self, WireType};
use tonic::body::Body;
use tonic::codec::Streaming;
use tonic::server::NamedService;
use tonic::Status;
use tower::Service;

use crate::payload::{decode_produce_request, trace_context_len, ProduceIn, WireItem};
use crate::queue::Delivery;
use crate::service::{BrokerService, ConsumeOut};

pub use dflash_proto::frames::LARGE_PAYLOAD_BYTES as ZERO_COPY_MIN_BYTES;

const PRODUCE_PATH: &str = "/dflash.v1.Broker/Produce";
const CONSUME_PATH: &str = "/dflash.v1.Broker/Consume";

/// One outgoing Consume message as a gRPC frame in pieces: a delivery with
/// every large payload slice as its own piece (shared with the queue), any
/// other message in one buffer.
pub fn grpc_frame(message: ConsumeOut) -> Result<Vec<Bytes>, Status> {
    match message {
        ConsumeOut::Delivery(delivery) => encode_delivery(&delivery),
        ConsumeOut::Message(message) => Ok(vec![Pieces::whole(&message)?]),
    }
}

/// prost's encoding of `ConsumeResponse { delivery }`, written field by
/// field in field-number order, leaving out proto3 defaults as prost does.
fn encode_delivery(delivery: &Delivery<Arc<WireItem>>) -> Result<Vec<Bytes>, Status> {
    let item = &delivery.payload;
    let target_id = delivery.target_id.as_bytes();
    let mut length = 0;
    if delivery.delivery_id != 0 {
        length += encoding::uint64::encoded_len(DELIVERY_ID, &delivery.delivery_id);
    }
    if !target_id.is_empty() {
        length += frames::delimited_len(DELIVERY_TARGET_ID, target_id.len());
    }
    if delivery.seq != 0 {
        length += encoding::uint64::encoded_len(DELIVERY_SEQ, &delivery.seq);
    }
    if let Some(sample) = &item.sample {
        length += frames::delimited_len(DELIVERY_SAMPLE, sample.encoded_len());
    }
    if delivery.delivery_count != 0 {
        length += encoding::uint32::encoded_len(DELIVERY_COUNT, &delivery.delivery_count);
    }
    length += trace_context_len(DELIVERY_TRACE_CONTEXT, &item.trace_context);

    let mut pieces = Pieces::message(frames::delimited_len(CONSUME_RESPONSE_DELIVERY, length))?;
    let buffer = pieces.buffer();
    buffer.reserve(64 + target_id.len());
    encoding::encode_key(CONSUME_RESPONSE_DELIVERY, WireType::LengthDelimited, buffer);
    encoding::encode_varint(length as u64, buffer);
    if delivery.delivery_id != 0 {
        encoding::uint64::encode(DELIVERY_ID, &delivery.delivery_id, buffer);
    }
    if !target_id.is_empty() {
        encoding::encode_key(DELIVERY_TARGET_ID, WireType::LengthDelimited, buffer);
        encoding::encode_varint(target_id.len() as u64, buffer);
        buffer.put_slice(target_id);
    }
    if delivery.seq != 0 {
        encoding::uint64::encode(DELIVERY_SEQ, &delivery.seq, buffer);
    }
    if let Some(sample) = &item.sample {
        sample.encode(DELIVERY_SAMPLE, &mut pieces)?;
    }
    let buffer = pieces.buffer();
    if delivery.delivery_count != 0 {
        encoding::uint32::encode(DELIVERY_COUNT, &delivery.delivery_count, buffer);
    }
    crate::payload::encode_trace_context(DELIVERY_TRACE_CONTEXT, &item.trace_context, buffer);
    Ok(pieces.finish())
}

/// `dflash.v1.Broker` with its Produce and Consume routes served here and
/// every other method by the generated server.
#[derive(Clone)]
pub struct BrokerRoutes {
    service: BrokerService,
    generated: BrokerServer<BrokerService>,
    message_limit: usize,
}

impl BrokerRoutes {
    pub fn new(service: BrokerService, message_limit: usize) -> Self {
        // The generated server answers everything but the two streaming
        // routes above: unary calls and WatchStatus, control messages only.
        let generated = BrokerServer::new(service.clone())
            .max_decoding_message_size(dflash_proto::transport::CONTROL_MESSAGE_BYTES)
            .max_encoding_message_size(message_limit);
        BrokerRoutes {
            service,
            generated,
            message_limit,
        }
    }
}

impl NamedService for BrokerRoutes {
    const NAME: &'static str = <BrokerServer<BrokerService> as NamedService>::NAME;
}

type RouteFuture =
    Pin<Box<dyn std::future::Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

/// A gRPC response carrying `body`'s messages.
fn grpc_response(body: Body) -> http::Response<Body> {
    let mut response = http::Response::new(body);
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

/// Refuses a compressed request stream the way tonic's generated server
/// does when it accepts no compression: UNIMPLEMENTED, naming the encoding.
fn refuse_compression(headers: &http::HeaderMap) -> Result<(), RpcError> {
    match headers.get("grpc-encoding") {
        Some(encoding) if encoding != "identity" => Err(RpcError::CompressedStream {
            encoding: encoding.clone(),
        }),
        _ => Ok(()),
    }
}

impl BrokerRoutes {
    fn produce(&self, request: http::Request<Body>) -> RouteFuture {
        let service = self.service.clone();
        let message_limit = self.message_limit;
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            if let Err(error) = refuse_compression(&parts.headers) {
                return Ok(Status::from(error).into_http());
            }
            let principal = Principal::of(&parts.extensions);
            let mut decoded = 0u64;
            let inbound = futures::StreamExt::map(
                MessageReader::new(body, Direction::Request, message_limit),
                move |message| {
                    let message = message?;
                    decoded += 1;
                    decode_produce_request(message).map_err(|failure| {
                        Status::from(RpcError::InvalidProduceMessage {
                            message_number: decoded,
                            failure,
                        })
                    })
                },
            );
            let inbound: Pin<Box<dyn futures::Stream<Item = Result<ProduceIn, Status>> + Send>> =
                Box::pin(inbound);
            match service.open_produce(inbound, principal).await {
                Ok(answers) => Ok(grpc_response(Body::new(PieceBody::response(
                    answers,
                    |answer: proto::ProduceResponse| Ok(vec![Pieces::whole(&answer)?]),
                )))),
                Err(status) => Ok(status.into_http()),
            }
        })
    }

    fn consume(&self, request: http::Request<Body>) -> RouteFuture {
        let service = self.service.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            if let Err(error) = refuse_compression(&parts.headers) {
                return Ok(Status::from(error).into_http());
            }
            let principal = Principal::of(&parts.extensions);
            // A drafter sends only control messages (acks, nacks, credit,
            // stats): their own small limit, not an item's.
            let requests = Streaming::new_request(
                tonic_prost::ProstDecoder::<proto::ConsumeRequest>::default(),
                body,
                None,
                Some(dflash_proto::transport::CONTROL_MESSAGE_BYTES),
            );
            match service.open_consume(requests, principal).await {
                Ok(outgoing) => Ok(grpc_response(Body::new(PieceBody::response(
                    outgoing, grpc_frame,
                )))),
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}

impl Service<http::Request<Body>> for BrokerRoutes {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = RouteFuture;

    fn poll_ready(&mut self, _context: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> RouteFuture {
        match request.uri().path() {
            PRODUCE_PATH => self.produce(request),
            CONSUME_PATH => self.consume(request),
            _ => {
                let mut generated = self.generated.clone();
                Box::pin(async move { generated.call(request).await })
            }
        }
    }
}

#[cfg(test)]
mod tests;
