//! Fuzz body for the client's decoder of what the broker sends, run by
//! cargo-fuzz (`tests/fuzz`, `make fuzz`) and, over the committed corpus,
//! by `crates/client/tests/fuzz_corpus.rs` in every `cargo test`.
//!
//! [`delivery`] takes any bytes and must not panic, hang or allocate from
//! a length it has not checked; where a decode succeeds it checks what
//! must hold of the result (a panic is the finding). [`seeds`] builds the
//! seed inputs from the project's encoders.

use dflash_proto::frames::{Direction, Rope};
use dflash_proto::fuzzing::{
    framed_body, read_messages, rope_bytes, same_message, schema_sample, ReceivedBody, Seed,
};
use dflash_proto::sample as schema;
use dflash_proto::v1 as proto;
use prost::Message;

use crate::wire::decode_message;

/// Fuzz body: a response body the broker sent (the layout of
/// [`ReceivedBody`]; its direction bit picks the stream: set, a Produce
/// stream's answers, else a Consume stream's deliveries) read as the
/// client reads it: the gRPC prefix reader, then each message decoded by
/// prost from its frames' slices (`wire`), then, as the consumer and a
/// drafter take them, the welcome first, deliveries through the sample
/// schema, nothing after the end-of-stream.
///
/// Checks: each message decodes from its frames' slices as from one
/// buffer; what the decoder counts as joined from several frames is no
/// more than the message; a delivery written again by prost reads back the
/// same; a delivery the schema accepts has its tensors' bytes.
pub fn delivery(data: &[u8]) {
    let body = ReceivedBody::parse(data);
    let produce_answers = body.direction == Direction::Request;
    let read = read_messages(body.frames, Direction::Response, body.limit);
    let mut welcomed = false;
    for message in read.messages {
        if produce_answers {
            decodes_alike::<proto::ProduceResponse>(message);
            continue;
        }
        let Some(response) = decodes_alike::<proto::ConsumeResponse>(message) else {
            // The consumer ends the stream with the decode error.
            return;
        };
        use proto::consume_response::Kind;
        match response.kind {
            Some(Kind::Welcome(_)) => welcomed = true,
            // `Consumer::open` wants the welcome first.
            _ if !welcomed => return,
            Some(Kind::Delivery(delivery)) => delivery_round_trips(delivery),
            // `Consumer::next` reads nothing after the end-of-stream.
            Some(Kind::EndOfStream(_)) => return,
            None => {}
        }
    }
}

/// `message` decoded by [`decode_message`] (from the rope) and by prost
/// from one buffer: the same outcome. The message when it decoded.
fn decodes_alike<T: Message + Default + PartialEq>(message: Rope) -> Option<T> {
    let length = message.len() as u64;
    let contiguous = T::decode(rope_bytes(&message));
    let (decoded, copies) = decode_message::<T>(message);
    assert!(
        copies.assembled_bytes <= length,
        "{} bytes joined from a {length}-byte message",
        copies.assembled_bytes
    );
    match (decoded, contiguous) {
        (Ok(decoded), Ok(contiguous)) => {
            assert!(
                same_message(&decoded, &contiguous),
                "the frames decoded otherwise than the bytes"
            );
            Some(decoded)
        }
        (Err(_), Err(_)) => None,
        (decoded, contiguous) => panic!(
            "the frames and the bytes disagree: {:?} against {:?}",
            decoded.err(),
            contiguous.err()
        ),
    }
}

/// A delivery as a drafter takes it: prost's encoding of it reads back the
/// same, and a sample the schema accepts holds its tensors' bytes.
fn delivery_round_trips(delivery: proto::Delivery) {
    let bytes = delivery.encode_to_vec();
    match proto::Delivery::decode(bytes.as_slice()) {
        Ok(back) => assert!(back == delivery, "a delivery did not survive its encoding"),
        Err(error) => panic!("a delivery's own encoding did not decode: {error}"),
    }
    let Some(sample) = &delivery.sample else {
        return;
    };
    let _ = schema::token_count(sample);
    if let Ok(decoded) = schema::decode(sample) {
        assert_eq!(decoded.input_ids.len() as u64, decoded.tokens);
        let element_bytes = decoded.hidden_dtype.element_size().unwrap_or(0);
        assert_eq!(
            decoded.hidden_states.data.len() as u64,
            decoded.tokens * decoded.width * element_bytes
        );
        let _ = schema::non_finite_values(&decoded.hidden_states.data, decoded.hidden_dtype);
    }
}

