//! The write-ahead log under `--state-dir`: a plain segment log of the
//! queue's journal entries, so a broker killed with `kill -9` comes back with
//! every accepted and unacked item, every target's resume point, the done
//! set and the run id.
//!
//! On disk: `run-id`, `run-config` (the target ids the log was written
//! under), `target-capture` (the run's `--target-capture`; all three in
//! `wal/state_dir.rs`), and `segment-NNNNNNNNNNNNNNNN.wal` files: a
//! 32-byte header (magic, format version, the run configuration's
//! fingerprint; `wal/segment.rs`) then frames `[u32 body length][u32 CRC-32
//! of body][body]`, little endian; a body is a kind byte and its fields
//! (`wal/record.rs`). Records are written before anyone is answered.
//!
//! Replay refuses what it cannot trust, naming the file and byte offset:
//! only a write cut short at the end of the newest segment (a frame past
//! the end, a bad last frame, a zero-filled tail) is cut off with a
//! warning; a bad frame with good bytes after it, a frame that decodes to
//! nothing, damage in an older segment, a foreign or newer-format segment,
//! a state dir written for another set of targets (unless
//! `--adopt-state-dir`) and one recording another `--target-capture` (a
//! state dir from before that record takes the configured one, with a
//! warning) all refuse to start. A run whose log failed for
//! good leaves an `aborted` file, so a restart does not resume it.
//!
//! Bounded by the queue's byte cap: when the segment grows past
//! `compact_above` (twice `--max-queue-bytes`, at least 64 MiB), the queue's
//! whole state (targets, counters and the items still held, at most the cap)
//! is written as a segment that starts with a `Reset`, and older segments
//! are deleted. The broker compacts in the background
//! ([`Wal::compact_in_background`]): appends move to a fresh segment at once
//! and a thread writes the snapshot, so the queue's lock is not held while
//! up to the cap is written. On disk: one snapshot (≤ the cap plus the
//! target books) and at most `compact_above` of appends after it; while a
//! compaction writes, also the new snapshot: at most about 4x the cap.
//!
//! One broker per state dir: [`Wal::open`] takes an advisory lock on
//! `lock` (`flock`, released by the kernel when the process exits, even on
//! `kill -9`) and a second broker on the same directory refuses to start.
//!
//! Appends and syncs run on the log's own thread ([`writer::LogWriter`]),
//! off the queue's lock, with group commit; `--fsync` is applied there:
//! `always` syncs each group before its answers leave; `batch` (default)
//! syncs at most [`BATCH_SYNC_INTERVAL`] after a write (a process crash
//! loses nothing, since written data is in the page cache; a power loss
//! loses at most that window); `never` leaves it to the OS (compaction
//! still syncs). A write that fails for want of space (or with EIO) is
//! rolled back ([`Wal::rollback`]) and retried until it succeeds, holding
//! every answer back meanwhile; a failed sync is fatal.
//!
//! An accepted item's record is written from the slices of the frames it
//! arrived in (`DurablePayload::encode_payload` returns shared pieces), so
//! the log copies no payload bytes on the way to the kernel.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::ValueEnum;

use crate::queue::{JournalEntry, Recovered};

mod error;
mod record;
mod segment;
mod state_dir;

use error::io_error;
pub use error::WalError;
pub use record::DurablePayload;
#[doc(hidden)]
pub use segment::{encode_segment, replay_bytes};
pub mod writer;
use record::write_frame;
use segment::{FingerprintCheck, HEADER_BYTES};
pub use state_dir::RunShape;

/// The longest `batch` leaves written records unsynced.
pub const BATCH_SYNC_INTERVAL: Duration = Duration::from_millis(100);
/// [`LogConfig::target_capture`] of a run without `--target-capture`.
pub const NO_TARGET_CAPTURE: &str = "none";
/// Smallest compaction threshold, so small caps do not compact constantly.
const MIN_COMPACT_ABOVE: u64 = 64 << 20;

