//! The write-ahead log's file format on a real directory: replay, a torn
//! tail cut off, corruption refused with its place, compaction bounded.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::sync::Arc;

use dflash_broker::queue::{JournalEntry, Payload, Queue, QueueConfig, Recovered};
use dflash_broker::wal::{DurablePayload, LogConfig, RunShape, Wal, WalError};

#[derive(Debug, Clone, PartialEq)]
struct Blob(Vec<u8>);

impl Payload for Blob {
    fn size_bytes(&self) -> u64 {
        self.0.len() as u64
    }
}

impl DurablePayload for Blob {
    fn encode_payload(&self) -> Vec<bytes::Bytes> {
        // Two pieces, so the record framing is checked across pieces.
        let middle = self.0.len() / 2;
        vec![
            bytes::Bytes::copy_from_slice(&self.0[..middle]),
            bytes::Bytes::copy_from_slice(&self.0[middle..]),
        ]
    }

    fn decode_payload(bytes: &[u8]) -> Result<Self, String> {
        Ok(Blob(bytes.to_vec()))
    }
}

fn accepted(target: &str, seq: u64, bytes: usize) -> JournalEntry<Blob> {
    JournalEntry::Accepted {
        target_id: Arc::from(target),
        seq,
        payload: Blob(vec![seq as u8; bytes]),
    }
}

fn acked(target: &str, seq: u64) -> JournalEntry<Blob> {
    JournalEntry::Acked {
        target_id: Arc::from(target),
        seq,
    }
}

/// The log of a run of one target, `target-0`.
fn log_config(max_queue_bytes: u64) -> LogConfig {
    LogConfig::new(max_queue_bytes, RunShape::new(vec!["target-0".to_string()]))
}

fn open(dir: &std::path::Path) -> dflash_broker::wal::Opened<Blob> {
    Wal::<Blob>::open(dir, &log_config(1 << 20), || "run-test".to_string()).unwrap()
}

/// A queue of one target holding at most `max_queue_bytes`, with the
/// queue tests' other settings.
fn one_target_config(max_queue_bytes: u64) -> QueueConfig {
    QueueConfig {
        target_ids: QueueConfig::default_target_ids(1),
        max_queue_bytes,
        lease_timeout: std::time::Duration::from_secs(30),
        max_deliveries: 3,
        target_grace: std::time::Duration::from_secs(120),
        target_startup_timeout: None,
        on_target_failure: dflash_broker::queue::FailurePolicy::Abort,
        target_stall_timeout: None,
        target_load_timeout: None,
        max_lease_lifetime: None,
        keepalive_detection: None,
    }
}

fn segments(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "wal"))
        .collect();
    found.sort();
    found
}

#[test]
fn replay_returns_unacked_items_and_the_same_run_id() {
    let dir = tempfile::tempdir().unwrap();
    let mut opened = open(dir.path());
    assert_eq!(opened.run_id, "run-test");
    assert_eq!(opened.records, 0);
    opened
        .wal
        .append(&[
            JournalEntry::Epoch {
                target_id: Arc::from("target-0"),
                epoch: 3,
            },
            accepted("target-0", 0, 100),
            accepted("target-0", 1, 200),
            accepted("target-0", 2, 300),
            acked("target-0", 1),
            JournalEntry::Done {
                target_id: Arc::from("target-0"),
            },
        ])
        .unwrap();
    drop(opened);
    let reopened = Wal::<Blob>::open(dir.path(), &log_config(1 << 20), || {
        panic!("the run id must be read back, not made anew")
    })
    .unwrap();
    assert_eq!(reopened.run_id, "run-test");
    assert_eq!(reopened.records, 6);
    assert!(!reopened.truncated_tail);
    let recovered = reopened.recovered;
    let items: Vec<(String, u64, usize)> = recovered
        .items()
        .map(|(target, seq, blob)| (target.to_string(), *seq, blob.0.len()))
        .collect();
    assert_eq!(
        items,
        vec![
            ("target-0".to_string(), 0, 100),
            ("target-0".to_string(), 2, 300)
        ]
    );
    let target = &recovered.targets["target-0"];
    assert_eq!(
        (target.epoch, target.accepted_items, target.done),
        (3, 3, true)
    );
    assert_eq!(target.highest_seq(), Some(2));
    assert_eq!((recovered.acked_items, recovered.acked_bytes), (1, 200));
}

