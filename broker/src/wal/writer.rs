//! The write-ahead log's writer thread: every append and fsync happens here,
//! off the broker's queue lock, with group commit.
//!
//! Under the lock an operation hands the thread its journal entries and
//! what it decided to tell its peers (a release: the stream messages, an
//! RPC's answer) in one channel send ([`LogWriter::submit`]). The thread
//! takes every submission waiting, writes them all, syncs once for the
//! group as `--fsync` says, and only then runs their releases, in order:
//! - `always`: one `fdatasync` per group, before any of its releases;
//! - `batch`: releases once written (a process crash loses nothing, the
//!   bytes are in the page cache); the sync follows within
//!   [`BATCH_SYNC_INTERVAL`];
//! - `never`: releases once written; the OS flushes.
//!
//! So a producer hears `accepted` only once its record is as durable as
//! `--fsync` promises, and no message a peer receives describes state that
//! a crash could still take back: a message the lock side decides while
//! earlier submissions are still in flight goes behind them
//! ([`LogWriter::is_idle`] tells the lock side when it may send directly).
//!
//! A write that fails for want of space, a quota or with EIO
//! ([`WalError::is_retryable_write`]) is rolled back to where it began and
//! retried (after 50 ms, backing off to 1 s) until it succeeds: meanwhile
//! nothing is released, so producers fill their windows and are held back,
//! and `on_stall` tells the broker (health NOT_SERVING) when the stall
//! begins and ends. Any other failed write, and every failed sync, fails
//! the log for good: the thread records the abort in the state dir (best
//! effort: a restart then does not resume the run), runs `on_failure` once
//! (the broker aborts the run), and no release submitted before or after
//! the failure ever runs, so nobody is told "accepted" about a record that
//! is not on disk. Closing while stalled gives up the unwritten group
//! (never confirmed to anyone) without recording an abort. When the log outgrows its bound the
//! thread asks for a compaction ([`LogWriter::take_compaction_request`]);
//! the lock side answers with the queue's image, which is written in order
//! after everything submitted before it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{DurablePayload, FsyncPolicy, LogMark, Wal, WalError, BATCH_SYNC_INTERVAL};
use crate::queue::JournalEntry;

/// What runs once a submission is as durable as `--fsync` promises.
pub type Release = Box<dyn FnOnce() + Send + 'static>;

/// The writer's view of the log file, so the writer's ordering and failure
/// rules are tested without a disk ([`Wal`] is the real one).
pub trait LogFile: Send + 'static {
    type Payload: Send + 'static;
    /// Where the log ends, for [`LogFile::rollback`].
    type Mark: Copy + Send + 'static;
    /// Writes the entries' frames (possibly buffered in the process).
    fn write(&mut self, entries: &[JournalEntry<Self::Payload>]) -> Result<(), WalError>;
    /// Where the log ends now (after a flush).
    fn mark(&self) -> Self::Mark;
    /// Undoes a failed write back to `mark`, buffered bytes included.
    fn rollback(&mut self, mark: Self::Mark) -> Result<(), WalError>;
    /// Records, best effort, that the run was aborted because the log
    /// failed for good.
    fn record_abort(&mut self, reason: &str);
    /// Hands buffered frames to the kernel: a process crash (SIGKILL)
    /// then loses nothing.
    fn flush(&mut self) -> Result<(), WalError>;
    /// Flushes written frames to stable storage.
    fn sync(&mut self) -> Result<(), WalError>;
    /// Whether the log outgrew its bound and no compaction is writing.
    fn wants_compaction(&mut self) -> bool;
    /// Starts writing `image` as the log's new start (see
    /// [`Wal::compact_in_background`]).
    fn compact(&mut self, image: Vec<JournalEntry<Self::Payload>>) -> Result<(), WalError>;
    /// Bytes in the newest segment.
    fn log_bytes(&self) -> u64;
}

