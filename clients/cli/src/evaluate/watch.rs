//! `--watch`: when a version is due ([`Schedule`]), the loop's decisions
//! apart from its RPCs and the clock ([`Watcher`]), and the loop itself.

use std::time::{Duration, Instant};

use super::args::EvaluateArgs;
use super::broker::Evaluator;
use super::measure::{Bench, Kept, Measuring};
use super::report::EvaluatorReport;
use anyhow::bail;
use dflash_proto::v1 as proto;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// When the next evaluation is due: every `every_versions` versions or
/// every `every`, and never twice for one version.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub every_versions: u64,
    pub every: Duration,
}

impl Schedule {
    /// Whether `version` should be evaluated now, given the last one
    /// evaluated and when.
    pub fn due(&self, version: u64, last: Option<(u64, Instant)>, now: Instant) -> bool {
        match last {
            None => true,
            Some((last_version, _)) if version == last_version => false,
            Some((last_version, at)) => {
                version >= last_version.saturating_add(self.every_versions.max(1))
                    || now.saturating_duration_since(at) >= self.every
            }
        }
    }
}

/// Whether the run is over for the evaluator: COMPLETE with the final
/// model written, or ABORTED.
pub(super) fn run_over(snapshot: &proto::StatusSnapshot) -> bool {
    let final_saved = snapshot
        .model_sync
        .as_ref()
        .is_some_and(|sync| sync.final_saved || !sync.has_model);
    match snapshot.state() {
        proto::BrokerState::Complete => final_saved,
        proto::BrokerState::Aborted => true,
        _ => false,
    }
}

/// What the watch loop does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Read the current model (it is due and the backlog has room).
    Read,
    /// Poll again later (or when a measurement ends).
    Wait,
    /// The run is over and every version read is measured.
    Stop,
}

/// The watch loop's decisions and its backlog, apart from its RPCs and the
/// clock: which version to read when, the versions read (`T`: what was
/// read) waiting for their measurement, which one is being measured, and
/// when the evaluator is done.
#[derive(Debug, Clone)]
pub struct Watcher<T> {
    schedule: Schedule,
    backlog: usize,
    /// Versions read and not yet being measured, oldest first.
    waiting: std::collections::VecDeque<(u64, T)>,
    /// The version being measured.
    measuring: Option<u64>,
    last_read: Option<(u64, Instant)>,
    /// The run's last version, once the run is over.
    final_version: Option<u64>,
}

impl<T> Watcher<T> {
    /// `backlog`: versions read and not yet measured at most (at least 1).
    pub fn new(schedule: Schedule, backlog: u32) -> Self {
        Watcher {
            schedule,
            backlog: (backlog as usize).max(1),
            waiting: std::collections::VecDeque::new(),
            measuring: None,
            last_read: None,
            final_version: None,
        }
    }

    /// After a status: the model's version (`None` before the first
    /// JOIN), how many unreported versions the broker keeps (0: not
    /// said), and whether the run is over.
    pub fn on_status(&mut self, model: Option<u64>, kept: u32, over: bool, now: Instant) -> Next {
        let backlog = match kept {
            0 => self.backlog,
            kept => self.backlog.min(kept as usize),
        };
        if let Some(version) = model {
            if over {
                self.final_version = Some(version);
            }
            let due = if over {
                self.last_read.is_none_or(|(last, _)| last != version)
            } else {
                self.schedule.due(version, self.last_read, now)
            };
            if due {
                // Reading more than the broker keeps would let an
                // unreported version go; the next poll reads once one is
                // measured.
                return if self.unmeasured() < backlog {
                    Next::Read
                } else {
                    Next::Wait
                };
            }
        }
        if over && self.unmeasured() == 0 {
            Next::Stop
        } else {
            Next::Wait
        }
    }

    /// A version was read: it waits for its measurement.
    pub fn read(&mut self, version: u64, read: T, now: Instant) {
        self.last_read = Some((version, now));
        self.waiting.push_back((version, read));
    }

    /// The oldest version read, to measure now, unless one is being
    /// measured (one at a time) or none waits.
    pub fn next_to_measure(&mut self) -> Option<T> {
        if self.measuring.is_some() {
            return None;
        }
        let (version, read) = self.waiting.pop_front()?;
        self.measuring = Some(version);
        Some(read)
    }

