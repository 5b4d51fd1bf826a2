//! Fuzz bodies for the decoders of untrusted bytes this crate owns, and
//! the pieces every crate's fuzz bodies share. cargo-fuzz runs them
//! (`tests/fuzz`, `make fuzz`); every `cargo test` replays the committed
//! corpus through them (`proto/tests/fuzz_corpus.rs`).
//!
//! Each body takes any bytes and must not panic, hang or allocate from a
//! length it has not checked; where a decode succeeds it checks what must
//! hold of the result (a panic is the finding). [`seeds`] builds the seed
//! inputs from this crate's own encoders.
//!
//! - [`frames`]: a response or request body cut into HTTP/2 DATA frames,
//!   read by [`MessageReader`] (the gRPC prefix reader) and each message
//!   decoded by prost from the [`Rope`] of its frames' slices.
//! - [`sample`]: a `Sample`'s bytes through the sample schema's decoder.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use prost::Message;
use tonic::Status;

use crate::frames::{Direction, MessageReader, Pieces, Rope, PREFIX_BYTES};
use crate::sample as schema;
use crate::v1 as proto;

/// One seed input: the fuzz target it is for, a file name, its bytes.
#[derive(Debug, Clone)]
pub struct Seed {
    pub target: &'static str,
    pub name: String,
    pub bytes: Vec<u8>,
}

/// A received HTTP body as a fuzz input describes it: the message limit
/// the reader is given, the direction, and the DATA frames.
///
/// Input layout: `[limit byte] [cut byte] [body…]`. The limit byte picks
/// the limit (bit 7: a request body, else a response) and the cut byte how
/// the body is cut into frames (0: one frame; 1–127: frames of 1 to that
/// many bytes, so 1 is byte by byte; 128–255: frames of up to 32 KiB), so
/// one body is read cut in many ways.
#[derive(Debug, Clone)]
pub struct ReceivedBody {
    pub limit: usize,
    pub direction: Direction,
    pub frames: Vec<Bytes>,
}

impl ReceivedBody {
    pub fn parse(data: &[u8]) -> ReceivedBody {
        let limit_byte = data.first().copied().unwrap_or(0);
        let cut_byte = data.get(1).copied().unwrap_or(0);
        let body = Bytes::copy_from_slice(data.get(2..).unwrap_or_default());
        let limit = match limit_byte & 0x7F {
            0 => crate::transport::CONTROL_MESSAGE_BYTES,
            1 => 0,
            small @ 2..=63 => usize::from(small),
            other => usize::from(other) << 6,
        };
        let direction = if limit_byte & 0x80 != 0 {
            Direction::Request
        } else {
            Direction::Response
        };
        ReceivedBody {
            limit,
            direction,
            frames: cut_into_frames(&body, cut_byte),
        }
    }

    /// The layout [`ReceivedBody::parse`] reads: a seed from a body.
    pub fn input(limit_byte: u8, cut_byte: u8, body: &[u8]) -> Vec<u8> {
        let mut input = vec![limit_byte, cut_byte];
        input.extend_from_slice(body);
        input
    }

    /// The body's bytes, as one buffer.
    pub fn joined(&self) -> Bytes {
        let mut joined = Vec::with_capacity(self.frames.iter().map(Bytes::len).sum());
        for frame in &self.frames {
            joined.extend_from_slice(frame);
        }
        Bytes::from(joined)
    }
}

/// `body` as frames whose lengths a small generator seeded by `cut_byte`
/// draws (the same cut byte always cuts the same way).
fn cut_into_frames(body: &Bytes, cut_byte: u8) -> Vec<Bytes> {
    if cut_byte == 0 || body.is_empty() {
        return vec![body.clone()];
    }
    let longest = if cut_byte < 128 {
        usize::from(cut_byte)
    } else {
        (usize::from(cut_byte) - 127) * 256
    };
    let mut state = u32::from(cut_byte);
    let mut frames = Vec::new();
    let mut start = 0;
    while start < body.len() {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let length = 1 + (state >> 8) as usize % longest;
        let end = (start + length).min(body.len());
        frames.push(body.slice(start..end));
        start = end;
    }
    frames
}

/// A body that yields its frames, always ready, then ends.
struct ScriptedBody {
    frames: VecDeque<Bytes>,
}

