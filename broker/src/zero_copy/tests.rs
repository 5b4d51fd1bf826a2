use std::sync::Arc;

use dflash_proto::frames::Rope;
use prost::Message;

use super::*;
use crate::payload::{WireItem, WireSample, WireTensor};

fn payload_bytes(bytes: usize) -> Bytes {
    Bytes::from((0..bytes).map(|value| value as u8).collect::<Vec<_>>())
}

/// A delivery of an item whose large tensor arrived as `slices`.
fn delivery(slices: Vec<Bytes>, delivery_id: u64, seq: u64, count: u32) -> Delivery<Arc<WireItem>> {
    let mut data = Rope::new();
    for slice in slices {
        data.push(slice);
    }
    let large = data.len() as u64;
    let item = WireItem {
        seq,
        sample: Some(WireSample {
            tensors: vec![
                WireTensor {
                    header: proto::Tensor::from_parts(
                        "input_ids",
                        proto::Dtype::I32,
                        vec![4],
                        Bytes::new(),
                    ),
                    data: Rope::from_bytes(Bytes::from(vec![1u8; 16])),
                },
                WireTensor {
                    header: proto::Tensor::from_parts(
                        "hidden_states",
                        proto::Dtype::U8,
                        vec![large],
                        Bytes::new(),
                    ),
                    data,
                },
            ],
        }),
        trace_context: [("traceparent".to_string(), "00-ab-cd-01".to_string())]
            .into_iter()
            .collect(),
    };
    Delivery {
        delivery_id,
        target_id: Arc::from("target-3"),
        seq,
        payload: Arc::new(item),
        delivery_count: count,
    }
}

fn joined(pieces: &[Bytes]) -> Vec<u8> {
    pieces
        .iter()
        .flat_map(|piece| piece.iter().copied())
        .collect()
}

/// prost's encoding of the same delivery, behind the gRPC prefix.
fn prosts_frame(delivery: Delivery<Arc<WireItem>>) -> Vec<u8> {
    let message = ConsumeOut::Delivery(delivery).into_proto();
    let mut expected = vec![0u8];
    expected.extend_from_slice(&(message.encoded_len() as u32).to_be_bytes());
    expected.extend_from_slice(&message.encode_to_vec());
    expected
}

/// The pieces are prost's encoding behind the gRPC prefix, byte for byte,
/// and each slice of the large payload is the queue's own memory.
#[test]
fn a_delivery_is_prosts_bytes_with_the_payload_passed_through() {
    let whole = payload_bytes(1 << 20);
    let slices = vec![whole.slice(..300_000), whole.slice(300_000..)];
    let message = delivery(slices.clone(), 9, 41, 2);
    let pieces = grpc_frame(ConsumeOut::Delivery(message.clone())).unwrap();
    assert_eq!(joined(&pieces), prosts_frame(message));
    for slice in &slices {
        assert!(
            pieces
                .iter()
                .any(|piece| piece.as_ptr() == slice.as_ptr() && piece.len() == slice.len()),
            "a payload slice was copied"
        );
    }
    // Prefix and small fields, the two slices, and the fields after them.
    assert_eq!(pieces.len(), 4);
}

/// Zero fields (left out by proto3) and an empty target id encode as
/// prost's do.
#[test]
fn default_fields_are_left_out_as_prost_does() {
    let whole = payload_bytes(ZERO_COPY_MIN_BYTES);
    for (delivery_id, seq, count) in [(0, 0, 0), (1, 0, 7), (u64::MAX, u64::MAX, u32::MAX)] {
        let mut message = delivery(vec![whole.clone()], delivery_id, seq, count);
        let pieces = grpc_frame(ConsumeOut::Delivery(message.clone())).unwrap();
        assert_eq!(joined(&pieces), prosts_frame(message.clone()));
        message.target_id = Arc::from("");
        let pieces = grpc_frame(ConsumeOut::Delivery(message.clone())).unwrap();
        assert_eq!(joined(&pieces), prosts_frame(message));
    }
}

/// Small payloads are copied into one piece; decoding gives the message.
#[test]
fn small_messages_are_one_piece_and_decode_back() {
    let message = delivery(vec![payload_bytes(100)], 9, 41, 2);
    let pieces = grpc_frame(ConsumeOut::Delivery(message.clone())).unwrap();
    assert_eq!(pieces.len(), 1);
    let bytes = joined(&pieces);
    let decoded = proto::ConsumeResponse::decode(&bytes[5..]).unwrap();
    assert_eq!(decoded, ConsumeOut::Delivery(message).into_proto());
    let end = proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::EndOfStream(
            proto::EndOfStream {
                status: proto::RunStatus::Complete as i32,
                reason: String::new(),
                summary: None,
            },
        )),
    };
    let pieces = grpc_frame(ConsumeOut::Message(end.clone())).unwrap();
    assert_eq!(pieces.len(), 1);
    assert_eq!(
        proto::ConsumeResponse::decode(&pieces[0][5..]).unwrap(),
        end
    );
}
