//! `dflash local` stopped with SIGTERM mid-run (as a scheduler or `timeout`
//! stops it), sent to it or to its whole process group: it stops its
//! children with SIGTERM, waits for them (bounded), prints its summary, and
//! leaves no process of the run behind. Killed with SIGKILL, it leaves no
//! child running either (they stop on their parent-death signal).

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::Read as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use dflash_testkit::wait_until_blocking;

/// Processes whose command line names `workdir` (the run's children do).
fn processes_naming(workdir: &Path, except: u32) -> Vec<String> {
    let needle = workdir.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            if pid == except || pid == std::process::id() {
                return None;
            }
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // Zombies have an empty command line; they are not running.
            cmdline
                .contains(&needle)
                .then(|| format!("{pid}: {cmdline}"))
        })
        .collect()
}

#[test]
fn sigterm_stops_the_children_and_prints_the_summary() {
    stop_mid_run(Signalled::Process);
}

/// Ctrl-C in a terminal and `timeout` signal dflash's whole process group.
/// On an H200 (recorded in e010b21) `timeout` did, the broker (then in dflash's group)
/// stopped at once, and dflash, left without its final status, printed an
/// error instead of its summary. The children now have their own groups.
#[test]
fn a_signal_to_the_process_group_still_ends_with_the_summary() {
    stop_mid_run(Signalled::Group);
}

/// Who the SIGTERM goes to.
enum Signalled {
    /// dflash alone (`kill PID`).
    Process,
    /// dflash's process group (`kill -- -PGID`), dflash started as its leader.
    Group,
}

/// A `dflash local` run (its children started, in the pipeline) with
/// enough epochs that it is still running when the test acts; the temporary
/// folder holds its workdir.
struct MidRun {
    local: std::process::Child,
    workdir: std::path::PathBuf,
    _temporary: tempfile::TempDir,
}

fn start_mid_run() -> MidRun {
    use std::os::unix::process::CommandExt as _;

    let temporary = tempfile::tempdir().unwrap();
    let workdir = temporary.path().join("run");
    let local = Command::new(dflash_testkit::workspace_binary("dflash"))
        .args(["local", "--view", "lines", "--timeout", "15m"])
        .args([
            "--demo-sequences",
            "32",
            "--demo-epochs",
            "200",
            "--workdir",
        ])
        .arg(&workdir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let drafter_log = workdir.join("logs").join("drafter-1.log");
    let started = wait_until_blocking(Duration::from_secs(300), || {
        drafter_log.is_file() && !processes_naming(&workdir, local.id()).is_empty()
    });
    assert!(started, "the pipeline's children never started");
    MidRun {
        local,
        workdir,
        _temporary: temporary,
    }
}

/// dflash killed with SIGKILL (the OOM killer, `timeout -s KILL`) can stop
/// nothing itself: its children, each in its own process group, stop on the
/// parent-death signal they asked for, and none is left running.
#[test]
fn sigkill_of_dflash_leaves_no_child_running() {
    let MidRun {
        mut local,
        workdir,
        _temporary,
    } = start_mid_run();
    let pid = local.id();
    local.kill().unwrap();
    local.wait().unwrap();
    let gone = wait_until_blocking(Duration::from_secs(120), || {
        processes_naming(&workdir, pid).is_empty()
    });
    let left = processes_naming(&workdir, pid);
    assert!(
        gone,
        "children still running after dflash was killed: {left:?}"
    );
}

fn stop_mid_run(signalled: Signalled) {
    let MidRun {
        mut local,
        workdir,
        _temporary,
    } = start_mid_run();
    let target = match signalled {
        Signalled::Process => local.id().to_string(),
        Signalled::Group => format!("-{}", local.id()),
    };
    let status = Command::new("kill")
        .args(["-TERM", "--", &target])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = wait_until_blocking(Duration::from_secs(120), || {
        matches!(local.try_wait(), Ok(Some(_)))
    });
    if !exited {
        let _ = local.kill();
    }
    let mut stdout = String::new();
    let mut stderr = String::new();
    local
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    local
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(
        exited,
        "dflash local did not exit after SIGTERM\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("dflash local summary") && stdout.contains("interrupted"),
        "no summary after SIGTERM\n{stdout}\n{stderr}"
    );
    let left = processes_naming(&workdir, local.id());
    assert!(left.is_empty(), "children still running: {left:?}");
    assert!(workdir.join("summary.json").is_file());
}
