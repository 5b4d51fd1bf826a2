//! The checkpoint folder: `step-NNNNNNNN/` directories (each written
//! atomically by the engine), a `latest` file naming the newest complete one
//! (replaced atomically), and pruning of old ones.

use std::path::{Path, PathBuf};

/// Name of the file that names the newest complete checkpoint.
pub const LATEST_FILE_NAME: &str = "latest";

/// `step-00001000` for step 1000 (zero-padded so names sort by step).
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn parse_step(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// Step checkpoints in `output`, oldest first.
pub fn list_step_checkpoints(output: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    if !output.exists() {
        return Ok(Vec::new());
    }
    let mut found = Vec::new();
    for entry in std::fs::read_dir(output)? {
        let entry = entry?;
        if !entry.file_type()?.is_dir() {
            continue;
        }
        if let Some(step) = entry.file_name().to_str().and_then(parse_step) {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The newest complete checkpoint: the one `latest` names if it exists,
/// else the highest step directory.
pub fn latest_checkpoint(output: &Path) -> std::io::Result<Option<PathBuf>> {
    if let Ok(name) = std::fs::read_to_string(output.join(LATEST_FILE_NAME)) {
        let candidate = output.join(name.trim());
        if candidate.is_dir() {
            return Ok(Some(candidate));
        }
    }
    Ok(list_step_checkpoints(output)?.pop().map(|(_, path)| path))
}

/// Points `latest` at `dir_name` (write to a temporary file, then rename).
pub fn record_latest(output: &Path, dir_name: &str) -> std::io::Result<()> {
    let temporary = output.join(format!(".{LATEST_FILE_NAME}.tmp-{}", std::process::id()));
    std::fs::write(&temporary, format!("{dir_name}\n"))?;
    std::fs::rename(&temporary, output.join(LATEST_FILE_NAME))
}

/// Deletes all but the newest `keep` step checkpoints (at least one is kept).
pub fn prune_step_checkpoints(output: &Path, keep: usize) -> std::io::Result<Vec<PathBuf>> {
    let checkpoints = list_step_checkpoints(output)?;
    let excess = checkpoints.len().saturating_sub(keep.max(1));
    let mut removed = Vec::new();
    for (_, path) in checkpoints.into_iter().take(excess) {
        std::fs::remove_dir_all(&path)?;
        removed.push(path);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_sort_and_parse() {
        assert_eq!(step_dir_name(42), "step-00000042");
        assert_eq!(parse_step("step-00000042"), Some(42));
        assert_eq!(parse_step("step-x"), None);
        assert_eq!(parse_step(".step-00000001.tmp"), None);
    }
}
