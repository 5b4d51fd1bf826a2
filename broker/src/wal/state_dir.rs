//! The small files of a state dir beside its segments: `lock` (one broker
//! per directory), `run-id`, `run-config` (the configuration the log was
//! written under), `target-capture` (what the run's targets capture beyond
//! DFlash's tensors) and `aborted` (a run the log could not keep going).
//!
//! Each small file is written whole: a temporary file, synced, renamed
//! into place, and the directory synced.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;

use super::error::{io_error, WalError};

const RUN_ID_FILE: &str = "run-id";
const RUN_CONFIG_FILE: &str = "run-config";
const ABORTED_FILE: &str = "aborted";
/// The run's `--target-capture` (`none`, or the tensors' flag names
/// joined by commas), recorded when the run starts.
const TARGET_CAPTURE_FILE: &str = "target-capture";
/// Held locked (an advisory `flock`) by the broker that owns the state dir.
/// The kernel drops the lock when that process exits, however it exits
/// (`kill -9` included), so a stale lock file never blocks a restart.
const LOCK_FILE: &str = "lock";

/// The configuration a state dir's records only make sense under: the
/// target ids in order (their count is the number of shards, and a
/// target's place is its shard). Kept in `run-config` and, as a
/// fingerprint, in every segment's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunShape {
    pub target_ids: Vec<String>,
}

impl RunShape {
    pub fn new(target_ids: Vec<String>) -> Self {
        RunShape { target_ids }
    }

    /// The `run-config` file's text.
    fn file_text(&self) -> String {
        format!(
            "format 1\nshards {}\ntarget_ids {}\n",
            self.target_ids.len(),
            self.target_ids.join(",")
        )
    }

    /// For messages: `2 shards: target-0,target-1`.
    pub fn describe(&self) -> String {
        describe_file_text(&self.file_text())
    }

    /// The first 8 bytes of the SHA-256 of the `run-config` text.
    pub fn fingerprint(&self) -> u64 {
        fingerprint_of(&self.file_text())
    }
}

