use crate::fields::SAMPLE_TENSORS;
use std::collections::VecDeque;

use futures::StreamExt;
use http_body::{Body, Frame};

use super::*;

/// A body that yields the given frames (or errors), then ends.
struct ScriptedBody {
    frames: VecDeque<Result<Frame<Bytes>, Status>>,
}

impl ScriptedBody {
    fn data(chunks: Vec<Bytes>) -> Self {
        ScriptedBody {
            frames: chunks
                .into_iter()
                .map(|chunk| Ok(Frame::data(chunk)))
                .collect(),
        }
    }
}

impl Body for ScriptedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Poll::Ready(self.frames.pop_front())
    }
}

fn payload(bytes: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..bytes)
            .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<_>>(),
    )
}

fn delivery(data_bytes: usize) -> proto::ConsumeResponse {
    proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::Delivery(proto::Delivery {
            delivery_id: 9,
            target_id: "target-3".into(),
            seq: 300,
            sample: Some(proto::Sample {
                tensors: vec![
                    proto::Tensor::from_parts(
                        "input_ids",
                        proto::Dtype::I32,
                        vec![3],
                        payload(12, 1),
                    ),
                    proto::Tensor::from_parts(
                        "hidden_states",
                        proto::Dtype::U8,
                        vec![data_bytes as u64],
                        payload(data_bytes, 2),
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

fn framed(messages: &[proto::ConsumeResponse]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for message in messages {
        bytes.push(0);
        bytes.extend_from_slice(&(message.encoded_len() as u32).to_be_bytes());
        bytes.extend_from_slice(&message.encode_to_vec());
    }
    bytes
}

fn read_all(
    chunks: Vec<Bytes>,
    limit: usize,
) -> (Vec<Result<proto::ConsumeResponse, String>>, Copies) {
    let mut reader = MessageReader::new(ScriptedBody::data(chunks), Direction::Response, limit);
    let mut out = Vec::new();
    let mut copies = Copies::default();
    futures::executor::block_on(async {
        while let Some(message) = reader.next().await {
            match message {
                Ok(mut rope) => {
                    let decoded = proto::ConsumeResponse::decode(&mut rope)
                        .map_err(|error| error.to_string());
                    copies.add(rope.copies());
                    out.push(decoded);
                }
                Err(status) => out.push(Err(format!("{:?}: {}", status.code(), status.message()))),
            }
        }
    });
    (out, copies)
}

fn decoded(message: &proto::ConsumeResponse) -> Result<proto::ConsumeResponse, String> {
    Ok(message.clone())
}

/// Two messages split into two chunks at every position: each decodes to
/// prost's own decoding of the whole bytes.
#[test]
fn messages_split_at_every_boundary_decode_as_prost_does() {
    let messages = [delivery(40), delivery(0)];
    let bytes = Bytes::from(framed(&messages));
    for cut in 0..=bytes.len() {
        let chunks = vec![bytes.slice(..cut), bytes.slice(cut..)];
        let (out, _) = read_all(chunks, 1 << 20);
        assert_eq!(
            out,
            vec![decoded(&messages[0]), decoded(&messages[1])],
            "cut at {cut}"
        );
    }
    // Every byte its own frame.
    let chunks = (0..bytes.len()).map(|at| bytes.slice(at..at + 1)).collect();
    let (out, _) = read_all(chunks, 1 << 20);
    assert_eq!(out, vec![decoded(&messages[0]), decoded(&messages[1])]);
}

/// A payload within one frame comes out as a slice of that frame; one
/// that spans frames is assembled once, and counted.
#[test]
fn a_payload_in_one_frame_is_a_slice_and_one_across_frames_is_counted() {
    let message = delivery(64 << 10);
    let bytes = Bytes::from(framed(std::slice::from_ref(&message)));
    let (mut out, copies) = read_all(vec![bytes.clone()], 1 << 20);
    let Ok(proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::Delivery(delivery)),
    }) = out.remove(0)
    else {
        panic!("a delivery")
    };
    let data = &delivery.sample.as_ref().unwrap().tensors[1].data;
    let range = bytes.as_ptr() as usize..bytes.as_ptr() as usize + bytes.len();
    assert!(range.contains(&(data.as_ptr() as usize)), "copied");
    assert_eq!(copies.assembled, 0);

    let middle = bytes.len() / 2;
    let (out, copies) = read_all(vec![bytes.slice(..middle), bytes.slice(middle..)], 1 << 20);
    assert_eq!(out, vec![Ok(message)]);
    assert_eq!((copies.assembled, copies.assembled_bytes), (1, 64 << 10));
}

fn error_of(chunks: Vec<Bytes>, limit: usize) -> String {
    let (out, _) = read_all(chunks, limit);
    assert_eq!(out.len(), 1, "{out:?}");
    out.into_iter().next().unwrap().expect_err("an error")
}

#[test]
fn malformed_prefixes_and_truncation_get_statuses_naming_the_value() {
    let message = delivery(100);
    let bytes = framed(std::slice::from_ref(&message));

    let mut compressed = bytes.clone();
    compressed[0] = 1;
    let error = error_of(vec![Bytes::from(compressed)], 1 << 20);
    assert!(error.starts_with("Internal"), "{error}");
    assert!(error.contains("compressed flag set (1)"), "{error}");

    let mut bad_flag = bytes.clone();
    bad_flag[0] = 7;
    let error = error_of(vec![Bytes::from(bad_flag)], 1 << 20);
    assert!(error.contains("compressed flag 7"), "{error}");

    let error = error_of(vec![Bytes::from(bytes.clone())], 100);
    assert!(error.starts_with("OutOfRange"), "{error}");
    assert!(
        error.contains(&format!(
            "declares {} bytes, the limit is 100 bytes",
            bytes.len() - 5
        )),
        "{error}"
    );
    assert!(error.contains("too large"), "{error}");

    let error = error_of(vec![Bytes::copy_from_slice(&bytes[..3])], 1 << 20);
    assert!(
        error.contains("prefix of gRPC message 1: 3 bytes arrived"),
        "{error}"
    );

    let error = error_of(vec![Bytes::copy_from_slice(&bytes[..20])], 1 << 20);
    assert!(
        error.contains(&format!("15 of its {} bytes arrived", bytes.len() - 5)),
        "{error}"
    );

    // A length of u32::MAX is refused before anything is read or allocated.
    let error = error_of(vec![Bytes::from_static(&[0, 255, 255, 255, 255])], 1 << 20);
    assert!(error.contains("4294967295 bytes"), "{error}");
}

/// After a good message, garbage: the good one comes out, then the error,
/// then nothing (never a panic).
#[test]
fn an_error_ends_the_stream() {
    let message = delivery(10);
    let mut bytes = framed(std::slice::from_ref(&message));
    bytes.extend_from_slice(&[9, 0, 0, 0, 1, 0]);
    let (out, _) = read_all(vec![Bytes::from(bytes)], 1 << 20);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0], Ok(message));
    assert!(out[1].as_ref().unwrap_err().contains("compressed flag 9"));
}

/// A request whose client reset it (CANCEL) just ends; other body errors
/// come out as the stream's error.
#[test]
fn a_cancelled_request_ends_and_other_errors_are_reported() {
    for (direction, code, ends_quietly) in [
        (Direction::Request, tonic::Code::Cancelled, true),
        (Direction::Response, tonic::Code::Cancelled, false),
        (Direction::Request, tonic::Code::Unavailable, false),
    ] {
        let body = ScriptedBody {
            frames: [Err(Status::new(code, "gone"))].into_iter().collect(),
        };
        let mut reader = MessageReader::new(body, direction, 1 << 20);
        let first = futures::executor::block_on(reader.next());
        if ends_quietly {
            assert!(first.is_none());
        } else {
            assert_eq!(first.unwrap().unwrap_err().code(), code);
        }
        assert!(futures::executor::block_on(reader.next()).is_none());
    }
}

#[test]
fn trailers_are_kept() {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let body = ScriptedBody {
        frames: [Ok(Frame::trailers(trailers))].into_iter().collect(),
    };
    let mut reader = MessageReader::new(body, Direction::Response, 1 << 20);
    assert!(futures::executor::block_on(reader.next()).is_none());
    assert_eq!(reader.trailers().unwrap()["grpc-status"], "0");
}

#[test]
fn rope_split_and_advance_keep_the_bytes() {
    let whole = payload(1000, 3);
    let mut rope = Rope::new();
    for range in [0..10, 10..500, 500..501, 501..1000] {
        rope.push(whole.slice(range));
    }
    assert_eq!(rope.len(), 1000);
    let front = rope.split_to(250);
    assert_eq!(front.clone().into_bytes(), whole.slice(..250));
    assert_eq!(front.chunk_count(), 2);
    rope.advance(300);
    assert_eq!(rope.clone().into_bytes(), whole.slice(550..));
    // One chunk left: the bytes are that chunk, shared.
    assert_eq!(rope.chunk_count(), 1);
    let rest = rope.into_bytes();
    assert_eq!(rest.as_ptr(), whole.slice(550..).as_ptr());
}

/// `Pieces` and `encode_tensor` write prost's bytes, the payload as its own
/// chunk.
#[test]
fn pieces_are_prosts_bytes_with_the_payload_passed_through() {
    let tensor = proto::Tensor::from_parts(
        "hidden_states",
        proto::Dtype::U8,
        vec![64 << 10],
        payload(64 << 10, 5),
    );
    let sample = proto::Sample {
        tensors: vec![tensor.clone()],
    };
    let header = proto::Tensor {
        data: Bytes::new(),
        ..tensor.clone()
    };
    let length = delimited_len(SAMPLE_TENSORS, tensor_len(&header, tensor.data.len()));
    assert_eq!(length, sample.encoded_len());
    let mut pieces = Pieces::message(length).unwrap();
    encode_tensor(
        SAMPLE_TENSORS,
        &header,
        [&tensor.data],
        tensor.data.len(),
        &mut pieces,
    )
    .unwrap();
    let pieces = pieces.finish();
    assert_eq!(pieces.len(), 2);
    assert_eq!(pieces[1].as_ptr(), tensor.data.as_ptr());
    let joined: Vec<u8> = pieces
        .iter()
        .flat_map(|piece| piece.iter().copied())
        .collect();
    let mut expected = vec![0];
    expected.extend_from_slice(&(length as u32).to_be_bytes());
    expected.extend_from_slice(&sample.encode_to_vec());
    assert_eq!(joined, expected);
}

/// A response body of pieces ends with the status in trailers.
#[test]
fn a_piece_body_ends_with_its_status() {
    let messages = futures::stream::iter(vec![
        Ok(delivery(10)),
        Err(Status::invalid_argument("bad seq 7")),
    ]);
    let mut body = PieceBody::response(messages, |message: proto::ConsumeResponse| {
        Ok(vec![Pieces::whole(&message)?])
    });
    let mut data = Vec::new();
    let mut trailers = None;
    futures::executor::block_on(async {
        while let Some(frame) =
            futures::future::poll_fn(|context| Pin::new(&mut body).poll_frame(context)).await
        {
            let frame = frame.unwrap();
            if frame.is_data() {
                data.extend_from_slice(&frame.into_data().unwrap());
            } else {
                trailers = frame.into_trailers().ok();
            }
        }
    });
    assert_eq!(data, framed(&[delivery(10)]));
    let status = Status::from_header_map(&trailers.unwrap()).unwrap();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(status.message(), "bad seq 7");
}
