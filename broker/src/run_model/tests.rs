//! The model's rules on known buffers: snapshots of later and older
//! steps, torn uploads, refused files and kinds, the final-snapshot
//! bookkeeping. No I/O.

use std::time::Instant;

use bytes::Bytes;
use dflash_proto::v1 as proto;
use prost::Message;

use super::store::{CommitOutcome, FiniteUpload, ModelSyncState, SyncError, Upload};
use crate::fuzzing::model_files::{file_chunks, weights_file, weights_file_of_bytes, F32Tensor};
use crate::run_model::store::files::{CONFIG_FILE_NAME, MODEL_FILE_NAME};

const CONFIG: &str = r#"{"architectures": ["DFlashDraftModel"], "hidden_size": 4}"#;

/// Two tensors: "a" [2, 2] and "b" [3].
fn weights(a: [f32; 4], b: [f32; 3]) -> Vec<F32Tensor> {
    vec![
        ("a".to_string(), vec![2, 2], a.to_vec()),
        ("b".to_string(), vec![3], b.to_vec()),
    ]
}

fn begin(kind: proto::SyncKind, steps: u64, samples: u64) -> proto::SyncBegin {
    proto::SyncBegin {
        kind: kind as i32,
        steps,
        samples,
        ..proto::SyncBegin::default()
    }
}

/// An upload of `config` and the weights file `weights` opened by
/// `begin`, each file split into chunks of at most `chunk_bytes` (so
/// offsets, and values across chunk boundaries, are exercised).
fn upload_of_files(
    begin: &proto::SyncBegin,
    config: &str,
    weights: Vec<u8>,
    chunk_bytes: usize,
) -> Result<Upload, SyncError> {
    let mut upload = Upload::new(begin)?;
    let config = Bytes::from(config.as_bytes().to_vec());
    let weights = Bytes::from(weights);
    for (name, bytes) in [(CONFIG_FILE_NAME, &config), (MODEL_FILE_NAME, &weights)] {
        for chunk in file_chunks(name, bytes, chunk_bytes) {
            upload.add_file_chunk(chunk)?;
        }
    }
    Ok(upload)
}

fn upload_of(begin: &proto::SyncBegin, tensors: &[F32Tensor], chunk_bytes: usize) -> Upload {
    upload_of_files(begin, CONFIG, weights_file(tensors), chunk_bytes).unwrap()
}

/// A snapshot of `steps` committed steps and `samples`, in chunks of 7
/// bytes.
fn snapshot_upload(
    kind: proto::SyncKind,
    steps: u64,
    samples: u64,
    tensors: &[F32Tensor],
) -> FiniteUpload {
    upload_of(&begin(kind, steps, samples), tensors, 7)
        .into_finite(2)
        .unwrap()
}

fn commit_snapshot(
    state: &mut ModelSyncState,
    drafter_id: &str,
    steps: u64,
    tensors: &[F32Tensor],
) -> CommitOutcome {
    state
        .commit(
            drafter_id,
            snapshot_upload(proto::SyncKind::Snapshot, steps, 8 * steps, tensors),
            Instant::now(),
        )
        .unwrap()
}

fn model_values(state: &ModelSyncState, name: &str) -> Vec<f32> {
    let model = state.model().unwrap();
    let joined = model.weights.joined();
    let tensor = model.layout.get(name).unwrap();
    joined[tensor.start as usize..tensor.end as usize]
        .chunks_exact(4)
        .map(|raw| f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
        .collect()
}

/// A state whose model is `d0`'s snapshot of step 0.
fn initialised_state() -> ModelSyncState {
    let mut state = ModelSyncState::new(None);
    state.open_session("d0");
    let initial = weights([1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 8.0]);
    let outcome = commit_snapshot(&mut state, "d0", 0, &initial);
    assert!(outcome.initialised && outcome.applied);
    state
}

#[test]
fn the_first_snapshot_makes_the_model_of_its_files_as_they_arrived() {
    let mut state = ModelSyncState::new(None);
    // An empty snapshot cannot make a model.
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 1, 8, &[]),
            Instant::now(),
        )
        .unwrap_err();
    assert_eq!(error, SyncError::NoModel);
    let initial = weights([1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 8.0]);
    let outcome = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 3, 24, &initial),
            Instant::now(),
        )
        .unwrap();
    assert!(outcome.initialised);
    assert_eq!((outcome.model_version, outcome.model_samples), (3, 24));
    assert_eq!(model_values(&state, "a"), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(model_values(&state, "b"), vec![0.5, -0.5, 8.0]);
    // The model holds the files as they arrived, byte for byte, in their
    // chunks of 7 bytes: not a copy, not a re-encoding.
    let model = state.model().unwrap();
    assert_eq!(model.weights.joined(), weights_file(&initial));
    assert_eq!(model.config_json, CONFIG);
    assert!(model.weights.chunks.iter().all(|chunk| chunk.len() <= 7));
    assert_eq!(model.parameters(), 7);
}

