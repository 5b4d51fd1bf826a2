//! The write-ahead log under `--state-dir`: a plain segment log of the
//! queue's journal entries, so a broker killed with `kill -9` comes back with
//! every accepted and unacked item, every target's resume point, the done
//! set and the run id.
//!
//! On disk: `run-id` (written once, atomically) and `segment-NNNNNNNNNNNNNNNN.wal`
//! files of frames `[u32 body length][u32 CRC-32 of body][body]`, little
//! endian; a body is a kind byte and its fields (the one framing, in
//! `wal/record.rs`). Records are appended before
//! anyone is answered. A torn or corrupt frame at the end of the newest
//! segment (a crash mid-write) is cut off with a warning; corruption anywhere
//! else refuses to start, naming the file and offset.
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
//! still syncs).
//!
//! An accepted item's record is written from the slices of the frames it
//! arrived in (`DurablePayload::encode_payload` returns shared pieces), so
//! the log copies no payload bytes on the way to the kernel.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::ValueEnum;

use crate::queue::{JournalEntry, Payload, Recovered};

mod record;
pub mod writer;
use record::write_frame;

/// The longest `batch` leaves written records unsynced.
pub const BATCH_SYNC_INTERVAL: Duration = Duration::from_millis(100);
/// Smallest compaction threshold, so small caps do not compact constantly.
const MIN_COMPACT_ABOVE: u64 = 64 << 20;
const RUN_ID_FILE: &str = "run-id";
/// Held locked (an advisory `flock`) by the broker that owns the state dir.
/// The kernel drops the lock when that process exits, however it exits
/// (`kill -9` included), so a stale lock file never blocks a restart.
const LOCK_FILE: &str = "lock";

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

/// A payload the log can store.
pub trait DurablePayload: Payload + Sized {
    /// The payload's encoding as pieces written one after another; large
    /// pieces are shared with the payload, not copied.
    fn encode_payload(&self) -> Vec<bytes::Bytes>;
    fn decode_payload(bytes: &[u8]) -> Result<Self, String>;
}

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("state dir {path} is in use by another broker (it holds the lock on {lock}); two brokers on one state dir would interleave one log: stop the other one or give this one its own --state-dir")]
    Locked { path: PathBuf, lock: PathBuf },
    #[error("state dir {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state dir {path}: corrupt record at byte {offset}: {detail}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        detail: String,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> WalError + '_ {
    move |source| WalError::Io {
        path: path.to_path_buf(),
        source,
    }
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
    /// with [`WalError::Locked`] while another process holds it) and
    /// replays its log.
    pub fn open(
        dir: &Path,
        max_queue_bytes: u64,
        new_run_id: impl FnOnce() -> String,
    ) -> Result<Opened<P>, WalError> {
        fs::create_dir_all(dir).map_err(io_error(dir))?;
        let lock = lock_state_dir(dir)?;
        remove_unfinished_snapshots(dir)?;
        let run_id = read_or_create_run_id(dir, new_run_id)?;
        let mut segments = list_segments(dir)?;
        segments.sort();
        let mut recovered = Recovered::default();
        let mut records = 0;
        let mut truncated_tail = false;
        let last = segments.len().saturating_sub(1);
        for (position, (_, path)) in segments.iter().enumerate() {
            let (count, torn) = replay_segment(path, position == last, &mut recovered)?;
            records += count;
            truncated_tail |= torn;
        }
        let segment_index = segments.last().map_or(1, |(index, _)| *index);
        let segment_path = segment_path(dir, segment_index);
        let segment = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&segment_path)
            .map_err(io_error(&segment_path))?;
        let segment_bytes = segment.metadata().map_err(io_error(&segment_path))?.len();
        sync_dir(dir)?;
        Ok(Opened {
            wal: Wal {
                dir: dir.to_path_buf(),
                segment_index,
                segment_path,
                segment: BufWriter::with_capacity(WRITE_BUFFER_BYTES, segment),
                segment_bytes,
                compact_above: max_queue_bytes.saturating_mul(2).max(MIN_COMPACT_ABOVE),
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
        let bytes = write_snapshot_segment(&self.dir, next_index, snapshot)?;
        let next_path = segment_path(&self.dir, next_index);
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
        let append_path = segment_path(&self.dir, append_index);
        let segment = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&append_path)
            .map_err(io_error(&append_path))?;
        sync_dir(&self.dir)?;
        let before = self.segment_bytes;
        self.segment = BufWriter::with_capacity(WRITE_BUFFER_BYTES, segment);
        self.segment_index = append_index;
        self.segment_path = append_path;
        self.segment_bytes = 0;
        let dir = self.dir.clone();
        let spawned = std::thread::Builder::new()
            .name("wal-compaction".to_string())
            .spawn(move || {
                let started = Instant::now();
                let bytes = write_snapshot_segment(&dir, snapshot_index, &snapshot)?;
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
    snapshot: &[JournalEntry<P>],
) -> Result<u64, WalError> {
    let path = segment_path(dir, index);
    let temporary = dir.join(format!("segment-{index:016}.tmp"));
    let file = File::create(&temporary).map_err(io_error(&temporary))?;
    let mut writer = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut bytes = 0;
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
    sync_dir(dir)?;
    Ok(bytes)
}

/// Deletes snapshots a crash left half written (`segment-*.tmp`): replay
/// never reads them, and the log before them is complete.
fn remove_unfinished_snapshots(dir: &Path) -> Result<(), WalError> {
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let path = entry.map_err(io_error(dir))?.path();
        let unfinished = path
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with("segment-") && name.ends_with(".tmp"));
        if unfinished {
            fs::remove_file(&path).map_err(io_error(&path))?;
        }
    }
    Ok(())
}

/// Deletes every segment with an index below `index`.
fn delete_segments_below(dir: &Path, index: u64) -> Result<(), WalError> {
    for (found, path) in list_segments(dir)? {
        if found < index {
            fs::remove_file(&path).map_err(io_error(&path))?;
        }
    }
    sync_dir(dir)
}

/// Takes the state dir's lock without waiting.
fn lock_state_dir(dir: &Path) -> Result<File, WalError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_error(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(fs::TryLockError::WouldBlock) => Err(WalError::Locked {
            path: dir.to_path_buf(),
            lock: path,
        }),
        Err(fs::TryLockError::Error(source)) => Err(WalError::Io { path, source }),
    }
}