fn fingerprint_of(text: &str) -> u64 {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(text.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

/// `run-config` text → `N shards: a,b` (or the text itself when it is not
/// in the expected form).
fn describe_file_text(text: &str) -> String {
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .map(str::to_string)
    };
    match (field("shards"), field("target_ids")) {
        (Some(shards), Some(ids)) => format!("{shards} shards: {ids}"),
        _ => text.trim().to_string(),
    }
}

/// Takes the state dir's lock without waiting.
pub(super) fn lock(dir: &Path) -> Result<File, WalError> {
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

/// The state dir's `run-config` against `shape`: written when absent;
/// equal, fine; different, refused ([`WalError::ConfigMismatch`]) unless
/// `adopt`, which keeps the log and records `shape` instead. What the
/// segments' headers must carry: `shape`'s fingerprint, or, when adopting,
/// whatever they carry (the caller rewrites them).
pub(super) fn check_run_config(
    dir: &Path,
    shape: &RunShape,
    adopt: bool,
    fresh: bool,
) -> Result<bool, WalError> {
    let path = dir.join(RUN_CONFIG_FILE);
    let wanted = shape.file_text();
    match read_optional(&path)? {
        Some(stored) if stored == wanted => Ok(false),
        Some(stored) if !adopt => Err(WalError::ConfigMismatch {
            path: dir.to_path_buf(),
            stored: describe_file_text(&stored),
            configured: shape.describe(),
        }),
        Some(stored) => {
            tracing::warn!(state_dir = %dir.display(), stored = %describe_file_text(&stored), configured = %shape.describe(), "--adopt-state-dir: the log written under another configuration is kept, and the run goes on under this one");
            Ok(true)
        }
        None if fresh => {
            write_whole(dir, RUN_CONFIG_FILE, &wanted)?;
            Ok(false)
        }
        None if adopt => Ok(true),
        None => Err(WalError::ConfigMismatch {
            path: dir.to_path_buf(),
            stored: "unknown (segments without a run-config file)".to_string(),
            configured: shape.describe(),
        }),
    }
}

/// What [`check_target_capture`] found in the state dir.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CaptureRecord {
    /// The state dir records the configured capture.
    Matches,
    /// No record: a new state dir, or one written before the broker
    /// recorded the capture. The configured one is to be recorded.
    Missing,
}

/// The state dir's `target-capture` against `configured` (the run's
/// `--target-capture`, as the broker's configuration names it):
/// another value is refused ([`WalError::CaptureMismatch`]) whatever
/// `--adopt-state-dir` says, since the samples held and the drafters'
/// architecture were chosen for the recorded one.
pub(super) fn check_target_capture(
    dir: &Path,
    configured: &str,
) -> Result<CaptureRecord, WalError> {
    match read_optional(&dir.join(TARGET_CAPTURE_FILE))? {
        Some(stored) if stored.trim() == configured => Ok(CaptureRecord::Matches),
        Some(stored) => Err(WalError::CaptureMismatch {
            path: dir.to_path_buf(),
            stored: stored.trim().to_string(),
            configured: configured.to_string(),
        }),
        None => Ok(CaptureRecord::Missing),
    }
}

/// Records `capture` as the run's `--target-capture`.
pub(super) fn write_target_capture(dir: &Path, capture: &str) -> Result<(), WalError> {
    write_whole(dir, TARGET_CAPTURE_FILE, &format!("{capture}\n"))
}

/// Records `shape` as the state dir's configuration (after adopting).
pub(super) fn write_run_config(dir: &Path, shape: &RunShape) -> Result<(), WalError> {
    write_whole(dir, RUN_CONFIG_FILE, &shape.file_text())
}

pub(super) fn read_or_create_run_id(
    dir: &Path,
    new_run_id: impl FnOnce() -> String,
) -> Result<String, WalError> {
    let path = dir.join(RUN_ID_FILE);
    if let Some(run_id) = read_optional(&path)? {
        if !run_id.trim().is_empty() {
            return Ok(run_id.trim().to_string());
        }
    }
    let run_id = new_run_id();
    write_whole(dir, RUN_ID_FILE, &run_id)?;
    Ok(run_id)
}

/// Why the run was aborted when its log failed for good, if it was.
pub(super) fn read_aborted(dir: &Path) -> Result<Option<String>, WalError> {
    Ok(read_optional(&dir.join(ABORTED_FILE))?.map(|reason| reason.trim().to_string()))
}

/// Records that the run was aborted because its log failed, so a restart
/// does not resume it from a log that may lack what was confirmed.
pub(super) fn write_aborted(dir: &Path, reason: &str) -> Result<(), WalError> {
    write_whole(dir, ABORTED_FILE, reason)
}

/// Deletes snapshots a crash left half written (`segment-*.tmp`) and small
/// files left half written (`*.tmp`): replay never reads them.
pub(super) fn remove_unfinished(dir: &Path) -> Result<(), WalError> {
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let path = entry.map_err(io_error(dir))?.path();
        let unfinished = path
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(|name| name.strip_suffix(".tmp"))
            .is_some_and(|stem| {
                stem.starts_with("segment-")
                    || [
                        RUN_ID_FILE,
                        RUN_CONFIG_FILE,
                        TARGET_CAPTURE_FILE,
                        ABORTED_FILE,
                    ]
                    .contains(&stem)
            });
        if unfinished {
            fs::remove_file(&path).map_err(io_error(&path))?;
        }
    }
    Ok(())
}

pub(super) fn sync_dir(dir: &Path) -> Result<(), WalError> {
    File::open(dir)
        .and_then(|handle| handle.sync_all())
        .map_err(io_error(dir))
}

fn read_optional(path: &Path) -> Result<Option<String>, WalError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(WalError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Writes `name` in `dir` whole: temporary file, sync, rename, dir sync.
fn write_whole(dir: &Path, name: &str, text: &str) -> Result<(), WalError> {
    let temporary = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    let mut file = File::create(&temporary).map_err(io_error(&temporary))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io_error(&temporary))?;
    fs::rename(&temporary, &path).map_err(io_error(&path))?;
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_follows_the_target_ids_and_their_order() {
        let two = RunShape::new(vec!["target-0".into(), "target-1".into()]);
        let swapped = RunShape::new(vec!["target-1".into(), "target-0".into()]);
        let three = RunShape::new(vec!["a".into(), "b".into(), "c".into()]);
        assert_eq!(two.fingerprint(), two.clone().fingerprint());
        assert_ne!(two.fingerprint(), swapped.fingerprint());
        assert_ne!(two.fingerprint(), three.fingerprint());
        assert_eq!(two.describe(), "2 shards: target-0,target-1");
    }
}