#[test]
fn a_snapshot_of_a_later_step_becomes_the_model_and_an_older_one_changes_nothing() {
    let mut state = initialised_state();
    let trained = weights([1.5, 2.5, -3.0, 4.25], [0.0, 1.0, 2.0]);
    let outcome = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 7, 56, &trained),
            Instant::now(),
        )
        .unwrap();
    assert!(outcome.applied);
    assert_eq!(outcome.model_version, 7);
    assert_eq!(outcome.model_samples, 56);
    assert_eq!(model_values(&state, "a"), vec![1.5, 2.5, -3.0, 4.25]);
    assert_eq!(model_values(&state, "b"), vec![0.0, 1.0, 2.0]);
    // A member behind the others (step 6) changes nothing.
    let older = weights([9.0; 4], [9.0; 3]);
    let outcome = state
        .commit(
            "d1",
            snapshot_upload(proto::SyncKind::FinalSnapshot, 6, 48, &older),
            Instant::now(),
        )
        .unwrap();
    assert!(!outcome.applied);
    assert!(outcome.reason.contains("step 7"), "{}", outcome.reason);
    assert_eq!(state.version(), Some(7));
    assert_eq!(model_values(&state, "a"), vec![1.5, 2.5, -3.0, 4.25]);
    assert!(state.drafter("d1").unwrap().finished);
}

#[test]
fn a_snapshot_with_a_non_finite_weight_or_a_missing_tensor_is_refused_naming_it() {
    let mut state = initialised_state();
    // The NaN's bytes straddle two chunks of 7 bytes: read in place.
    let broken = weights([1.0, f32::NAN, 3.0, 4.0], [0.5, -0.5, 8.0]);
    let error = upload_of(&begin(proto::SyncKind::Snapshot, 3, 8), &broken, 7)
        .into_finite(2)
        .unwrap_err();
    assert!(
        error.to_string().contains("\"a\"") && error.to_string().contains("NaN at element 1"),
        "{error}"
    );
    let infinite = weights([1.0, 2.0, 3.0, 4.0], [0.5, f32::INFINITY, 8.0]);
    let error = upload_of(&begin(proto::SyncKind::Snapshot, 3, 8), &infinite, 1 << 20)
        .into_finite(2)
        .unwrap_err();
    assert!(
        error.to_string().contains("\"b\"") && error.to_string().contains("inf at element 1"),
        "{error}"
    );
    let partial = vec![("a".to_string(), vec![2, 2], vec![1.0, 2.0, 3.0, 4.0])];
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 3, 8, &partial),
            Instant::now(),
        )
        .unwrap_err();
    assert_eq!(error, SyncError::MissingTensor("b".to_string()));
    let extra = vec![
        ("a".to_string(), vec![2, 2], vec![1.0; 4]),
        ("b".to_string(), vec![3], vec![1.0; 3]),
        ("c".to_string(), vec![1], vec![1.0]),
    ];
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 3, 8, &extra),
            Instant::now(),
        )
        .unwrap_err();
    assert_eq!(error, SyncError::UnknownTensor("c".to_string()));
    assert_eq!(state.version(), Some(0));
    assert_eq!(model_values(&state, "a"), vec![1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn torn_or_inconsistent_uploads_change_nothing() {
    let mut state = initialised_state();
    let before = state.model().unwrap().weights.joined();
    let now = Instant::now();
    let all = weights([1.0; 4], [1.0; 3]);
    let file = weights_file(&all);
    // A drafter that dies mid-upload never commits: its staged chunks are
    // dropped with its session and the model is untouched.
    let mut torn = Upload::new(&begin(proto::SyncKind::Snapshot, 1, 8)).unwrap();
    let config = Bytes::from(CONFIG.as_bytes().to_vec());
    for chunk in file_chunks(CONFIG_FILE_NAME, &config, 1 << 20) {
        torn.add_file_chunk(chunk).unwrap();
    }
    let first = file_chunks(MODEL_FILE_NAME, &Bytes::from(file.clone()), 40);
    torn.add_file_chunk(first[0].clone()).unwrap();
    // Its commit is refused: the weights are not whole.
    let error = torn.into_finite(2).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "file \"model.safetensors\": 40 of {} bytes received",
            file.len()
        )
    );
    // The commit's count must match what was sent.
    let error = upload_of(&begin(proto::SyncKind::Snapshot, 1, 8), &all, 7)
        .into_finite(3)
        .unwrap_err();
    assert_eq!(
        error,
        SyncError::FileCountMismatch {
            sent: 2,
            declared: 3
        }
    );
    // A tensor of another shape is another model.
    let reshaped = vec![
        ("a".to_string(), vec![4u64], vec![1.0f32; 4]),
        ("b".to_string(), vec![3], vec![1.0; 3]),
    ];
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 1, 8, &reshaped),
            now,
        )
        .unwrap_err();
    assert!(matches!(error, SyncError::ShapeMismatch { .. }), "{error}");
    assert_eq!(state.model().unwrap().weights.joined(), before);
    assert_eq!(state.version(), Some(0));
}

