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
//! - [`model_sync`]: ModelSync sessions' messages, interleaved, against one
//!   center, as the session adapter (`model_sync::service`) applies them.
//! - [`center_checkpoint`]: a center checkpoint's files through the reader
//!   a restarted broker resumes the center with.
//! - [`wal_segment`]: a write-ahead log segment (header and frames)
//!   replayed as a restarted broker replays its newest one, and the queue
//!   rebuilt from what it recovered.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_proto::frames::{Direction, Rope};
use dflash_proto::fuzzing::{
    read_messages, rope_bytes, same_message, schema_sample, ReceivedBody, Seed,
};
use dflash_proto::v1 as proto;
use prost::Message;

use crate::convert::WirePayload;
use crate::model_sync::arith::{self, WireDtype};
use crate::model_sync::center::{ModelSyncState, OuterSettings, Upload};
use crate::model_sync::checkpoint::{self, CenterFiles};
use crate::payload::{decode_produce_request, ProduceIn, WireItem};
use crate::queue::Delivery;
use crate::service::ConsumeOut;
use crate::zero_copy::grpc_frame;

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
    let bytes = item.held_bytes();
    let delivery = Delivery {
        delivery_id: 7,
        target_id: Arc::from("target-0"),
        seq: item.seq,
        payload: WirePayload {
            item: Arc::new(item),
            bytes,
        },
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

/// Drafter sessions one [`model_sync`] input can hold open at once.
const SESSIONS: usize = 4;
/// The config every fuzzed JOIN is pinned to when the settings pin one.
const PINNED_CONFIG: &str = r#"{"model_type": "dflash", "hidden_size": 4}"#;

/// One open session: what `model_sync::service` keeps per stream.
struct FuzzSession {
    drafter_id: String,
    model_config_json: String,
    upload: Option<Upload>,
}

/// The input layout of [`model_sync`]: `[settings byte]` then records of
/// `[session byte] [length: u16 little-endian] [SyncRequest bytes]` (the
/// length cut to what remains). The session byte's low two bits pick the
/// session; with bit 7 set that session's stream ends instead (its message
/// is ignored). The settings byte: bit 0 momentum 0.7 (else 0), bit 1 a
/// momentum delay of 2 (else the open sessions), bit 2 a staleness bound
/// of 1, bit 3 a pinned model config, bit 4 acks that credit at most 3
/// samples, bits 5–6 the outer learning rate (1, 0.5, 2, 0.1).
pub fn model_sync_input(settings: u8, records: &[(u8, proto::SyncRequest)]) -> Vec<u8> {
    let mut input = vec![settings];
    for (session, request) in records {
        let bytes = request.encode_to_vec();
        input.push(*session);
        input.extend_from_slice(&(bytes.len().min(usize::from(u16::MAX)) as u16).to_le_bytes());
        input.extend_from_slice(&bytes);
    }
    input
}

/// Fuzz body: sessions' messages (layout: [`model_sync_input`]) against
/// one center, each handled as `model_sync::service` handles it: a hello
/// first (drafter id and config checked), then begin, chunks and commit;
/// an error ends the session.
///
/// Checks after every message: the center is finite (weights and the
/// outer optimizer's buffers); a refused exchange, and one that applied no
/// delta, left the center as it was; the version moves by one exactly when
/// a delta was applied; the reply's encoding of the center decodes back to
/// it (exactly in f32).
pub fn model_sync(data: &[u8]) {
    let _ = run_sessions(data);
}

/// [`model_sync`]'s work; the state it left (the seeds' test reads it).
fn run_sessions(data: &[u8]) -> Option<ModelSyncState> {
    let (&settings_byte, mut rest) = data.split_first()?;
    let settings = OuterSettings {
        learning_rate: [1.0, 0.5, 2.0, 0.1][usize::from(settings_byte >> 5 & 3)],
        momentum: if settings_byte & 1 != 0 { 0.7 } else { 0.0 },
        momentum_delay: if settings_byte & 2 != 0 { 2 } else { 0 },
        max_staleness: u64::from(settings_byte >> 2 & 1),
        ..OuterSettings::default()
    };
    let mut state = ModelSyncState::new(settings, None);
    if settings_byte & 8 != 0 && state.pin_config(PINNED_CONFIG).is_err() {
        panic!("the pinned config is valid JSON");
    }
    let acked_by_drafter = (settings_byte & 16 != 0).then_some(3);
    let mut sessions: [Option<FuzzSession>; SESSIONS] = Default::default();
    let start = Instant::now();
    let mut clock = 0u64;
    while rest.len() >= 3 {
        let session_byte = rest[0];
        let declared = usize::from(u16::from_le_bytes([rest[1], rest[2]]));
        let length = declared.min(rest.len() - 3);
        let message = &rest[3..3 + length];
        rest = &rest[3 + length..];
        let slot = &mut sessions[usize::from(session_byte) % SESSIONS];
        if session_byte & 0x80 != 0 {
            if let Some(session) = slot.take() {
                state.close_session(&session.drafter_id);
            }
            continue;
        }
        let Ok(request) = proto::SyncRequest::decode(message) else {
            // tonic ends the stream on an undecodable message.
            if let Some(session) = slot.take() {
                state.close_session(&session.drafter_id);
            }
            continue;
        };
        clock += 1;
        let now = start + Duration::from_millis(clock);
        let refused = match slot {
            None => {
                *slot = open_session(&mut state, request);
                false
            }
            Some(session) => {
                handle_request(&mut state, session, request, acked_by_drafter, now).is_err()
            }
        };
        if refused {
            if let Some(session) = slot.take() {
                state.close_session(&session.drafter_id);
            }
        }
    }
    for session in sessions.into_iter().flatten() {
        state.close_session(&session.drafter_id);
    }
    assert!(
        state.awaiting_final().is_empty(),
        "a closed session is awaited"
    );
    let _ = state.status(start + Duration::from_secs(1));
    Some(state)
}

/// A session's first message, checked as `ModelSyncService::session` does.
fn open_session(state: &mut ModelSyncState, request: proto::SyncRequest) -> Option<FuzzSession> {
    let Some(proto::sync_request::Kind::Hello(hello)) = request.kind else {
        return None;
    };
    if hello.drafter_id.is_empty()
        || crate::roles::validate_id("drafter_id", &hello.drafter_id).is_err()
        || serde_json::from_str::<serde_json::Value>(&hello.model_config_json).is_err()
    {
        return None;
    }
    state.open_session(&hello.drafter_id);
    Some(FuzzSession {
        drafter_id: hello.drafter_id,
        model_config_json: hello.model_config_json,
        upload: None,
    })
}

/// The center's weights and optimizer buffers as bits, and its version.
type CenterImage = Option<(u64, Vec<Vec<u32>>)>;

fn center_image(state: &ModelSyncState) -> CenterImage {
    state.center().map(|center| {
        let buffers = center
            .tensors
            .iter()
            .flat_map(|tensor| [&tensor.values, &tensor.velocity, &tensor.delta_sum])
            .map(|values| values.iter().map(|value| value.to_bits()).collect())
            .collect();
        (center.version, buffers)
    })
}

/// One message of an open session, as `model_sync::service::handle_request`
/// and `commit_exchange` handle it.
fn handle_request(
    state: &mut ModelSyncState,
    session: &mut FuzzSession,
    request: proto::SyncRequest,
    acked_by_drafter: Option<u64>,
    now: Instant,
) -> Result<(), ()> {
    use proto::sync_request::Kind;
    match request.kind {
        Some(Kind::Begin(begin)) => {
            if session.upload.is_some() {
                return Err(());
            }
            session.upload = Some(Upload::new(&begin).map_err(drop)?);
            Ok(())
        }
        Some(Kind::Chunk(chunk)) => {
            let open = session.upload.as_mut().ok_or(())?;
            open.add_chunk(chunk).map_err(drop)
        }
        Some(Kind::Commit(commit)) => {
            let mut open = session.upload.take().ok_or(())?;
            let reply_dtype = open.reply_dtype;
            open.measure_norm();
            open.acked_by_drafter = acked_by_drafter;
            let before = center_image(state);
            let outcome = state.commit(
                &session.drafter_id,
                open,
                commit.tensors,
                &session.model_config_json,
                now,
            );
            check_center(state, reply_dtype);
            let after = center_image(state);
            let before_version = before.as_ref().map(|(version, _)| *version);
            match &outcome {
                Err(_) => assert!(before == after, "a refused exchange changed the center"),
                Ok(outcome) if outcome.applied => {
                    assert_eq!(
                        before_version.map(|version| version + 1),
                        Some(outcome.center_version)
                    );
                }
                Ok(outcome) if outcome.initialised => assert_eq!(before_version, None),
                Ok(_) => assert!(
                    before == after,
                    "an exchange that applied nothing changed the center"
                ),
            }
            outcome.map(drop).map_err(drop)
        }
        Some(Kind::Hello(_)) | None => Err(()),
    }
}

/// The center is finite, and its reply encoding decodes back to it.
fn check_center(state: &ModelSyncState, reply_dtype: WireDtype) {
    let Some(center) = state.center() else {
        return;
    };
    for tensor in &center.tensors {
        for (what, values) in [
            ("weights", &tensor.values),
            ("velocity", &tensor.velocity),
            ("delta sum", &tensor.delta_sum),
        ] {
            if let Some(index) = values.iter().position(|value| !value.is_finite()) {
                panic!(
                    "the center's {what} of {:?} are not finite: {} at {index}",
                    tensor.name, values[index]
                );
            }
        }
    }
    // The bounds the center carries cover its buffers (up to f32's
    // rounding of the steps they were carried through).
    let measured = center.measure_magnitudes();
    for (what, measured, bound) in [
        ("weights", measured.values, center.magnitudes.values),
        ("velocity", measured.velocity, center.magnitudes.velocity),
        ("delta sum", measured.delta_sum, center.magnitudes.delta_sum),
    ] {
        assert!(
            measured <= bound * (1.0 + 1e-4),
            "the center's {what} reach {measured:e}, over their bound {bound:e}"
        );
    }
    let Some((_, encoded)) = state.encode_center(reply_dtype) else {
        return;
    };
    for ((name, shape, bytes), tensor) in encoded.iter().zip(&center.tensors) {
        assert_eq!((name, shape), (&tensor.name, &tensor.shape));
        let mut back = vec![0.0f32; tensor.values.len()];
        if let Err(error) = arith::decode_into(&mut back, bytes, reply_dtype) {
            panic!("the center's reply encoding: {error}");
        }
        if reply_dtype == WireDtype::F32 {
            assert!(
                back.iter()
                    .map(|value| value.to_bits())
                    .eq(tensor.values.iter().map(|value| value.to_bits())),
                "the center's f32 reply differs from it"
            );
        }
    }
}

/// The input layout of [`center_checkpoint`]: `[flags]` then the files
/// `config.json`, `model.safetensors`, `center_state.json` and
/// `outer_optimizer.safetensors`, each as `[length: u32 little-endian]
/// [bytes]` (the length cut to what remains); a file the input ends before
/// is absent. Flags bit 0: read with momentum.
pub fn center_checkpoint_input(momentum: bool, files: &[&[u8]]) -> Vec<u8> {
    let mut input = vec![u8::from(momentum)];
    for file in files {
        input.extend_from_slice(&(file.len() as u32).to_le_bytes());
        input.extend_from_slice(file);
    }
    input
}

/// Fuzz body: a center checkpoint's files (layout:
/// [`center_checkpoint_input`]) through [`checkpoint::decode_center`], the
/// reader of a restarted broker.
///
/// Checks: a center read is finite with its optimizer buffers as long as
/// its weights (or empty without momentum), and written again by the
/// checkpoint's encoders it reads back the same, bit for bit.
pub fn center_checkpoint(data: &[u8]) {
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let momentum = flags & 1 != 0;
    let mut files: Vec<&[u8]> = Vec::new();
    while rest.len() >= 4 && files.len() < 4 {
        let declared = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let length = declared.min(rest.len() - 4);
        files.push(&rest[4..4 + length]);
        rest = &rest[4 + length..];
    }
    let [config, model, state, optimizer] = [0, 1, 2, 3].map(|index| files.get(index).copied());
    let (Some(config), Some(model)) = (config, model) else {
        return;
    };
    // Text files that are not UTF-8 fail to be read (`read_to_string`).
    let Ok(config_json) = std::str::from_utf8(config) else {
        return;
    };
    let state_json = match state.map(std::str::from_utf8) {
        Some(Err(_)) => return,
        Some(Ok(text)) => Some(text),
        None => None,
    };
    let files = CenterFiles {
        config_json,
        model,
        state_json,
        optimizer: optimizer.filter(|_| momentum),
    };
    let dir = Path::new("center");
    let Ok(center) = checkpoint::decode_center(dir, files, momentum) else {
        return;
    };
    for tensor in &center.tensors {
        assert!(tensor.values.iter().all(|value| value.is_finite()));
        let optimizer_len = if momentum { tensor.values.len() } else { 0 };
        assert_eq!(tensor.velocity.len(), optimizer_len);
        assert_eq!(tensor.delta_sum.len(), optimizer_len);
    }
    let written = match checkpoint::encode_center_files(&center, "fuzz") {
        Ok(written) => written,
        Err(error) => panic!("a center read could not be written again: {error}"),
    };
    let file = |name: &str| {
        written
            .iter()
            .find(|(file_name, _)| *file_name == name)
            .map(|(_, bytes)| bytes.as_slice())
    };
    let config_again = file(checkpoint::CONFIG_FILE_NAME).map(String::from_utf8_lossy);
    let state_again = file(checkpoint::STATE_FILE_NAME).map(String::from_utf8_lossy);
    let again = checkpoint::decode_center(
        dir,
        CenterFiles {
            config_json: config_again.as_deref().unwrap_or_default(),
            model: file(checkpoint::MODEL_FILE_NAME).unwrap_or_default(),
            state_json: state_again.as_deref(),
            optimizer: file(checkpoint::OPTIMIZER_FILE_NAME),
        },
        momentum,
    );
    let again = match again {
        Ok(again) => again,
        Err(error) => panic!("a center written again did not read back: {error}"),
    };
    assert_eq!(
        (again.version, again.samples, again.pending_deltas),
        (center.version, center.samples, center.pending_deltas)
    );
    assert_eq!(again.tensors.len(), center.tensors.len());
    for (left, right) in again.tensors.iter().zip(&center.tensors) {
        assert_eq!((&left.name, &left.shape), (&right.name, &right.shape));
        for (left, right) in [
            (&left.values, &right.values),
            (&left.velocity, &right.velocity),
            (&left.delta_sum, &right.delta_sum),
        ] {
            assert!(
                left.iter()
                    .map(|value| value.to_bits())
                    .eq(right.iter().map(|value| value.to_bits())),
                "a center tensor changed in its round trip"
            );
        }
    }
}

/// A chunk of tensor `name` (`dtype`, `shape`) at `offset`.
fn chunk(
    name: &str,
    dtype: proto::Dtype,
    shape: &[u64],
    offset: u64,
    data: Vec<u8>,
) -> proto::SyncRequest {
    proto::SyncRequest {
        kind: Some(proto::sync_request::Kind::Chunk(proto::TensorChunk {
            name: name.to_string(),
            dtype: dtype as i32,
            shape: shape.to_vec(),
            offset,
            data: Bytes::from(data),
        })),
    }
}

fn hello(drafter_id: &str, config: &str) -> proto::SyncRequest {
    proto::SyncRequest {
        kind: Some(proto::sync_request::Kind::Hello(proto::SyncHello {
            drafter_id: drafter_id.to_string(),
            model_config_json: config.to_string(),
        })),
    }
}

fn begin(
    kind: proto::SyncKind,
    base_version: u64,
    samples: u64,
    reply: proto::Dtype,
) -> proto::SyncRequest {
    proto::SyncRequest {
        kind: Some(proto::sync_request::Kind::Begin(proto::SyncBegin {
            kind: kind as i32,
            base_version,
            steps: 4,
            samples,
            tokens: samples * 16,
            reply_dtype: reply as i32,
        })),
    }
}

fn commit(tensors: u32) -> proto::SyncRequest {
    proto::SyncRequest {
        kind: Some(proto::sync_request::Kind::Commit(proto::SyncCommit {
            tensors,
        })),
    }
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

fn bf16_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values
        .into_iter()
        .flat_map(|value| arith::f32_to_bf16(value).to_le_bytes())
        .collect()
}

/// An exchange's messages: begin, each tensor of the model (`weight` [2, 3]
/// and `bias` [3]) in chunks of `chunk_elements`, commit.
fn exchange(
    kind: proto::SyncKind,
    base_version: u64,
    dtype: proto::Dtype,
    scale: f32,
    chunk_elements: usize,
) -> Vec<proto::SyncRequest> {
    let mut messages = vec![begin(kind, base_version, 2, proto::Dtype::Bf16)];
    for (name, shape) in [("bias", vec![3u64]), ("weight", vec![2, 3])] {
        let elements = shape.iter().product::<u64>() as usize;
        let values: Vec<f32> = (0..elements)
            .map(|index| scale * (index as f32 - 2.5))
            .collect();
        let element_bytes = if dtype == proto::Dtype::Bf16 { 2 } else { 4 };
        for (index, part) in values.chunks(chunk_elements).enumerate() {
            let data = match dtype {
                proto::Dtype::Bf16 => bf16_bytes(part.iter().copied()),
                _ => f32_bytes(part.iter().copied()),
            };
            let offset = (index * chunk_elements * element_bytes) as u64;
            messages.push(chunk(name, dtype, &shape, offset, data));
        }
    }
    messages.push(commit(2));
    messages
}

/// Seed inputs for the broker's fuzz bodies, from its own encoders and
/// prost's (the drafter's encoder of sync messages): Produce bodies of real
/// items cut several ways; sessions that join, update (f32 and bf16
/// deltas, stale ones, with momentum), finish, and one that is refused;
/// checkpoints written by the center's writer, with and without momentum.
/// Fuzz body: a write-ahead log segment's bytes (its 32-byte header, then
/// frames) replayed as the newest segment is when a broker restarts
/// ([`crate::wal::replay_bytes`]; every frame's length is checked against
/// the bytes left before anything is allocated), then the queue rebuilt
/// from whatever it recovered, as a restarted broker rebuilds it.
///
/// Checks: neither panics, and the rebuilt queue keeps its invariants
/// (`Queue::check_invariants`), whatever sequence of records the segment
/// held.
pub fn wal_segment(data: &[u8]) {
    let Ok((recovered, _records)) = crate::wal::replay_bytes::<WirePayload>(data) else {
        return;
    };
    let config = crate::BrokerConfig::for_targets(2).queue_config();
    let queue = crate::queue::Queue::recover(config, recovered, Instant::now());
    if let Err(broken) = queue.check_invariants() {
        panic!("a queue rebuilt from a replayed segment breaks an invariant: {broken}");
    }
}

/// Seed segments for [`wal_segment`]: what a run's log holds (epochs,
/// accepted items, deliveries, acks, a dead letter, done), a snapshot, and
/// an aborted run.
fn wal_seeds() -> Vec<Seed> {
    use crate::queue::JournalEntry;
    let item = |seq: u64| {
        let proto_item = proto::Item {
            seq,
            sample: Some(schema_sample(2, 4)),
            trace_context: Default::default(),
        };
        let encoded = proto_item.encode_to_vec();
        <WirePayload as crate::wal::DurablePayload>::decode_payload(&encoded).ok()
    };
    let target = |index: usize| -> Arc<str> { Arc::from(format!("target-{index}").as_str()) };
    let mut run = Vec::new();
    for index in 0..2 {
        run.push(JournalEntry::Epoch {
            target_id: target(index),
            epoch: 1,
        });
        for seq in 0..3 {
            if let Some(payload) = item(seq) {
                run.push(JournalEntry::Accepted {
                    target_id: target(index),
                    seq,
                    payload,
                });
            }
        }
        run.push(JournalEntry::Delivered {
            target_id: target(index),
            seq: 0,
            deliveries: 1,
        });
        run.push(JournalEntry::Acked {
            target_id: target(index),
            seq: 0,
        });
    }
    run.push(JournalEntry::Done {
        target_id: target(0),
    });
    let mut aborted = run.clone();
    aborted.push(JournalEntry::Aborted {
        reason: "target target-1 failed".to_string(),
    });
    let config = crate::BrokerConfig::for_targets(2);
    let fingerprint = config.log_config().shape.fingerprint();
    // The run's log compacted: the queue rebuilt from it, as a snapshot.
    let snapshot =
        crate::wal::replay_bytes::<WirePayload>(&crate::wal::encode_segment(fingerprint, &run))
            .map(|(recovered, _)| {
                crate::queue::Queue::recover(config.queue_config(), recovered, Instant::now())
                    .snapshot_entries()
            })
            .unwrap_or_default();
    [("run", run), ("aborted", aborted), ("snapshot", snapshot)]
        .into_iter()
        .map(|(name, entries)| Seed {
            target: "wal_segment",
            name: name.to_string(),
            bytes: crate::wal::encode_segment(fingerprint, &entries),
        })
        .collect()
}

pub fn seeds() -> Vec<Seed> {
    let mut seeds = wal_seeds();
    let item = |seq: u64, tokens: usize, width: usize| proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Item(proto::Item {
            seq,
            sample: Some(schema_sample(tokens, width)),
            trace_context: [("traceparent".to_string(), "00-ab-cd-01".to_string())]
                .into_iter()
                .collect(),
        })),
    };
    let hello_message = proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Hello(proto::ProducerHello {
            target_id: "target-0".into(),
            run_id: String::new(),
        })),
    };
    let stats = proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Stats(
            proto::ProducerStats::default(),
        )),
    };
    let body =
        dflash_proto::fuzzing::framed_body(&[hello_message, item(1, 4, 8), stats, item(2, 2, 4)]);
    for (name, cut_byte) in [
        ("stream-one-frame", 0u8),
        ("stream-small-frames", 11),
        ("stream-wide-frames", 131),
    ] {
        seeds.push(Seed {
            target: "broker_produce",
            name: name.to_string(),
            bytes: ReceivedBody::input(0x80, cut_byte, &body),
        });
    }
    // A tensor of 16 KiB and more is kept as its frames' slices.
    let large = dflash_proto::fuzzing::framed_body(&[item(3, 2, LARGE_WIDTH)]);
    seeds.push(Seed {
        target: "broker_produce",
        name: "large-tensor-across-frames".to_string(),
        bytes: ReceivedBody::input(0x80 | 100, 150, &large),
    });
    let mut duplicate = item(4, 2, 2);
    if let Some(proto::produce_request::Kind::Item(item)) = &mut duplicate.kind {
        if let Some(sample) = &mut item.sample {
            let first = sample.tensors[0].clone();
            sample.tensors.push(first);
        }
    }
    seeds.push(Seed {
        target: "broker_produce",
        name: "duplicate-tensor".to_string(),
        bytes: ReceivedBody::input(0x80, 0, &dflash_proto::fuzzing::framed_body(&[duplicate])),
    });

    use proto::{Dtype, SyncKind};
    let config = PINNED_CONFIG;
    let mut join_update_final = vec![(0, hello("drafter-0", config))];
    join_update_final.extend(
        exchange(SyncKind::Join, 0, Dtype::F32, 1.0, 2)
            .into_iter()
            .map(|message| (0, message)),
    );
    join_update_final.push((1, hello("drafter-1", config)));
    join_update_final.push((1, begin(SyncKind::Join, 0, 0, Dtype::F32)));
    join_update_final.push((1, commit(0)));
    join_update_final.extend(
        exchange(SyncKind::Update, 0, Dtype::Bf16, 0.01, 4)
            .into_iter()
            .map(|message| (0, message)),
    );
    join_update_final.extend(
        exchange(SyncKind::Update, 0, Dtype::F32, -0.02, 9)
            .into_iter()
            .map(|message| (1, message)),
    );
    join_update_final.extend(
        exchange(SyncKind::Final, 1, Dtype::Bf16, 0.005, 3)
            .into_iter()
            .map(|message| (0, message)),
    );
    join_update_final.push((1, begin(SyncKind::Final, 2, 0, Dtype::F32)));
    join_update_final.push((1, commit(0)));
    join_update_final.push((0x80, commit(0)));
    for (name, settings) in [
        ("sessions-plain", 0u8),
        ("sessions-momentum", 1),
        ("sessions-momentum-delay-staleness", 1 | 2 | 4),
        ("sessions-pinned-acked-lr-half", 8 | 16 | 32),
    ] {
        seeds.push(Seed {
            target: "model_sync",
            name: name.to_string(),
            bytes: model_sync_input(settings, &join_update_final),
        });
    }
    let mut refused = vec![(2, hello("drafter-2", config))];
    refused.extend(
        exchange(SyncKind::Join, 0, Dtype::Bf16, 1.0, 6)
            .into_iter()
            .map(|message| (2, message)),
    );
    refused.push((2, begin(SyncKind::Update, 0, 1, Dtype::F32)));
    refused.push((
        2,
        chunk("bias", Dtype::F32, &[4], 0, f32_bytes([1.0, 2.0, 3.0, 4.0])),
    ));
    refused.push((2, commit(1)));
    refused.push((3, hello("drafter-3", r#"{"model_type": "other"}"#)));
    refused.push((3, begin(SyncKind::Join, 0, 0, Dtype::F32)));
    refused.push((3, commit(0)));
    seeds.push(Seed {
        target: "model_sync",
        name: "sessions-refused".to_string(),
        bytes: model_sync_input(8, &refused),
    });

    for (name, momentum, with_state) in [
        ("center-plain", false, true),
        ("center-momentum", true, true),
        ("center-without-state", false, false),
    ] {
        let Some(files) = seed_center_files(momentum) else {
            continue;
        };
        let file = |wanted: &str| {
            files
                .iter()
                .find(|(name, _)| *name == wanted)
                .map_or(&[][..], |(_, bytes)| bytes.as_slice())
        };
        let mut parts = vec![
            file(checkpoint::CONFIG_FILE_NAME),
            file(checkpoint::MODEL_FILE_NAME),
        ];
        if with_state {
            parts.push(file(checkpoint::STATE_FILE_NAME));
            if momentum {
                parts.push(file(checkpoint::OPTIMIZER_FILE_NAME));
            }
        }
        seeds.push(Seed {
            target: "center_checkpoint",
            name: name.to_string(),
            bytes: center_checkpoint_input(momentum, &parts),
        });
    }
    seeds
}

/// Width of the seed item whose hidden states span frames (2 tokens of
/// bf16: 16 KiB and more).
const LARGE_WIDTH: usize = 4200;

/// A center made by a JOIN and an update through the state machine, as
/// its checkpoint writer encodes it.
fn seed_center_files(momentum: bool) -> Option<Vec<(&'static str, Vec<u8>)>> {
    let settings = OuterSettings {
        momentum: if momentum { 0.7 } else { 0.0 },
        ..OuterSettings::default()
    };
    let mut state = ModelSyncState::new(settings, None);
    let now = Instant::now();
    for (kind, dtype, scale) in [
        (proto::SyncKind::Join, proto::Dtype::F32, 1.0),
        (proto::SyncKind::Update, proto::Dtype::Bf16, 0.01),
    ] {
        let messages = exchange(kind, 0, dtype, scale, 4);
        let mut upload = None;
        for message in messages {
            match message.kind {
                Some(proto::sync_request::Kind::Begin(begin)) => upload = Upload::new(&begin).ok(),
                Some(proto::sync_request::Kind::Chunk(chunk)) => {
                    upload.as_mut()?.add_chunk(chunk).ok()?;
                }
                Some(proto::sync_request::Kind::Commit(commit)) => {
                    state
                        .commit(
                            "drafter-0",
                            upload.take()?,
                            commit.tensors,
                            PINNED_CONFIG,
                            now,
                        )
                        .ok()?;
                }
                _ => {}
            }
        }
    }
    let center = state.center()?;
    checkpoint::encode_center_files(center, &settings.describe()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed passes its fuzz body, and the seeds reach the decoders'
    /// insides: the sessions make and update a center, the checkpoints
    /// read back.
    #[test]
    fn every_seed_passes_and_reaches_past_the_first_checks() {
        let seeds = seeds();
        for seed in &seeds {
            match seed.target {
                "broker_produce" => produce(&seed.bytes),
                "model_sync" => model_sync(&seed.bytes),
                "center_checkpoint" => center_checkpoint(&seed.bytes),
                "wal_segment" => {
                    wal_segment(&seed.bytes);
                    // Past the header: every seed's records are read.
                    let (_, records) =
                        crate::wal::replay_bytes::<WirePayload>(&seed.bytes).unwrap();
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
                count("center_checkpoint"),
                count("wal_segment")
            ),
            (5, 5, 3, 3)
        );
        for seed in seeds.iter().filter(|seed| seed.target == "model_sync") {
            let state = run_sessions(&seed.bytes).unwrap();
            let status = state.status(Instant::now());
            if seed.name == "sessions-refused" {
                // The JOIN made the center; the bad update and the other
                // model's JOIN changed nothing.
                assert_eq!((status.center_version, status.updates_applied), (0, 0));
                continue;
            }
            assert_eq!(status.center_version, 3, "{}", seed.name);
            assert!(
                status.drafters.iter().all(|drafter| drafter.finished),
                "{}",
                seed.name
            );
        }
        assert!(seed_center_files(true).is_some_and(|files| files.len() == 4));
        let momentum = seed_center_files(true).unwrap();
        let file = |name: &str| {
            momentum
                .iter()
                .find(|(file_name, _)| *file_name == name)
                .map(|(_, bytes)| bytes.as_slice())
        };
        let config =
            String::from_utf8(file(checkpoint::CONFIG_FILE_NAME).unwrap().to_vec()).unwrap();
        let state = String::from_utf8(file(checkpoint::STATE_FILE_NAME).unwrap().to_vec()).unwrap();
        let center = checkpoint::decode_center(
            Path::new("center"),
            CenterFiles {
                config_json: &config,
                model: file(checkpoint::MODEL_FILE_NAME).unwrap(),
                state_json: Some(&state),
                optimizer: file(checkpoint::OPTIMIZER_FILE_NAME),
            },
            true,
        )
        .unwrap();
        assert_eq!((center.version, center.tensors.len()), (1, 2));
    }
}