/// When the log is flushed to stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FsyncPolicy {
    /// Never explicitly (the OS flushes; compaction syncs).
    Never,
    /// At most every 100 ms.
    Batch,
    /// After every operation that logged something, before answering.
    Always,
}

/// Bytes of the segment's write buffer: records smaller than this are
/// coalesced into one write; larger pieces (tensor data) go straight to the
/// file.
const WRITE_BUFFER_BYTES: usize = 256 << 10;

/// How to open a state dir.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// Compaction starts above twice this (at least 64 MiB).
    pub max_queue_bytes: u64,
    /// The run's configuration the log must have been written under.
    pub shape: RunShape,
    /// Keep a log written under another configuration (`--adopt-state-dir`).
    pub adopt: bool,
    /// What the run's targets capture beyond DFlash's tensors
    /// (`--target-capture`: `none`, or the flag's values joined by commas).
    /// Recorded in the state dir when the run starts; a restart with
    /// another value is refused ([`WalError::CaptureMismatch`]).
    pub target_capture: String,
}

impl LogConfig {
    pub fn new(max_queue_bytes: u64, shape: RunShape) -> Self {
        LogConfig {
            max_queue_bytes,
            shape,
            adopt: false,
            target_capture: NO_TARGET_CAPTURE.to_string(),
        }
    }
}

/// A place in the log to roll back to ([`Wal::mark`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogMark {
    segment_index: u64,
    bytes: u64,
}

/// The open log: appends go to the newest segment.
pub struct Wal<P> {
    dir: PathBuf,
    segment_index: u64,
    segment_path: PathBuf,
    segment: BufWriter<File>,
    /// Bytes in the newest segment.
    segment_bytes: u64,
    compact_above: u64,
    /// The run configuration's fingerprint, in every new segment's header.
    fingerprint: u64,
    /// Written since the last sync.
    dirty: bool,
    /// A compaction writing its snapshot on its own thread, off the
    /// queue's lock ([`Wal::compact_in_background`]).
    compaction: Option<std::thread::JoinHandle<Result<u64, WalError>>>,
    /// The state dir's lock, held for as long as this log is open.
    _lock: File,
    _payload: PhantomData<P>,
}

/// What [`Wal::open`] found.
pub struct Opened<P> {
    pub wal: Wal<P>,
    pub recovered: Recovered<P>,
    pub run_id: String,
    /// Records replayed, and whether a torn tail was cut off.
    pub records: u64,
    pub truncated_tail: bool,
}