#[test]
fn a_file_of_another_name_or_chunks_out_of_order_are_refused_naming_them() {
    let mut upload = Upload::new(&begin(proto::SyncKind::Snapshot, 1, 8)).unwrap();
    let chunk = |file: &str, offset: u64, length: usize, size: u64| proto::ModelFileChunk {
        file: file.to_string(),
        offset,
        data: Bytes::from(vec![b' '; length]),
        file_size: size,
    };
    for name in ["optimizer.safetensors", "../config.json", "", "CONFIG.JSON"] {
        assert_eq!(
            upload.add_file_chunk(chunk(name, 0, 1, 1)).unwrap_err(),
            SyncError::FileName(name.to_string())
        );
    }
    let error = upload
        .add_file_chunk(chunk(CONFIG_FILE_NAME, 4, 1, 8))
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("first chunk at offset 4, expected 0"),
        "{error}"
    );
    upload
        .add_file_chunk(chunk(CONFIG_FILE_NAME, 0, 2, 8))
        .unwrap();
    let error = upload
        .add_file_chunk(chunk(CONFIG_FILE_NAME, 3, 1, 8))
        .unwrap_err();
    assert!(error.to_string().contains("expected 2"), "{error}");
    let error = upload
        .add_file_chunk(chunk(CONFIG_FILE_NAME, 2, 7, 8))
        .unwrap_err();
    assert!(
        error.to_string().contains("more than its size 8"),
        "{error}"
    );
    let error = upload
        .add_file_chunk(chunk(CONFIG_FILE_NAME, 2, 1, 9))
        .unwrap_err();
    assert!(error.to_string().contains("chunk says size 9"), "{error}");
    // The next file begins only once this one is whole.
    let error = upload
        .add_file_chunk(chunk(MODEL_FILE_NAME, 0, 8, 100))
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "file \"config.json\": 2 of 8 bytes received"
    );
    let mut huge = Upload::new(&begin(proto::SyncKind::Snapshot, 1, 8)).unwrap();
    let error = huge
        .add_file_chunk(chunk(CONFIG_FILE_NAME, 0, 1, 1 << 40))
        .unwrap_err();
    assert!(error.to_string().contains("a config may have"), "{error}");
}

