//! The `Consume` route without copying payloads: deliveries go to the
//! drafter's HTTP/2 stream as the very `Bytes` the producer's item arrived
//! in.
//!
//! tonic encodes every outgoing message into one contiguous buffer, which
//! copies each 16 MiB payload once more per delivery (and, before
//! [`dflash_proto::codec`], twice). This route serves
//! `/dflash.v1.Broker/Consume` itself: the request stream is decoded by
//! tonic as usual and handed to the same [`Broker::consume`] handler; only
//! the response body differs. Each `ConsumeResponse` becomes the gRPC
//! length prefix and the message's small fields in one buffer, with every
//! large tensor passed through as its own chunk ([`grpc_frame`]),
//! so h2 sends the payload straight from the queue's memory. The wire
//! format is prost's, byte for byte (tested), so any gRPC client reads it.
//!
//! Every other method goes to the generated server unchanged.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use dflash_proto::v1 as proto;
use dflash_proto::v1::broker_server::{Broker, BrokerServer};
use futures::Stream;
use http_body::Frame;
use prost::encoding::{self, WireType};
use prost::Message;
use tonic::body::Body;
use tonic::codec::Streaming;
use tonic::server::NamedService;
use tonic::Status;
use tower::Service;

use crate::service::BrokerService;

/// `bytes` fields at least this long travel as their own chunk; shorter
/// ones are copied into the message's buffer (a chunk costs more than a
/// small copy).
pub const ZERO_COPY_MIN_BYTES: usize = 16 << 10;

const CONSUME_PATH: &str = "/dflash.v1.Broker/Consume";

/// Encodes one `ConsumeResponse` as a gRPC frame (uncompressed flag,
/// big-endian length, prost's encoding) in pieces: every tensor's `data` of
/// at least [`ZERO_COPY_MIN_BYTES`] is its own piece, sharing the queue's
/// memory; everything else is copied into small buffers between them.
///
/// prost writes a message's fields in tag order, and proto3 leaves out
/// default values, so a copy of a message with only some fields set encodes
/// to exactly those fields' bytes. A `Delivery` is written as its fields
/// 1-3, its `sample` (each tensor's fields 1-3, then the `data` field by
/// hand), then fields 5-6; the test checks the result is prost's own
/// encoding byte for byte.
pub fn grpc_frame(message: &proto::ConsumeResponse) -> Result<Vec<Bytes>, Status> {
    let length = message.encoded_len();
    let length = u32::try_from(length).map_err(|_| {
        Status::resource_exhausted(format!(
            "a message of {length} bytes does not fit one gRPC frame"
        ))
    })?;
    let mut pieces = Pieces::default();
    pieces.current.put_u8(0);
    pieces.current.put_u32(length);
    match &message.kind {
        Some(proto::consume_response::Kind::Delivery(delivery)) => {
            encode_delivery(delivery, &mut pieces)?;
        }
        _ => encode_into(message, &mut pieces.current)?,
    }
    Ok(pieces.finish())
}

/// Pieces of one frame: finished ones, and the small buffer being filled.
#[derive(Debug, Default)]
struct Pieces {
    finished: Vec<Bytes>,
    current: BytesMut,
}

impl Pieces {
    fn pass_through(&mut self, bytes: &Bytes) {
        if !self.current.is_empty() {
            self.finished.push(self.current.split().freeze());
        }
        self.finished.push(bytes.clone());
    }

    fn finish(mut self) -> Vec<Bytes> {
        if !self.current.is_empty() {
            self.finished.push(self.current.split().freeze());
        }
        self.finished
    }
}

/// prost's encoding appended to a growable buffer (which never runs out of
/// room, so this fails only on a broken invariant).
fn encode_into(message: &impl Message, buffer: &mut BytesMut) -> Result<(), Status> {
    message
        .encode(buffer)
        .map_err(|error| Status::internal(format!("encoding a delivery: {error}")))
}

/// `ConsumeResponse.delivery` (field 2) with its payloads passed through.
fn encode_delivery(delivery: &proto::Delivery, pieces: &mut Pieces) -> Result<(), Status> {
    const CONSUME_RESPONSE_DELIVERY: u32 = 2;
    const DELIVERY_SAMPLE: u32 = 4;
    const SAMPLE_TENSORS: u32 = 1;
    const TENSOR_DATA: u32 = 4;
    let buffer = &mut pieces.current;
    encoding::encode_key(CONSUME_RESPONSE_DELIVERY, WireType::LengthDelimited, buffer);
    encoding::encode_varint(delivery.encoded_len() as u64, buffer);
    let head = proto::Delivery {
        delivery_id: delivery.delivery_id,
        target_id: delivery.target_id.clone(),
        seq: delivery.seq,
        ..Default::default()
    };
    encode_into(&head, buffer)?;
    if let Some(sample) = &delivery.sample {
        encoding::encode_key(
            DELIVERY_SAMPLE,
            WireType::LengthDelimited,
            &mut pieces.current,
        );
        encoding::encode_varint(sample.encoded_len() as u64, &mut pieces.current);
        for tensor in &sample.tensors {
            let buffer = &mut pieces.current;
            encoding::encode_key(SAMPLE_TENSORS, WireType::LengthDelimited, buffer);
            encoding::encode_varint(tensor.encoded_len() as u64, buffer);
            let header = proto::Tensor {
                name: tensor.name.clone(),
                dtype: tensor.dtype,
                shape: tensor.shape.clone(),
                data: Bytes::new(),
            };
            encode_into(&header, buffer)?;
            if tensor.data.is_empty() {
                continue;
            }
            encoding::encode_key(TENSOR_DATA, WireType::LengthDelimited, buffer);
            encoding::encode_varint(tensor.data.len() as u64, buffer);
            if tensor.data.len() >= ZERO_COPY_MIN_BYTES {
                pieces.pass_through(&tensor.data);
            } else {
                buffer.extend_from_slice(&tensor.data);
            }
        }
    }
    let tail = proto::Delivery {
        delivery_count: delivery.delivery_count,
        trace_context: delivery.trace_context.clone(),
        ..Default::default()
    };
    encode_into(&tail, &mut pieces.current)
}