impl http_body::Body for ScriptedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Poll::Ready(self.frames.pop_front().map(|frame| Ok(Frame::data(frame))))
    }
}

/// What [`MessageReader`] made of a body: its messages, then the error
/// that ended it, if one did.
#[derive(Debug)]
pub struct ReadMessages {
    pub messages: Vec<Rope>,
    pub error: Option<Status>,
}

/// Reads every message of `frames` as the broker and the clients do.
///
/// # Panics
/// When the reader breaks its contract: a message over `limit`, more
/// polls than the body can need (a hang), a body that is always ready left
/// pending, or anything but the end after an error.
pub fn read_messages(frames: Vec<Bytes>, direction: Direction, limit: usize) -> ReadMessages {
    let body_bytes: usize = frames.iter().map(Bytes::len).sum();
    // Each poll takes a frame or returns a message of at least a prefix's
    // bytes, or ends the stream.
    let most_polls = frames.len() + body_bytes / PREFIX_BYTES + 3;
    let mut reader = MessageReader::new(
        ScriptedBody {
            frames: frames.into(),
        },
        direction,
        limit,
    );
    let mut context = Context::from_waker(std::task::Waker::noop());
    let mut messages = Vec::new();
    let mut error = None;
    for _ in 0..most_polls {
        match reader.poll_message(&mut context) {
            Poll::Ready(Some(Ok(message))) => {
                assert!(
                    message.len() <= limit,
                    "a message of {} bytes passed the limit of {limit}",
                    message.len()
                );
                messages.push(message);
            }
            Poll::Ready(Some(Err(status))) => {
                assert!(
                    matches!(reader.poll_message(&mut context), Poll::Ready(None)),
                    "the reader went on after its error {status:?}"
                );
                error = Some(status);
                break;
            }
            Poll::Ready(None) => {
                return ReadMessages { messages, error };
            }
            Poll::Pending => panic!("a body that is always ready left the reader pending"),
        }
    }
    assert!(
        error.is_some(),
        "the reader did not end within {most_polls} polls of a {body_bytes}-byte body"
    );
    ReadMessages { messages, error }
}

/// Equal messages, or a NaN in one of their floats (which `==` never
/// calls equal): the same bytes when encoded. (prost writes a map in its
/// iteration order, so two equal maps of several entries can encode
/// apart; no message here has both a map and a float in one variant.)
pub fn same_message<T: Message + PartialEq>(left: &T, right: &T) -> bool {
    left == right || left.encode_to_vec() == right.encode_to_vec()
}

/// The contiguous bytes of a rope, without consuming it.
pub fn rope_bytes(rope: &Rope) -> Bytes {
    rope.clone().into_bytes()
}

/// Fuzz body: a gRPC body (see [`ReceivedBody`]) through [`MessageReader`],
/// each message decoded by prost from its frames' slices.
///
/// Checks: no message is over the limit; the same body read as one frame
/// gives the same messages and the same error code; a body read without
/// error is exactly its messages and their prefixes; prost's decoding from
/// the [`Rope`] (a `Buf` over the frames) equals its decoding of the same
/// bytes in one buffer; and a decoded message written back by [`Pieces`]
/// reads back as the same message.
pub fn frames(data: &[u8]) {
    let body = ReceivedBody::parse(data);
    let joined = body.joined();
    let read = read_messages(body.frames.clone(), body.direction, body.limit);
    let whole = read_messages(vec![joined.clone()], body.direction, body.limit);
    assert_eq!(
        read.messages, whole.messages,
        "the frames' cuts changed the messages"
    );
    assert_eq!(
        read.error.as_ref().map(Status::code),
        whole.error.as_ref().map(Status::code),
        "the frames' cuts changed the outcome"
    );
    let framed: usize = read
        .messages
        .iter()
        .map(|message| PREFIX_BYTES + message.len())
        .sum();
    if read.error.is_none() {
        assert_eq!(framed, joined.len(), "bytes left over without an error");
    } else {
        assert!(framed <= joined.len());
    }
    for message in read.messages {
        match body.direction {
            Direction::Request => decodes_alike::<proto::ProduceRequest>(message, body.limit),
            Direction::Response => decodes_alike::<proto::ConsumeResponse>(message, body.limit),
        }
    }
}