/// The weights' header is read from their first bytes as they arrive (8
/// bytes of length, then JSON), with the `safetensors` crate's metadata
/// reader: a header whose tensors do not end at the file's end, or that
/// overlap or leave a gap, a dtype other than F32, or a length past the
/// file, is refused naming the value before the rest is staged.
#[test]
fn a_weights_header_that_does_not_fit_its_file_is_refused_naming_it() {
    let begin = begin(proto::SyncKind::Snapshot, 1, 8);
    let refuse = |weights: Vec<u8>| {
        upload_of_files(&begin, CONFIG, weights, 5)
            .and_then(|upload| upload.into_finite(2).map(drop))
            .unwrap_err()
            .to_string()
    };
    let header_file = |header: &str, data: usize| {
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend(std::iter::repeat_n(0u8, data));
        file
    };
    // Offsets past the file's end.
    let error = refuse(header_file(
        r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
        8,
    ));
    assert!(
        error.contains("model.safetensors") && error.contains("the file has"),
        "{error}"
    );
    // Offsets that do not match the shape.
    let error = refuse(header_file(
        r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#,
        16,
    ));
    assert!(
        error.contains("model.safetensors") && error.contains("header"),
        "{error}"
    );
    // Another dtype.
    let error = refuse(header_file(
        r#"{"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}}"#,
        8,
    ));
    assert!(
        error.contains("\"a\" has dtype BF16, expected F32"),
        "{error}"
    );
    // A header length past the file.
    let mut long = header_file("{}", 0);
    long[..8].copy_from_slice(&1000u64.to_le_bytes());
    let error = refuse(long);
    assert!(
        error.contains("header of 1000 bytes does not fit the file's 10"),
        "{error}"
    );
    // Too short for the length itself.
    let error = refuse(vec![1, 2, 3]);
    assert!(
        error.contains("end before the safetensors header"),
        "{error}"
    );
    // Not JSON.
    let error = refuse(header_file("{not json", 0));
    assert!(error.contains("header:"), "{error}");
    // Any bytes as values are staged as they are: the finite check reads
    // them (here a NaN), not a decoder.
    let nan = f32::NAN.to_le_bytes();
    let file = weights_file_of_bytes([("x", &[1u64][..], &nan[..])]);
    let error = refuse(file);
    assert!(error.contains("\"x\"") && error.contains("NaN"), "{error}");
}

#[test]
fn a_config_that_is_not_json_is_refused() {
    let begin = begin(proto::SyncKind::Snapshot, 1, 8);
    let upload = upload_of_files(
        &begin,
        "{oops",
        weights_file(&weights([1.0; 4], [1.0; 3])),
        64,
    )
    .unwrap();
    let error = upload.into_finite(2).unwrap_err();
    assert!(
        matches!(&error, SyncError::Config(detail) if detail.starts_with("config.json")),
        "{error}"
    );
}

#[test]
fn the_final_model_waits_only_for_open_sessions_without_a_final_snapshot() {
    let mut state = initialised_state();
    state.open_session("d1");
    state.open_session("killed");
    assert_eq!(state.awaiting_final(), vec!["d0", "d1", "killed"]);
    // A drafter killed between snapshots: its session closes, nobody waits.
    state.close_session("killed");
    assert_eq!(state.awaiting_final(), vec!["d0", "d1"]);
    for (drafter_id, steps) in [("d0", 2), ("d1", 1)] {
        state
            .commit(
                drafter_id,
                snapshot_upload(
                    proto::SyncKind::FinalSnapshot,
                    steps,
                    16,
                    &weights([1.0; 4], [1.0; 3]),
                ),
                Instant::now(),
            )
            .unwrap();
    }
    assert!(state.awaiting_final().is_empty());
    assert_eq!(state.version(), Some(2));
}

/// #22: with `--model-config` the run's model is fixed: the first snapshot
/// (which defines an empty model) and every later one must carry that
/// config, or are refused naming both; a resumed model of another config is
/// refused.
#[test]
fn a_pinned_model_config_refuses_any_other_model_even_for_an_empty_model() {
    let mut state = ModelSyncState::new(None);
    state.pin_config(CONFIG).unwrap();
    state.open_session("squatter");
    let initial = weights([1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 8.0]);
    let other = r#"{"architectures": ["DFlashDraftModel"], "hidden_size": 8}"#;
    let with_config = |config: &str| {
        upload_of_files(
            &begin(proto::SyncKind::Snapshot, 1, 8),
            config,
            weights_file(&initial),
            64,
        )
        .unwrap()
        .into_finite(2)
        .unwrap()
    };
    let error = state
        .commit("squatter", with_config(other), Instant::now())
        .unwrap_err();
    assert!(
        matches!(&error, SyncError::ConfigMismatch { expected, got }
            if expected.contains("\"hidden_size\":4") && got.contains("\"hidden_size\":8")),
        "{error}"
    );
    assert!(state.model().is_none(), "nothing was defined");
    // The same config, spelled with other spacing, is the same model.
    let spaced = r#"{ "hidden_size": 4, "architectures": [ "DFlashDraftModel" ] }"#;
    let outcome = state
        .commit("d0", with_config(spaced), Instant::now())
        .unwrap();
    assert!(outcome.initialised);
    // A resumed model of another config cannot be pinned to this one.
    let model = state.model().unwrap().clone();
    let mut resumed = ModelSyncState::new(Some(model));
    assert!(matches!(
        resumed.pin_config(other),
        Err(SyncError::ConfigMismatch { .. })
    ));
}

