//! The center's fuzz bodies: [`model_sync`] (sessions against one
//! center) and [`center_checkpoint`] (the checkpoint reader).

use std::path::Path;
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;
use prost::Message;

use crate::model_sync::arith::{self, WireDtype};
use crate::model_sync::center::{ModelSyncState, OuterSettings, StalenessScaling, Upload};
use crate::model_sync::checkpoint::{self, CenterFiles};

/// Drafter sessions one [`model_sync`] input can hold open at once.
pub(super) const SESSIONS: usize = 4;
/// The config every fuzzed JOIN is pinned to when the settings pin one.
pub(super) const PINNED_CONFIG: &str = r#"{"model_type": "dflash", "hidden_size": 4}"#;

/// One open session: what `model_sync::service` keeps per stream.
pub(super) struct FuzzSession {
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
pub(super) fn run_sessions(data: &[u8]) -> Option<ModelSyncState> {
    let (&settings_byte, mut rest) = data.split_first()?;
    let settings = OuterSettings {
        learning_rate: [1.0, 0.5, 2.0, 0.1][usize::from(settings_byte >> 5 & 3)],
        momentum: if settings_byte & 1 != 0 { 0.7 } else { 0.0 },
        momentum_delay: if settings_byte & 2 != 0 { 2 } else { 0 },
        max_staleness: u64::from(settings_byte >> 2 & 1),
        staleness_scaling: if settings_byte & 128 != 0 {
            StalenessScaling::Inverse
        } else {
            StalenessScaling::None
        },
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
pub(super) fn open_session(
    state: &mut ModelSyncState,
    request: proto::SyncRequest,
) -> Option<FuzzSession> {
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
pub(super) type CenterImage = Option<(u64, Vec<Vec<u32>>)>;

pub(super) fn center_image(state: &ModelSyncState) -> CenterImage {
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
pub(super) fn handle_request(
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
pub(super) fn check_center(state: &ModelSyncState, reply_dtype: WireDtype) {
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
