//! Wire values for the tests of every crate that encodes or decodes items
//! by hand (the broker's payload decoder, the client's zero-copy encoder):
//! one item builder, so both sides test against the same bytes. Behind the
//! `testing` feature, which only dev-dependencies turn on.

use bytes::Bytes;

use crate::v1 as proto;

/// `bytes` bytes of a pattern that differs per `seed`, so a payload cut or
/// joined in the wrong place does not compare equal by accident.
pub fn patterned_bytes(bytes: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..bytes)
            .map(|index| (index as u8).wrapping_mul(13).wrapping_add(seed))
            .collect::<Vec<_>>(),
    )
}

/// A Produce item of `seq` with one u8 tensor `t{index}` per entry of
/// `tensor_sizes` (patterned data) and a `traceparent`.
pub fn item_request(seq: u64, tensor_sizes: &[usize]) -> proto::ProduceRequest {
    proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Item(proto::Item {
            seq,
            sample: Some(proto::Sample {
                tensors: tensor_sizes
                    .iter()
                    .enumerate()
                    .map(|(index, &size)| {
                        proto::Tensor::from_parts(
                            format!("t{index}"),
                            proto::Dtype::U8,
                            vec![size as u64],
                            patterned_bytes(size, index as u8),
                        )
                    })
                    .collect(),
            }),
            trace_context: [("traceparent".to_string(), "00-ab-cd-01".to_string())]
                .into_iter()
                .collect(),
        })),
    }
}
