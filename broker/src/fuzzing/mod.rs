//! Fuzz bodies for the broker's decoders of untrusted bytes (the
//! write-ahead log's are the log's own), run by cargo-fuzz (`tests/fuzz`,
//! `make fuzz`) and, over the committed corpus, by
//! `broker/tests/fuzz_corpus.rs` in every `cargo test`.
//!
//! Each body takes any bytes and must not panic, hang or allocate from a
//! length it has not checked; where a decode succeeds it checks what must
//! hold of the result (a panic is the finding). [`seeds`] builds the seed
//! inputs from the broker's own encoders.
//!
//! - [`produce`]: a Produce request body cut into HTTP/2 frames, read as
//!   the Produce route reads it (`zero_copy`: the gRPC prefix reader, then
//!   [`decode_produce_request`]), each item checked as the service checks
//!   it and sent on as a delivery.
//! - [`model_sync`]: ModelSync snapshot sessions' messages, interleaved,
//!   against one model, as the session adapter (`run_model::service`)
//!   applies them.
//! - [`model_checkpoint`]: a model checkpoint's files through the reader
//!   a restarted broker resumes the model with.
//! - [`wal_segment`]: a write-ahead log segment (header and frames)
//!   replayed as a restarted broker replays its newest one, and the queue
//!   rebuilt from what it recovered.
//!
//! # Layout
//! - `mod.rs`: [`produce`] and [`wal_segment`], and the seeds' test.
//! - `run_model`: [`model_sync`] and [`model_checkpoint`], the model's
//!   bodies, and the input layouts they read.
//! - `model_files`: a snapshot's files and messages made from f32 values
//!   (for the seeds, the tests and the snapshot bench).
//! - `seeds`: [`seeds`], every target's seed inputs from the broker's own
//!   encoders.

use std::sync::Arc;
use std::time::Instant;

use dflash_proto::frames::{Direction, Rope};
use dflash_proto::fuzzing::{read_messages, rope_bytes, same_message, ReceivedBody};
use dflash_proto::v1 as proto;
use prost::Message;

use crate::payload::{decode_produce_request, ProduceIn, WireItem};
use crate::queue::Delivery;
use crate::service::ConsumeOut;
use crate::zero_copy::grpc_frame;

pub mod model_files;
mod run_model;
mod seeds;

pub use run_model::{model_checkpoint, model_checkpoint_input, model_sync, model_sync_input};
pub use seeds::seeds;

/// Fuzz body: a Produce request body (the layout of
/// [`ReceivedBody`], always read as a request) through the Produce route's
/// reader and decoder.
///
/// Checks, for every message: [`decode_produce_request`] over the frames'
/// slices agrees with prost's decoding of the same bytes (both fail, or
/// both give the same message); a decoded item's encoded length is what it
/// writes and its encoding decodes back to it; a valid item (as the
/// service validates it) goes out as a delivery that prost reads back as
/// the same sample and trace context.
pub fn produce(data: &[u8]) {
    let body = ReceivedBody::parse(data);
    let read = read_messages(body.frames, Direction::Request, body.limit);
    for message in read.messages {
        let ours = decode_produce_request(message.clone());
        let prosts = proto::ProduceRequest::decode(rope_bytes(&message));
        match (ours, prosts) {
            (Ok(ours), Ok(prosts)) => {
                assert!(
                    same_message(&ours.to_proto(), &prosts),
                    "ours and prost's decoding differ"
                );
                if let ProduceIn::Item(item) = ours {
                    item_round_trips(item);
                }
            }
            (Err(_), Err(_)) => {}
            (ours, prosts) => panic!(
                "ours and prost's decoding disagree: {:?} against {:?}",
                ours.err(),
                prosts.err()
            ),
        }
    }
}

fn item_round_trips(item: WireItem) {
    let expected = item.to_proto();
    assert_eq!(item.encoded_len(), expected.encoded_len());
    let Ok(pieces) = item.encode_pieces() else {
        panic!("a decoded item did not encode")
    };
    let mut rope = Rope::new();
    for piece in pieces {
        rope.push(piece);
    }
    assert_eq!(
        rope.len(),
        item.encoded_len(),
        "the item wrote another length"
    );
    match proto::Item::decode(rope) {
        Ok(back) => assert!(back == expected, "the item did not survive its encoding"),
        Err(error) => panic!("the item's own encoding did not decode: {error}"),
    }
    // What the service accepts (`service::produce`) goes on to a drafter.
    let Some(sample) = &item.sample else {
        return;
    };
    if sample.validate().is_err() || item.check_trace_context().is_err() {
        return;
    }
    let delivery = Delivery {
        delivery_id: 7,
        target_id: Arc::from("target-0"),
        seq: item.seq,
        payload: Arc::new(item),
        delivery_count: 1,
    };
    let Ok(pieces) = grpc_frame(ConsumeOut::Delivery(delivery)) else {
        // Only a delivery over 4 GiB does not fit a gRPC frame.
        return;
    };
    let read = read_messages(pieces, Direction::Response, usize::MAX);
    assert!(read.error.is_none(), "a delivery's frame: {:?}", read.error);
    let [message] = read.messages.as_slice() else {
        panic!("a delivery is one message, got {}", read.messages.len())
    };
    match proto::ConsumeResponse::decode(rope_bytes(message)) {
        Ok(proto::ConsumeResponse {
            kind: Some(proto::consume_response::Kind::Delivery(delivery)),
        }) => {
            assert!(
                delivery.sample == expected.sample,
                "the delivery's sample differs"
            );
            assert_eq!(delivery.trace_context, expected.trace_context);
            assert_eq!((delivery.seq, delivery.delivery_id), (expected.seq, 7));
        }
        other => panic!("a delivery read back as {other:?}"),
    }
}