#[test]
fn a_torn_tail_is_cut_off_and_appends_continue() {
    let dir = tempfile::tempdir().unwrap();
    let mut opened = open(dir.path());
    opened
        .wal
        .append(&[accepted("target-0", 0, 64), accepted("target-0", 1, 64)])
        .unwrap();
    drop(opened);
    let segment = segments(dir.path()).pop().unwrap();
    let full = std::fs::metadata(&segment).unwrap().len();
    // A crash mid-write: the last frame is half there.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap();
    file.set_len(full - 30).unwrap();
    drop(file);
    let mut reopened = open(dir.path());
    assert!(reopened.truncated_tail);
    assert_eq!(reopened.records, 1);
    assert_eq!(reopened.recovered.items().count(), 1);
    reopened.wal.append(&[accepted("target-0", 1, 64)]).unwrap();
    drop(reopened);
    let again = open(dir.path());
    assert!(!again.truncated_tail);
    assert_eq!(again.recovered.items().count(), 2);
}

#[test]
fn corruption_before_the_tail_is_refused_with_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let mut opened = open(dir.path());
    opened.wal.append(&[accepted("target-0", 0, 64)]).unwrap();
    // Compaction starts a second segment, so the first is no longer the tail.
    let snapshot = vec![
        JournalEntry::Reset,
        accepted("target-0", 0, 64),
        JournalEntry::SnapshotEnd,
    ];
    opened.wal.compact(&snapshot).unwrap();
    opened.wal.append(&[accepted("target-0", 1, 64)]).unwrap();
    drop(opened);
    let files = segments(dir.path());
    assert_eq!(files.len(), 1, "compaction deletes the older segment");
    // Recreate an older segment with a flipped byte in its only frame.
    let older = dir.path().join("segment-0000000000000000.wal");
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&older, &bytes).unwrap();
    match try_open(dir.path()) {
        Err(WalError::Corrupt { path, detail, .. }) => {
            assert_eq!(path, older);
            assert!(detail.contains("CRC"), "{detail}");
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("a corrupt older segment was accepted"),
    }
}

#[test]
fn compaction_keeps_the_log_bounded_and_the_state_equal() {
    let dir = tempfile::tempdir().unwrap();
    let max_queue_bytes = 1 << 20;
    let config = one_target_config(max_queue_bytes);
    let now = std::time::Instant::now();
    let mut opened = Wal::<Blob>::open(dir.path(), &log_config(max_queue_bytes), || {
        "run-compact".to_string()
    })
    .unwrap();
    let mut queue = Queue::recover(config.clone(), Recovered::default(), now);
    let producer = queue.open_producer("target-0", now).unwrap();
    let drafter = queue
        .open_consumer(
            "drafter",
            dflash_broker::queue::Credit { items: 4, bytes: 0 },
            now,
        )
        .unwrap();
    let mut compactions = 0;
    let mut largest = 0;
    // 400 items of 512 KiB (200 MiB in all) through a 1 MiB cap: acked as
    // they go, so only a few are ever held.
    for seq in 0..400u64 {
        queue
            .accept_item(producer.connection, seq, Blob(vec![7; 512 << 10]), now)
            .unwrap();
        let deliveries: Vec<u64> = queue
            .take_effects()
            .into_iter()
            .filter_map(|effect| match effect {
                dflash_broker::queue::Effect::Deliver { delivery, .. } => {
                    Some(delivery.delivery_id)
                }
                _ => None,
            })
            .collect();
        queue.ack(drafter, &deliveries, now);
        opened.wal.append(&queue.take_journal()).unwrap();
        if opened.wal.needs_compaction() {
            opened.wal.compact(&queue.snapshot_entries()).unwrap();
            compactions += 1;
        }
        largest = largest.max(opened.wal.log_bytes());
    }
    assert!(compactions >= 2, "{compactions} compactions");
    // Bound: the compaction threshold (64 MiB minimum) plus one item.
    assert!(
        largest <= (64 << 20) + (600 << 10),
        "log reached {largest} bytes"
    );
    let before = queue.snapshot(now);
    drop(opened);
    let reopened = open(dir.path());
    let recovered = Queue::recover(config, reopened.recovered, now);
    let after = recovered.snapshot(now);
    assert_eq!(after.accepted_items, before.accepted_items);
    assert_eq!(after.acked_items, before.acked_items);
    assert_eq!(
        after.queued_items,
        before.queued_items + before.leased_items
    );
    assert_eq!(after.targets[0].highest_seq, Some(399));
    recovered.check_invariants().unwrap();
}