/// The response body of a Consume stream: the handler's messages as gRPC
/// frames (in pieces), then the status in trailers.
struct PieceBody<S> {
    messages: Pin<Box<S>>,
    pending: VecDeque<Bytes>,
    finished: bool,
}

impl<S> http_body::Body for PieceBody<S>
where
    S: Stream<Item = Result<proto::ConsumeResponse, Status>> + Send,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        loop {
            if let Some(piece) = self.pending.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(piece))));
            }
            if self.finished {
                return Poll::Ready(None);
            }
            let status = match self.messages.as_mut().poll_next(context) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(message))) => match grpc_frame(&message) {
                    Ok(pieces) => {
                        self.pending.extend(pieces);
                        continue;
                    }
                    Err(status) => status,
                },
                Poll::Ready(Some(Err(status))) => status,
                Poll::Ready(None) => Status::ok(""),
            };
            self.finished = true;
            let mut trailers = http::HeaderMap::new();
            if let Err(status) = status.add_header(&mut trailers) {
                tracing::warn!(%status, "a Consume status could not be written as trailers");
            }
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished && self.pending.is_empty()
    }
}

/// `dflash.v1.Broker` with its Consume route served by [`PieceBody`] and
/// every other method by the generated server.
#[derive(Clone)]
pub struct BrokerRoutes {
    service: BrokerService,
    generated: BrokerServer<BrokerService>,
    message_limit: usize,
}

impl BrokerRoutes {
    pub fn new(service: BrokerService, message_limit: usize) -> Self {
        let generated = BrokerServer::new(service.clone())
            .max_decoding_message_size(message_limit)
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

impl Service<http::Request<Body>> for BrokerRoutes {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = RouteFuture;

    fn poll_ready(&mut self, _context: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> RouteFuture {
        if request.uri().path() != CONSUME_PATH {
            let mut generated = self.generated.clone();
            return Box::pin(async move { generated.call(request).await });
        }
        let service = self.service.clone();
        let message_limit = self.message_limit;
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let requests = Streaming::new_request(
                tonic_prost::ProstDecoder::<proto::ConsumeRequest>::default(),
                body,
                None,
                Some(message_limit),
            );
            let request = tonic::Request::from_http(http::Request::from_parts(parts, requests));
            let response = match Broker::consume(&service, request).await {
                Ok(response) => response,
                Err(status) => return Ok(status.into_http()),
            };
            let (metadata, messages, extensions) = response.into_parts();
            let body = PieceBody {
                messages: Box::pin(messages),
                pending: VecDeque::new(),
                finished: false,
            };
            let mut http_response = http::Response::new(Body::new(body));
            *http_response.headers_mut() = metadata.into_headers();
            *http_response.extensions_mut() = extensions;
            http_response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            Ok(http_response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(payload: Bytes) -> proto::ConsumeResponse {
        proto::ConsumeResponse {
            kind: Some(proto::consume_response::Kind::Delivery(proto::Delivery {
                delivery_id: 9,
                target_id: "target-3".into(),
                seq: 41,
                sample: Some(proto::Sample {
                    tensors: vec![
                        proto::Tensor::from_parts(
                            "input_ids",
                            proto::Dtype::I32,
                            vec![4],
                            Bytes::from(vec![1u8; 16]),
                        ),
                        proto::Tensor::from_parts(
                            "hidden_states",
                            proto::Dtype::U8,
                            vec![payload.len() as u64],
                            payload,
                        ),
                    ],
                }),
                delivery_count: 2,
                trace_context: [("traceparent".to_string(), "00-ab-cd-01".to_string())]
                    .into_iter()
                    .collect(),
            })),
        }
    }

    fn joined(pieces: &[Bytes]) -> Vec<u8> {
        pieces
            .iter()
            .flat_map(|piece| piece.iter().copied())
            .collect()
    }

    /// The pieces are prost's encoding behind the gRPC prefix, byte for
    /// byte, and the large payload is the queue's own memory.
    #[test]
    fn a_delivery_is_prosts_bytes_with_the_payload_passed_through() {
        let payload = Bytes::from(
            (0..(1u32 << 20))
                .map(|value| value as u8)
                .collect::<Vec<_>>(),
        );
        let message = delivery(payload.clone());
        let pieces = grpc_frame(&message).unwrap();

        let mut expected = vec![0u8];
        expected.extend_from_slice(&(message.encoded_len() as u32).to_be_bytes());
        expected.extend_from_slice(&message.encode_to_vec());
        assert_eq!(joined(&pieces), expected);
        assert!(
            pieces
                .iter()
                .any(|piece| piece.as_ptr() == payload.as_ptr() && piece.len() == payload.len()),
            "the payload was copied"
        );
        // Prefix and small fields, the payload, and the fields after it.
        assert_eq!(pieces.len(), 3);
    }

    /// Small payloads are copied into one piece; decoding gives the message.
    #[test]
    fn small_messages_are_one_piece_and_decode_back() {
        let message = delivery(Bytes::from(vec![3u8; 100]));
        let pieces = grpc_frame(&message).unwrap();
        assert_eq!(pieces.len(), 1);
        let bytes = joined(&pieces);
        let decoded = proto::ConsumeResponse::decode(&bytes[5..]).unwrap();
        assert_eq!(decoded, message);
    }
}
