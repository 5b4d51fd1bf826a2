//! `dflash top` and `dflash status`: the broker's status snapshot as a table
//! an operator reads at a glance, with idle devices marked. Rendering is a
//! pure function of the snapshot so it is tested without a terminal.

use std::fmt::Write as _;
use std::time::Duration;

use dflash_proto::v1 as proto;

/// A connected device busy less than this fraction of the time is IDLE.
pub const IDLE_BUSY_FRACTION: f64 = 0.05;

#[derive(Debug, Clone, Copy)]
pub struct RenderOptions {
    /// ANSI colours (red reverse video for idle rows).
    pub color: bool,
}

fn human_bytes(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn human_count(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.1}M", value / 1e6)
    } else if value >= 1e4 {
        format!("{:.1}k", value / 1e3)
    } else {
        format!("{value:.0}")
    }
}

fn human_duration(duration: Duration) -> String {
    let seconds = duration.as_secs();
    if seconds >= 3600 {
        format!("{}h{:02}m", seconds / 3600, (seconds % 3600) / 60)
    } else if seconds >= 60 {
        format!("{}m{:02}s", seconds / 60, seconds % 60)
    } else {
        format!("{:.1}s", duration.as_secs_f64())
    }
}

fn state_name(state: proto::BrokerState) -> &'static str {
    match state {
        proto::BrokerState::Running => "RUNNING",
        proto::BrokerState::Draining => "DRAINING",
        proto::BrokerState::Complete => "COMPLETE",
        proto::BrokerState::Aborted => "ABORTED",
        proto::BrokerState::Unspecified => "UNKNOWN",
    }
}

fn target_state_name(state: proto::TargetState) -> &'static str {
    match state {
        proto::TargetState::Connected => "producing",
        proto::TargetState::Disconnected => "disconnected",
        proto::TargetState::Done => "done",
        proto::TargetState::Failed => "FAILED",
        proto::TargetState::Unspecified => "unknown",
    }
}

/// Seconds until every expected item is acked at the recent rate, when the
/// data size is known.
pub fn eta(snapshot: &proto::StatusSnapshot) -> Option<Duration> {
    let expected = snapshot.summary.as_ref()?.expected_items;
    if expected == 0 || snapshot.items_per_second <= 0.0 {
        return None;
    }
    let remaining = expected.saturating_sub(snapshot.acked_items + snapshot.dead_letters);
    Some(Duration::from_secs_f64(
        remaining as f64 / snapshot.items_per_second,
    ))
}

/// Why a connected, idle device is idle, from what the broker knows.
fn idle_reason_drafter(
    snapshot: &proto::StatusSnapshot,
    drafter: &proto::DrafterStatus,
) -> &'static str {
    if snapshot.queued_items == 0 && drafter.leased_items == 0 {
        "starved: queue empty"
    } else if drafter.credit.is_some_and(|credit| credit.items == 0) {
        "no credit"
    } else {
        "holding data, not computing"
    }
}

fn idle_reason_target(snapshot: &proto::StatusSnapshot) -> &'static str {
    let held = snapshot.queued_bytes + snapshot.leased_bytes;
    if snapshot.max_queue_bytes > 0 && held as f64 >= 0.95 * snapshot.max_queue_bytes as f64 {
        "blocked: broker queue full"
    } else {
        "not computing"
    }
}

struct Row {
    role: &'static str,
    id: String,
    device: String,
    state: String,
    busy: Option<f64>,
    tokens_per_second: Option<f64>,
    samples: String,
    leased: String,
    loss: String,
    last_seen: Duration,
    /// Set when the device is connected and idle: why.
    idle: Option<&'static str>,
}