#[test]
fn a_second_open_of_a_locked_state_dir_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path());
    let refused = Wal::<Blob>::open(dir.path(), &log_config(1 << 20), || {
        panic!("a refused open must not make a run id")
    });
    let error = match refused {
        Err(error) => error,
        Ok(_) => panic!("two logs open on one state dir"),
    };
    assert!(matches!(error, WalError::Locked { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains(&dir.path().display().to_string()),
        "{error}"
    );
    // Closed (the process exited): the next broker gets in.
    drop(first);
    let reopened = open(dir.path());
    assert_eq!(reopened.run_id, "run-test");
}

#[test]
fn delivery_counts_are_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut opened = open(dir.path());
    let delivered = |seq, deliveries| JournalEntry::Delivered {
        target_id: Arc::from("target-0"),
        seq,
        deliveries,
    };
    opened
        .wal
        .append(&[
            accepted("target-0", 0, 10),
            accepted("target-0", 1, 10),
            delivered(0, 1),
            delivered(1, 1),
            delivered(0, 2),
        ])
        .unwrap();
    drop(opened);
    let recovered = open(dir.path()).recovered;
    assert_eq!(recovered.deliveries_of("target-0", 0), 2);
    assert_eq!(recovered.deliveries_of("target-0", 1), 1);
    assert_eq!(recovered.deliveries_of("target-0", 2), 0);
}

/// A queue at its cap (`items` of `item_bytes`, none acked) and its journal
/// appended to a fresh log in `dir`.
fn log_at_the_cap(
    dir: &std::path::Path,
    items: u64,
    item_bytes: usize,
) -> (dflash_broker::wal::Opened<Blob>, Queue<Blob>) {
    let max_queue_bytes = items * item_bytes as u64;
    let config = one_target_config(max_queue_bytes);
    let now = std::time::Instant::now();
    let mut opened =
        Wal::<Blob>::open(dir, &log_config(max_queue_bytes), || "run-cap".to_string()).unwrap();
    let mut queue = Queue::recover(config, Recovered::default(), now);
    let producer = queue.open_producer("target-0", now).unwrap();
    for seq in 0..items {
        queue
            .accept_item(
                producer.connection,
                seq,
                Blob(vec![seq as u8; item_bytes]),
                now,
            )
            .unwrap();
    }
    opened.wal.append(&queue.take_journal()).unwrap();
    opened.wal.sync().unwrap();
    (opened, queue)
}

/// Compaction at the cap (64 MiB: four 16 MiB items) done both ways. The
/// broker calls it under its queue lock: the synchronous form holds the
/// caller for the whole snapshot write and sync, the background form only
/// for a sync and a new segment (both durations are printed; run with
/// `--nocapture`). Either way the log replays to the same state, including
/// what was appended while the snapshot was being written.
#[test]
fn background_compaction_keeps_every_entry_and_frees_the_caller() {
    const ITEMS: u64 = 4;
    const ITEM_BYTES: usize = 16 << 20;
    let mut held_for = Vec::new();
    for background in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (mut opened, queue) = log_at_the_cap(dir.path(), ITEMS, ITEM_BYTES);
        let snapshot = queue.snapshot_entries();
        let started = std::time::Instant::now();
        if background {
            opened.wal.compact_in_background(snapshot).unwrap();
        } else {
            opened.wal.compact(&snapshot).unwrap();
        }
        held_for.push(started.elapsed());
        // Appended while (maybe) the snapshot is still being written.
        opened
            .wal
            .append(&[acked("target-0", 1), accepted("target-0", ITEMS, 64)])
            .unwrap();
        opened.wal.wait_for_compaction().unwrap();
        assert!(!opened.wal.is_compacting());
        drop(opened);
        assert_eq!(
            segments(dir.path()).len(),
            if background { 2 } else { 1 },
            "older segments deleted: {:?}",
            segments(dir.path())
        );
        let recovered = Wal::<Blob>::open(dir.path(), &log_config(1 << 20), || {
            panic!("the run id is kept")
        })
        .unwrap()
        .recovered;
        let items: Vec<(u64, usize)> = recovered
            .items()
            .map(|(_, seq, blob)| (*seq, blob.0.len()))
            .collect();
        assert_eq!(
            items,
            vec![
                (0, ITEM_BYTES),
                (2, ITEM_BYTES),
                (3, ITEM_BYTES),
                (ITEMS, 64)
            ],
            "background: {background}"
        );
        assert_eq!(recovered.acked_items, 1);
        assert_eq!(recovered.targets["target-0"].accepted_items, ITEMS + 1);
    }
    eprintln!(
        "compaction of a {} MiB snapshot: caller held {:.1} ms synchronously, {:.1} ms in the background form",
        (ITEMS * ITEM_BYTES as u64) >> 20,
        held_for[0].as_secs_f64() * 1e3,
        held_for[1].as_secs_f64() * 1e3
    );
}

