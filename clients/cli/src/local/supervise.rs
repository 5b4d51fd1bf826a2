//! The children as processes: spawning one with its log and report file,
//! watching them (and showing the live view) until they all exit, a
//! Ctrl-C or `--timeout`, and stopping them with SIGTERM, a bounded wait,
//! then SIGKILL. Apart from `launch` (what to start) so that the shutdown
//! path, which must stop every child whatever happened, reads on its own.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use dflash_client::BrokerClient;
use dflash_ops::top::{self, RenderOptions};
use dflash_proto::v1 as proto;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use super::args::View;

/// What a child of the run is: the broker, a target-server, a
/// drafter-server or the online evaluator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Broker,
    Target,
    Drafter,
    Evaluator,
}

impl Role {
    /// Its name in the summary and `summary.json`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Broker => "broker",
            Role::Target => "target",
            Role::Drafter => "drafter",
            Role::Evaluator => "evaluator",
        }
    }
}

/// One child process of the run: what the summary needs of it (name, role,
/// device, exit code) and where it writes (log, checkpoints, report).
pub(super) struct Managed {
    pub(super) name: String,
    pub(super) role: Role,
    pub(super) device: String,
    pub(super) child: Child,
    pub(super) log: PathBuf,
    pub(super) exit_code: Option<i32>,
    pub(super) output: Option<PathBuf>,
    /// The process's `--report-file` (targets and drafters).
    pub(super) report: Option<PathBuf>,
}

pub(super) fn spawn(
    name: &str,
    role: Role,
    device: &str,
    program: &Path,
    args: &[String],
    logs: &Path,
    threads: Option<&str>,
) -> anyhow::Result<Managed> {
    let log = logs.join(format!("{name}.log"));
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    // Targets, drafters and the evaluator write their whole-run report for
    // the summary.
    let report = (role != Role::Broker).then(|| logs.join(format!("{name}.report.json")));
    let mut command = Command::new(program);
    // The flags first: the evaluator's start with its subcommand.
    command.args(args);
    if let Some(report) = &report {
        command.arg("--report-file").arg(report);
    }
    if let Some(threads) = threads {
        command.env("OMP_NUM_THREADS", threads);
    }
    // Its own process group: a signal to dflash's group (Ctrl-C in a
    // terminal, `timeout`) reaches dflash alone, which stops the children in
    // order (targets, drafters and the evaluator, then the broker after its
    // final status) instead of every process at once, the broker first.
    command.process_group(0);
    // ... and stops when dflash dies, however (SIGKILL included): the
    // parent-death signal the children ask for (`dflash_shell::shutdown_signal`).
    // Linux sends it when the *thread* that spawned the child exits: spawn
    // from the runtime's own threads (main's `block_on`, its workers: they
    // live as long as dflash), never inside `spawn_blocking` (its threads
    // exit after 10 s idle, which would stop the child mid-run).
    command.env(
        dflash_shell::STOP_WITH_PARENT_ENV,
        std::process::id().to_string(),
    );
    let child = command
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    Ok(Managed {
        name: name.to_string(),
        role,
        device: device.to_string(),
        child,
        log,
        exit_code: None,
        output: None,
        report,
    })
}

pub(super) fn terminate(process: &Managed) {
    if let Some(id) = process.child.id() {
        if let Ok(raw) = i32::try_from(id) {
            let _ = kill(Pid::from_raw(raw), Signal::SIGTERM);
        }
    }
}

/// How the children ended: on their own, or stopped.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StopReason {
    /// Ctrl-C (or SIGTERM) stopped them.
    pub(super) interrupted: bool,
    /// `--timeout` stopped them.
    pub(super) timed_out: bool,
    /// When every child but the evaluator had exited: the training's end
    /// (the evaluator may go on measuring versions it read).
    pub(super) training_ended: Option<Instant>,
    /// Every drafter had exited, one of them failed, and the run was not
    /// complete: nothing was left to train, so the rest were stopped.
    pub(super) drafters_gone: bool,
    /// The broker did not answer the final status call: the summary's
    /// figures are its last status seen while watching.
    pub(super) final_status_stale: bool,
}

/// Whether the run can no longer complete for want of a drafter: every
/// drafter has exited, at least one failed, and the broker's last status
/// was not COMPLETE. Drafters that all exit 0 got end-of-stream; one that
/// fails after a COMPLETE run does not stop the evaluator's tail.
pub(super) fn no_drafter_left(
    exits: impl IntoIterator<Item = (Role, Option<i32>)>,
    last_state: Option<proto::BrokerState>,
) -> bool {
    let mut drafters = 0;
    let mut failed = 0;
    for (role, exit_code) in exits {
        if role == Role::Drafter {
            match exit_code {
                None => return false,
                Some(0) => {}
                Some(_) => failed += 1,
            }
            drafters += 1;
        }
    }
    drafters > 0 && failed > 0 && last_state != Some(proto::BrokerState::Complete)
}

/// The live view while the children run.
pub(super) struct Watch<'a> {
    pub(super) client: &'a BrokerClient,
    pub(super) address: &'a str,
    pub(super) view: View,
    pub(super) started: Instant,
}