fn rows(snapshot: &proto::StatusSnapshot) -> Vec<Row> {
    let mut rows = Vec::new();
    for target in &snapshot.targets {
        let stats = target.stats.clone().unwrap_or_default();
        let state = target.state();
        let live = state == proto::TargetState::Connected;
        let busy = target.stats.as_ref().map(|stats| stats.busy_fraction);
        let samples = if stats.samples_total > 0 {
            format!(
                "{}/{}",
                stats.samples_done.max(target.accepted_items),
                stats.samples_total
            )
        } else {
            target.accepted_items.to_string()
        };
        rows.push(Row {
            role: "target",
            id: target.target_id.clone(),
            device: stats.device.clone(),
            state: if state == proto::TargetState::Failed {
                format!("FAILED: {}", target.failure_reason)
            } else {
                target_state_name(state).to_string()
            },
            busy,
            tokens_per_second: target.stats.as_ref().map(|stats| stats.tokens_per_second),
            samples,
            leased: "-".to_string(),
            loss: "-".to_string(),
            last_seen: Duration::from_millis(target.last_seen_ms_ago),
            idle: (live && busy.unwrap_or(0.0) < IDLE_BUSY_FRACTION)
                .then(|| idle_reason_target(snapshot)),
        });
    }
    for drafter in &snapshot.drafters {
        let stats = drafter.stats.clone().unwrap_or_default();
        let busy = drafter.stats.as_ref().map(|stats| stats.busy_fraction);
        let running = matches!(
            snapshot.state(),
            proto::BrokerState::Running | proto::BrokerState::Draining
        );
        rows.push(Row {
            role: "drafter",
            id: drafter.drafter_id.clone(),
            device: stats.device.clone(),
            state: if drafter.connected {
                "training".to_string()
            } else {
                "gone".to_string()
            },
            busy,
            tokens_per_second: drafter.stats.as_ref().map(|stats| stats.tokens_per_second),
            samples: format!("{}", stats.samples_trained.max(drafter.acked_items)),
            leased: drafter.leased_items.to_string(),
            loss: drafter
                .stats
                .as_ref()
                .map_or("-".to_string(), |stats| format!("{:.3}", stats.loss)),
            last_seen: Duration::from_millis(drafter.last_seen_ms_ago),
            idle: (drafter.connected && running && busy.unwrap_or(0.0) < IDLE_BUSY_FRACTION)
                .then(|| idle_reason_drafter(snapshot, drafter)),
        });
    }
    rows
}

/// The whole screen: a header line, then one row per target and drafter.
pub fn render(snapshot: &proto::StatusSnapshot, broker: &str, options: RenderOptions) -> String {
    let mut out = String::new();
    let held = snapshot.queued_bytes + snapshot.leased_bytes;
    let _ = writeln!(
        out,
        "dflash top  {broker}  state {}  targets done {}/{}  queued {} items ({} held of {})  leased {}  dead letters {}",
        state_name(snapshot.state()),
        snapshot.done_targets,
        snapshot.expected_targets,
        snapshot.queued_items,
        human_bytes(held as f64),
        human_bytes(snapshot.max_queue_bytes as f64),
        snapshot.leased_items,
        snapshot.dead_letters,
    );
    let eta_text = eta(snapshot).map_or("ETA -".to_string(), |eta| {
        format!("ETA {}", human_duration(eta))
    });
    let expected = snapshot
        .summary
        .as_ref()
        .map_or(0, |summary| summary.expected_items);
    let _ = writeln!(
        out,
        "trained {}/{} samples  throughput {:.1} items/s {}/s  accepted {} ({})  redelivered {}  rejected {}  {eta_text}  up {}",
        snapshot.acked_items,
        if expected > 0 { expected.to_string() } else { "?".to_string() },
        snapshot.items_per_second,
        human_bytes(snapshot.bytes_per_second),
        snapshot.accepted_items,
        human_bytes(snapshot.accepted_bytes as f64),
        snapshot.redelivered_items,
        snapshot.rejected_items,
        human_duration(Duration::from_millis(snapshot.uptime_ms)),
    );
    if !snapshot.abort_reason.is_empty() {
        let _ = writeln!(out, "ABORTED: {}", snapshot.abort_reason);
    }
    let _ = writeln!(
        out,
        "{:<8} {:<14} {:<8} {:<13} {:>9} {:>8} {:>11} {:>6} {:>7} {:>9}",
        "ROLE", "ID", "DEVICE", "STATE", "BUSY", "TOK/S", "SAMPLES", "LEASED", "LOSS", "LAST SEEN"
    );
    for row in rows(snapshot) {
        let _ = writeln!(out, "{}", row_line(row, options));
    }
    out.push_str(&guard_lines(snapshot));
    out.push_str(&model_sync_lines(snapshot));
    out.push_str(&lighthouse_line(snapshot.lighthouse.as_ref()));
    out.push_str(&trace_export_line(snapshot));
    for dead in snapshot.dead_letter_items.iter().take(5) {
        let _ = writeln!(
            out,
            "dead letter: {} seq {} after {} deliveries: {}",
            dead.target_id, dead.seq, dead.deliveries, dead.reason
        );
    }
    out
}