/// Seed inputs for [`delivery`]: Consume streams as the broker writes them
/// (welcome, deliveries of schema samples, end-of-stream; one delivery
/// large enough to span frames) cut several ways, and a Produce stream's
/// answers.
pub fn seeds() -> Vec<Seed> {
    let delivery = |delivery_id: u64, tokens: usize, width: usize| proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::Delivery(proto::Delivery {
            delivery_id,
            target_id: "target-2".into(),
            seq: 10 + delivery_id,
            sample: Some(schema_sample(tokens, width)),
            delivery_count: 1 + (delivery_id % 2) as u32,
            trace_context: [("traceparent".to_string(), "00-ab-cd-01".to_string())]
                .into_iter()
                .collect(),
        })),
    };
    let welcome = proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::Welcome(
            proto::ConsumerWelcome {
                lease_timeout_ms: 30_000,
                run_id: "run-7".into(),
                ..Default::default()
            },
        )),
    };
    let end = proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::EndOfStream(
            proto::EndOfStream {
                status: proto::RunStatus::Complete as i32,
                ..Default::default()
            },
        )),
    };
    let stream = framed_body(&[
        welcome.clone(),
        delivery(1, 3, 4),
        delivery(2, 6, 2),
        end.clone(),
    ]);
    let mut seeds = Vec::new();
    for (name, cut_byte) in [
        ("consume-one-frame", 0u8),
        ("consume-bytewise", 1),
        ("consume-small-frames", 23),
        ("consume-wide-frames", 129),
    ] {
        seeds.push(Seed {
            target: "client_delivery",
            name: name.to_string(),
            bytes: ReceivedBody::input(0, cut_byte, &stream),
        });
    }
    // 2 tokens of 4200 bf16 values: a tensor of 16 KiB and more, which
    // the consumer joins once when it spans frames.
    let large = framed_body(&[welcome, delivery(3, 2, 4200), end]);
    seeds.push(Seed {
        target: "client_delivery",
        name: "consume-large-across-frames".to_string(),
        bytes: ReceivedBody::input(0, 140, &large),
    });
    let answers = framed_body(&[
        proto::ProduceResponse {
            kind: Some(proto::produce_response::Kind::Welcome(
                proto::ProducerWelcome {
                    resume_after_seq: Some(4),
                    run_id: "run-7".into(),
                    epoch: 2,
                    ..Default::default()
                },
            )),
        },
        proto::ProduceResponse {
            kind: Some(proto::produce_response::Kind::Accepted(
                proto::ItemAccepted {
                    seq: 5,
                    duplicate: false,
                },
            )),
        },
        proto::ProduceResponse {
            kind: Some(proto::produce_response::Kind::Rejected(
                proto::ItemRejected {
                    seq: 6,
                    reason: "tensor \"hidden_states\": 3 bytes, expected 4".into(),
                },
            )),
        },
    ]);
    seeds.push(Seed {
        target: "client_delivery",
        name: "produce-answers".to_string(),
        bytes: ReceivedBody::input(0x80, 5, &answers),
    });
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed passes, and the Consume seeds hold deliveries the
    /// schema accepts (the seeds reach the drafter's decoding).
    #[test]
    fn every_seed_passes_and_its_deliveries_pass_the_schema() {
        let seeds = seeds();
        assert_eq!(seeds.len(), 6);
        for seed in &seeds {
            delivery(&seed.bytes);
        }
        let body = ReceivedBody::parse(&seeds[2].bytes);
        let read = read_messages(body.frames, Direction::Response, body.limit);
        assert_eq!(read.messages.len(), 4);
        let (response, _) = decode_message::<proto::ConsumeResponse>(read.messages[1].clone());
        let Some(proto::consume_response::Kind::Delivery(delivery)) = response.unwrap().kind else {
            panic!("a delivery")
        };
        assert_eq!(
            schema::decode(delivery.sample.as_ref().unwrap())
                .unwrap()
                .tokens,
            3
        );
    }
}
