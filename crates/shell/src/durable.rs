//! Files that survive a crash: a file written and fsynced, a directory's
//! files and entries fsynced, and a checkpoint directory replaced as a whole
//! (written into a staging sibling, fsynced, swapped in, the parent fsynced),
//! so a reader finds the whole old directory or the whole new one. The draft
//! model's checkpoints and the run's model both write this way.

use std::fs::File;
use std::path::{Path, PathBuf};

/// An I/O failure and the path it happened on.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct DurableError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

fn at(path: &Path) -> impl FnOnce(std::io::Error) -> DurableError + '_ {
    move |source| DurableError {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` and fsyncs the file.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), DurableError> {
    std::fs::write(path, bytes).map_err(at(path))?;
    sync_file(path)
}

/// Writes `parts` one after the other as the one file `path` and fsyncs
/// it: a file that arrived in chunks is written without joining them (the
/// run's model, 4 GiB for a 1 B-parameter drafter, is never copied whole).
pub fn write_parts_synced<Part: AsRef<[u8]>>(
    path: &Path,
    parts: &[Part],
) -> Result<(), DurableError> {
    use std::io::Write as _;
    let mut file = std::io::BufWriter::new(File::create(path).map_err(at(path))?);
    for part in parts {
        file.write_all(part.as_ref()).map_err(at(path))?;
    }
    let file = file
        .into_inner()
        .map_err(|error| at(path)(error.into_error()))?;
    file.sync_all().map_err(at(path))
}

fn sync_file(path: &Path) -> Result<(), DurableError> {
    File::open(path)
        .and_then(|file| file.sync_all())
        .map_err(at(path))
}

/// fsyncs every file directly in `dir`, then `dir` itself, so its files'
/// contents and its entries (new names, renames) survive a crash.
pub fn sync_directory(dir: &Path) -> Result<(), DurableError> {
    for entry in std::fs::read_dir(dir).map_err(at(dir))? {
        let path = entry.map_err(at(dir))?.path();
        if path.is_file() {
            sync_file(&path)?;
        }
    }
    sync_file(dir)
}

/// Replaces the directory `dir` with what `write` puts into the empty
/// staging directory it is given (a hidden sibling of `dir`): the staging
/// directory is fsynced, moved into `dir`'s place (the old `dir`, when there
/// is one, moved aside first and then removed), and `dir`'s parent is
/// fsynced. When `write` fails, `dir` is left as it was.
pub fn replace_directory<E: From<DurableError>>(
    dir: &Path,
    write: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    let parent = match dir.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = dir
        .file_name()
        .ok_or_else(|| DurableError {
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "has no final component"),
        })?
        .to_string_lossy()
        .into_owned();
    std::fs::create_dir_all(&parent).map_err(at(&parent))?;
    let staging = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(at(&staging))?;
    }
    std::fs::create_dir_all(&staging).map_err(at(&staging))?;
    write(&staging)?;
    sync_directory(&staging)?;
    if dir.exists() {
        let retired = parent.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(dir, &retired).map_err(at(dir))?;
        std::fs::rename(&staging, dir).map_err(at(dir))?;
        std::fs::remove_dir_all(&retired).map_err(at(&retired))?;
    } else {
        std::fs::rename(&staging, dir).map_err(at(dir))?;
    }
    sync_file(&parent)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("dflash-durable-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn replace_directory_swaps_in_the_whole_new_contents() {
        let root = scratch("swap");
        let dir = root.join("model");
        replace_directory::<DurableError>(&dir, |staging| {
            write_synced(&staging.join("a.txt"), b"old a")?;
            write_synced(&staging.join("b.txt"), b"old b")
        })
        .unwrap();
        replace_directory::<DurableError>(&dir, |staging| {
            write_synced(&staging.join("a.txt"), b"new a")
        })
        .unwrap();
        assert_eq!(std::fs::read(dir.join("a.txt")).unwrap(), b"new a");
        assert!(
            !dir.join("b.txt").exists(),
            "the old directory's files are gone"
        );
        let leftovers: Vec<_> = std::fs::read_dir(&root)
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(leftovers, vec![std::ffi::OsString::from("model")]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_the_old_directory() {
        let root = scratch("failed");
        let dir = root.join("checkpoint");
        replace_directory::<DurableError>(&dir, |staging| {
            write_synced(&staging.join("weights"), b"kept")
        })
        .unwrap();
        let failed = replace_directory::<DurableError>(&dir, |staging| {
            write_synced(&staging.join("weights"), b"half")?;
            Err(DurableError {
                path: staging.to_path_buf(),
                source: std::io::Error::other("disk full"),
            })
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read(dir.join("weights")).unwrap(), b"kept");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_path_without_a_name_is_refused_with_the_path() {
        let error = replace_directory::<DurableError>(Path::new("/"), |_| Ok(())).unwrap_err();
        assert_eq!(error.path, PathBuf::from("/"));
        assert!(
            error.to_string().contains("has no final component"),
            "{error}"
        );
    }
}