/// Bytes of a segment's header (magic, version, fingerprint).
const SEGMENT_HEADER_BYTES: u64 = 32;

/// The newest segment's bytes after appending `entries` to a fresh log.
fn segment_with(dir: &std::path::Path, entries: &[JournalEntry<Blob>]) -> std::path::PathBuf {
    let mut opened = open(dir);
    opened.wal.append(entries).unwrap();
    opened.wal.flush().unwrap();
    drop(opened);
    segments(dir).pop().unwrap()
}

/// Opens `dir` as a one-target log (a new run id "x" if it has none).
fn try_open(dir: &std::path::Path) -> Result<dflash_broker::wal::Opened<Blob>, WalError> {
    Wal::<Blob>::open(dir, &log_config(1 << 20), || "x".to_string())
}

/// Where and why opening `dir` is refused as corrupt (fails the test if it
/// is accepted or refused otherwise).
fn refused_at(dir: &std::path::Path) -> (std::path::PathBuf, u64, String) {
    match try_open(dir) {
        Err(WalError::Corrupt {
            path,
            offset,
            detail,
        }) => (path, offset, detail),
        Err(other) => panic!("unexpected error {other}"),
        Ok(opened) => panic!("a damaged log was accepted ({} records)", opened.records),
    }
}

/// #25: a flipped bit in the newest segment's first frame, with good
/// frames after it, is not a torn write: the broker refuses to start,
/// naming the file and the frame's offset, instead of cutting off every
/// record after it (acks and accepted items rolled back).
#[test]
fn a_bad_frame_with_good_frames_after_it_is_refused_not_cut() {
    let dir = tempfile::tempdir().unwrap();
    let segment = segment_with(
        dir.path(),
        &[
            accepted("target-0", 0, 64),
            accepted("target-0", 1, 64),
            acked("target-0", 0),
        ],
    );
    let before = std::fs::read(&segment).unwrap();
    let mut bytes = before.clone();
    // Inside the first frame's body (after its 8-byte frame header).
    bytes[SEGMENT_HEADER_BYTES as usize + 20] ^= 0x01;
    std::fs::write(&segment, &bytes).unwrap();
    let (path, offset, detail) = refused_at(dir.path());
    assert_eq!(path, segment);
    assert_eq!(offset, SEGMENT_HEADER_BYTES);
    assert!(detail.contains("CRC"), "{detail}");
    // Refusing changed nothing on disk.
    assert_eq!(std::fs::read(&segment).unwrap(), bytes);
}

/// A crash can leave the last frame half written, its CRC failing, or a
/// tail of zero bytes the file system allocated: each is cut off, the
/// records before it kept.
#[test]
fn only_a_write_cut_short_at_the_end_is_cut_off() {
    for damage in ["bad last frame", "zero tail"] {
        let dir = tempfile::tempdir().unwrap();
        let segment = segment_with(
            dir.path(),
            &[accepted("target-0", 0, 64), accepted("target-0", 1, 64)],
        );
        let mut bytes = std::fs::read(&segment).unwrap();
        let good = bytes.len();
        match damage {
            "bad last frame" => {
                let last = bytes.len() - 1;
                bytes[last] ^= 0xff;
            }
            _ => bytes.extend(std::iter::repeat_n(0u8, 4096)),
        }
        std::fs::write(&segment, &bytes).unwrap();
        let reopened = open(dir.path());
        assert!(reopened.truncated_tail, "{damage}");
        let kept = if damage == "zero tail" { 2 } else { 1 };
        assert_eq!(reopened.recovered.items().count(), kept, "{damage}");
        drop(reopened);
        let length = std::fs::metadata(&segment).unwrap().len() as usize;
        assert!(length <= good, "{damage}: {length} > {good}");
    }
}

/// A frame whose CRC holds but whose body is no record (another format, a
/// bug) is never taken for a torn write, even at the end.
#[test]
fn a_frame_that_decodes_to_nothing_is_refused_even_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let segment = segment_with(dir.path(), &[accepted("target-0", 0, 64)]);
    let mut bytes = std::fs::read(&segment).unwrap();
    let body = [0xEEu8, 1, 2, 3];
    bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    bytes.extend_from_slice(&body);
    std::fs::write(&segment, &bytes).unwrap();
    let (_, offset, detail) = refused_at(dir.path());
    assert_eq!(offset as usize, bytes.len() - 12);
    assert!(!detail.contains("CRC"), "{detail}");
}

