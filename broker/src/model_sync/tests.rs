//! The center's rules on known buffers: joins, deltas in f32 and bf16,
//! staleness, torn uploads, the final-sync bookkeeping. No I/O.

use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_proto::v1 as proto;

use super::arith::{self, WireDtype};
use super::center::{CommitOutcome, ModelSyncState, OuterSettings, SyncError, Upload};

/// Plain asynchronous local SGD (no momentum): every center is a sum of
/// deltas, exact on these values.
fn plain() -> OuterSettings {
    OuterSettings {
        momentum: 0.0,
        ..OuterSettings::default()
    }
}

const CONFIG: &str = r#"{"architectures": ["DFlashDraftModel"], "hidden_size": 4}"#;

/// Two tensors: "a" [2, 2] and "b" [3]. Values chosen dyadic so every sum
/// below is exact in f32.
fn weights(a: [f32; 4], b: [f32; 3]) -> Vec<(&'static str, Vec<u64>, Vec<f32>)> {
    vec![("a", vec![2, 2], a.to_vec()), ("b", vec![3], b.to_vec())]
}

fn begin(kind: proto::SyncKind, base_version: u64) -> proto::SyncBegin {
    proto::SyncBegin {
        kind: kind as i32,
        base_version,
        steps: 5,
        samples: 10,
        tokens: 100,
        reply_dtype: proto::Dtype::F32 as i32,
        gradient_step: None,
    }
}