/// prost decodes `message` from its rope as from one buffer; what decodes
/// goes out through [`Pieces`] and comes back the same.
fn decodes_alike<T: Message + Default + PartialEq>(message: Rope, limit: usize) {
    let contiguous = rope_bytes(&message);
    let mut rope = message;
    let from_rope = T::decode(&mut rope);
    let from_bytes = T::decode(contiguous);
    match (from_rope, from_bytes) {
        (Ok(from_rope), Ok(from_bytes)) => {
            assert!(
                same_message(&from_rope, &from_bytes),
                "the rope decoded otherwise than the bytes"
            );
            round_trips(&from_rope, limit);
        }
        (Err(_), Err(_)) => {}
        (from_rope, from_bytes) => panic!(
            "the rope and the bytes disagree: {:?} against {:?}",
            from_rope.err(),
            from_bytes.err()
        ),
    }
}

/// `message` framed by [`Pieces::whole`] and read back is `message`.
fn round_trips<T: Message + Default + PartialEq>(message: &T, limit: usize) {
    let Ok(frame) = Pieces::whole(message) else {
        return;
    };
    let read = read_messages(
        vec![frame],
        Direction::Response,
        limit.max(message.encoded_len()),
    );
    assert!(
        read.error.is_none(),
        "our own frame was refused: {:?}",
        read.error
    );
    assert_eq!(read.messages.len(), 1);
    let mut rope = read.messages.into_iter().next().unwrap_or_default();
    match T::decode(&mut rope) {
        Ok(back) => assert!(
            same_message(&back, message),
            "a message did not survive its round trip"
        ),
        Err(error) => panic!("our own encoding did not decode: {error}"),
    }
}

/// Fuzz body: a `Sample`'s protobuf bytes through the sample schema
/// ([`crate::sample::decode`]), as a drafter decodes each delivery.
///
/// Checks: a decoded sample's counts agree with its tensors; encoding its
/// parts again ([`crate::sample::encode`]) decodes to the same parts when
/// the token ids fit int32 (the encoder's stated domain).
pub fn sample(data: &[u8]) {
    let Ok(sample) = proto::Sample::decode(data) else {
        return;
    };
    let _ = schema::token_count(&sample);
    let Ok(decoded) = schema::decode(&sample) else {
        return;
    };
    assert_eq!(decoded.input_ids.len() as u64, decoded.tokens);
    assert_eq!(decoded.loss_mask.len() as u64, decoded.tokens);
    assert!(decoded.loss_mask.iter().all(|&value| value <= 1));
    let element_bytes = decoded.hidden_dtype.element_size().unwrap_or(0);
    assert_eq!(
        decoded.hidden_states.data.len() as u64,
        decoded.tokens * decoded.width * element_bytes,
        "hidden states' bytes disagree with their shape"
    );
    let _ = schema::non_finite_values(&decoded.hidden_states.data, decoded.hidden_dtype);
    if decoded
        .input_ids
        .iter()
        .any(|&id| i32::try_from(id).is_err())
    {
        return;
    }
    let again = schema::encode(
        &decoded.input_ids,
        &decoded.loss_mask,
        decoded.hidden_states.data.clone(),
        decoded.hidden_dtype,
        decoded.width,
    );
    let bytes = again.encode_to_vec();
    let Ok(back) = proto::Sample::decode(bytes.as_slice()) else {
        panic!("our own sample encoding did not decode")
    };
    match schema::decode(&back) {
        Ok(redecoded) => {
            assert_eq!(redecoded.input_ids, decoded.input_ids);
            assert_eq!(redecoded.loss_mask, decoded.loss_mask);
            assert_eq!(redecoded.width, decoded.width);
            assert_eq!(redecoded.hidden_dtype, decoded.hidden_dtype);
            assert_eq!(redecoded.hidden_states.data, decoded.hidden_states.data);
        }
        Err(error) => panic!("our own sample did not pass the schema: {error}"),
    }
}

/// The committed corpus of fuzz target `target`:
/// `tests/fuzz/corpus/<target>/` of this repository.
pub fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fuzz/corpus")
        .join(target)
}

