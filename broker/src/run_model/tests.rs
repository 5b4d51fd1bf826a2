//! The model's rules on known buffers: snapshots of later and older
//! steps, torn uploads, refused kinds, the final-snapshot bookkeeping. No
//! I/O.

use std::time::Instant;

use bytes::Bytes;
use dflash_proto::v1 as proto;
use prost::Message;

use super::store::{CommitOutcome, FiniteUpload, ModelSyncState, SyncError, Upload};

const CONFIG: &str = r#"{"architectures": ["DFlashDraftModel"], "hidden_size": 4}"#;

/// Two tensors: "a" [2, 2] and "b" [3].
fn weights(a: [f32; 4], b: [f32; 3]) -> Vec<(&'static str, Vec<u64>, Vec<f32>)> {
    vec![("a", vec![2, 2], a.to_vec()), ("b", vec![3], b.to_vec())]
}

fn begin(kind: proto::SyncKind, steps: u64, samples: u64) -> proto::SyncBegin {
    proto::SyncBegin {
        kind: kind as i32,
        steps,
        samples,
        ..proto::SyncBegin::default()
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

/// An upload of `tensors` in f32 opened by `begin`, each split into chunks
/// of at most `chunk_elements` elements (so offsets are exercised).
fn upload_of(
    begin: &proto::SyncBegin,
    tensors: &[(&'static str, Vec<u64>, Vec<f32>)],
    chunk_elements: usize,
) -> Upload {
    let mut upload = Upload::new(begin).unwrap();
    for (name, shape, values) in tensors {
        let bytes = f32_bytes(values);
        let chunk_bytes = chunk_elements * 4;
        for (index, piece) in bytes.chunks(chunk_bytes).enumerate() {
            upload
                .add_chunk(proto::TensorChunk {
                    name: name.to_string(),
                    dtype: proto::Dtype::F32 as i32,
                    shape: shape.clone(),
                    offset: (index * chunk_bytes) as u64,
                    data: Bytes::copy_from_slice(piece),
                })
                .unwrap();
        }
    }
    upload
}

/// A snapshot of `steps` committed steps and `samples`, in f32 chunks of
/// three elements.
fn snapshot_upload(
    kind: proto::SyncKind,
    steps: u64,
    samples: u64,
    tensors: &[(&'static str, Vec<u64>, Vec<f32>)],
) -> FiniteUpload {
    upload_of(&begin(kind, steps, samples), tensors, 3)
        .into_finite()
        .unwrap()
}

fn commit_snapshot(
    state: &mut ModelSyncState,
    drafter_id: &str,
    steps: u64,
    tensors: &[(&'static str, Vec<u64>, Vec<f32>)],
) -> CommitOutcome {
    state
        .commit(
            drafter_id,
            snapshot_upload(proto::SyncKind::Snapshot, steps, 8 * steps, tensors),
            2,
            CONFIG,
            Instant::now(),
        )
        .unwrap()
}

fn model_values(state: &ModelSyncState, name: &str) -> Vec<f32> {
    let model = state.model().unwrap();
    let joined = model.tensors[model.by_name[name]].data.concat();
    joined
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
fn the_first_snapshot_makes_the_model_of_its_bytes_and_bf16_is_refused() {
    let mut state = ModelSyncState::new(None);
    // An empty snapshot cannot make a model.
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 1, 8, &[]),
            0,
            CONFIG,
            Instant::now(),
        )
        .unwrap_err();
    assert_eq!(error, SyncError::NoModel);
    // A snapshot is the f32 master weights: a bf16 chunk is refused.
    let mut bf16 = Upload::new(&begin(proto::SyncKind::Snapshot, 3, 24)).unwrap();
    let error = bf16
        .add_chunk(proto::TensorChunk {
            name: "a".into(),
            dtype: proto::Dtype::Bf16 as i32,
            shape: vec![2],
            offset: 0,
            data: Bytes::from(vec![0u8; 4]),
        })
        .unwrap_err();
    assert_eq!(error, SyncError::Dtype(proto::Dtype::Bf16 as i32));
    let initial = weights([1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 8.0]);
    let outcome = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 3, 24, &initial),
            2,
            CONFIG,
            Instant::now(),
        )
        .unwrap();
    assert!(outcome.initialised);
    assert_eq!((outcome.model_version, outcome.model_samples), (3, 24));
    assert_eq!(model_values(&state, "a"), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(model_values(&state, "b"), vec![0.5, -0.5, 8.0]);
    // The model holds the bytes as they arrived: the chunks of three
    // elements, not a copy.
    let model = state.model().unwrap();
    let chunk_lengths: Vec<usize> = model.tensors[model.by_name["a"]]
        .data
        .iter()
        .map(|chunk| chunk.len())
        .collect();
    assert_eq!(chunk_lengths, vec![12, 4]);
}

#[test]
fn a_snapshot_of_a_later_step_becomes_the_model_and_an_older_one_changes_nothing() {
    let mut state = initialised_state();
    let trained = weights([1.5, 2.5, -3.0, 4.25], [0.0, 1.0, 2.0]);
    let outcome = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 7, 56, &trained),
            2,
            CONFIG,
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
            2,
            CONFIG,
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
fn a_snapshot_with_a_non_finite_weight_or_a_missing_tensor_is_refused() {
    let mut state = initialised_state();
    let broken = weights([1.0, f32::NAN, 3.0, 4.0], [0.5, -0.5, 8.0]);
    let error = upload_of(&begin(proto::SyncKind::Snapshot, 3, 8), &broken, 3)
        .into_finite()
        .unwrap_err();
    assert!(
        error.to_string().contains("\"a\"") && error.to_string().contains("NaN at element 1"),
        "{error}"
    );
    let partial = vec![("a", vec![2, 2], vec![1.0, 2.0, 3.0, 4.0])];
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 3, 8, &partial),
            1,
            CONFIG,
            Instant::now(),
        )
        .unwrap_err();
    assert_eq!(error, SyncError::MissingTensor("b".to_string()));
    assert_eq!(state.version(), Some(0));
    assert_eq!(model_values(&state, "a"), vec![1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn torn_or_inconsistent_uploads_change_nothing() {
    let mut state = initialised_state();
    let before_a = model_values(&state, "a");
    let before_b = model_values(&state, "b");
    let now = Instant::now();
    // A drafter that dies mid-upload never commits: its staged chunks are
    // dropped with its session and the model is untouched. Shown here by
    // staging half an upload and dropping it.
    let half = || proto::TensorChunk {
        name: "a".into(),
        dtype: proto::Dtype::F32 as i32,
        shape: vec![2, 2],
        offset: 0,
        data: Bytes::from(f32_bytes(&[100.0, 100.0])),
    };
    let mut torn = Upload::new(&begin(proto::SyncKind::Snapshot, 1, 8)).unwrap();
    torn.add_chunk(half()).unwrap();
    drop(torn);
    // A commit whose tensor is incomplete is refused.
    let mut short = Upload::new(&begin(proto::SyncKind::Snapshot, 1, 8)).unwrap();
    short.add_chunk(half()).unwrap();
    let error = state
        .commit("d0", short.into_finite().unwrap(), 1, CONFIG, now)
        .unwrap_err();
    assert!(error.to_string().contains("8 of 16 bytes"), "{error}");
    // The commit's count must match what was sent.
    let all = weights([1.0; 4], [1.0; 3]);
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 1, 8, &all),
            3,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert_eq!(
        error,
        SyncError::CountMismatch {
            sent: 2,
            declared: 3
        }
    );
    // A tensor of another shape is another model.
    let reshaped = vec![
        ("a", vec![4u64], vec![1.0f32; 4]),
        ("b", vec![3], vec![1.0; 3]),
    ];
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 1, 8, &reshaped),
            2,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert!(matches!(error, SyncError::ShapeMismatch { .. }), "{error}");
    assert_eq!(model_values(&state, "a"), before_a);
    assert_eq!(model_values(&state, "b"), before_b);
    assert_eq!(state.version(), Some(0));
}

#[test]
fn chunks_out_of_order_or_too_long_are_refused() {
    let mut upload = Upload::new(&begin(proto::SyncKind::Snapshot, 1, 8)).unwrap();
    let chunk = |offset: u64, elements: usize| proto::TensorChunk {
        name: "a".into(),
        dtype: proto::Dtype::F32 as i32,
        shape: vec![2, 2],
        offset,
        data: Bytes::from(vec![0u8; elements * 4]),
    };
    assert!(
        upload.add_chunk(chunk(4, 1)).is_err(),
        "first chunk not at 0"
    );
    upload.add_chunk(chunk(0, 2)).unwrap();
    let error = upload.add_chunk(chunk(12, 1)).unwrap_err();
    assert!(error.to_string().contains("expected 8"), "{error}");
    let error = upload.add_chunk(chunk(8, 3)).unwrap_err();
    assert!(error.to_string().contains("more than the 16"), "{error}");
    let mut odd = chunk(8, 1);
    odd.data = Bytes::from(vec![0u8; 3]);
    assert!(upload.add_chunk(odd).is_err(), "not whole elements");
    let mut wrong_dtype = chunk(8, 1);
    wrong_dtype.dtype = proto::Dtype::I32 as i32;
    assert_eq!(
        upload.add_chunk(wrong_dtype).unwrap_err(),
        SyncError::Dtype(proto::Dtype::I32 as i32)
    );
}

/// A shape whose element count fits a u64 but whose bytes do not is
/// refused at its first chunk, naming the tensor (fuzz target `model_sync`
/// found the byte count overflowing: tests/fuzz/corpus/model_sync/crash-*).
#[test]
fn a_shape_whose_bytes_overflow_is_refused_at_its_first_chunk() {
    for (dtype, shape) in [
        (proto::Dtype::F32, vec![1u64 << 62]),
        (proto::Dtype::F32, vec![1u64 << 32, 1 << 31]),
        (proto::Dtype::F32, vec![u64::MAX, 2]),
    ] {
        let mut upload = Upload::new(&begin(proto::SyncKind::Snapshot, 1, 8)).unwrap();
        let error = upload
            .add_chunk(proto::TensorChunk {
                name: "huge".into(),
                dtype: dtype as i32,
                shape: shape.clone(),
                offset: 0,
                data: Bytes::from(vec![0u8; 8]),
            })
            .unwrap_err();
        assert!(
            matches!(&error, SyncError::BadTensor { name, detail }
                if name == "huge" && detail.contains("overflow")),
            "{shape:?}: {error}"
        );
    }
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
                2,
                CONFIG,
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
    let error = state
        .commit(
            "squatter",
            snapshot_upload(proto::SyncKind::Snapshot, 1, 8, &initial),
            2,
            other,
            Instant::now(),
        )
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
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 1, 8, &initial),
            2,
            spaced,
            Instant::now(),
        )
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