/// One target's or drafter's line; an idle one is flagged (in red with
/// `options.color`).
fn row_line(row: Row, options: RenderOptions) -> String {
    let busy = row
        .busy
        .map_or("-".to_string(), |busy| format!("{:.0}%", busy * 100.0));
    let busy = if row.idle.is_some() {
        format!("IDLE {busy}")
    } else {
        busy
    };
    let mut line = format!(
        "{:<8} {:<14} {:<8} {:<13} {:>9} {:>8} {:>11} {:>6} {:>7} {:>9}",
        row.role,
        row.id,
        if row.device.is_empty() {
            "-"
        } else {
            &row.device
        },
        row.state,
        busy,
        row.tokens_per_second.map_or("-".to_string(), human_count),
        row.samples,
        row.leased,
        row.loss,
        human_duration(row.last_seen),
    );
    if let Some(reason) = row.idle {
        line = format!("{line}  <-- IDLE ({reason})");
        if options.color {
            line = format!("\x1b[1;41;97m{line}\x1b[0m");
        }
    }
    line
}

/// What the finite guards refused, per drafter (nothing when nothing was):
/// steps skipped and non-finite samples dead-lettered.
pub fn guard_lines(snapshot: &proto::StatusSnapshot) -> String {
    let mut out = String::new();
    for drafter in &snapshot.drafters {
        let Some(stats) = &drafter.stats else {
            continue;
        };
        if stats.skipped_steps == 0 && stats.non_finite_samples == 0 {
            continue;
        }
        let _ = writeln!(
            out,
            "GUARD  {}: {} optimizer steps skipped (loss or gradient not finite, or a spike), {} non-finite samples dead-lettered",
            drafter.drafter_id, stats.skipped_steps, stats.non_finite_samples
        );
    }
    out
}

/// Every process's span export as the broker's status last heard of it:
/// the broker's own, and each target's and drafter's last stats.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TraceExportTotals {
    pub exported_spans: u64,
    pub dropped_spans: u64,
    pub failed_spans: u64,
    /// Processes that report an exporter.
    pub processes: usize,
    /// The processes that dropped or failed spans, or whose last export failed.
    pub losing: Vec<String>,
}

/// The sum of [`TraceExportTotals`] over `snapshot`; `None` when no
/// process exports spans.
pub fn trace_export_totals(snapshot: &proto::StatusSnapshot) -> Option<TraceExportTotals> {
    let targets = snapshot.targets.iter().map(|target| {
        let stats = target.stats.as_ref().and_then(|s| s.trace_export.as_ref());
        (target.target_id.as_str(), stats)
    });
    let drafters = snapshot.drafters.iter().map(|drafter| {
        let stats = drafter.stats.as_ref().and_then(|s| s.trace_export.as_ref());
        (drafter.drafter_id.as_str(), stats)
    });
    let mut totals = TraceExportTotals::default();
    let processes = std::iter::once(("broker", snapshot.trace_export.as_ref()))
        .chain(targets)
        .chain(drafters);
    for (name, stats) in processes {
        let Some(stats) = stats else {
            continue;
        };
        totals.processes += 1;
        totals.exported_spans += stats.exported_spans;
        totals.dropped_spans += stats.dropped_spans;
        totals.failed_spans += stats.failed_spans;
        if stats.failing || stats.dropped_spans > 0 || stats.failed_spans > 0 {
            totals.losing.push(name.to_string());
        }
    }
    (totals.processes > 0).then_some(totals)
}

/// The `traces` line: [`trace_export_totals`], with the processes losing
/// spans named (nothing when no process exports spans).
pub fn trace_export_line(snapshot: &proto::StatusSnapshot) -> String {
    let Some(totals) = trace_export_totals(snapshot) else {
        return String::new();
    };
    let trouble = if totals.losing.is_empty() {
        String::new()
    } else {
        format!("  LOSING SPANS: {}", totals.losing.join(", "))
    };
    format!(
        "traces {} spans exported  {} dropped  {} failed  ({} processes){trouble}\n",
        totals.exported_spans, totals.dropped_spans, totals.failed_spans, totals.processes,
    )
}