/// A file that is not a segment, or a segment of a newer format, refuses
/// to start naming it.
#[test]
fn a_segment_without_the_magic_or_of_another_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let segment = segment_with(dir.path(), &[accepted("target-0", 0, 64)]);
    let good = std::fs::read(&segment).unwrap();
    let mut no_magic = good.clone();
    no_magic[0] = b'X';
    std::fs::write(&segment, &no_magic).unwrap();
    let (path, offset, detail) = refused_at(dir.path());
    assert_eq!((path, offset), (segment.clone(), 0));
    assert!(detail.contains("magic"), "{detail}");
    let mut newer = good.clone();
    newer[8..12].copy_from_slice(&2u32.to_le_bytes());
    let crc = crc32fast::hash(&newer[..24]);
    newer[24..28].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&segment, &newer).unwrap();
    match try_open(dir.path()) {
        Err(WalError::Version {
            found: 2,
            supported: 1,
            ..
        }) => {}
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("a segment of format 2 was read"),
    }
}

/// #25: a state dir written for other targets refuses to start, naming
/// both configurations; `--adopt-state-dir` keeps it under the new one,
/// and after that it opens under the new one without the flag.
#[test]
fn a_state_dir_of_other_targets_is_refused_unless_adopted() {
    let dir = tempfile::tempdir().unwrap();
    segment_with(dir.path(), &[accepted("target-0", 0, 64)]);
    let two = LogConfig::new(
        1 << 20,
        RunShape::new(vec!["target-0".to_string(), "target-1".to_string()]),
    );
    let error = match Wal::<Blob>::open(dir.path(), &two, || "x".to_string()) {
        Err(error) => error,
        Ok(_) => panic!("a state dir of one target opened for two"),
    };
    assert!(matches!(error, WalError::ConfigMismatch { .. }), "{error}");
    let message = error.to_string();
    assert!(message.contains("1 shards: target-0"), "{message}");
    assert!(message.contains("2 shards: target-0,target-1"), "{message}");
    assert!(message.contains("--adopt-state-dir"), "{message}");
    let mut adopt = two.clone();
    adopt.adopt = true;
    let adopted = Wal::<Blob>::open(dir.path(), &adopt, || panic!("the run id is kept")).unwrap();
    assert_eq!(adopted.recovered.items().count(), 1);
    drop(adopted);
    let again = Wal::<Blob>::open(dir.path(), &two, || panic!("the run id is kept")).unwrap();
    assert_eq!(again.recovered.items().count(), 1);
    drop(again);
    // And the old configuration is now the mismatch.
    assert!(matches!(
        try_open(dir.path()),
        Err(WalError::ConfigMismatch { .. })
    ));
}

/// #50: the state dir records the run's `--target-capture`. Another value
/// is refused naming both, `--adopt-state-dir` or not; a state dir written
/// before the record (segments, no `target-capture` file) takes the
/// configured value and is held to it from then on.
#[test]
fn a_state_dir_recording_another_target_capture_is_refused_even_when_adopting() {
    let with_capture = |capture: &str| LogConfig {
        target_capture: capture.to_string(),
        ..log_config(1 << 20)
    };
    let dir = tempfile::tempdir().unwrap();
    segment_with(dir.path(), &[accepted("target-0", 0, 64)]);
    // `segment_with` opened it without a capture: `none` is recorded.
    let record = dir.path().join("target-capture");
    assert_eq!(std::fs::read_to_string(&record).unwrap(), "none\n");
    for adopt in [false, true] {
        let config = LogConfig {
            adopt,
            ..with_capture("last-hidden-states")
        };
        match Wal::<Blob>::open(dir.path(), &config, || "x".to_string()) {
            Err(WalError::CaptureMismatch {
                path,
                stored,
                configured,
            }) => {
                assert_eq!(path, dir.path());
                assert_eq!(
                    (stored.as_str(), configured.as_str()),
                    ("none", "last-hidden-states")
                );
            }
            Err(other) => panic!("unexpected error {other}"),
            Ok(_) => panic!("a state dir of a run without capture opened with one (adopt {adopt})"),
        }
    }
    assert_eq!(open(dir.path()).recovered.items().count(), 1);

    // A state dir from an older broker: the configured value is recorded.
    std::fs::remove_file(&record).unwrap();
    let legacy = Wal::<Blob>::open(dir.path(), &with_capture("last-hidden-states"), || {
        panic!("the run id is kept")
    })
    .unwrap();
    assert_eq!(legacy.recovered.items().count(), 1);
    drop(legacy);
    assert_eq!(
        std::fs::read_to_string(&record).unwrap(),
        "last-hidden-states\n"
    );
    let message = match try_open(dir.path()) {
        Err(error) => error.to_string(),
        Ok(_) => panic!("the recorded capture was not held to"),
    };
    assert!(
        message.contains("capture last-hidden-states (its file target-capture)")
            && message.contains("configured with no --target-capture (none)")
            && message.contains("Restart it with --target-capture last-hidden-states"),
        "{message}"
    );
}