impl Watch<'_> {
    /// Watches until every child has exited, Ctrl-C, `deadline`, or no
    /// drafter is left ([`no_drafter_left`]); stops the children still
    /// running in the last three cases. Returns how it ended and the last
    /// broker status it saw.
    pub(super) async fn until_exit(
        &self,
        children: &mut [Managed],
        deadline: Instant,
        interrupt: &CancellationToken,
    ) -> (StopReason, Option<proto::StatusSnapshot>) {
        let mut last_line = Instant::now();
        let mut training_ended = None;
        let mut last_seen: Option<proto::StatusSnapshot> = None;
        loop {
            for child in children
                .iter_mut()
                .filter(|child| child.exit_code.is_none())
            {
                if let Ok(Some(status)) = child.child.try_wait() {
                    child.exit_code = Some(status.code().unwrap_or(-1));
                }
            }
            if training_ended.is_none()
                && children
                    .iter()
                    .filter(|child| child.role != Role::Evaluator)
                    .all(|child| child.exit_code.is_some())
            {
                training_ended = Some(Instant::now());
            }
            if children.iter().all(|child| child.exit_code.is_some()) {
                // A signal may have come as they exited: still said.
                let stop = StopReason {
                    interrupted: interrupt.is_cancelled(),
                    training_ended,
                    ..StopReason::default()
                };
                return (stop, last_seen);
            }
            if interrupt.is_cancelled() || Instant::now() > deadline {
                let interrupted = interrupt.is_cancelled();
                stop_children(children).await;
                let stop = StopReason {
                    interrupted,
                    timed_out: !interrupted,
                    training_ended,
                    ..StopReason::default()
                };
                return (stop, last_seen);
            }
            let last_state = last_seen.as_ref().map(|snapshot| snapshot.state());
            if no_drafter_left(
                children.iter().map(|child| (child.role, child.exit_code)),
                last_state,
            ) {
                println!(
                    "dflash local: every drafter has exited and one failed before the run completed; \
                     stopping the rest (see the drafters' logs)"
                );
                stop_children(children).await;
                let stop = StopReason {
                    drafters_gone: true,
                    training_ended: Some(training_ended.unwrap_or_else(Instant::now)),
                    ..StopReason::default()
                };
                return (stop, last_seen);
            }
            if let Ok(snapshot) = self.client.status().await {
                self.show(&snapshot, &mut last_line);
                last_seen = Some(snapshot);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn show(&self, snapshot: &proto::StatusSnapshot, last_line: &mut Instant) {
        match self.view {
            View::Top => {
                print!(
                    "\x1b[H\x1b[2J{}",
                    top::render(snapshot, self.address, RenderOptions { color: true })
                );
            }
            View::Lines if last_line.elapsed() >= Duration::from_secs(5) => {
                *last_line = Instant::now();
                println!(
                    "[{:>5.0}s] {:?} targets done {}/{} accepted {} trained {} queued {} leased {}",
                    self.started.elapsed().as_secs_f64(),
                    snapshot.state(),
                    snapshot.done_targets,
                    snapshot.expected_targets,
                    snapshot.accepted_items,
                    snapshot.acked_items,
                    snapshot.queued_items,
                    snapshot.leased_items
                );
            }
            _ => {}
        }
    }
}

/// SIGTERM to every child still running, one bounded wait for all of them,
/// then SIGKILL.
async fn stop_children(children: &mut [Managed]) {
    for child in children.iter().filter(|child| child.exit_code.is_none()) {
        terminate(child);
    }
    let stop_deadline = Instant::now() + Duration::from_secs(30);
    for child in children
        .iter_mut()
        .filter(|child| child.exit_code.is_none())
    {
        let left = stop_deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, child.child.wait()).await {
            Ok(Ok(status)) => child.exit_code = Some(status.code().unwrap_or(-1)),
            _ => {
                let _ = child.child.kill().await;
                child.exit_code = Some(-9);
            }
        }
    }
}

pub(super) async fn stop_broker(broker: &mut Managed) {
    terminate(broker);
    if let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(15), broker.child.wait()).await
    {
        broker.exit_code = status.code();
    } else {
        let _ = broker.child.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_stops_only_when_every_drafter_is_gone_and_one_failed_before_completion() {
        use proto::BrokerState::{Complete, Draining, Running};
        let running = Some(Running);
        // Both drafters died (the H200 run recorded in e010b21: each drafter's
        // training thread failed at its first step; dflash local then waited
        // for --timeout).
        let dead = [
            (Role::Target, Some(0)),
            (Role::Drafter, Some(1)),
            (Role::Drafter, Some(1)),
            (Role::Evaluator, None),
        ];
        assert!(no_drafter_left(dead, Some(Draining)));
        assert!(no_drafter_left(dead, None));
        // One drafter still runs: it trains the rest.
        assert!(!no_drafter_left(
            [(Role::Drafter, Some(1)), (Role::Drafter, None)],
            running
        ));
        // Every drafter got end-of-stream and exited 0.
        assert!(!no_drafter_left(
            [(Role::Drafter, Some(0)), (Role::Drafter, Some(0))],
            running
        ));
        // One failed after the run completed: the evaluator's tail goes on.
        assert!(!no_drafter_left(
            [
                (Role::Drafter, Some(0)),
                (Role::Drafter, Some(2)),
                (Role::Evaluator, None)
            ],
            Some(Complete)
        ));
        // A killed drafter (no exit code from a signal is -1 here) counts as failed.
        assert!(no_drafter_left([(Role::Drafter, Some(-1))], running));
        // No drafter at all is not this case.
        assert!(!no_drafter_left([(Role::Target, Some(1))], running));
    }
}