impl<P: DurablePayload> Wal<P> {
    /// Opens (creating when empty) the state dir, takes its lock (refused
    /// with [`WalError::Locked`] while another process holds it), checks
    /// that it was written under `config.shape`, and replays its log.
    pub fn open(
        dir: &Path,
        config: &LogConfig,
        new_run_id: impl FnOnce() -> String,
    ) -> Result<Opened<P>, WalError> {
        fs::create_dir_all(dir).map_err(io_error(dir))?;
        let lock = state_dir::lock(dir)?;
        state_dir::remove_unfinished(dir)?;
        let segments = segment::list_segments(dir)?;
        let adopting =
            state_dir::check_run_config(dir, &config.shape, config.adopt, segments.is_empty())?;
        let capture = state_dir::check_target_capture(dir, &config.target_capture)?;
        let run_id = state_dir::read_or_create_run_id(dir, new_run_id)?;
        let fingerprint = config.shape.fingerprint();
        let check = if adopting {
            FingerprintCheck::Any
        } else {
            FingerprintCheck::Require(fingerprint)
        };
        let mut recovered = Recovered::default();
        let mut records = 0;
        let mut truncated_tail = false;
        let mut needs_header = segments.is_empty();
        let last = segments.len().saturating_sub(1);
        for (position, (_, path)) in segments.iter().enumerate() {
            let replayed = segment::replay_segment(path, position == last, check, &mut recovered)?;
            records += replayed.records;
            truncated_tail |= replayed.truncated_tail;
            needs_header |= replayed.needs_header;
        }
        if let (true, Some((_, path))) = (recovered.is_mid_snapshot(), segments.last()) {
            // A snapshot is renamed into the log only once written whole:
            // one cut short (its end among a damaged tail) is damage.
            return Err(WalError::Corrupt {
                path: path.clone(),
                offset: fs::metadata(path).map_err(io_error(path))?.len(),
                detail: "the log ends inside a snapshot (its end is missing): the broker refuses to start rather than resume from part of one; restore the state dir from a copy, or start a new run with a new --state-dir".to_string(),
            });
        }
        if adopting {
            for (_, path) in &segments {
                segment::rewrite_fingerprint(path, fingerprint)?;
            }
            state_dir::write_run_config(dir, &config.shape)?;
        }
        if capture == state_dir::CaptureRecord::Missing {
            if !segments.is_empty() {
                // Written before the broker recorded the capture: what the
                // run was started with is unknown. The targets still stop
                // on a reconnect whose welcome changes it.
                tracing::warn!(state_dir = %dir.display(), target_capture = %config.target_capture, "the state dir has no record of the run's --target-capture (written by an older broker): recording this broker's, which could not be checked against the run's");
            }
            state_dir::write_target_capture(dir, &config.target_capture)?;
        }
        if let Some(reason) = state_dir::read_aborted(dir)? {
            recovered.aborted.get_or_insert(reason);
        }
        let segment_index = segments.last().map_or(1, |(index, _)| *index);
        let segment_path = segment::segment_path(dir, segment_index);
        let mut segment = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&segment_path)
            .map_err(io_error(&segment_path))?;
        if needs_header {
            segment
                .write_all(&segment::encode_header(fingerprint))
                .and_then(|()| segment.sync_data())
                .map_err(io_error(&segment_path))?;
        }
        let segment_bytes = segment.metadata().map_err(io_error(&segment_path))?.len();
        state_dir::sync_dir(dir)?;
        Ok(Opened {
            wal: Wal {
                dir: dir.to_path_buf(),
                segment_index,
                segment_path,
                segment: BufWriter::with_capacity(WRITE_BUFFER_BYTES, segment),
                segment_bytes,
                compact_above: config
                    .max_queue_bytes
                    .saturating_mul(2)
                    .max(MIN_COMPACT_ABOVE),
                fingerprint,
                dirty: false,
                compaction: None,
                _lock: lock,
                _payload: PhantomData,
            },
            recovered,
            run_id,
            records,
            truncated_tail,
        })
    }

    /// Appends entries to the segment's write buffer (large pieces go
    /// straight to the file). Nothing is synced: [`Wal::flush`] hands the
    /// buffer to the kernel, [`Wal::sync`] to stable storage; the writer
    /// thread calls them as `--fsync` says.
    pub fn append(&mut self, entries: &[JournalEntry<P>]) -> Result<(), WalError> {
        for entry in entries {
            let written =
                write_frame(&mut self.segment, entry).map_err(io_error(&self.segment_path))?;
            self.segment_bytes += written;
            self.dirty = true;
        }
        Ok(())
    }

    /// Hands buffered records to the kernel (a process crash then loses
    /// nothing).
    pub fn flush(&mut self) -> Result<(), WalError> {
        self.segment.flush().map_err(io_error(&self.segment_path))
    }

    /// Flushes and syncs the segment's data to stable storage.
    pub fn sync(&mut self) -> Result<(), WalError> {
        self.flush()?;
        if self.dirty {
            self.segment
                .get_ref()
                .sync_data()
                .map_err(io_error(&self.segment_path))?;
            self.dirty = false;
        }
        Ok(())
    }

    /// Bytes in the newest segment.
    pub fn log_bytes(&self) -> u64 {
        self.segment_bytes
    }

    /// Where the log ends now, once flushed: what [`Wal::rollback`] returns
    /// to.
    pub fn mark(&self) -> LogMark {
        LogMark {
            segment_index: self.segment_index,
            bytes: self.segment_bytes,
        }
    }

    /// Undoes a write that failed part way: what is still buffered is
    /// dropped and the segment cut back to `mark`, so a retry writes the
    /// same records again without leaving half a frame before them. Only
    /// within the segment the mark was taken in.
    pub fn rollback(&mut self, mark: LogMark) -> Result<(), WalError> {
        if mark.segment_index != self.segment_index {
            return Err(WalError::Io {
                path: self.segment_path.clone(),
                source: std::io::Error::other(
                    "cannot roll back across a segment switch (a compaction in the failed group)",
                ),
            });
        }
        let file = self
            .segment
            .get_ref()
            .try_clone()
            .map_err(io_error(&self.segment_path))?;
        // `into_parts` drops the buffered bytes without writing them (a
        // dropped BufWriter would try to).
        let failed = std::mem::replace(
            &mut self.segment,
            BufWriter::with_capacity(WRITE_BUFFER_BYTES, file),
        );
        drop(failed.into_parts());
        // The file is in append mode: the next write lands at the new end.
        self.segment
            .get_ref()
            .set_len(mark.bytes)
            .map_err(io_error(&self.segment_path))?;
        self.segment_bytes = mark.bytes;
        Ok(())
    }

    /// Records that the run was aborted because this log failed for good
    /// (a restart then does not resume it). Best effort: the disk may be
    /// the reason.
    pub fn record_abort(&self, reason: &str) -> Result<(), WalError> {
        state_dir::write_aborted(&self.dir, reason)
    }

    pub fn needs_compaction(&self) -> bool {
        self.segment_bytes > self.compact_above
    }

    /// Replaces the log with `snapshot` (the queue's whole state, starting
    /// with `Reset`) and waits for it: written to a temporary file, synced,
    /// renamed to the next segment, then older segments are deleted. A crash
    /// at any point leaves a log that replays to the same state.
    pub fn compact(&mut self, snapshot: &[JournalEntry<P>]) -> Result<(), WalError> {
        self.wait_for_compaction()?;
        self.flush()?;
        let next_index = self.segment_index + 1;
        let bytes = write_snapshot_segment(&self.dir, next_index, self.fingerprint, snapshot)?;
        let next_path = segment::segment_path(&self.dir, next_index);
        let segment = OpenOptions::new()
            .append(true)
            .open(&next_path)
            .map_err(io_error(&next_path))?;
        let before = self.segment_bytes;
        self.segment = BufWriter::with_capacity(WRITE_BUFFER_BYTES, segment);
        self.segment_index = next_index;
        self.segment_path = next_path;
        self.segment_bytes = bytes;
        self.dirty = false;
        delete_segments_below(&self.dir, next_index)?;
        tracing::info!(before, after = bytes, "write-ahead log compacted");
        Ok(())
    }

    /// Whether a background compaction is still writing.
    pub fn is_compacting(&mut self) -> bool {
        self.reap_compaction();
        self.compaction.is_some()
    }

    /// Compaction without holding the caller (the broker's queue lock)
    /// while the snapshot is written: the appends move at once to a fresh
    /// segment two indexes on (N+2), and a thread writes `snapshot` as
    /// segment N+1 (temporary file, sync, rename) and then deletes N and
    /// older. Replay reads segments in index order, so at every moment the
    /// directory replays to the same state: N then N+2 before the rename,
    /// N, the snapshot (which starts with `Reset`) and N+2 after it, the
    /// snapshot and N+2 at the end. What the caller pays: building the
    /// entry list (reference-counted payloads, no copy), a sync of N and
    /// opening the new segment. Does nothing while an earlier compaction
    /// is still writing.
    pub fn compact_in_background(&mut self, snapshot: Vec<JournalEntry<P>>) -> Result<(), WalError>
    where
        P: Send + 'static,
    {
        if self.is_compacting() {
            return Ok(());
        }
        // N complete on disk before the appends move on.
        self.sync()?;
        let snapshot_index = self.segment_index + 1;
        let append_index = self.segment_index + 2;
        let append_path = segment::segment_path(&self.dir, append_index);
        let segment = segment::create_segment(&append_path, self.fingerprint)?;
        state_dir::sync_dir(&self.dir)?;
        let before = self.segment_bytes;
        self.segment = BufWriter::with_capacity(WRITE_BUFFER_BYTES, segment);
        self.segment_index = append_index;
        self.segment_path = append_path;
        self.segment_bytes = HEADER_BYTES;
        let dir = self.dir.clone();
        let fingerprint = self.fingerprint;
        let spawned = std::thread::Builder::new()
            .name("wal-compaction".to_string())
            .spawn(move || {
                let started = Instant::now();
                let bytes = write_snapshot_segment(&dir, snapshot_index, fingerprint, &snapshot)?;
                delete_segments_below(&dir, snapshot_index)?;
                tracing::info!(
                    before,
                    after = bytes,
                    seconds = started.elapsed().as_secs_f64(),
                    "write-ahead log compacted (in the background)"
                );
                Ok(bytes)
            })
            .map_err(io_error(&self.dir))?;
        self.compaction = Some(spawned);
        Ok(())
    }

    /// Joins a finished background compaction; its failure is logged (the
    /// log stays complete, only uncompacted, and the next threshold
    /// crossing tries again).
    fn reap_compaction(&mut self) {
        if self
            .compaction
            .as_ref()
            .is_some_and(|handle| handle.is_finished())
        {
            if let Err(error) = self.wait_for_compaction() {
                tracing::warn!(%error, "background compaction of the write-ahead log failed; the log is complete, compaction is retried");
            }
        }
    }

    /// Waits for a background compaction to finish writing.
    pub fn wait_for_compaction(&mut self) -> Result<(), WalError> {
        let Some(handle) = self.compaction.take() else {
            return Ok(());
        };
        match handle.join() {
            Ok(result) => result.map(|_| ()),
            Err(_) => Err(WalError::Io {
                path: self.dir.clone(),
                source: std::io::Error::other("the compaction thread panicked"),
            }),
        }
    }
}