/// Asynchronous local SGD was retired: its kinds (JOIN 1, UPDATE 2, FINAL
/// 3, reserved on the wire) are refused by name with INVALID_ARGUMENT
/// before anything is staged. The broker's AdamW (`gradient_step`, field
/// 7, reserved too) is an unknown field now: a begin that still carries it
/// reads as the same begin without it, and its kind decides.
#[test]
fn the_kinds_of_retired_methods_are_refused_by_name_and_change_nothing() {
    let state = initialised_state();
    for (kind, name) in [
        (1, "SYNC_KIND_JOIN"),
        (2, "SYNC_KIND_UPDATE"),
        (3, "SYNC_KIND_FINAL"),
    ] {
        let refused = proto::SyncBegin {
            kind,
            ..begin(proto::SyncKind::Snapshot, 1, 8)
        };
        let error = Upload::new(&refused).unwrap_err();
        assert_eq!(error, SyncError::RemovedKind(name));
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().starts_with(name) && status.message().contains("local SGD"),
            "{}",
            status.message()
        );
    }
    // An old drafter of the broker's AdamW: kind UPDATE and a
    // `gradient_step` (field 7: a message whose learning_rate, field 1, is
    // 1e-3), as the wire carried them.
    let mut wire = proto::SyncBegin {
        kind: 2,
        ..begin(proto::SyncKind::Snapshot, 1, 8)
    }
    .encode_to_vec();
    wire.extend_from_slice(&[(7 << 3) | 2, 9, (1 << 3) | 1]);
    wire.extend_from_slice(&1e-3f64.to_le_bytes());
    let decoded = proto::SyncBegin::decode(wire.as_slice()).unwrap();
    assert_eq!(
        decoded,
        proto::SyncBegin {
            kind: 2,
            ..begin(proto::SyncKind::Snapshot, 1, 8)
        }
    );
    let error = Upload::new(&decoded).unwrap_err();
    assert_eq!(error, SyncError::RemovedKind("SYNC_KIND_UPDATE"));
    assert_eq!(state.version(), Some(0));
    assert_eq!(model_values(&state, "a"), vec![1.0, 2.0, 3.0, 4.0]);
}

/// The model's tensor chunks (`TensorChunk`, SyncRequest field 3) were
/// retired for its files: an old drafter's chunk, as the wire carried it,
/// decodes as a message of no kind (prost drops the reserved field), which
/// the session refuses naming it, INVALID_ARGUMENT, before anything is
/// staged.
#[test]
fn an_old_drafters_tensor_chunk_decodes_as_no_kind_and_is_refused_by_name() {
    // TensorChunk { name: "a" (1), dtype: F32 (2), shape: [1] (3), offset
    // 0 (4), data: 4 bytes (5) } as field 3 of a SyncRequest.
    let chunk = [
        (1 << 3) | 2,
        1,
        b'a',
        2 << 3,
        1,
        (3 << 3) | 2,
        1,
        1,
        (5 << 3) | 2,
        4,
        0,
        0,
        128,
        63,
    ];
    let mut wire = vec![(3 << 3) | 2, chunk.len() as u8];
    wire.extend_from_slice(&chunk);
    let decoded = proto::SyncRequest::decode(wire.as_slice()).unwrap();
    assert_eq!(decoded.kind, None);
    let status = tonic::Status::from(crate::rpc_error::RpcError::RetiredTensorChunk);
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("tensor `chunk` (TensorChunk, SyncRequest field 3) is retired"),
        "{}",
        status.message()
    );
}