    /// The measurement of `version` ended. A failed one is read again when
    /// due, unless it is the run's final version: that failure ends the
    /// evaluator (`Err`).
    pub fn measured(&mut self, version: u64, ok: bool) -> Result<(), u64> {
        if self.measuring == Some(version) {
            self.measuring = None;
        }
        if ok {
            return Ok(());
        }
        if self.final_version == Some(version) {
            return Err(version);
        }
        if self.last_read.is_some_and(|(last, _)| last == version) {
            self.last_read = None;
        }
        Ok(())
    }

    /// Versions read and not yet measured (the one being measured
    /// included).
    pub fn unmeasured(&self) -> usize {
        self.waiting.len() + usize::from(self.measuring.is_some())
    }
}

/// `--watch`: polls the status, reads a version when due (while fewer
/// than the backlog wait), measures what was read in order, and once the
/// run is over the final model, then returns (see [`Watcher`]).
pub(super) async fn watch(
    args: &EvaluateArgs,
    bench: &mut Bench,
    evaluator: &mut Evaluator,
    report: &mut EvaluatorReport,
    interrupt: &CancellationToken,
) -> anyhow::Result<()> {
    let mut watcher: Watcher<Kept> = Watcher::new(
        Schedule {
            every_versions: args.every_versions,
            every: args.every,
        },
        args.backlog,
    );
    let mut measuring: Option<Measuring> = None;
    let mut failures = 0u32;
    loop {
        if interrupt.is_cancelled() {
            info!(unmeasured = watcher.unmeasured(), "stopped by a signal");
            return Ok(());
        }
        if let Some(next) = watcher.next_to_measure() {
            let version = next.header.model_version;
            match next.read(evaluator, args.poll).await {
                Ok(read) => measuring = Some(bench.start(read)?),
                Err(error) => {
                    if watcher.measured(version, false).is_err() {
                        return Err(anyhow::Error::from(error).context("reading the final model"));
                    }
                    warn!(
                        version,
                        error = format!("{error:#}"),
                        "reading a kept version failed; the run's model is read again when due"
                    );
                }
            }
        }
        match evaluator.status.status().await {
            Ok(snapshot) => {
                failures = 0;
                let sync = snapshot.model_sync.as_ref().filter(|sync| sync.has_model);
                let next = watcher.on_status(
                    sync.map(|sync| sync.model_version),
                    sync.map_or(0, |sync| sync.max_pending_evaluations),
                    run_over(&snapshot),
                    Instant::now(),
                );
                match next {
                    Next::Stop => {
                        info!(
                            evaluations = report.points.len(),
                            "the run is over; the evaluator stops"
                        );
                        return Ok(());
                    }
                    Next::Read => match Kept::from(evaluator).await {
                        Ok(kept) => {
                            let version = kept.header.model_version;
                            watcher.read(version, kept, Instant::now());
                            continue;
                        }
                        Err(error) => warn!(
                            error = format!("{error:#}"),
                            "reading the run's model failed; retrying at the next poll"
                        ),
                    },
                    Next::Wait => {}
                }
            }
            Err(error) => {
                failures += 1;
                // A broker restart is survived; a broker gone for good is not.
                if failures >= 30 {
                    bail!("the broker did not answer {failures} status calls in a row: {error}");
                }
                warn!(%error, "broker status failed; retrying");
            }
        }
        // Until the poll, a signal, or the measurement's end.
        let joined = match measuring.as_mut() {
            Some(handle) => tokio::select! {
                () = interrupt.cancelled() => None,
                () = tokio::time::sleep(args.poll) => None,
                joined = handle => Some(joined),
            },
            None => {
                pause(args.poll, interrupt).await;
                None
            }
        };
        if let Some(joined) = joined {
            measuring = None;
            match bench.finish(joined, evaluator, report).await {
                Ok(version) => {
                    let _ = watcher.measured(version, true);
                }
                Err((None, error)) => return Err(error),
                Err((Some(version), error)) => {
                    if watcher.measured(version, false).is_err() {
                        return Err(error.context("the final evaluation"));
                    }
                    warn!(
                        version,
                        error = format!("{error:#}"),
                        "evaluation failed; the version is read again when due"
                    );
                }
            }
        }
    }
}

pub(super) async fn pause(poll: Duration, interrupt: &CancellationToken) {
    tokio::select! {
        () = interrupt.cancelled() => {}
        () = tokio::time::sleep(poll) => {}
    }
}