/// Runs `body` on every file of `target`'s committed corpus, in name
/// order; returns how many. What the replay tests of each crate call.
///
/// # Panics
/// When the corpus cannot be read, or `body` panics (naming the file).
pub fn replay_corpus(target: &str, body: fn(&[u8])) -> usize {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .collect(),
        Err(error) => panic!("{}: {error}", dir.display()),
    };
    files.sort();
    for file in &files {
        let bytes =
            std::fs::read(file).unwrap_or_else(|error| panic!("{}: {error}", file.display()));
        if let Err(panic) = std::panic::catch_unwind(|| body(&bytes)) {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
                .unwrap_or_default();
            panic!("{}: {message}", file.display());
        }
    }
    files.len()
}

/// Writes `seeds` into their targets' corpora as `seed-<name>`.
pub fn write_seeds(seeds: &[Seed]) -> std::io::Result<()> {
    for seed in seeds {
        let dir = corpus_dir(seed.target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(format!("seed-{}", seed.name)), &seed.bytes)?;
    }
    Ok(())
}

/// Bytes of a pattern that differs per `seed`.
fn patterned(bytes: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..bytes)
            .map(|index| (index as u8).wrapping_mul(29).wrapping_add(seed))
            .collect::<Vec<_>>(),
    )
}

/// bf16 bytes of small finite values (1.0, -0.5, ...), `count` of them.
pub fn bf16_values(count: usize) -> Bytes {
    Bytes::from(
        (0..count)
            .flat_map(|index| {
                let value = (index as f32 - 3.0) * 0.25;
                ((value.to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect::<Vec<_>>(),
    )
}

/// A schema sample of `tokens` tokens and hidden width `width` (bf16).
pub fn schema_sample(tokens: usize, width: usize) -> proto::Sample {
    let ids: Vec<i64> = (0..tokens as i64).map(|token| 100 + token * 7).collect();
    let mask: Vec<u8> = (0..tokens).map(|token| u8::from(token % 3 != 0)).collect();
    schema::encode(
        &ids,
        &mask,
        bf16_values(tokens * width),
        proto::Dtype::Bf16,
        width as u64,
    )
}

/// `messages` as a gRPC body: each one's prefix and prost's bytes, written
/// by [`Pieces`] as the broker and the clients write them.
pub fn framed_body<T: Message>(messages: &[T]) -> Vec<u8> {
    let mut body = Vec::new();
    for message in messages {
        if let Ok(frame) = Pieces::whole(message) {
            body.extend_from_slice(&frame);
        }
    }
    body
}

/// Seed inputs for [`frames`] and [`sample`], from this crate's encoders:
/// Produce and Consume bodies of real messages cut in several ways, limits
/// that fit and one that does not, a truncated body; schema samples in each
/// accepted dtype.
pub fn seeds() -> Vec<Seed> {
    let mut seeds = Vec::new();
    let item = |seq: u64, tokens: usize, width: usize| proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Item(proto::Item {
            seq,
            sample: Some(schema_sample(tokens, width)),
            trace_context: [(
                "traceparent".to_string(),
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_string(),
            )]
            .into_iter()
            .collect(),
        })),
    };
    let hello = proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Hello(proto::ProducerHello {
            target_id: "target-0".into(),
            run_id: "run-1".into(),
        })),
    };
    let produce = framed_body(&[hello, item(1, 4, 8), item(2, 3, 16)]);
    for (name, limit_byte, cut_byte) in [
        ("produce-one-frame", 0x80, 0),
        ("produce-small-frames", 0x80, 7),
        ("produce-bytewise", 0x80, 1),
        ("produce-large-frames", 0x80, 200),
        ("produce-over-limit", 0x80 | 5, 0),
    ] {
        seeds.push(Seed {
            target: "proto_frames",
            name: name.to_string(),
            bytes: ReceivedBody::input(limit_byte, cut_byte, &produce),
        });
    }
    let delivery = |delivery_id: u64, tokens: usize| proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::Delivery(proto::Delivery {
            delivery_id,
            target_id: "target-1".into(),
            seq: delivery_id + 40,
            sample: Some(schema_sample(tokens, 4)),
            delivery_count: 1,
            trace_context: Default::default(),
        })),
    };
    let welcome = proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::Welcome(
            proto::ConsumerWelcome::default(),
        )),
    };
    let consume = framed_body(&[welcome, delivery(1, 5), delivery(2, 2)]);
    for (name, cut_byte) in [
        ("consume-one-frame", 0),
        ("consume-cut", 13),
        ("consume-cut-wide", 140),
    ] {
        seeds.push(Seed {
            target: "proto_frames",
            name: name.to_string(),
            bytes: ReceivedBody::input(0, cut_byte, &consume),
        });
    }
    seeds.push(Seed {
        target: "proto_frames",
        name: "consume-truncated".to_string(),
        bytes: ReceivedBody::input(0, 3, &consume[..consume.len() - 7]),
    });
    let mut compressed = consume.clone();
    compressed[0] = 1;
    seeds.push(Seed {
        target: "proto_frames",
        name: "consume-compressed-flag".to_string(),
        bytes: ReceivedBody::input(0, 0, &compressed),
    });

    for (name, tokens, width) in [
        ("sample-1x1", 1, 1),
        ("sample-5x8", 5, 8),
        ("sample-0x4", 0, 4),
    ] {
        seeds.push(Seed {
            target: "proto_sample",
            name: name.to_string(),
            bytes: schema_sample(tokens, width).encode_to_vec(),
        });
    }
    let mut wide = schema_sample(3, 2);
    wide.tensors[0] = proto::Tensor::from_parts(
        schema::INPUT_IDS,
        proto::Dtype::I64,
        vec![3],
        Bytes::from(
            [1i64, 70_000, 5_000_000_000]
                .iter()
                .flat_map(|id| id.to_le_bytes())
                .collect::<Vec<_>>(),
        ),
    );
    wide.tensors[1] = proto::Tensor::from_parts(
        schema::LOSS_MASK,
        proto::Dtype::I32,
        vec![3],
        patterned(12, 1),
    );
    wide.tensors[2].dtype = proto::Dtype::F16 as i32;
    seeds.push(Seed {
        target: "proto_sample",
        name: "sample-int64-ids-int32-mask-f16".to_string(),
        bytes: wide.encode_to_vec(),
    });
    let mut float32 = schema_sample(2, 2);
    float32.tensors[2] = proto::Tensor::from_parts(
        schema::HIDDEN_STATES,
        proto::Dtype::F32,
        vec![2, 2],
        Bytes::from(
            [0.5f32, f32::NAN, -1.0, f32::INFINITY]
                .iter()
                .flat_map(|value| value.to_le_bytes())
                .collect::<Vec<_>>(),
        ),
    );
    seeds.push(Seed {
        target: "proto_sample",
        name: "sample-f32-non-finite".to_string(),
        bytes: float32.encode_to_vec(),
    });
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed passes its fuzz body, and the ones built to decode do:
    /// the seeds reach the decoders' insides, not only their first check.
    #[test]
    fn every_seed_passes_and_the_well_formed_ones_decode() {
        for seed in seeds() {
            match seed.target {
                "proto_frames" => frames(&seed.bytes),
                "proto_sample" => sample(&seed.bytes),
                other => panic!("a seed for {other}"),
            }
        }
        let produce = seeds()
            .into_iter()
            .find(|seed| seed.name == "produce-small-frames")
            .unwrap();
        let body = ReceivedBody::parse(&produce.bytes);
        assert!(body.frames.len() > 10);
        let read = read_messages(body.frames, body.direction, body.limit);
        assert_eq!((read.messages.len(), read.error.is_none()), (3, true));
        let sample_seed = seeds()
            .into_iter()
            .find(|seed| seed.name == "sample-5x8")
            .unwrap();
        let decoded = proto::Sample::decode(sample_seed.bytes.as_slice()).unwrap();
        assert_eq!(schema::decode(&decoded).unwrap().tokens, 5);
    }

    #[test]
    fn the_same_cut_byte_cuts_the_same_way_and_keeps_every_byte() {
        let body = patterned(5000, 3);
        for cut_byte in [0u8, 1, 9, 127, 128, 255] {
            let frames = cut_into_frames(&body, cut_byte);
            assert_eq!(frames, cut_into_frames(&body, cut_byte));
            let joined: Vec<u8> = frames.iter().flat_map(|frame| frame.to_vec()).collect();
            assert_eq!(joined, body.to_vec(), "cut byte {cut_byte}");
            assert!(frames.iter().all(|frame| !frame.is_empty()));
        }
        assert_eq!(cut_into_frames(&body, 1).len(), 5000);
    }
}