/// An upload of `tensors` as `dtype`, each split into chunks of at most
/// `chunk_elements` elements (so offsets are exercised).
fn upload(
    kind: proto::SyncKind,
    base_version: u64,
    tensors: &[(&'static str, Vec<u64>, Vec<f32>)],
    dtype: WireDtype,
    chunk_elements: usize,
) -> Upload {
    upload_of(&begin(kind, base_version), tensors, dtype, chunk_elements)
}

/// [`upload`] with its own `begin`.
fn upload_of(
    begin: &proto::SyncBegin,
    tensors: &[(&'static str, Vec<u64>, Vec<f32>)],
    dtype: WireDtype,
    chunk_elements: usize,
) -> Upload {
    let mut upload = Upload::new(begin).unwrap();
    for (name, shape, values) in tensors {
        let bytes = arith::encode(values, dtype);
        let chunk_bytes = chunk_elements * dtype.element_bytes();
        for (index, piece) in bytes.chunks(chunk_bytes).enumerate() {
            upload
                .add_chunk(proto::TensorChunk {
                    name: name.to_string(),
                    dtype: super::center::dtype_to_proto(dtype) as i32,
                    shape: shape.clone(),
                    offset: (index * chunk_bytes) as u64,
                    data: Bytes::copy_from_slice(piece),
                })
                .unwrap();
        }
    }
    upload
}

/// Commits an f32 exchange of both tensors (see [`weights`]) from
/// `drafter_id`, in chunks of four elements; it must be accepted.
fn commit_f32(
    state: &mut ModelSyncState,
    drafter_id: &str,
    kind: proto::SyncKind,
    base_version: u64,
    tensors: &[(&'static str, Vec<u64>, Vec<f32>)],
    now: Instant,
) -> CommitOutcome {
    state
        .commit(
            drafter_id,
            upload(kind, base_version, tensors, WireDtype::F32, 4),
            2,
            CONFIG,
            now,
        )
        .unwrap()
}

fn center_values(state: &ModelSyncState, name: &str) -> Vec<f32> {
    let center = state.center().unwrap();
    center.tensors[center.by_name[name]].values.to_vec()
}

fn joined_state(settings: OuterSettings) -> (ModelSyncState, Instant) {
    let now = Instant::now();
    let mut state = ModelSyncState::new(settings, None);
    state.open_session("d0");
    let initial = weights([1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 8.0]);
    let outcome = state
        .commit(
            "d0",
            upload(proto::SyncKind::Join, 0, &initial, WireDtype::F32, 3),
            2,
            CONFIG,
            now,
        )
        .unwrap();
    assert!(outcome.initialised);
    assert!(
        !outcome.send_center,
        "the initialiser already has the center"
    );
    (state, now)
}

#[test]
fn the_first_join_initialises_the_center_and_later_joins_start_from_it() {
    let (mut state, now) = joined_state(plain());
    assert_eq!(state.version(), Some(0));
    assert_eq!(center_values(&state, "a"), vec![1.0, 2.0, 3.0, 4.0]);
    // A drafter joining mid-run, after one update, gets the current center,
    // not its own (different) initial weights.
    let delta = weights([0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0]);
    commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    state.open_session("late");
    let own = weights([9.0; 4], [9.0; 3]);
    let outcome = state
        .commit(
            "late",
            upload(proto::SyncKind::Join, 0, &own, WireDtype::F32, 4),
            2,
            CONFIG,
            now,
        )
        .unwrap();
    assert!(!outcome.initialised);
    assert!(outcome.send_center);
    assert_eq!(outcome.center_version, 1);
    let (version, tensors) = state.encode_center(WireDtype::F32).unwrap();
    assert_eq!(version, 1);
    let mut a = vec![0.0f32; 4];
    arith::decode_into(&mut a, &tensors[0].2, WireDtype::F32).unwrap();
    assert_eq!(tensors[0].0, "a");
    assert_eq!(a, vec![1.25, 2.0, 3.0, 4.0]);
    assert_eq!(state.drafter("late").unwrap().base_version, 1);
    // A join without weights also just receives the center.
    let outcome = state
        .commit(
            "late",
            upload(proto::SyncKind::Join, 0, &[], WireDtype::F32, 4),
            0,
            CONFIG,
            now,
        )
        .unwrap();
    assert!(outcome.send_center);
}

#[test]
fn a_join_of_another_model_is_refused_and_changes_nothing() {
    let (mut state, now) = joined_state(plain());
    let other = vec![("a", vec![4u64], vec![0.0f32; 4])];
    let error = state
        .commit(
            "d1",
            upload(proto::SyncKind::Join, 0, &other, WireDtype::F32, 4),
            1,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert_eq!(
        error,
        SyncError::ShapeMismatch {
            name: "a".into(),
            got: vec![4],
            center: vec![2, 2]
        }
    );
    assert!(state.drafter("d1").is_none());
    // No center and no weights: nothing to start from.
    let mut empty = ModelSyncState::new(OuterSettings::default(), None);
    let error = empty
        .commit(
            "d0",
            upload(proto::SyncKind::Join, 0, &[], WireDtype::F32, 4),
            0,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert_eq!(error, SyncError::NoCenter);
}

#[test]
fn deltas_apply_with_the_outer_learning_rate_and_stale_ones_still_count() {
    let settings = OuterSettings {
        learning_rate: 0.5,
        ..plain()
    };
    let (mut state, now) = joined_state(settings);
    // Both drafters start from version 0; d0 syncs first.
    let delta0 = weights([1.0, 0.0, -2.0, 0.0], [0.0, 0.0, 0.0]);
    let first = state
        .commit(
            "d0",
            upload(proto::SyncKind::Update, 0, &delta0, WireDtype::F32, 3),
            2,
            CONFIG,
            now,
        )
        .unwrap();
    assert!(first.applied);
    assert_eq!((first.center_version, first.staleness), (1, 0));
    // d1's base is version 0: one update behind, applied as the method
    // prescribes (plain outer step, no momentum to amplify it).
    let delta1 = weights([0.5, 0.5, 0.5, 0.5], [2.0, 2.0, 2.0]);
    let second = state
        .commit(
            "d1",
            upload(proto::SyncKind::Update, 0, &delta1, WireDtype::F32, 2),
            2,
            CONFIG,
            now + Duration::from_millis(5),
        )
        .unwrap();
    assert!(second.applied);
    assert_eq!((second.center_version, second.staleness), (2, 1));
    assert!(second.send_center);
    assert_eq!(center_values(&state, "a"), vec![1.75, 2.25, 2.25, 4.25]);
    assert_eq!(center_values(&state, "b"), vec![1.5, 0.5, 9.0]);
    assert_eq!(second.center_samples, 20);
    let record = state.drafter("d1").unwrap();
    assert_eq!((record.base_version, record.last_update_staleness), (2, 1));
    // The status shows how far each drafter is behind now.
    let status = state.status(now + Duration::from_millis(10));
    assert_eq!(status.center_version, 2);
    let d0 = status
        .drafters
        .iter()
        .find(|d| d.drafter_id == "d0")
        .unwrap();
    assert_eq!((d0.base_version, d0.staleness), (1, 1));
    assert_eq!(d0.last_sync_ms_ago, 10);
}

#[test]
fn bf16_deltas_accumulate_into_the_f32_center() {
    let (mut state, now) = joined_state(plain());
    // 2^-7 is exact in bf16; added to 4.0 it is kept by the f32 center.
    let delta = weights([1.0 / 128.0, -0.5, 0.0, 1.0 / 128.0], [0.0, 0.0, -8.0]);
    state
        .commit(
            "d0",
            upload(proto::SyncKind::Update, 0, &delta, WireDtype::Bf16, 1),
            2,
            CONFIG,
            now,
        )
        .unwrap();
    assert_eq!(
        center_values(&state, "a"),
        vec![1.0 + 1.0 / 128.0, 1.5, 3.0, 4.0 + 1.0 / 128.0]
    );
    assert_eq!(center_values(&state, "b"), vec![0.5, -0.5, 0.0]);
}

#[test]
fn deltas_beyond_the_staleness_bound_are_discarded_and_the_drafter_restarts() {
    let settings = OuterSettings {
        max_staleness: 1,
        ..plain()
    };
    let (mut state, now) = joined_state(settings);
    let delta = weights([1.0; 4], [1.0; 3]);
    for _ in 0..2 {
        let base = state.version().unwrap();
        commit_f32(&mut state, "d0", proto::SyncKind::Update, base, &delta, now);
    }
    let before = center_values(&state, "a");
    let outcome = commit_f32(&mut state, "d1", proto::SyncKind::Update, 0, &delta, now);
    assert!(!outcome.applied);
    assert_eq!(outcome.staleness, 2);
    assert!(outcome.reason.contains("staleness 2"), "{}", outcome.reason);
    assert!(outcome.send_center, "the drafter restarts from the center");
    assert_eq!(outcome.center_version, 2);
    assert_eq!(center_values(&state, "a"), before);
    let record = state.drafter("d1").unwrap();
    assert_eq!((record.updates_discarded, record.base_version), (1, 2));
    // Exactly at the bound is still applied.
    let outcome = commit_f32(&mut state, "d1", proto::SyncKind::Update, 1, &delta, now);
    assert!(outcome.applied);
}

#[test]
fn torn_or_inconsistent_uploads_change_nothing() {
    let (mut state, now) = joined_state(plain());
    let before_a = center_values(&state, "a");
    let before_b = center_values(&state, "b");
    // A drafter that dies mid-upload never commits: its staged chunks are
    // dropped with its session and the center is untouched. Shown here by
    // staging half an upload and dropping it.
    let mut torn = Upload::new(&begin(proto::SyncKind::Update, 0)).unwrap();
    torn.add_chunk(proto::TensorChunk {
        name: "a".into(),
        dtype: proto::Dtype::F32 as i32,
        shape: vec![2, 2],
        offset: 0,
        data: Bytes::from(arith::encode(&[100.0, 100.0], WireDtype::F32)),
    })
    .unwrap();
    drop(torn);
    // A commit whose tensor is incomplete is refused.
    let mut short = Upload::new(&begin(proto::SyncKind::Update, 0)).unwrap();
    short
        .add_chunk(proto::TensorChunk {
            name: "a".into(),
            dtype: proto::Dtype::F32 as i32,
            shape: vec![2, 2],
            offset: 0,
            data: Bytes::from(arith::encode(&[100.0, 100.0], WireDtype::F32)),
        })
        .unwrap();
    let error = state.commit("d0", short, 1, CONFIG, now).unwrap_err();
    assert!(error.to_string().contains("8 of 16 bytes"), "{error}");
    // A delta missing a tensor is refused.
    let only_a = vec![("a", vec![2u64, 2], vec![1.0f32; 4])];
    let error = state
        .commit(
            "d0",
            upload(proto::SyncKind::Update, 0, &only_a, WireDtype::F32, 4),
            1,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert_eq!(error, SyncError::MissingTensor("b".into()));
    // The commit's count must match what was sent.
    let all = weights([1.0; 4], [1.0; 3]);
    let error = state
        .commit(
            "d0",
            upload(proto::SyncKind::Update, 0, &all, WireDtype::F32, 4),
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
    // A base from the future is a confused drafter.
    let error = state
        .commit(
            "d0",
            upload(proto::SyncKind::Update, 7, &all, WireDtype::F32, 4),
            2,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert_eq!(error, SyncError::FutureBase { base: 7, center: 0 });
    assert_eq!(center_values(&state, "a"), before_a);
    assert_eq!(center_values(&state, "b"), before_b);
    assert_eq!(state.version(), Some(0));
}

#[test]
fn chunks_out_of_order_or_too_long_are_refused() {
    let mut upload = Upload::new(&begin(proto::SyncKind::Update, 0)).unwrap();
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
        (proto::Dtype::Bf16, vec![1u64 << 32, 1 << 31]),
        (proto::Dtype::F32, vec![u64::MAX, 2]),
    ] {
        let mut upload = Upload::new(&begin(proto::SyncKind::Join, 0)).unwrap();
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
fn the_final_center_waits_only_for_open_sessions_without_a_final_sync() {
    let (mut state, now) = joined_state(plain());
    state.open_session("d1");
    state.open_session("killed");
    assert_eq!(state.awaiting_final(), vec!["d0", "d1", "killed"]);
    // A drafter killed between syncs: its session closes, nobody waits.
    state.close_session("killed");
    assert_eq!(state.awaiting_final(), vec!["d0", "d1"]);
    let delta = weights([1.0; 4], [1.0; 3]);
    let outcome = commit_f32(&mut state, "d0", proto::SyncKind::Final, 0, &delta, now);
    assert!(outcome.applied);
    assert!(!outcome.send_center, "a final sync gets no weights back");
    // A final sync without a delta (no step since the last sync).
    let outcome = state
        .commit(
            "d1",
            upload(proto::SyncKind::Final, 1, &[], WireDtype::F32, 4),
            0,
            CONFIG,
            now,
        )
        .unwrap();
    assert!(!outcome.applied);
    assert!(state.awaiting_final().is_empty());
    assert_eq!(state.version(), Some(1));
}

#[test]
fn momentum_is_applied_to_the_mean_of_the_delayed_deltas() {
    let settings = OuterSettings {
        learning_rate: 1.0,
        momentum: 0.5,
        momentum_delay: 2,
        max_staleness: 0,
        max_delta_norm_ratio: 0.0,
        staleness_scaling: super::center::StalenessScaling::None,
    };
    let (mut state, now) = joined_state(settings);
    let initial = center_values(&state, "b");
    for delta_b in [[2.0f32, 0.0, 0.0], [4.0, 0.0, 0.0]] {
        let delta = weights([0.0; 4], delta_b);
        let base = state.version().unwrap();
        commit_f32(&mut state, "d0", proto::SyncKind::Update, base, &delta, now);
    }
    // Immediate steps: +2 +4; after the second, velocity = mean 3 and the
    // Nesterov push adds lr·μ·3 = 1.5: 0.5 + 6 + 1.5 = 8.
    assert_eq!(center_values(&state, "b")[0], initial[0] + 7.5);
    let center = state.center().unwrap();
    assert_eq!(center.pending_deltas, 0);
    // Weights, velocity and delta sum: three f32 copies.
    assert_eq!(center.memory_bytes(), 3 * 4 * 7);
}

/// #22: a delta with a NaN or an infinity is discarded with its reason, in
/// either wire dtype, and the center (values and version) is unchanged; the
/// drafter is sent the center to restart from.
#[test]
fn a_non_finite_delta_is_discarded_and_changes_nothing() {
    for (dtype, bad) in [(WireDtype::F32, f32::NAN), (WireDtype::Bf16, f32::INFINITY)] {
        let (mut state, now) = joined_state(plain());
        state.open_session("d1");
        let before_a = center_values(&state, "a");
        let delta = weights([1.0, bad, 0.0, 0.0], [0.0, 0.0, 0.0]);
        let outcome = state
            .commit(
                "d1",
                upload(proto::SyncKind::Update, 0, &delta, dtype, 4),
                2,
                CONFIG,
                now,
            )
            .unwrap();
        assert!(!outcome.applied, "{dtype:?}");
        assert!(outcome.send_center);
        assert!(
            outcome.reason.contains("NaN or an infinity"),
            "{}",
            outcome.reason
        );
        assert_eq!(outcome.center_version, 0);
        assert_eq!(center_values(&state, "a"), before_a);
        assert_eq!(state.non_finite_deltas, 1);
        assert!(center_values(&state, "b")
            .iter()
            .all(|value| value.is_finite()));
    }
}

/// A finite delta that could take the center past half of f32's range is
/// discarded before it touches anything: the fuzz target `model_sync`
/// made the center infinite with a JOIN near f32's range and one such
/// delta (tests/fuzz/corpus/model_sync/crash-center-overflow). Within the
/// range, one is applied and the carried bounds cover the center; with
/// momentum, the step's push counts too.
#[test]
fn a_delta_that_could_overflow_the_center_is_discarded_and_changes_nothing() {
    let now = Instant::now();
    let mut state = ModelSyncState::new(plain(), None);
    let near_the_top = weights([3.0e38, 1.0, 0.0, -2.0], [0.5, 0.0, -1.0]);
    let outcome = state
        .commit(
            "d0",
            upload(proto::SyncKind::Join, 0, &near_the_top, WireDtype::F32, 4),
            2,
            CONFIG,
            now,
        )
        .unwrap();
    assert!(
        outcome.initialised,
        "a finite JOIN near the top is a center"
    );
    let before = center_values(&state, "a");
    let delta = weights([1.0e38, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]);
    let outcome = commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    assert!(!outcome.applied);
    assert!(outcome.send_center);
    assert!(
        outcome.reason.contains("past half of f32's range"),
        "{}",
        outcome.reason
    );
    assert_eq!((outcome.center_version, state.outlier_deltas), (0, 1));
    assert_eq!(center_values(&state, "a"), before);

    // The norm rules off: the magnitude bound alone.
    let (mut state, now) = joined_state(OuterSettings {
        max_delta_norm_ratio: 0.0,
        ..plain()
    });
    let large = weights([1.0e38, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]);
    let outcome = commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &large, now);
    assert!(outcome.applied, "{}", outcome.reason);
    let center = state.center().unwrap();
    let measured = center.measure_magnitudes();
    assert!(measured.values <= center.magnitudes.values);
    assert!(center.magnitudes.values < 1.1e38);
    let outcome = commit_f32(&mut state, "d0", proto::SyncKind::Update, 1, &large, now);
    assert!(!outcome.applied, "2e38 is past half of f32's range");
    assert_eq!(center_values(&state, "a")[0], 1.0e38 + 1.0);

    // Momentum 0.5 every delta: 6e37 → values 6e37 + 0.5 x 6e37 = 9e37;
    // the second would push them to 1.95e38.
    let momentum = OuterSettings {
        momentum: 0.5,
        momentum_delay: 1,
        max_delta_norm_ratio: 0.0,
        ..plain()
    };
    let (mut state, now) = joined_state(momentum);
    let delta = weights([0.0; 4], [6.0e37, 0.0, 0.0]);
    assert!(commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now).applied);
    let before = center_values(&state, "b");
    assert!(!commit_f32(&mut state, "d0", proto::SyncKind::Update, 1, &delta, now).applied);
    assert_eq!(center_values(&state, "b"), before);
}

/// #22: after the warm-up, a finite delta far above the recent applied
/// deltas' largest norm is discarded; one within the bound is applied.
#[test]
fn an_outlier_delta_norm_is_discarded_by_the_largest_recent_norm_rule() {
    let (mut state, now) = joined_state(plain());
    let small = weights([0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]);
    for version in 0..super::center::DELTA_NORM_WARMUP as u64 {
        let outcome = commit_f32(
            &mut state,
            "d0",
            proto::SyncKind::Update,
            version,
            &small,
            now,
        );
        assert!(outcome.applied);
    }
    let version = super::center::DELTA_NORM_WARMUP as u64;
    let before = center_values(&state, "a");
    // Norm 0.25 x 11 is over 10 x the largest, 0.25.
    let huge = weights([0.25 * 11.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]);
    let outcome = commit_f32(
        &mut state,
        "d0",
        proto::SyncKind::Update,
        version,
        &huge,
        now,
    );
    assert!(!outcome.applied);
    assert!(outcome.reason.contains("largest"), "{}", outcome.reason);
    assert_eq!(center_values(&state, "a"), before);
    assert_eq!(state.outlier_deltas, 1);
    // Nine times the largest is within the bound.
    let large = weights([0.25 * 9.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]);
    let outcome = commit_f32(
        &mut state,
        "d0",
        proto::SyncKind::Update,
        version,
        &large,
        now,
    );
    assert!(outcome.applied, "{}", outcome.reason);
}

/// #22: the center is finite by construction: a first JOIN with a NaN is
/// refused (no center is made) and names the tensor.
#[test]
fn a_join_with_non_finite_weights_never_becomes_the_center() {
    let mut state = ModelSyncState::new(plain(), None);
    state.open_session("d0");
    let initial = weights([1.0, 2.0, f32::NAN, 4.0], [0.5, -0.5, 8.0]);
    let error = state
        .commit(
            "d0",
            upload(proto::SyncKind::Join, 0, &initial, WireDtype::F32, 3),
            2,
            CONFIG,
            Instant::now(),
        )
        .unwrap_err();
    assert!(
        matches!(&error, SyncError::BadTensor { name, detail } if name == "a" && detail.contains("not finite")),
        "{error}"
    );
    assert!(state.center().is_none());
}

/// #22: the samples a drafter claims are credited only up to what the
/// broker saw it ack, over all its exchanges: an inflated claim (2^62
/// samples) cannot advance the center's count, and so the run's schedule;
/// acks that land later are credited at the next exchange.
#[test]
fn claimed_samples_are_credited_only_up_to_the_drafters_acks() {
    let (mut state, now) = joined_state(plain());
    let delta = weights([0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]);
    let mut inflated = upload(proto::SyncKind::Update, 0, &delta, WireDtype::F32, 4);
    inflated.samples = 1 << 62;
    inflated.acked_by_drafter = Some(4);
    let outcome = state.commit("d0", inflated, 2, CONFIG, now).unwrap();
    assert!(outcome.applied);
    assert_eq!(outcome.center_samples, 4);
    // The begin claims 10; 30 acked in all, 4 already credited: all 10 count.
    let mut honest = upload(proto::SyncKind::Update, 1, &delta, WireDtype::F32, 4);
    honest.acked_by_drafter = Some(30);
    let outcome = state.commit("d0", honest, 2, CONFIG, now).unwrap();
    assert_eq!(outcome.center_samples, 14);
    // Acks lagging behind the claim: credited up to them (16), no more.
    let mut early = upload(proto::SyncKind::Update, 2, &delta, WireDtype::F32, 4);
    early.acked_by_drafter = Some(16);
    let outcome = state.commit("d0", early, 2, CONFIG, now).unwrap();
    assert_eq!(outcome.center_samples, 16);
    let status = state.status(now);
    let record = status
        .drafters
        .iter()
        .find(|drafter| drafter.drafter_id == "d0")
        .unwrap();
    assert_eq!(record.samples, 16);
}

/// #22: with `--model-config` the run's model is fixed: the first JOIN (which
/// defines an empty center) and every later one must carry that config, or
/// are refused naming both; a resumed center of another model is refused.
#[test]
fn a_pinned_model_config_refuses_any_other_model_even_for_an_empty_center() {
    let mut state = ModelSyncState::new(plain(), None);
    state.pin_config(CONFIG).unwrap();
    state.open_session("squatter");
    let initial = weights([1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 8.0]);
    let other = r#"{"architectures": ["DFlashDraftModel"], "hidden_size": 8}"#;
    let error = state
        .commit(
            "squatter",
            upload(proto::SyncKind::Join, 0, &initial, WireDtype::F32, 3),
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
    assert!(state.center().is_none(), "nothing was defined");
    // The same config, spelled with other spacing, is the same model.
    let spaced = r#"{ "hidden_size": 4, "architectures": [ "DFlashDraftModel" ] }"#;
    state.open_session("d0");
    let outcome = state
        .commit(
            "d0",
            upload(proto::SyncKind::Join, 0, &initial, WireDtype::F32, 3),
            2,
            spaced,
            Instant::now(),
        )
        .unwrap();
    assert!(outcome.initialised);
    // A resumed center of another model cannot be pinned to this one.
    let center = state.center().unwrap().clone();
    let mut resumed = ModelSyncState::new(plain(), Some(center));
    assert!(matches!(
        resumed.pin_config(other),
        Err(SyncError::ConfigMismatch { .. })
    ));
}

/// #23: with `--outer-staleness-scaling inverse` a delta s center updates
/// stale moves the center by delta / s (a fresh one, s = 0, fully), and adds
/// the same weighted delta to the momentum's sum.
#[test]
fn inverse_staleness_scaling_weighs_a_delta_by_one_over_its_staleness() {
    let settings = OuterSettings {
        staleness_scaling: super::center::StalenessScaling::Inverse,
        ..plain()
    };
    let (mut state, now) = joined_state(settings);
    let delta = weights([1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]);
    // Base 0 at version 0: staleness 0, weight 1 → a = 2.
    let outcome = commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    assert_eq!((outcome.applied, outcome.staleness), (true, 0));
    assert_eq!(center_values(&state, "a")[0], 2.0);
    // Base 0 at version 1: staleness 1, weight 1 → a = 3.
    let outcome = commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    assert_eq!((outcome.applied, outcome.staleness), (true, 1));
    assert_eq!(center_values(&state, "a")[0], 3.0);
    // Base 0 at version 2: staleness 2, weight 1/2 → a = 3.5; then
    // staleness 3 at version 3 would be 1/3 (not dyadic): 4 is exact.
    commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    assert_eq!(center_values(&state, "a")[0], 3.5);
    commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    assert_eq!(state.version(), Some(5));
    let a = center_values(&state, "a")[0];
    assert!(
        (a - (3.5 + 1.0 / 3.0 + 0.25)).abs() <= 4.0 * f32::EPSILON * a,
        "a = {a}"
    );

    // Momentum μ 0.5 every delta: the sum gets the weighted delta too.
    // Staleness 0 (weight 1): a = 1 + 1, velocity 1, push 0.5 → 2.5.
    // Staleness 1 (weight 1): a = 3.5, velocity 0.5 + 1 = 1.5, push 0.75 → 4.25.
    // Staleness 2 (weight 1/2): a = 4.75, velocity 0.75 + 0.5 = 1.25,
    // push 0.625 → 5.375 (unweighted it would be 6.125).
    let momentum = OuterSettings {
        momentum: 0.5,
        momentum_delay: 1,
        ..settings
    };
    let (mut state, now) = joined_state(momentum);
    for expected in [2.5, 4.25, 5.375] {
        commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
        assert_eq!(center_values(&state, "a")[0], expected);
    }
}

/// The broker's AdamW over drafters' gradients (`--sync-gradients`) was
/// removed; its `SyncBegin.gradient_step` stays on the wire (field 7) and
/// is refused, whatever the exchange, before anything is staged.
#[test]
fn a_begin_with_a_gradient_step_is_refused_naming_it_and_changes_nothing() {
    let (mut state, now) = joined_state(plain());
    let delta = weights([0.5; 4], [0.5; 3]);
    commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    let (version, a, b) = (
        state.version(),
        center_values(&state, "a"),
        center_values(&state, "b"),
    );
    let record = state.drafter("d0").unwrap().clone();
    let step = proto::GradientStep {
        learning_rate: 1e-3,
        max_grad_norm: 1.0,
        beta1: 0.9,
        beta2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.0,
        step_samples: 4,
    };
    for kind in [
        proto::SyncKind::Update,
        proto::SyncKind::Final,
        proto::SyncKind::Join,
    ] {
        let refused = proto::SyncBegin {
            gradient_step: Some(step),
            ..begin(kind, 1)
        };
        let error = Upload::new(&refused).unwrap_err();
        assert_eq!(error, SyncError::GradientStepRemoved);
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().starts_with("gradient_step: ")
                && status.message().contains("--sync-gradients"),
            "{kind:?}: {}",
            status.message()
        );
    }
    assert_eq!(state.version(), version);
    assert_eq!(center_values(&state, "a"), a);
    assert_eq!(center_values(&state, "b"), b);
    let after = state.drafter("d0").unwrap();
    assert_eq!(
        (after.updates_applied, after.samples, after.base_version),
        (record.updates_applied, record.samples, record.base_version)
    );
    // The same exchange without it is a delta as before.
    let outcome = commit_f32(&mut state, "d0", proto::SyncKind::Update, 1, &delta, now);
    assert!(outcome.applied);
    assert_eq!(state.version(), version.map(|version| version + 1));
}

/// A data-parallel snapshot of `steps` committed steps and `samples`.
fn snapshot_upload(
    kind: proto::SyncKind,
    steps: u64,
    samples: u64,
    tensors: &[(&'static str, Vec<u64>, Vec<f32>)],
) -> Upload {
    let begin = proto::SyncBegin {
        steps,
        samples,
        ..begin(kind, 0)
    };
    upload_of(&begin, tensors, WireDtype::F32, 3)
}

#[test]
fn a_snapshot_of_a_later_step_becomes_the_center_and_an_older_one_changes_nothing() {
    let (mut state, now) = joined_state(plain());
    let trained = weights([1.5, 2.5, -3.0, 4.25], [0.0, 1.0, 2.0]);
    let outcome = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 7, 56, &trained),
            2,
            CONFIG,
            now,
        )
        .unwrap();
    assert!(outcome.applied);
    assert_eq!(outcome.center_version, 7);
    assert_eq!(outcome.center_samples, 56);
    assert_eq!(center_values(&state, "a"), vec![1.5, 2.5, -3.0, 4.25]);
    assert_eq!(center_values(&state, "b"), vec![0.0, 1.0, 2.0]);
    // A member behind the others (step 6) changes nothing.
    let older = weights([9.0; 4], [9.0; 3]);
    let outcome = state
        .commit(
            "d1",
            snapshot_upload(proto::SyncKind::FinalSnapshot, 6, 48, &older),
            2,
            CONFIG,
            now,
        )
        .unwrap();
    assert!(!outcome.applied);
    assert!(outcome.reason.contains("step 7"), "{}", outcome.reason);
    assert_eq!(state.version(), Some(7));
    assert_eq!(center_values(&state, "a"), vec![1.5, 2.5, -3.0, 4.25]);
    assert!(state.drafter("d1").unwrap().finished);
}

#[test]
fn a_snapshot_with_a_non_finite_weight_or_a_missing_tensor_is_refused() {
    let (mut state, now) = joined_state(plain());
    let broken = weights([1.0, f32::NAN, 3.0, 4.0], [0.5, -0.5, 8.0]);
    assert!(state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 3, 8, &broken),
            2,
            CONFIG,
            now,
        )
        .is_err());
    let partial = vec![("a", vec![2, 2], vec![1.0, 2.0, 3.0, 4.0])];
    let error = state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 3, 8, &partial),
            1,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert_eq!(error, SyncError::MissingTensor("b".to_string()));
    assert_eq!(state.version(), Some(0));
    assert_eq!(center_values(&state, "a"), vec![1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn snapshots_and_deltas_never_mix_in_one_run() {
    let (mut state, now) = joined_state(plain());
    let trained = weights([1.5, 2.5, -3.0, 4.25], [0.0, 1.0, 2.0]);
    state
        .commit(
            "d0",
            snapshot_upload(proto::SyncKind::Snapshot, 2, 16, &trained),
            2,
            CONFIG,
            now,
        )
        .unwrap();
    let delta = weights([0.5; 4], [0.5; 3]);
    let error = state
        .commit(
            "d1",
            upload(proto::SyncKind::Update, 2, &delta, WireDtype::F32, 4),
            2,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert!(matches!(error, SyncError::MixedMethods(_)), "{error:?}");
    assert_eq!(center_values(&state, "a"), vec![1.5, 2.5, -3.0, 4.25]);
    // Nor the other way: a run of deltas keeps its center.
    let (mut state, now) = joined_state(plain());
    commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &delta, now);
    let error = state
        .commit(
            "d1",
            snapshot_upload(proto::SyncKind::Snapshot, 9, 16, &trained),
            2,
            CONFIG,
            now,
        )
        .unwrap_err();
    assert!(matches!(error, SyncError::MixedMethods(_)), "{error:?}");
    assert_eq!(state.version(), Some(1));
    assert_eq!(center_values(&state, "a"), vec![1.5, 2.5, 3.5, 4.5]);
}

/// #37's try: a drafter credential's first delta of 1e20 per value was
/// applied (the largest-recent-norm rule waits for 4 applied deltas) and
/// the center became 1e20 everywhere. Before that warm-up a delta over ten
/// times the weights' norm is refused, and one within it still applies.
#[test]
fn a_huge_first_delta_is_refused_before_the_norm_rule_has_history() {
    let (mut state, now) = joined_state(plain());
    let before = center_values(&state, "a");
    // The joined weights' norm: sqrt(1+4+9+16+0.25+0.25+64) = 9.73.
    let destroying = weights([1e20; 4], [1e20; 3]);
    let outcome = commit_f32(
        &mut state,
        "d0",
        proto::SyncKind::Update,
        0,
        &destroying,
        now,
    );
    assert!(!outcome.applied);
    assert!(
        outcome.reason.contains("weights' norm"),
        "{}",
        outcome.reason
    );
    assert_eq!(center_values(&state, "a"), before);
    assert_eq!(state.outlier_deltas, 1);
    // 90 is under 10 x 9.73: a large early delta is not a fault.
    let large = weights([90.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]);
    let outcome = commit_f32(&mut state, "d0", proto::SyncKind::Update, 0, &large, now);
    assert!(outcome.applied, "{}", outcome.reason);
}

/// A snapshot's samples are the run's (every member's), so the sending
/// drafter's own acks do not cut them, where a delta's claim is cut.
#[test]
fn a_snapshots_samples_are_the_runs_not_cut_to_the_senders_acks() {
    let (mut state, now) = joined_state(plain());
    let trained = weights([1.5, 2.5, -3.0, 4.25], [0.0, 1.0, 2.0]);
    let mut upload = snapshot_upload(proto::SyncKind::Snapshot, 4, 64, &trained);
    upload.acked_by_drafter = Some(16);
    let outcome = state.commit("d0", upload, 2, CONFIG, now).unwrap();
    assert!(outcome.applied);
    assert_eq!(outcome.center_samples, 64);
}
