//! Produce and Consume streams without tonic's copies: requests go out as
//! [`Pieces`] (an item's tensors passed to h2 as their own chunks, not
//! encoded into one buffer), responses are read as gRPC messages made of
//! slices of the received HTTP/2 frames ([`MessageReader`]) and decoded by
//! prost from them, so a delivered tensor that arrived within one frame is
//! a view on that frame and one that spanned frames is joined once (the
//! client's one copy; [`Copies`] counts both).
//!
//! The calls go through the same channel (TLS, token, HTTP/2 settings) as
//! the generated client; the bytes on the wire are prost's.

use bytes::Bytes;
use dflash_proto::fields::{ITEM_SAMPLE, PRODUCE_REQUEST_ITEM, SAMPLE_TENSORS};
use dflash_proto::frames::{self, Copies, Direction, MessageReader, Pieces, Rope};
use dflash_proto::v1 as proto;
use futures::StreamExt;
use prost::encoding::{self, WireType};
use prost::Message;
use tonic::body::Body;
use tonic::Status;
use tower::Service;

use crate::AuthChannel;

pub(crate) const PRODUCE_PATH: &str = "/dflash.v1.Broker/Produce";
pub(crate) const CONSUME_PATH: &str = "/dflash.v1.Broker/Consume";

/// The response body of a call on an [`AuthChannel`].
type ResponseBody = <AuthChannel as Service<http::Request<Body>>>::Response;

/// The messages of a streaming call's response, then its status.
pub(crate) struct ResponseMessages {
    /// In a `Mutex` only so that `ResponseMessages` is `Sync` (tonic's body
    /// is `Send` but not `Sync`, and callers hold `&Consumer` across
    /// awaits in `Send` futures); it is only reached through `get_mut`,
    /// which never locks.
    reader: std::sync::Mutex<MessageReader<<ResponseBody as HttpResponse>::Body>>,
    copies: Copies,
    /// The status that ended the stream, once it ended.
    ended: Option<Status>,
}

/// The body type of an `http::Response`.
pub(crate) trait HttpResponse {
    type Body;
}

impl<B> HttpResponse for http::Response<B> {
    type Body = B;
}

impl ResponseMessages {
    /// The next message; `Ok(None)` when the broker ended the stream with
    /// OK, `Err` with its status otherwise.
    pub(crate) async fn message<T: Message + Default>(&mut self) -> Result<Option<T>, Status> {
        loop {
            if let Some(status) = &self.ended {
                return if status.code() == tonic::Code::Ok {
                    Ok(None)
                } else {
                    Err(status.clone())
                };
            }
            let reader = self
                .reader
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match reader.next().await {
                Some(Ok(message)) => {
                    let (decoded, copies) = decode_message(message);
                    self.copies.add(copies);
                    return decoded.map(Some);
                }
                Some(Err(status)) => self.ended = Some(status),
                None => {
                    self.ended = Some(match reader.trailers().map(Status::from_header_map) {
                        Some(Some(status)) => status,
                        _ => Status::unknown("the broker's stream ended without a grpc-status"),
                    });
                }
            }
        }
    }

    /// How the `bytes` fields of the messages so far came out.
    pub(crate) fn copies(&self) -> Copies {
        self.copies
    }
}

/// One received message decoded by prost from its frames' slices, and how
/// its `bytes` fields came out (views on a frame, or joined once).
pub(crate) fn decode_message<T: Message + Default>(
    mut message: Rope,
) -> (Result<T, Status>, Copies) {
    let decoded = T::decode(&mut message).map_err(|error| {
        Status::internal(format!("the broker sent an undecodable message: {error}"))
    });
    (decoded, message.copies())
}

/// The status a non-gRPC HTTP answer stands for (as tonic maps them).
fn http_status(code: http::StatusCode) -> Status {
    let grpc = match code.as_u16() {
        400 => tonic::Code::Internal,
        401 => tonic::Code::Unauthenticated,
        403 => tonic::Code::PermissionDenied,
        404 => tonic::Code::Unimplemented,
        429 | 502..=504 => tonic::Code::Unavailable,
        _ => tonic::Code::Unknown,
    };
    Status::new(grpc, format!("the broker answered HTTP {code}"))
}

