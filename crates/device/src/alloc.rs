//! Allocator settings for processes that allocate and free the same large
//! tensors on every step (the drafter's training step, the target's capture).
//!
//! libtorch's CPU allocator is glibc `malloc`. By default glibc serves every
//! block above 128 KiB–32 MiB with a fresh `mmap` and gives it back with
//! `munmap` on free, so each step's score and activation tensors are new,
//! zero-filled mappings: one page fault per 4 KiB page on first touch, and
//! half of a drafter step's time spent in the kernel. [`configure_allocator`]
//! makes large blocks come from the heap (`M_MMAP_MAX = 0`) and keeps freed
//! heap memory (`M_TRIM_THRESHOLD = -1`), so from the second step on the
//! same pages are reused without faults. The price is that the process keeps
//! its peak heap for its lifetime, which is what a trainer wants anyway.
//!
//! Optionally ([`AllocatorMode::RetainedHugePages`]) the process re-executes
//! itself once with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which glibc only
//! reads at start, so the heap is backed by transparent huge pages when the
//! host allows them (`/sys/kernel/mm/transparent_hugepage/enabled` in
//! `madvise` or `always` mode).
//!
//! `DFLASH_MALLOC` overrides the mode a binary asks for: `system` (glibc's
//! defaults, for comparisons), `retain`, or `retain+hugepages`.

use std::ffi::OsString;

/// Environment variable that overrides the mode a binary asks for.
pub const MALLOC_MODE_VARIABLE: &str = "DFLASH_MALLOC";
/// Set in the environment of the re-executed process so it never loops.
const REEXECUTED_VARIABLE: &str = "DFLASH_MALLOC_REEXECUTED";
const THP_ENABLED_PATH: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// How the process's allocator is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocatorMode {
    /// glibc's defaults: large blocks are mapped and unmapped on every use.
    System,
    /// Large blocks come from the heap and freed memory is kept.
    Retained,
    /// [`AllocatorMode::Retained`], with the heap on transparent huge pages
    /// (needs one re-exec at start).
    RetainedHugePages,
}

impl AllocatorMode {
    /// Parses a `DFLASH_MALLOC` value.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim() {
            "system" => Ok(AllocatorMode::System),
            "retain" => Ok(AllocatorMode::Retained),
            "retain+hugepages" => Ok(AllocatorMode::RetainedHugePages),
            other => Err(format!(
                "{MALLOC_MODE_VARIABLE}={other:?}: expected system, retain or retain+hugepages"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AllocatorMode::System => "system",
            AllocatorMode::Retained => "retain",
            AllocatorMode::RetainedHugePages => "retain+hugepages",
        }
    }
}

/// What [`configure_allocator`] did, for the startup log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatorReport {
    /// The mode in effect.
    pub mode: AllocatorMode,
    /// Whether glibc's huge-page tunable is active in this process.
    pub huge_pages: bool,
    /// Why a setting was not applied (unknown `DFLASH_MALLOC`, a failed
    /// `mallopt`, no transparent huge pages on this host, a failed re-exec).
    pub warnings: Vec<String>,
}

impl std::fmt::Display for AllocatorReport {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "allocator: {}, huge pages {}",
            self.mode.name(),
            if self.huge_pages { "on" } else { "off" }
        )?;
        for warning in &self.warnings {
            write!(formatter, "; {warning}")?;
        }
        Ok(())
    }
}

/// Sets the process's allocator up for tensor workloads: `default_mode`
/// unless `DFLASH_MALLOC` says otherwise. Call it first thing in `main`:
/// with huge pages it may re-execute the process (same pid, same arguments),
/// which is only harmless before any work has started.
pub fn configure_allocator(default_mode: AllocatorMode) -> AllocatorReport {
    let mut warnings = Vec::new();
    let mode = match std::env::var(MALLOC_MODE_VARIABLE) {
        Ok(value) => AllocatorMode::parse(&value).unwrap_or_else(|error| {
            warnings.push(format!("{error}; using {}", default_mode.name()));
            default_mode
        }),
        Err(_) => default_mode,
    };
    if mode == AllocatorMode::RetainedHugePages && !huge_page_tunable_active() {
        match transparent_huge_pages_mode() {
            Some(thp) if thp == "madvise" || thp == "always" => {
                // Only returns when the exec failed.
                let error = reexecute_with_huge_page_tunable();
                warnings.push(format!(
                    "re-exec with the huge-page tunable failed: {error}"
                ));
            }
            Some(thp) => warnings.push(format!("transparent huge pages are {thp:?} on this host")),
            None => warnings.push(format!("{THP_ENABLED_PATH} unreadable")),
        }
    }
    if mode != AllocatorMode::System {
        warnings.extend(retain_large_blocks());
    }
    AllocatorReport {
        mode,
        huge_pages: mode == AllocatorMode::RetainedHugePages && huge_page_tunable_active(),
        warnings,
    }
}