/// The run's draft model: its step (the model's version), where it is
/// written, τ, and each drafter's last snapshot (nothing before the first
/// snapshot).
pub fn model_sync_lines(snapshot: &proto::StatusSnapshot) -> String {
    let mut out = String::new();
    let Some(sync) = snapshot.model_sync.as_ref().filter(|sync| sync.has_model) else {
        return out;
    };
    let saved = if sync.saved_path.is_empty() {
        "not written".to_string()
    } else {
        format!(
            "written v{}{} to {}",
            sync.saved_version,
            if sync.final_saved { " (final)" } else { "" },
            sync.saved_path
        )
    };
    let _ = writeln!(
        out,
        "model  v{}  {} parameters ({} held)  {} samples  {saved}",
        sync.model_version,
        human_count(sync.parameters as f64),
        human_bytes(sync.model_bytes as f64),
        sync.model_samples,
    );
    out.push_str(&tau_line(sync));
    for drafter in &sync.drafters {
        let state = if drafter.finished {
            "finished"
        } else if drafter.connected {
            "connected"
        } else {
            "gone"
        };
        let _ = writeln!(
            out,
            "  snapshot {:<14} {:<9} last {:>7} ago",
            drafter.drafter_id,
            state,
            human_duration(Duration::from_millis(drafter.last_sync_ms_ago)),
        );
    }
    out
}

/// Data-parallel drafters: the last quorum and the lighthouse's counters
/// (nothing before the first quorum).
pub fn lighthouse_line(lighthouse: Option<&proto::LighthouseStatus>) -> String {
    let Some(parallel) = lighthouse.filter(|parallel| parallel.quorum_id > 0) else {
        return String::new();
    };
    let mut problems = if parallel.steps_failed
        + parallel.checksum_mismatches
        + parallel.members_dropped
        + parallel.splits
        + parallel.unknown_decisions
        > 0
    {
        format!(
            "  failed {}  dropped {}  checksum mismatches {}  splits {}  unknown {}",
            parallel.steps_failed,
            parallel.members_dropped,
            parallel.checksum_mismatches,
            parallel.splits,
            parallel.unknown_decisions
        )
    } else {
        String::new()
    };
    if parallel.rollbacks > 0 {
        problems.push_str(&format!(
            "  ROLLED BACK {} steps ({} rollbacks)",
            parallel.steps_rolled_back, parallel.rollbacks
        ));
    }
    if parallel.waiting_for_holder {
        problems.push_str(&format!(
            "  WAITING for a drafter holding step {}",
            parallel.committed_step
        ));
    }
    format!(
        "dp     H {} quorum {} step {}  {} members ({})  {} steps committed  {} heals{problems}\n",
        parallel.committed_step,
        parallel.quorum_id,
        parallel.step,
        parallel.members.len(),
        parallel.members.join(", "),
        parallel.steps_committed,
        parallel.heals,
    )
}

/// Points of the τ trend shown by `top`.
const TAU_TREND_POINTS: usize = 24;

/// Online evaluation: the latest τ, a sparkline of the last points and the
/// best (nothing before the first report).
pub fn tau_line(sync: &proto::ModelSyncStatus) -> String {
    let Some(latest) = sync.tau_history.last() else {
        return String::new();
    };
    let shown = &sync.tau_history[sync.tau_history.len().saturating_sub(TAU_TREND_POINTS)..];
    let taus: Vec<f64> = shown.iter().map(|point| point.tau).collect();
    let best = sync.best_tau.as_ref().map_or(String::new(), |best| {
        let place = if sync.best_path.is_empty() {
            String::new()
        } else {
            format!(" in {}", sync.best_path)
        };
        format!("  best {:.2} (v{}){place}", best.tau, best.model_version)
    });
    format!(
        "tau    v{} {:.2}  trend {} ({} points, {:.2}..{:.2}){best}\n",
        latest.model_version,
        latest.tau,
        sparkline(&taus),
        sync.tau_history.len(),
        taus.iter().copied().fold(f64::INFINITY, f64::min),
        taus.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    )
}