impl<P: DurablePayload + Send + 'static> LogFile for Wal<P> {
    type Payload = P;
    type Mark = LogMark;
    fn write(&mut self, entries: &[JournalEntry<P>]) -> Result<(), WalError> {
        self.append(entries)
    }
    fn mark(&self) -> LogMark {
        Wal::mark(self)
    }
    fn rollback(&mut self, mark: LogMark) -> Result<(), WalError> {
        Wal::rollback(self, mark)
    }
    fn record_abort(&mut self, reason: &str) {
        if let Err(error) = Wal::record_abort(self, reason) {
            tracing::error!(%error, "could not record the abort in the state dir: a restart may resume this run");
        }
    }
    fn flush(&mut self) -> Result<(), WalError> {
        Wal::flush(self)
    }
    fn sync(&mut self) -> Result<(), WalError> {
        Wal::sync(self)
    }
    fn wants_compaction(&mut self) -> bool {
        self.needs_compaction() && !self.is_compacting()
    }
    fn compact(&mut self, image: Vec<JournalEntry<P>>) -> Result<(), WalError> {
        self.compact_in_background(image)
    }
    fn log_bytes(&self) -> u64 {
        Wal::log_bytes(self)
    }
}

enum Command<P> {
    Append {
        entries: Vec<JournalEntry<P>>,
        release: Option<Release>,
    },
    Compact(Vec<JournalEntry<P>>),
}

/// Counters shared by the lock side and the thread.
#[derive(Default)]
struct Progress {
    /// Submissions handed to the thread.
    submitted: AtomicU64,
    /// Submissions the thread has finished (released, or dropped after a
    /// failure).
    finished: AtomicU64,
    /// Set by the thread when the log outgrew its bound; taken by the lock
    /// side, which then submits the queue's image.
    compaction_requested: AtomicBool,
    failed: AtomicBool,
    /// A write waits for space (retried until it succeeds).
    stalled: AtomicBool,
    /// Set when the handle is dropped: a stalled write gives up.
    closing: AtomicBool,
    /// Groups written (each ends with at most one sync).
    groups: AtomicU64,
    /// Syncs done.
    syncs: AtomicU64,
    log_bytes: AtomicU64,
}

/// Figures for `/metrics` and the bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriterCounts {
    pub submissions: u64,
    pub groups: u64,
    pub syncs: u64,
    pub log_bytes: u64,
    /// A write is waiting for space (answers held back).
    pub stalled: bool,
    pub failed: bool,
}

/// The handle the broker keeps under its lock. Dropping it lets the thread
/// write and release what it holds, sync, and exit, and waits for that.
pub struct LogWriter<P> {
    commands: Option<mpsc::Sender<Command<P>>>,
    thread: Option<JoinHandle<()>>,
    progress: Arc<Progress>,
}