/// A segment copied in from another state dir (its fingerprint another
/// configuration's) is refused.
#[test]
fn a_segment_of_another_run_configuration_is_refused() {
    let ours = tempfile::tempdir().unwrap();
    let theirs = tempfile::tempdir().unwrap();
    segment_with(ours.path(), &[accepted("target-0", 0, 64)]);
    let other = LogConfig::new(1 << 20, RunShape::new(vec!["other".to_string()]));
    let mut opened = Wal::<Blob>::open(theirs.path(), &other, || "y".to_string()).unwrap();
    opened.wal.append(&[accepted("other", 0, 64)]).unwrap();
    opened.wal.flush().unwrap();
    drop(opened);
    let foreign = segments(theirs.path()).pop().unwrap();
    std::fs::copy(&foreign, ours.path().join("segment-0000000000000009.wal")).unwrap();
    assert!(matches!(
        try_open(ours.path()),
        Err(WalError::ForeignSegment { .. })
    ));
}

/// A write rolled back (it failed part way for want of space) leaves no
/// trace: what is appended after the rollback follows the records before
/// the mark.
#[test]
fn a_rolled_back_write_leaves_no_trace() {
    let dir = tempfile::tempdir().unwrap();
    let mut opened = open(dir.path());
    opened.wal.append(&[accepted("target-0", 0, 64)]).unwrap();
    opened.wal.flush().unwrap();
    let mark = opened.wal.mark();
    // Partly flushed, partly buffered: a large record goes to the file at
    // once, a small one stays in the buffer.
    opened
        .wal
        .append(&[accepted("target-0", 1, 1 << 20), acked("target-0", 0)])
        .unwrap();
    opened.wal.rollback(mark).unwrap();
    opened.wal.append(&[accepted("target-0", 2, 64)]).unwrap();
    drop(opened);
    let reopened = open(dir.path());
    assert!(!reopened.truncated_tail);
    let seqs: Vec<u64> = reopened.recovered.items().map(|(_, seq, _)| *seq).collect();
    assert_eq!(seqs, vec![0, 2]);
    assert_eq!(reopened.recovered.acked_items, 0);
}

/// A run whose log failed for good stays aborted across a restart.
#[test]
fn a_recorded_abort_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let opened = open(dir.path());
    opened
        .wal
        .record_abort("the write-ahead log failed: EIO on fdatasync")
        .unwrap();
    drop(opened);
    let reopened = open(dir.path());
    assert_eq!(
        reopened.recovered.aborted.as_deref(),
        Some("the write-ahead log failed: EIO on fdatasync")
    );
}

/// A snapshot joins the log only once written whole, so a log that ends
/// inside one (its end frame lost with a damaged tail) is refused rather
/// than resumed from part of it (found by the wal_segment fuzzer).
#[test]
fn a_log_that_ends_inside_a_snapshot_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut opened = open(dir.path());
    opened.wal.append(&[accepted("target-0", 0, 64)]).unwrap();
    let snapshot = vec![
        JournalEntry::Reset,
        accepted("target-0", 0, 64),
        accepted("target-0", 1, 64),
        JournalEntry::SnapshotEnd,
    ];
    opened.wal.compact(&snapshot).unwrap();
    drop(opened);
    let segment = segments(dir.path()).pop().unwrap();
    let length = std::fs::metadata(&segment).unwrap().len();
    // The SnapshotEnd frame (8 bytes of header, a 1-byte body) half gone.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap();
    file.set_len(length - 4).unwrap();
    drop(file);
    let (path, _, detail) = refused_at(dir.path());
    assert_eq!(path, segment);
    assert!(detail.contains("inside a snapshot"), "{detail}");
}