impl<P> Drop for Wal<P> {
    /// A compaction in flight finishes (bounded by writing at most the
    /// queue's cap) so that no thread outlives the log; a crash instead
    /// would leave a directory that replays to the same state anyway.
    fn drop(&mut self) {
        if let Some(handle) = self.compaction.take() {
            let _ = handle.join();
        }
    }
}

/// Writes `snapshot` as segment `index`: a temporary file, synced, then
/// renamed into place and the directory synced. The bytes written.
fn write_snapshot_segment<P: DurablePayload>(
    dir: &Path,
    index: u64,
    fingerprint: u64,
    snapshot: &[JournalEntry<P>],
) -> Result<u64, WalError> {
    let path = segment::segment_path(dir, index);
    let temporary = dir.join(format!("segment-{index:016}.tmp"));
    let file = File::create(&temporary).map_err(io_error(&temporary))?;
    let mut writer = std::io::BufWriter::with_capacity(1 << 20, file);
    writer
        .write_all(&segment::encode_header(fingerprint))
        .map_err(io_error(&temporary))?;
    let mut bytes = HEADER_BYTES;
    for entry in snapshot {
        bytes += write_frame(&mut writer, entry).map_err(io_error(&temporary))?;
    }
    let file = writer
        .into_inner()
        .map_err(|error| error.into_error())
        .map_err(io_error(&temporary))?;
    file.sync_all().map_err(io_error(&temporary))?;
    drop(file);
    fs::rename(&temporary, &path).map_err(io_error(&path))?;
    state_dir::sync_dir(dir)?;
    Ok(bytes)
}

/// Deletes every segment with an index below `index`.
fn delete_segments_below(dir: &Path, index: u64) -> Result<(), WalError> {
    for (found, path) in segment::list_segments(dir)? {
        if found < index {
            fs::remove_file(&path).map_err(io_error(&path))?;
        }
    }
    state_dir::sync_dir(dir)
}