impl<P: Send + 'static> LogWriter<P> {
    /// Starts the thread over `log`. `on_failure` runs on the thread, at
    /// most once, when a write or sync fails (the log is then failed for
    /// good).
    pub fn spawn<L>(
        log: L,
        fsync: FsyncPolicy,
        on_failure: impl FnOnce(WalError) + Send + 'static,
        on_stall: StallReport,
    ) -> std::io::Result<Self>
    where
        L: LogFile<Payload = P>,
    {
        Self::spawn_with_interval(log, fsync, BATCH_SYNC_INTERVAL, on_failure, on_stall)
    }

    /// [`LogWriter::spawn`] with `batch`'s interval given (tests pin it).
    fn spawn_with_interval<L>(
        log: L,
        fsync: FsyncPolicy,
        batch_interval: Duration,
        on_failure: impl FnOnce(WalError) + Send + 'static,
        on_stall: StallReport,
    ) -> std::io::Result<Self>
    where
        L: LogFile<Payload = P>,
    {
        let (commands, receiver) = mpsc::channel();
        let progress = Arc::new(Progress::default());
        progress.log_bytes.store(log.log_bytes(), Ordering::Relaxed);
        let thread_progress = progress.clone();
        let thread = std::thread::Builder::new()
            .name("wal-writer".to_string())
            .spawn(move || {
                WriterThread {
                    log,
                    fsync,
                    batch_interval,
                    progress: thread_progress,
                    dirty: false,
                    last_sync: Instant::now(),
                    on_failure: Some(Box::new(on_failure)),
                    on_stall,
                }
                .run(receiver)
            })?;
        Ok(LogWriter {
            commands: Some(commands),
            thread: Some(thread),
            progress,
        })
    }

    /// Hands `entries` to the thread; `release` runs once they (and every
    /// submission before them) are as durable as `--fsync` promises, and
    /// never if the log fails first.
    pub fn submit(&self, entries: Vec<JournalEntry<P>>, release: Option<Release>) {
        self.send(Command::Append { entries, release });
    }

    /// Writes `image` (the queue's whole state, starting with `Reset`) as
    /// the log's new start, after everything submitted before.
    pub fn compact(&self, image: Vec<JournalEntry<P>>) {
        self.send(Command::Compact(image));
    }

    fn send(&self, command: Command<P>) {
        self.progress.submitted.fetch_add(1, Ordering::AcqRel);
        let sent = self
            .commands
            .as_ref()
            .is_some_and(|commands| commands.send(command).is_ok());
        if !sent {
            // The thread is gone (only after a failure): nothing will run.
            self.progress.finished.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Whether every submission has been released: only then may the lock
    /// side send a message directly without overtaking an earlier one.
    pub fn is_idle(&self) -> bool {
        self.progress.finished.load(Ordering::Acquire)
            == self.progress.submitted.load(Ordering::Acquire)
    }

    pub fn has_failed(&self) -> bool {
        self.progress.failed.load(Ordering::Acquire)
    }

    /// Whether the thread asked for a compaction since the last call.
    pub fn take_compaction_request(&self) -> bool {
        self.progress
            .compaction_requested
            .swap(false, Ordering::AcqRel)
    }

    pub fn counts(&self) -> WriterCounts {
        WriterCounts {
            submissions: self.progress.submitted.load(Ordering::Relaxed),
            groups: self.progress.groups.load(Ordering::Relaxed),
            syncs: self.progress.syncs.load(Ordering::Relaxed),
            log_bytes: self.progress.log_bytes.load(Ordering::Relaxed),
            stalled: self.progress.stalled.load(Ordering::Relaxed),
            failed: self.progress.failed.load(Ordering::Relaxed),
        }
    }
}

/// Told when a write starts waiting for space (the error) and when it
/// goes through again (`None`).
pub type StallReport = Box<dyn Fn(Option<&WalError>) + Send + 'static>;

impl<P> Drop for LogWriter<P> {
    /// Bounded by writing what was submitted (the queue's byte cap bounds
    /// the payloads among it).
    fn drop(&mut self) {
        self.progress.closing.store(true, Ordering::Release);
        drop(self.commands.take());
        if let Some(thread) = self.thread.take() {
            // Dropped on the thread itself (its failure callback held the
            // last reference to the broker): it ends on its own once its
            // channel is empty, and cannot wait for itself.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// Most submissions written as one group, so a long backlog still releases
/// in steps rather than all at the end.
const MAX_GROUP: usize = 4096;

struct WriterThread<L: LogFile> {
    log: L,
    fsync: FsyncPolicy,
    /// `batch`'s longest wait between a write and its sync.
    batch_interval: Duration,
    progress: Arc<Progress>,
    /// Written since the last sync.
    dirty: bool,
    last_sync: Instant,
    on_failure: Option<Box<dyn FnOnce(WalError) + Send>>,
    on_stall: StallReport,
}

/// The first wait before a stalled write is retried, and the longest.
const STALL_RETRY_FIRST: Duration = Duration::from_millis(50);
const STALL_RETRY_MAX: Duration = Duration::from_secs(1);

impl<L: LogFile> WriterThread<L> {
    fn run(mut self, receiver: mpsc::Receiver<Command<L::Payload>>) {
        loop {
            let first = match self.batch_sync_due() {
                Some(due) => {
                    match receiver.recv_timeout(due.saturating_duration_since(Instant::now())) {
                        Ok(command) => command,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            self.sync_or_fail();
                            continue;
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                }
                None => match receiver.recv() {
                    Ok(command) => command,
                    Err(mpsc::RecvError) => break,
                },
            };
            let mut group = vec![first];
            while group.len() < MAX_GROUP {
                match receiver.try_recv() {
                    Ok(command) => group.push(command),
                    Err(_) => break,
                }
            }
            self.write_group(group);
        }
        // Closed: what was written reaches the disk before the thread ends.
        if self.dirty && !self.has_failed() {
            self.sync_or_fail();
        }
    }

    fn has_failed(&self) -> bool {
        self.progress.failed.load(Ordering::Acquire)
    }

    /// With `batch` and unsynced records: when the sync is due.
    fn batch_sync_due(&self) -> Option<Instant> {
        (self.fsync == FsyncPolicy::Batch && self.dirty && !self.has_failed())
            .then(|| self.last_sync + self.batch_interval)
    }

    fn write_group(&mut self, group: Vec<Command<L::Payload>>) {
        let count = group.len() as u64;
        let mut releases = Vec::with_capacity(group.len());
        // The appends since the last compaction in the group, written (and
        // retried) together.
        let mut appends = Vec::new();
        let mut result = Ok(());
        for command in group {
            if self.has_failed() {
                break;
            }
            match command {
                Command::Append { entries, release } => {
                    releases.extend(release);
                    if !entries.is_empty() {
                        appends.push(entries);
                    }
                }
                Command::Compact(image) => {
                    result = self.write_appends(&appends);
                    appends.clear();
                    if result.is_err() {
                        break;
                    }
                    result = match self.log.compact(image) {
                        // No room for the snapshot: the log stays whole,
                        // only uncompacted; asked again at the next check.
                        Err(error) if error.is_retryable_write() => {
                            tracing::warn!(%error, "compaction of the write-ahead log postponed");
                            Ok(())
                        }
                        other => other.map_err(Stop::Fatal),
                    };
                    if result.is_err() {
                        break;
                    }
                }
            }
        }
        if result.is_ok() && !self.has_failed() {
            result = self.write_appends(&appends);
        }
        if result.is_ok() && !self.has_failed() {
            result = match self.fsync {
                FsyncPolicy::Always => self.sync().map_err(Stop::Fatal),
                FsyncPolicy::Batch if self.last_sync.elapsed() >= self.batch_interval => {
                    self.sync().map_err(Stop::Fatal)
                }
                FsyncPolicy::Batch | FsyncPolicy::Never => Ok(()),
            };
        }
        self.progress.groups.fetch_add(1, Ordering::Relaxed);
        self.progress
            .log_bytes
            .store(self.log.log_bytes(), Ordering::Relaxed);
        match result {
            Ok(()) if !self.has_failed() => {
                for release in releases {
                    release();
                }
                if self.log.wants_compaction() {
                    self.progress
                        .compaction_requested
                        .store(true, Ordering::Release);
                }
            }
            Ok(()) => {}
            Err(Stop::Fatal(error)) => self.fail(error),
            Err(Stop::Closing(error)) => {
                tracing::error!(%error, "closing while the write-ahead log waits for space: the records not written were never confirmed to anyone");
                self.progress.failed.store(true, Ordering::Release);
            }
        }
        self.progress.finished.fetch_add(count, Ordering::AcqRel);
    }

    /// Writes `appends` and hands them to the kernel (every policy
    /// releases only what the kernel holds: a SIGKILL after a release
    /// loses nothing). A write that fails for want of space is rolled back
    /// and retried until it succeeds or the writer closes.
    fn write_appends(&mut self, appends: &[Vec<JournalEntry<L::Payload>>]) -> Result<(), Stop> {
        if appends.is_empty() {
            return Ok(());
        }
        let mut wait = STALL_RETRY_FIRST;
        loop {
            let mark = self.log.mark();
            self.dirty = true;
            let written = appends
                .iter()
                .try_for_each(|entries| self.log.write(entries))
                .and_then(|()| self.log.flush());
            let error = match written {
                Ok(()) => {
                    if self.progress.stalled.swap(false, Ordering::AcqRel) {
                        tracing::info!("the write-ahead log writes again; answers resume");
                        (self.on_stall)(None);
                    }
                    return Ok(());
                }
                Err(error) if error.is_retryable_write() => error,
                Err(error) => return Err(Stop::Fatal(error)),
            };
            self.log.rollback(mark)?;
            if !self.progress.stalled.swap(true, Ordering::AcqRel) {
                tracing::error!(%error, "the write-ahead log cannot write: producers are held back and health is NOT_SERVING until it can; retrying");
                (self.on_stall)(Some(&error));
            }
            if !self.wait_unless_closing(wait) {
                return Err(Stop::Closing(error));
            }
            wait = (wait * 2).min(STALL_RETRY_MAX);
        }
    }

    /// Sleeps `wait` in short steps; false as soon as the writer closes.
    fn wait_unless_closing(&self, wait: Duration) -> bool {
        let until = Instant::now() + wait;
        loop {
            if self.progress.closing.load(Ordering::Acquire) {
                return false;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            std::thread::sleep(left.min(Duration::from_millis(20)));
        }
    }

    fn sync(&mut self) -> Result<(), WalError> {
        if self.dirty {
            self.log.sync()?;
            self.dirty = false;
            self.progress.syncs.fetch_add(1, Ordering::Relaxed);
        }
        self.last_sync = Instant::now();
        Ok(())
    }

    fn sync_or_fail(&mut self) {
        if let Err(error) = self.sync() {
            self.fail(error);
        }
    }

    /// The log failed for good: recorded in the state dir, then reported.
    fn fail(&mut self, error: WalError) {
        self.progress.failed.store(true, Ordering::Release);
        self.log
            .record_abort(&format!("the write-ahead log failed: {error}"));
        if let Some(on_failure) = self.on_failure.take() {
            on_failure(error);
        }
    }
}

/// Why a group was not written.
enum Stop {
    /// Failed for good (a sync, or a write that retrying cannot help).
    Fatal(WalError),
    /// Closing while a write waited for space.
    Closing(WalError),
}

impl From<WalError> for Stop {
    fn from(error: WalError) -> Self {
        Stop::Fatal(error)
    }
}

/// How long [`LogWriter`]'s tests wait for a release before failing.
#[cfg(test)]
const TEST_WAIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A log whose writes and syncs are recorded, and can be made to block
    /// (until the test opens the gate) or fail.
    #[derive(Clone, Default)]
    struct FakeLog {
        events: Arc<Mutex<Vec<String>>>,
        gate: Arc<(Mutex<bool>, std::sync::Condvar)>,
        fail_writes: Arc<AtomicBool>,
        /// Writes still to fail for want of space (ENOSPC), then succeed.
        writes_without_space: Arc<AtomicU64>,
        fail_syncs: Arc<AtomicBool>,
        /// Writes started (counted before the gate).
        writes_started: Arc<AtomicU64>,
    }

    impl FakeLog {
        fn closed_gate() -> Self {
            let log = FakeLog::default();
            *log.gate.0.lock().unwrap() = true;
            log
        }
        fn open_gate(&self) {
            *self.gate.0.lock().unwrap() = false;
            self.gate.1.notify_all();
        }
        fn events(&self) -> Vec<String> {
            self.events.lock().unwrap().clone()
        }
        fn record(&self, event: String) {
            self.events.lock().unwrap().push(event);
        }
    }

    impl LogFile for FakeLog {
        type Payload = ();
        fn write(&mut self, entries: &[JournalEntry<()>]) -> Result<(), WalError> {
            self.writes_started.fetch_add(1, Ordering::AcqRel);
            let (closed, opened) = &*self.gate;
            let mut closed = closed.lock().unwrap();
            while *closed {
                closed = opened.wait(closed).unwrap();
            }
            drop(closed);
            if self.fail_writes.load(Ordering::Acquire) {
                return Err(WalError::Io {
                    path: "fake".into(),
                    source: std::io::Error::other("bad file descriptor"),
                });
            }
            let without_space = self.writes_without_space.load(Ordering::Acquire);
            if without_space > 0 {
                self.writes_without_space
                    .store(without_space - 1, Ordering::Release);
                self.record("write failed: no space".to_string());
                return Err(WalError::Io {
                    path: "fake".into(),
                    source: std::io::Error::from(std::io::ErrorKind::StorageFull),
                });
            }
            self.record(format!("write {}", entries.len()));
            Ok(())
        }
        fn flush(&mut self) -> Result<(), WalError> {
            self.record("flush".to_string());
            Ok(())
        }
        fn sync(&mut self) -> Result<(), WalError> {
            if self.fail_syncs.load(Ordering::Acquire) {
                return Err(WalError::Io {
                    path: "fake".into(),
                    source: std::io::Error::from_raw_os_error(5),
                });
            }
            self.record("sync".to_string());
            Ok(())
        }
        type Mark = ();
        fn mark(&self) {}
        fn rollback(&mut self, (): ()) -> Result<(), WalError> {
            self.record("rollback".to_string());
            Ok(())
        }
        fn record_abort(&mut self, _reason: &str) {
            self.record("abort recorded".to_string());
        }
        fn wants_compaction(&mut self) -> bool {
            false
        }
        fn compact(&mut self, image: Vec<JournalEntry<()>>) -> Result<(), WalError> {
            self.record(format!("compact {}", image.len()));
            Ok(())
        }
        fn log_bytes(&self) -> u64 {
            0
        }
    }

    /// A writer over `log` with `--fsync always`, and the count of its
    /// failure reports.
    fn spawn_counting_failures(
        log: &FakeLog,
        on_stall: StallReport,
    ) -> (LogWriter<()>, Arc<AtomicU64>) {
        let failures = Arc::new(AtomicU64::new(0));
        let counted = failures.clone();
        let writer = LogWriter::spawn(
            log.clone(),
            FsyncPolicy::Always,
            move |_| {
                counted.fetch_add(1, Ordering::AcqRel);
            },
            on_stall,
        )
        .unwrap();
        (writer, failures)
    }

    fn no_stall() -> StallReport {
        Box::new(|_| {})
    }

    /// A stall report that records "stalled" and "resumed" in the log's
    /// events.
    fn stall_events(log: &FakeLog) -> StallReport {
        let log = log.clone();
        Box::new(move |error| {
            log.record(
                if error.is_some() {
                    "stalled"
                } else {
                    "resumed"
                }
                .to_string(),
            )
        })
    }

    fn acked(seq: u64) -> JournalEntry<()> {
        JournalEntry::Acked {
            target_id: "target-0".into(),
            seq,
        }
    }

    /// A release that records its name in the log's events.
    fn release(log: &FakeLog, name: &str) -> Option<Release> {
        let log = log.clone();
        let name = name.to_string();
        Some(Box::new(move || log.record(format!("release {name}"))))
    }

    fn wait_until(mut condition: impl FnMut() -> bool) {
        let deadline = Instant::now() + TEST_WAIT;
        while !condition() {
            assert!(Instant::now() < deadline, "condition not met in time");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn with_fsync_always_a_release_runs_only_after_its_records_are_synced() {
        let log = FakeLog::closed_gate();
        let writer =
            LogWriter::spawn(log.clone(), FsyncPolicy::Always, |_| {}, no_stall()).unwrap();
        writer.submit(vec![acked(0)], release(&log, "a"));
        // The write is blocked: nothing is released, and the writer is busy.
        assert!(!writer.is_idle());
        assert!(log.events().is_empty());
        log.open_gate();
        wait_until(|| writer.is_idle());
        assert_eq!(log.events(), ["write 1", "flush", "sync", "release a"]);
    }

    #[test]
    fn submissions_waiting_behind_a_slow_write_share_one_sync_and_release_in_order() {
        let log = FakeLog::closed_gate();
        let writer =
            LogWriter::spawn(log.clone(), FsyncPolicy::Always, |_| {}, no_stall()).unwrap();
        writer.submit(vec![acked(0)], release(&log, "first"));
        // Wait until the thread holds the first submission (blocked in its
        // write), so the rest queue up behind it as one group.
        wait_until(|| log.writes_started.load(Ordering::Acquire) == 1);
        for name in ["second", "third", "fourth"] {
            writer.submit(vec![acked(1), acked(2)], release(&log, name));
        }
        // A message-only submission (no records) is still ordered behind.
        writer.submit(Vec::new(), release(&log, "fifth"));
        log.open_gate();
        wait_until(|| writer.is_idle());
        let events = log.events();
        let releases: Vec<&String> = events
            .iter()
            .filter(|event| event.starts_with("release"))
            .collect();
        assert_eq!(
            releases,
            [
                "release first",
                "release second",
                "release third",
                "release fourth",
                "release fifth"
            ]
        );
        // Each release comes after a sync that followed its write.
        let last_write = events
            .iter()
            .rposition(|event| event.starts_with("write"))
            .unwrap();
        let first_release_after = events
            .iter()
            .position(|event| event == "release second")
            .unwrap();
        let sync_between = events[last_write..first_release_after]
            .iter()
            .any(|event| event == "sync");
        assert!(sync_between, "{events:?}");
        // At most two groups: the first write, then everything queued behind it.
        let syncs = events.iter().filter(|event| *event == "sync").count();
        assert!(syncs <= 2, "{syncs} syncs for 5 submissions: {events:?}");
        assert!(writer.counts().groups <= 2);
    }

    #[test]
    fn a_failed_write_releases_nothing_then_or_later_and_reports_once() {
        let log = FakeLog::default();
        log.fail_writes.store(true, Ordering::Release);
        let (writer, failures) = spawn_counting_failures(&log, no_stall());
        writer.submit(vec![acked(0)], release(&log, "a"));
        wait_until(|| writer.has_failed() && writer.is_idle());
        log.fail_writes.store(false, Ordering::Release);
        writer.submit(vec![acked(1)], release(&log, "b"));
        writer.submit(Vec::new(), release(&log, "c"));
        wait_until(|| writer.is_idle());
        drop(writer);
        assert_eq!(failures.load(Ordering::Acquire), 1);
        assert!(
            log.events()
                .iter()
                .all(|event| !event.starts_with("release")),
            "{:?}",
            log.events()
        );
    }

    #[test]
    fn with_fsync_batch_a_release_runs_once_written_without_waiting_for_the_sync() {
        let log = FakeLog::default();
        let hour = Duration::from_secs(3600);
        let writer = LogWriter::spawn_with_interval(
            log.clone(),
            FsyncPolicy::Batch,
            hour,
            |_| {},
            no_stall(),
        )
        .unwrap();
        writer.submit(vec![acked(0)], release(&log, "a"));
        wait_until(|| writer.is_idle());
        // Released once in the kernel's hands (flushed), before any sync.
        assert_eq!(log.events(), ["write 1", "flush", "release a"]);
        // Closing syncs what the interval had not.
        drop(writer);
        assert_eq!(log.events(), ["write 1", "flush", "release a", "sync"]);
    }

    #[test]
    fn with_fsync_batch_the_sync_follows_within_the_interval_without_new_work() {
        let log = FakeLog::default();
        let interval = Duration::from_millis(20);
        let writer = LogWriter::spawn_with_interval(
            log.clone(),
            FsyncPolicy::Batch,
            interval,
            |_| {},
            no_stall(),
        )
        .unwrap();
        writer.submit(vec![acked(0)], release(&log, "a"));
        wait_until(|| writer.counts().syncs == 1);
        let events = log.events();
        assert_eq!(events.iter().filter(|event| *event == "sync").count(), 1);
        assert!(events.contains(&"release a".to_string()), "{events:?}");
    }

    #[test]
    fn a_compaction_is_written_in_order_between_the_appends() {
        let log = FakeLog::default();
        let writer = LogWriter::spawn(log.clone(), FsyncPolicy::Never, |_| {}, no_stall()).unwrap();
        writer.submit(vec![acked(0)], None);
        writer.compact(vec![JournalEntry::Reset, acked(0)]);
        writer.submit(vec![acked(1)], release(&log, "after"));
        wait_until(|| writer.is_idle());
        let events: Vec<String> = log
            .events()
            .into_iter()
            .filter(|event| event != "flush")
            .collect();
        assert_eq!(events, ["write 1", "compact 2", "write 1", "release after"]);
    }

    #[test]
    fn dropping_the_writer_writes_and_releases_what_was_submitted() {
        let log = FakeLog::closed_gate();
        let writer =
            LogWriter::spawn(log.clone(), FsyncPolicy::Always, |_| {}, no_stall()).unwrap();
        writer.submit(vec![acked(0)], release(&log, "a"));
        writer.submit(vec![acked(1)], release(&log, "b"));
        let opener = log.clone();
        let open_later = std::thread::spawn(move || {
            wait_until(|| opener.writes_started.load(Ordering::Acquire) >= 1);
            opener.open_gate();
        });
        drop(writer);
        open_later.join().unwrap();
        let releases: Vec<String> = log
            .events()
            .into_iter()
            .filter(|event| event.starts_with("release"))
            .collect();
        assert_eq!(releases, ["release a", "release b"]);
    }

    #[test]
    fn a_write_without_space_is_rolled_back_and_retried_and_released_once_it_goes_through() {
        let log = FakeLog::default();
        log.writes_without_space.store(3, Ordering::Release);
        let (writer, failures) = spawn_counting_failures(&log, stall_events(&log));
        writer.submit(vec![acked(0)], release(&log, "a"));
        wait_until(|| writer.is_idle());
        assert_eq!(
            log.events(),
            [
                "write failed: no space",
                "rollback",
                "stalled",
                "write failed: no space",
                "rollback",
                "write failed: no space",
                "rollback",
                "write 1",
                "flush",
                "resumed",
                "sync",
                "release a"
            ]
        );
        assert_eq!(failures.load(Ordering::Acquire), 0);
        assert!(!writer.has_failed());
        assert!(!writer.counts().stalled);
    }

    #[test]
    fn while_a_write_waits_for_space_nothing_is_released_and_closing_gives_up_without_an_abort() {
        let log = FakeLog::default();
        log.writes_without_space.store(u64::MAX, Ordering::Release);
        let writer =
            LogWriter::spawn(log.clone(), FsyncPolicy::Batch, |_| {}, stall_events(&log)).unwrap();
        writer.submit(vec![acked(0)], release(&log, "a"));
        writer.submit(Vec::new(), release(&log, "b"));
        wait_until(|| writer.counts().stalled);
        assert!(!writer.is_idle());
        let started = Instant::now();
        drop(writer);
        // Closing waits at most one retry step (20 ms), not for space.
        assert!(started.elapsed() < TEST_WAIT);
        let events = log.events();
        assert!(
            events.iter().all(|event| !event.starts_with("release")
                && event != "abort recorded"
                && event != "resumed"),
            "{events:?}"
        );
        assert!(events.contains(&"stalled".to_string()), "{events:?}");
    }

    #[test]
    fn a_failed_sync_is_fatal_recorded_in_the_state_dir_and_releases_nothing() {
        let log = FakeLog::default();
        log.fail_syncs.store(true, Ordering::Release);
        let (writer, failures) = spawn_counting_failures(&log, no_stall());
        writer.submit(vec![acked(0)], release(&log, "a"));
        wait_until(|| writer.has_failed() && writer.is_idle());
        log.fail_syncs.store(false, Ordering::Release);
        writer.submit(vec![acked(1)], release(&log, "b"));
        wait_until(|| writer.is_idle());
        drop(writer);
        assert_eq!(failures.load(Ordering::Acquire), 1);
        let events = log.events();
        assert_eq!(events, ["write 1", "flush", "abort recorded"]);
    }
}