/// `mallopt(M_MMAP_MAX, 0)` and `mallopt(M_TRIM_THRESHOLD, -1)` (glibc only).
#[allow(unsafe_code)]
fn retain_large_blocks() -> Vec<String> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let mut warnings = Vec::new();
        for (name, parameter, value) in [
            ("M_MMAP_MAX", libc::M_MMAP_MAX, 0),
            ("M_TRIM_THRESHOLD", libc::M_TRIM_THRESHOLD, -1),
        ] {
            // SAFETY: mallopt only changes glibc's malloc parameters, under
            // malloc's own lock; any value is accepted or refused with 0.
            if unsafe { libc::mallopt(parameter, value) } == 0 {
                warnings.push(format!("mallopt({name}, {value}) refused"));
            }
        }
        warnings
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        vec!["not glibc: allocator left as it is".to_string()]
    }
}

/// Whether glibc read `glibc.malloc.hugetlb=1` (or 2) at this process's start.
fn huge_page_tunable_active() -> bool {
    std::env::var("GLIBC_TUNABLES")
        .map(|tunables| {
            tunables.split(':').any(|tunable| {
                matches!(tunable, "glibc.malloc.hugetlb=1" | "glibc.malloc.hugetlb=2")
            })
        })
        .unwrap_or(false)
}

/// The bracketed word of `/sys/kernel/mm/transparent_hugepage/enabled`.
fn transparent_huge_pages_mode() -> Option<String> {
    let contents = std::fs::read_to_string(THP_ENABLED_PATH).ok()?;
    let start = contents.find('[')? + 1;
    let end = start + contents[start..].find(']')?;
    Some(contents[start..end].to_string())
}

/// Replaces the process with itself, with the huge-page tunable added to
/// `GLIBC_TUNABLES`; returns only on failure.
fn reexecute_with_huge_page_tunable() -> std::io::Error {
    use std::os::unix::process::CommandExt;
    if std::env::var_os(REEXECUTED_VARIABLE).is_some() {
        return std::io::Error::other("already re-executed once and the tunable is still not set");
    }
    let mut tunables = OsString::from("glibc.malloc.hugetlb=1");
    if let Some(existing) = std::env::var_os("GLIBC_TUNABLES").filter(|value| !value.is_empty()) {
        tunables.push(":");
        tunables.push(existing);
    }
    let mut arguments = std::env::args_os();
    let program_name = arguments.next().unwrap_or_default();
    std::process::Command::new("/proc/self/exe")
        .arg0(program_name)
        .args(arguments)
        .env("GLIBC_TUNABLES", tunables)
        .env(REEXECUTED_VARIABLE, "1")
        .exec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_name_round_trip() {
        for mode in [
            AllocatorMode::System,
            AllocatorMode::Retained,
            AllocatorMode::RetainedHugePages,
        ] {
            assert_eq!(AllocatorMode::parse(mode.name()), Ok(mode));
        }
        let error = AllocatorMode::parse("jemalloc").unwrap_err();
        assert!(error.contains("\"jemalloc\""), "{error}");
    }

    #[test]
    fn report_names_the_mode_and_the_warnings() {
        let report = AllocatorReport {
            mode: AllocatorMode::Retained,
            huge_pages: false,
            warnings: vec!["mallopt(M_MMAP_MAX, 0) refused".to_string()],
        };
        assert_eq!(
            report.to_string(),
            "allocator: retain, huge pages off; mallopt(M_MMAP_MAX, 0) refused"
        );
    }
}