fn segment_path(dir: &Path, index: u64) -> PathBuf {
    dir.join(format!("segment-{index:016}.wal"))
}

fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>, WalError> {
    let mut segments = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(index) = name
            .strip_prefix("segment-")
            .and_then(|rest| rest.strip_suffix(".wal"))
            .and_then(|digits| digits.parse::<u64>().ok())
        {
            segments.push((index, entry.path()));
        }
    }
    Ok(segments)
}

fn sync_dir(dir: &Path) -> Result<(), WalError> {
    File::open(dir)
        .and_then(|handle| handle.sync_all())
        .map_err(io_error(dir))
}

fn read_or_create_run_id(
    dir: &Path,
    new_run_id: impl FnOnce() -> String,
) -> Result<String, WalError> {
    let path = dir.join(RUN_ID_FILE);
    match fs::read_to_string(&path) {
        Ok(run_id) if !run_id.trim().is_empty() => return Ok(run_id.trim().to_string()),
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(WalError::Io { path, source }),
    }
    let run_id = new_run_id();
    let temporary = dir.join(format!("{RUN_ID_FILE}.tmp"));
    let mut file = File::create(&temporary).map_err(io_error(&temporary))?;
    file.write_all(run_id.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io_error(&temporary))?;
    fs::rename(&temporary, &path).map_err(io_error(&path))?;
    sync_dir(dir)?;
    Ok(run_id)
}

/// Replays one segment; a torn tail of the newest one is cut off.
fn replay_segment<P: DurablePayload>(
    path: &Path,
    is_newest: bool,
    recovered: &mut Recovered<P>,
) -> Result<(u64, bool), WalError> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io_error(path))?;
    let length = file.metadata().map_err(io_error(path))?.len();
    let mut reader = std::io::BufReader::with_capacity(1 << 20, &mut file);
    let mut offset = 0u64;
    let mut records = 0u64;
    let failure = loop {
        if offset == length {
            break None;
        }
        match record::read_frame::<P>(&mut reader, offset, length) {
            Ok((entry, frame_bytes)) => {
                recovered.apply(entry);
                offset += frame_bytes;
                records += 1;
            }
            Err(detail) => break Some(detail),
        }
    };
    drop(reader);
    let Some(detail) = failure else {
        return Ok((records, false));
    };
    if !is_newest {
        return Err(WalError::Corrupt {
            path: path.to_path_buf(),
            offset,
            detail,
        });
    }
    tracing::warn!(path = %path.display(), offset, %detail, "cutting off a torn tail of the write-ahead log");
    file.set_len(offset).map_err(io_error(path))?;
    file.seek(SeekFrom::End(0)).map_err(io_error(path))?;
    file.sync_all().map_err(io_error(path))?;
    Ok((records, true))
}