/// Fuzz body: a write-ahead log segment's bytes (its 32-byte header, then
/// frames) replayed as the newest segment is when a broker restarts
/// ([`crate::wal::replay_bytes`]; every frame's length is checked against
/// the bytes left before anything is allocated), then the queue rebuilt
/// from whatever it recovered, as a restarted broker rebuilds it.
///
/// Checks: none of replay, rebuild and the invariant check panics,
/// whatever sequence of records the segment holds. A rebuilt queue that
/// breaks an invariant is one the broker refuses to start with
/// (`WalError::Inconsistent`): whole records can be missing or altered
/// with their CRCs intact (the fuzzer found a snapshot with an item's
/// frame cut out), and no replay rule can tell that from a real log.
pub fn wal_segment(data: &[u8]) {
    let Ok((recovered, _records)) = crate::wal::replay_bytes::<Arc<WireItem>>(data) else {
        return;
    };
    let config = crate::BrokerConfig::for_targets(2).queue_config();
    let queue = crate::queue::Queue::recover(config, recovered, Instant::now());
    // Refused at start when it fails; either way it must not panic.
    let _ = queue.check_invariants();
}

#[cfg(test)]
mod tests {
    use super::run_model::run_sessions;
    use super::seeds::seed_model_files;
    use super::*;
    use crate::run_model::checkpoint::{self, ModelFiles};
    use std::path::Path;

    /// Every seed passes its fuzz body, and the seeds reach the decoders'
    /// insides: the sessions make and replace a model, the checkpoints
    /// read back.
    #[test]
    fn every_seed_passes_and_reaches_past_the_first_checks() {
        let seeds = seeds();
        for seed in &seeds {
            match seed.target {
                "broker_produce" => produce(&seed.bytes),
                "model_sync" => model_sync(&seed.bytes),
                "model_checkpoint" => model_checkpoint(&seed.bytes),
                "wal_segment" => {
                    wal_segment(&seed.bytes);
                    // Past the header: every seed's records are read.
                    let (_, records) =
                        crate::wal::replay_bytes::<Arc<WireItem>>(&seed.bytes).unwrap();
                    assert!(records >= 3, "{}: {records} records", seed.name);
                }
                other => panic!("a seed for {other}"),
            }
        }
        let count = |target: &str| seeds.iter().filter(|seed| seed.target == target).count();
        assert_eq!(
            (
                count("broker_produce"),
                count("model_sync"),
                count("model_checkpoint"),
                count("wal_segment")
            ),
            (5, 3, 3, 3)
        );
        for seed in seeds.iter().filter(|seed| seed.target == "model_sync") {
            let state = run_sessions(&seed.bytes).unwrap();
            let status = state.status(Instant::now());
            if seed.name == "sessions-refused" {
                // The first snapshot made the model; the other shape, the
                // retired kind and the other model changed nothing.
                assert_eq!((status.model_version, status.has_model), (0, true));
                continue;
            }
            assert_eq!(status.model_version, 3, "{}", seed.name);
            assert!(
                status.drafters.iter().all(|drafter| drafter.finished),
                "{}",
                seed.name
            );
        }
        let files = seed_model_files(7).unwrap();
        assert_eq!(files.len(), 3);
        let file = |name: &str| {
            files
                .iter()
                .find(|(file_name, _)| *file_name == name)
                .map(|(_, bytes)| bytes.as_slice())
        };
        let config =
            String::from_utf8(file(checkpoint::CONFIG_FILE_NAME).unwrap().to_vec()).unwrap();
        let state = String::from_utf8(file(checkpoint::STATE_FILE_NAME).unwrap().to_vec()).unwrap();
        let model = bytes::Bytes::copy_from_slice(file(checkpoint::MODEL_FILE_NAME).unwrap());
        let model = checkpoint::decode_model(
            Path::new("model"),
            ModelFiles {
                config_json: &config,
                model: &model,
                state_json: Some(&state),
            },
        )
        .unwrap();
        assert_eq!((model.version, model.layout.tensors.len()), (7, 2));
    }
}