/// One block character per value, scaled between the values' least and
/// greatest (all the lowest block when they are equal).
pub fn sparkline(values: &[f64]) -> String {
    const BLOCKS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    values
        .iter()
        .map(|&value| {
            let level = if high > low {
                ((value - low) / (high - low) * 7.0).round() as usize
            } else {
                0
            };
            BLOCKS[level.min(7)]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipped_steps_and_non_finite_samples_are_shown() {
        let mut snapshot = snapshot();
        let plain = render(&snapshot, "b", RenderOptions { color: false });
        assert!(!plain.contains("GUARD"), "{plain}");
        if let Some(stats) = snapshot.drafters[0].stats.as_mut() {
            stats.skipped_steps = 3;
            stats.non_finite_samples = 1;
        }
        let text = render(&snapshot, "b", RenderOptions { color: false });
        assert!(
            text.contains("GUARD  drafter-0: 3 optimizer steps skipped")
                && text.contains("1 non-finite samples dead-lettered"),
            "{text}"
        );
    }

    #[test]
    fn the_latest_tau_its_trend_and_the_best_are_shown() {
        let point = |version: u64, tau: f64| proto::TauPoint {
            model_version: version,
            tau,
            ..Default::default()
        };
        let mut sync = proto::ModelSyncStatus {
            has_model: true,
            ..Default::default()
        };
        assert_eq!(tau_line(&sync), "", "nothing before the first report");
        sync.tau_history = vec![
            point(0, 1.0),
            point(10, 1.5),
            point(20, 2.0),
            point(30, 1.75),
        ];
        sync.best_tau = Some(point(20, 2.0));
        sync.best_path = "/runs/model-best".to_string();
        let line = tau_line(&sync);
        assert!(
            line.starts_with("tau    v30 1.75  trend ▁▅█▆ (4 points, 1.00..2.00)"),
            "{line}"
        );
        assert!(
            line.contains("best 2.00 (v20) in /runs/model-best"),
            "{line}"
        );
        assert_eq!(sparkline(&[3.0, 3.0]), "▁▁");
    }

    #[test]
    fn the_runs_model_and_each_drafters_last_snapshot_are_shown() {
        let mut snapshot = snapshot();
        assert!(!render(&snapshot, "b", RenderOptions { color: false }).contains("model  v"));
        snapshot.model_sync = Some(proto::ModelSyncStatus {
            has_model: true,
            model_version: 42,
            parameters: 1_500_000,
            model_samples: 640,
            drafters: vec![proto::DrafterSyncStatus {
                drafter_id: "drafter-1".into(),
                connected: true,
                last_sync_ms_ago: 2_000,
                ..Default::default()
            }],
            ..Default::default()
        });
        let text = render(&snapshot, "b", RenderOptions { color: false });
        assert!(text.contains("model  v42"), "{text}");
        assert!(text.contains("640 samples"), "{text}");
        let line = text
            .lines()
            .find(|line| line.contains("snapshot drafter-1"))
            .unwrap();
        assert!(
            line.contains("connected") && line.contains("2.0s ago"),
            "{line}"
        );
    }

    #[test]
    fn the_data_parallel_quorum_and_its_failures_are_shown() {
        let mut lighthouse = proto::LighthouseStatus::default();
        assert_eq!(lighthouse_line(None), "", "nothing without a lighthouse");
        assert_eq!(
            lighthouse_line(Some(&lighthouse)),
            "",
            "nothing before a quorum"
        );
        lighthouse = proto::LighthouseStatus {
            quorum_id: 3,
            step: 120,
            members: vec!["drafter-0".into(), "drafter-1".into()],
            steps_committed: 118,
            heals: 1,
            committed_step: 120,
            ..Default::default()
        };
        assert_eq!(
            lighthouse_line(Some(&lighthouse)),
            "dp     H 120 quorum 3 step 120  2 members (drafter-0, drafter-1)  118 steps committed  1 heals\n"
        );
        lighthouse.steps_failed = 2;
        lighthouse.members_dropped = 1;
        lighthouse.splits = 1;
        let line = lighthouse_line(Some(&lighthouse));
        assert!(
            line.contains("failed 2  dropped 1  checksum mismatches 0  splits 1  unknown 0"),
            "{line}"
        );
        lighthouse.rollbacks = 1;
        lighthouse.steps_rolled_back = 7;
        lighthouse.waiting_for_holder = true;
        let line = lighthouse_line(Some(&lighthouse));
        assert!(line.contains("ROLLED BACK 7 steps (1 rollbacks)"), "{line}");
        assert!(
            line.contains("WAITING for a drafter holding step 120"),
            "{line}"
        );
    }

    #[test]
    fn span_export_is_summed_and_the_processes_losing_spans_named() {
        let mut status = snapshot();
        assert_eq!(
            trace_export_line(&status),
            "",
            "nothing when no process exports"
        );
        status.trace_export = Some(proto::TraceExportStats {
            exported_spans: 100,
            ..Default::default()
        });
        if let Some(stats) = status.targets[0].stats.as_mut() {
            stats.trace_export = Some(proto::TraceExportStats {
                exported_spans: 20,
                dropped_spans: 3,
                ..Default::default()
            });
        }
        assert_eq!(
            trace_export_line(&status),
            "traces 120 spans exported  3 dropped  0 failed  (2 processes)  LOSING SPANS: target-0\n"
        );
        assert!(
            render(&status, "b", RenderOptions { color: false }).contains("LOSING SPANS: target-0")
        );
    }

    fn snapshot() -> proto::StatusSnapshot {
        proto::StatusSnapshot {
            state: proto::BrokerState::Running as i32,
            expected_targets: 5,
            done_targets: 1,
            queued_items: 0,
            max_queue_bytes: 2 << 30,
            items_per_second: 10.0,
            summary: Some(proto::RunSummary {
                expected_items: 1000,
                ..Default::default()
            }),
            acked_items: 400,
            targets: vec![proto::TargetStatus {
                target_id: "target-0".into(),
                state: proto::TargetState::Connected as i32,
                stats: Some(proto::ProducerStats {
                    busy_fraction: 0.97,
                    device: "cuda:0".into(),
                    tokens_per_second: 27_000.0,
                    samples_done: 10,
                    samples_total: 200,
                    ..Default::default()
                }),
                ..Default::default()
            }],
            drafters: vec![
                proto::DrafterStatus {
                    drafter_id: "drafter-0".into(),
                    connected: true,
                    stats: Some(proto::ConsumerStats {
                        busy_fraction: 0.9,
                        device: "cuda:1".into(),
                        loss: 2.5,
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                proto::DrafterStatus {
                    drafter_id: "drafter-2".into(),
                    connected: true,
                    stats: Some(proto::ConsumerStats {
                        busy_fraction: 0.0,
                        device: "cuda:3".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn idle_drafter_is_marked_with_its_reason() {
        let screen = render(
            &snapshot(),
            "http://broker:50051",
            RenderOptions { color: false },
        );
        let idle_line = screen
            .lines()
            .find(|line| line.contains("drafter-2"))
            .unwrap();
        assert!(idle_line.contains("IDLE 0%"), "{idle_line}");
        assert!(
            idle_line.contains("<-- IDLE (starved: queue empty)"),
            "{idle_line}"
        );
        let busy_line = screen
            .lines()
            .find(|line| line.contains("drafter-0"))
            .unwrap();
        assert!(!busy_line.contains("IDLE"), "{busy_line}");
        let target_line = screen
            .lines()
            .find(|line| line.contains("target-0"))
            .unwrap();
        assert!(
            target_line.contains("97%")
                && target_line.contains("27.0k")
                && target_line.contains("10/200"),
            "{target_line}"
        );
    }

    #[test]
    fn colour_highlights_only_idle_rows() {
        let screen = render(&snapshot(), "b", RenderOptions { color: true });
        let idle_line = screen
            .lines()
            .find(|line| line.contains("drafter-2"))
            .unwrap();
        assert!(idle_line.starts_with("\x1b[1;41;97m"));
        let busy_line = screen
            .lines()
            .find(|line| line.contains("drafter-0"))
            .unwrap();
        assert!(!busy_line.contains('\x1b'));
    }

    #[test]
    fn header_shows_progress_and_eta() {
        let screen = render(&snapshot(), "b", RenderOptions { color: false });
        let header: Vec<&str> = screen.lines().take(2).collect();
        assert!(
            header[0].contains("state RUNNING") && header[0].contains("targets done 1/5"),
            "{}",
            header[0]
        );
        // 600 items left at 10 items/s.
        assert!(
            header[1].contains("ETA 1m00s") && header[1].contains("trained 400/1000"),
            "{}",
            header[1]
        );
    }

    #[test]
    fn finished_run_marks_nobody_idle() {
        let mut finished = snapshot();
        finished.state = proto::BrokerState::Complete as i32;
        finished.targets[0].state = proto::TargetState::Done as i32;
        let screen = render(&finished, "b", RenderOptions { color: false });
        assert!(!screen.contains("<-- IDLE"), "{screen}");
    }
}