/// Opens a streaming call to `path` with `body` as its request stream.
pub(crate) async fn call(
    channel: &mut AuthChannel,
    path: &'static str,
    body: Body,
    max_message_bytes: usize,
) -> Result<ResponseMessages, Status> {
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(path)
        .version(http::Version::HTTP_2)
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(body)
        .map_err(|error| Status::internal(format!("building a request to {path}: {error}")))?;
    std::future::poll_fn(|context| channel.poll_ready(context))
        .await
        .map_err(|error| Status::from_error(error.into()))?;
    let response = channel
        .call(request)
        .await
        .map_err(|error| Status::from_error(error.into()))?;
    if let Some(status) = Status::from_header_map(response.headers()) {
        // A trailers-only answer: the call was refused.
        if status.code() != tonic::Code::Ok {
            return Err(status);
        }
    }
    if response.status() != http::StatusCode::OK {
        return Err(http_status(response.status()));
    }
    Ok(ResponseMessages {
        reader: std::sync::Mutex::new(MessageReader::new(
            response.into_body(),
            Direction::Response,
            max_message_bytes,
        )),
        copies: Copies::default(),
        ended: None,
    })
}

/// A small request as one gRPC frame.
pub(crate) fn whole(message: &impl Message) -> Result<Vec<Bytes>, Status> {
    Ok(vec![Pieces::whole(message)?])
}

/// A Produce message as pieces: an item's tensors' data each its own chunk
/// (no copy), everything else prost's encoding in small buffers.
pub(crate) fn produce_request(request: proto::ProduceRequest) -> Result<Vec<Bytes>, Status> {
    let Some(proto::produce_request::Kind::Item(mut item)) = request.kind else {
        return whole(&request);
    };
    // prost writes fields in number order: seq, sample, trace_context.
    let sample = item.sample.take();
    let has_sample = sample.is_some();
    let head = proto::Item {
        seq: item.seq,
        ..Default::default()
    };
    let tail = proto::Item {
        trace_context: std::mem::take(&mut item.trace_context),
        ..Default::default()
    };
    let mut tensors = Vec::new();
    let mut sample_len = 0;
    for mut tensor in sample.map(|sample| sample.tensors).unwrap_or_default() {
        let data = std::mem::take(&mut tensor.data);
        sample_len +=
            frames::delimited_len(SAMPLE_TENSORS, frames::tensor_len(&tensor, data.len()));
        tensors.push((tensor, data));
    }
    let item_len = head.encoded_len()
        + tail.encoded_len()
        + if has_sample {
            frames::delimited_len(ITEM_SAMPLE, sample_len)
        } else {
            0
        };
    let mut pieces = Pieces::message(frames::delimited_len(PRODUCE_REQUEST_ITEM, item_len))?;
    let buffer = pieces.buffer();
    encoding::encode_key(PRODUCE_REQUEST_ITEM, WireType::LengthDelimited, buffer);
    encoding::encode_varint(item_len as u64, buffer);
    pieces.encode(&head)?;
    if has_sample {
        let buffer = pieces.buffer();
        encoding::encode_key(ITEM_SAMPLE, WireType::LengthDelimited, buffer);
        encoding::encode_varint(sample_len as u64, buffer);
        for (header, data) in &tensors {
            frames::encode_tensor(SAMPLE_TENSORS, header, [data], data.len(), &mut pieces)?;
        }
    }
    pieces.encode(&tail)?;
    Ok(pieces.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_proto::testing::item_request;

    fn frame_of(request: &proto::ProduceRequest) -> Vec<u8> {
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(&(request.encoded_len() as u32).to_be_bytes());
        bytes.extend_from_slice(&request.encode_to_vec());
        bytes
    }

    /// Items (with and without a sample, seq 0 or not), hello and stats
    /// encode to prost's bytes; a large payload is its own piece, shared.
    #[test]
    fn produce_requests_are_prosts_bytes_with_payloads_passed_through() {
        let mut requests = vec![
            item_request(5, &[12, 1 << 20]),
            item_request(0, &[0, 3]),
            item_request(1, &[]),
            proto::ProduceRequest {
                kind: Some(proto::produce_request::Kind::Item(proto::Item::default())),
            },
            proto::ProduceRequest {
                kind: Some(proto::produce_request::Kind::Hello(proto::ProducerHello {
                    target_id: "target-0".into(),
                    run_id: "run-1".into(),
                })),
            },
            proto::ProduceRequest { kind: None },
        ];
        if let Some(proto::produce_request::Kind::Item(item)) = &mut requests[2].kind {
            item.sample = None;
        }
        for request in requests {
            let payload = match &request.kind {
                Some(proto::produce_request::Kind::Item(item)) => item
                    .sample
                    .as_ref()
                    .and_then(|sample| sample.tensors.get(1))
                    .map(|tensor| tensor.data.clone()),
                _ => None,
            };
            let pieces = produce_request(request.clone()).unwrap();
            let joined: Vec<u8> = pieces.iter().flat_map(|piece| piece.to_vec()).collect();
            assert_eq!(joined, frame_of(&request), "{request:?}");
            if let Some(payload) = payload.filter(|payload| payload.len() >= 1 << 20) {
                assert!(pieces
                    .iter()
                    .any(|piece| piece.as_ptr() == payload.as_ptr()));
            }
        }
    }
}
