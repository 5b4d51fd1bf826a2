//! The model's fuzz bodies: [`model_sync`] (sessions against one
//! model) and [`model_checkpoint`] (the checkpoint reader).

use std::path::Path;
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;
use prost::Message;

use crate::run_model::checkpoint::{self, ModelFiles};
use crate::run_model::store::files::first_non_finite_tensor;
use crate::run_model::store::{ModelSyncState, Upload};

/// Drafter sessions one [`model_sync`] input can hold open at once.
pub(super) const SESSIONS: usize = 4;
/// The config every fuzzed snapshot is pinned to when the settings pin one.
pub(super) const PINNED_CONFIG: &str = r#"{"model_type": "dflash", "hidden_size": 4}"#;

/// One open session: what `run_model::service` keeps per stream.
pub(super) struct FuzzSession {
    drafter_id: String,
    upload: Option<Upload>,
}

/// The input layout of [`model_sync`]: `[settings byte]` then records of
/// `[session byte] [length: u16 little-endian] [SyncRequest bytes]` (the
/// length cut to what remains). The session byte's low two bits pick the
/// session; with bit 7 set that session's stream ends instead (its message
/// is ignored). The settings byte: bit 3 a pinned model config; the other
/// bits chose local SGD's outer settings and are ignored since it was
/// retired (the corpus keeps them).
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
/// one model, each handled as `run_model::service` handles it: a hello
/// first (drafter id and config checked), then begin, file chunks and
/// commit; an error ends the session.
///
/// Checks after every message: the model is finite and each tensor of its
/// header lies inside its file; a refused snapshot, and one that was not
/// applied, left the model as it was; an applied one moved the version
/// forward.
pub fn model_sync(data: &[u8]) {
    let _ = run_sessions(data);
}

/// [`model_sync`]'s work; the state it left (the seeds' test reads it).
pub(super) fn run_sessions(data: &[u8]) -> Option<ModelSyncState> {
    let (&settings_byte, mut rest) = data.split_first()?;
    let mut state = ModelSyncState::new(None);
    if settings_byte & 8 != 0 && state.pin_config(PINNED_CONFIG).is_err() {
        panic!("the pinned config is valid JSON");
    }
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
            Some(session) => handle_request(&mut state, session, request, now).is_err(),
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
        upload: None,
    })
}

/// The model's files as bytes, and its version.
pub(super) type ModelImage = Option<(u64, String, Vec<u8>)>;

pub(super) fn model_image(state: &ModelSyncState) -> ModelImage {
    state.model().map(|model| {
        (
            model.version,
            model.config_json.clone(),
            model.weights.joined(),
        )
    })
}

/// One message of an open session, as `run_model::service::handle_request`
/// and `commit_snapshot` handle it.
pub(super) fn handle_request(
    state: &mut ModelSyncState,
    session: &mut FuzzSession,
    request: proto::SyncRequest,
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
        Some(Kind::FileChunk(chunk)) => {
            let open = session.upload.as_mut().ok_or(())?;
            open.add_file_chunk(chunk).map_err(drop)
        }
        Some(Kind::Commit(commit)) => {
            let open = session.upload.take().ok_or(())?;
            // As the service: the checks of the whole upload and the
            // finite check before the lock.
            let open = open.into_finite(commit.files).map_err(drop)?;
            let before = model_image(state);
            let outcome = state.commit(&session.drafter_id, open, now);
            check_model(state);
            let after = model_image(state);
            let before_version = before.as_ref().map(|(version, _, _)| *version);
            match &outcome {
                Err(_) => assert!(before == after, "a refused snapshot changed the model"),
                Ok(outcome) if outcome.initialised => assert_eq!(before_version, None),
                Ok(outcome) if outcome.applied => {
                    assert!(before_version.is_some_and(|version| version < outcome.model_version));
                }
                Ok(_) => assert!(
                    before == after,
                    "a snapshot that was not applied changed the model"
                ),
            }
            outcome.map(drop).map_err(drop)
        }
        Some(Kind::Hello(_)) | None => Err(()),
    }
}

/// The model is finite, its file holds what its chunks hold, and each
/// tensor lies inside it with exactly its shape's f32 bytes.
pub(super) fn check_model(state: &ModelSyncState) {
    let Some(model) = state.model() else {
        return;
    };
    if let Some((name, index, value)) = first_non_finite_tensor(&model.weights, &model.layout) {
        panic!("the model's weights of {name:?} are not finite: {value} at {index}");
    }
    let held: u64 = model
        .weights
        .chunks
        .iter()
        .map(|chunk| chunk.len() as u64)
        .sum();
    assert_eq!(held, model.weights.size);
    for tensor in &model.layout.tensors {
        let expected = tensor.shape.iter().product::<u64>() * 4;
        assert_eq!(tensor.end - tensor.start, expected, "{}", tensor.name);
        assert!(tensor.end <= model.weights.size, "{}", tensor.name);
    }
}

/// The input layout of [`model_checkpoint`]: `[flags]` then the files
/// `config.json`, `model.safetensors` and `center_state.json`, each as
/// `[length: u32 little-endian] [bytes]` (the length cut to what remains);
/// a file the input ends before is absent. The flags and a fourth file (local
/// SGD's outer optimizer, retired) are ignored; the corpus keeps them.
pub fn model_checkpoint_input(files: &[&[u8]]) -> Vec<u8> {
    let mut input = vec![0];
    for file in files {
        input.extend_from_slice(&(file.len() as u32).to_le_bytes());
        input.extend_from_slice(file);
    }
    input
}

/// Fuzz body: a model checkpoint's files (layout:
/// [`model_checkpoint_input`]) through [`checkpoint::decode_model`], the
/// reader of a restarted broker.
///
/// Checks: a model read is finite, and written again as the broker
/// writes it, it reads back the same, bit for bit.
pub fn model_checkpoint(data: &[u8]) {
    let Some((_, mut rest)) = data.split_first() else {
        return;
    };
    let mut files: Vec<&[u8]> = Vec::new();
    while rest.len() >= 4 && files.len() < 3 {
        let declared = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let length = declared.min(rest.len() - 4);
        files.push(&rest[4..4 + length]);
        rest = &rest[4 + length..];
    }
    let [config, model, state] = [0, 1, 2].map(|index| files.get(index).copied());
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
    let model = bytes::Bytes::copy_from_slice(model);
    let files = ModelFiles {
        config_json,
        model: &model,
        state_json,
    };
    let dir = Path::new("model");
    let Ok(model) = checkpoint::decode_model(dir, files) else {
        return;
    };
    assert!(first_non_finite_tensor(&model.weights, &model.layout).is_none());
    let written = match checkpoint::encode_model_files(&model) {
        Ok(written) => written,
        Err(error) => panic!("a model read could not be written again: {error}"),
    };
    let file = |name: &str| {
        written
            .iter()
            .find(|(file_name, _)| *file_name == name)
            .map(|(_, bytes)| bytes.as_slice())
    };
    let config_again = file(checkpoint::CONFIG_FILE_NAME).map(String::from_utf8_lossy);
    let state_again = file(checkpoint::STATE_FILE_NAME).map(String::from_utf8_lossy);
    let model_again =
        bytes::Bytes::copy_from_slice(file(checkpoint::MODEL_FILE_NAME).unwrap_or_default());
    let again = checkpoint::decode_model(
        dir,
        ModelFiles {
            config_json: config_again.as_deref().unwrap_or_default(),
            model: &model_again,
            state_json: state_again.as_deref(),
        },
    );
    let again = match again {
        Ok(again) => again,
        Err(error) => panic!("a model written again did not read back: {error}"),
    };
    assert_eq!(
        (again.version, again.samples),
        (model.version, model.samples)
    );
    assert_eq!(again.layout, model.layout);
    assert_eq!(again.config_json, model.config_json);
    assert!(
        again.weights.joined() == model.weights.joined(),
        "the model's weights changed in their round trip"
    );
}
