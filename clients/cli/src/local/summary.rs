//! The end-of-run report: [`LocalSummary`] (written as `summary.json`) with
//! one [`ProcessSummary`] per child, built from the broker's final status
//! and each process's own report; the list of failures that makes a run
//! not OK; and the table printed at the end.

use std::path::{Path, PathBuf};

use dflash_proto::v1 as proto;
use serde::Serialize;

use super::inputs::Inputs;
use super::quality::{model_is_finite, Taus};
use super::supervise::{Managed, Role, StopReason};

#[derive(Debug, Clone, Serialize)]
pub struct ProcessSummary {
    pub name: String,
    pub role: Role,
    pub device: String,
    pub exit_code: Option<i32>,
    /// Over the whole run, from the process's own final report (the last
    /// stats window's when it wrote none).
    pub busy_fraction: Option<f64>,
    /// The broker's last stats window of this process (the drain, often).
    pub last_window_busy_fraction: Option<f64>,
    pub tokens_per_second: Option<f64>,
    pub samples: u64,
    pub loss: Option<f64>,
    pub checkpoint: Option<PathBuf>,
    pub log: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct LocalSummary {
    pub end_of_stream: String,
    pub abort_reason: String,
    /// Whole wall time of `dflash local`.
    pub seconds: f64,
    /// Writing the tiny model and generating the demo data with the target
    /// (before the pipeline starts).
    pub generation_seconds: f64,
    /// From the broker's start until every target and drafter exited: the
    /// time the throughput figures are computed over.
    pub pipeline_seconds: f64,
    /// After the pipeline, the online evaluator measuring the run's model
    /// versions it read during the run and had not measured yet.
    pub evaluator_tail_seconds: f64,
    /// The τ measurements after the pipeline.
    pub eval_seconds: f64,
    pub accepted_samples: u64,
    pub trained_samples: u64,
    pub dead_letters: u64,
    pub expected_samples: Option<u64>,
    pub tokens: u64,
    pub samples_per_second: f64,
    pub tokens_per_second: f64,
    pub final_loss: Option<f64>,
    pub processes: Vec<ProcessSummary>,
    pub acceptance_length: Option<f64>,
    /// τ of a freshly initialised drafter of the same configuration: the
    /// baseline that shows what training bought.
    pub untrained_acceptance_length: Option<f64>,
    pub acceptance_length_drafter: Option<String>,
    /// τ of the run's shared model (the broker's checkpoint of it), when
    /// the drafters synced.
    pub model_acceptance_length: Option<f64>,
    pub held_out_prompts: usize,
    /// τ of the run's model while the run trained (the online evaluator's
    /// reports, as the broker kept them), oldest first. Each point says
    /// when its version was read as well as when it was measured: the
    /// evaluator measures later what it read while the CPUs were busy.
    pub tau_curve: Vec<proto::TauPoint>,
    /// The run's model version with the best τ, written to `model-best/`.
    pub best_model: Option<BestModel>,
    /// Generated tokens per target forward of the trained drafter's
    /// speculative decoding (prefills included).
    pub tokens_per_target_forward: Option<f64>,
    /// The drafters' mask token id and where it came from.
    pub mask_token_id: Option<i64>,
    pub mask_token_source: Option<String>,
    /// Every process's span export as the broker last heard of it (each
    /// target's and drafter's last stats; spans flushed at exit come after
    /// them); `None` when no process exported spans.
    pub trace_export: Option<dflash_ops::top::TraceExportTotals>,
    pub workdir: PathBuf,
    pub ok: bool,
    /// Why the run is not a success (empty when `ok`).
    pub failures: Vec<String>,
}

/// The best model the broker kept.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BestModel {
    pub model_version: u64,
    pub model_samples: u64,
    pub tau: f64,
    /// Empty when the broker wrote no checkpoint.
    pub path: String,
}

/// The τ curve and the best model from the broker's final status.
fn tau_curve(snapshot: &proto::StatusSnapshot) -> (Vec<proto::TauPoint>, Option<BestModel>) {
    let Some(sync) = snapshot.model_sync.as_ref() else {
        return (Vec::new(), None);
    };
    let curve = sync.tau_history.clone();
    let best = sync.best_tau.as_ref().map(|best| BestModel {
        model_version: best.model_version,
        model_samples: best.model_samples,
        tau: best.tau,
        path: sync.best_path.clone(),
    });
    (curve, best)
}

/// Where the wall time went.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timings {
    pub(super) seconds: f64,
    pub(super) generation_seconds: f64,
    pub(super) pipeline_seconds: f64,
    pub(super) evaluator_tail_seconds: f64,
    pub(super) eval_seconds: f64,
}

pub(super) fn summarize(
    snapshot: &proto::StatusSnapshot,
    processes: Vec<ProcessSummary>,
    taus: Taus,
    timings: Timings,
    inputs: &Inputs,
    workdir: &Path,
    stop: StopReason,
) -> LocalSummary {
    let tokens: u64 = snapshot
        .targets
        .iter()
        .filter_map(|target| target.stats.as_ref())
        .map(|stats| stats.tokens_done)
        .sum();
    // The mean of the drafters' last reported losses.
    let losses: Vec<f64> = processes
        .iter()
        .filter(|process| process.role == Role::Drafter)
        .filter_map(|process| process.loss)
        .collect();
    let final_loss = (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64);
    let end_of_stream = match snapshot.state() {
        proto::BrokerState::Complete => "COMPLETE",
        proto::BrokerState::Aborted => "ABORTED",
        proto::BrokerState::Draining => "DRAINING (not finished)",
        _ => "RUNNING (not finished)",
    };
    let trained = snapshot.acked_items;
    let failures = failures(
        snapshot,
        &processes,
        final_loss,
        &stop,
        &workdir.join("run-model"),
    );
    let ok = failures.is_empty();
    let pipeline_seconds = timings.pipeline_seconds;
    let (tau_curve, best_model) = tau_curve(snapshot);
    LocalSummary {
        end_of_stream: end_of_stream.to_string(),
        abort_reason: snapshot.abort_reason.clone(),
        seconds: timings.seconds,
        generation_seconds: timings.generation_seconds,
        pipeline_seconds,
        evaluator_tail_seconds: timings.evaluator_tail_seconds,
        eval_seconds: timings.eval_seconds,
        accepted_samples: snapshot.accepted_items,
        trained_samples: trained,
        dead_letters: snapshot.dead_letters,
        expected_samples: snapshot
            .summary
            .as_ref()
            .map(|summary| summary.expected_items)
            .filter(|&items| items > 0),
        tokens,
        samples_per_second: trained as f64 / pipeline_seconds.max(1e-9),
        tokens_per_second: tokens as f64 / pipeline_seconds.max(1e-9),
        final_loss,
        processes,
        acceptance_length: taus.acceptance_length,
        untrained_acceptance_length: taus.untrained_acceptance_length,
        acceptance_length_drafter: taus.acceptance_length_drafter,
        model_acceptance_length: taus.model_acceptance_length,
        held_out_prompts: taus.held_out_prompts,
        tau_curve,
        best_model,
        tokens_per_target_forward: taus.tokens_per_target_forward,
        mask_token_id: inputs.mask_token.as_ref().map(|(id, _)| *id),
        mask_token_source: inputs.mask_token.as_ref().map(|(_, source)| source.clone()),
        trace_export: dflash_ops::top::trace_export_totals(snapshot),
        workdir: workdir.to_path_buf(),
        ok,
        failures,
    }
}

/// Everything that makes the run not a success, each in words: a run that
/// lost data, whose drafters failed, or whose one model is not finite never
/// reports OK.
fn failures(
    snapshot: &proto::StatusSnapshot,
    processes: &[ProcessSummary],
    final_loss: Option<f64>,
    stop: &StopReason,
    model: &Path,
) -> Vec<String> {
    let mut failures = Vec::new();
    if stop.interrupted {
        failures.push("interrupted by a signal".to_string());
    }
    if stop.timed_out {
        failures.push("gave up at --timeout".to_string());
    }
    if stop.drafters_gone {
        failures.push(
            "every drafter exited and one failed before the run completed: nothing was left to \
             train, so the rest were stopped"
                .to_string(),
        );
    }
    if stop.final_status_stale {
        failures.push(
            "the broker did not answer the final status: the figures are its last status seen"
                .to_string(),
        );
    }
    if snapshot.state() != proto::BrokerState::Complete {
        failures.push(format!(
            "the run did not end COMPLETE ({:?}{})",
            snapshot.state(),
            if snapshot.abort_reason.is_empty() {
                String::new()
            } else {
                format!(": {}", snapshot.abort_reason)
            }
        ));
    }
    for process in processes {
        if process.exit_code != Some(0) {
            failures.push(format!(
                "{} exited {} (log: {})",
                process.name,
                process
                    .exit_code
                    .map_or("by a signal".to_string(), |code| code.to_string()),
                process.log.display()
            ));
        }
    }
    if snapshot.dead_letters > 0 {
        failures.push(format!(
            "{} samples were dead-lettered (never trained on)",
            snapshot.dead_letters
        ));
    }
    if final_loss.is_some_and(|loss| !loss.is_finite()) {
        failures.push("the drafters' final loss is not finite".to_string());
    }
    match model_is_finite(model) {
        Ok(None | Some(true)) => {}
        Ok(Some(false)) => failures.push(format!(
            "the run's model at {} is not finite",
            model.display()
        )),
        Err(error) => failures.push(format!(
            "the run's model at {} cannot be read: {error}",
            model.display()
        )),
    }
    failures
}

pub(super) fn process_summary(child: &Managed, snapshot: &proto::StatusSnapshot) -> ProcessSummary {
    let mut summary = ProcessSummary {
        name: child.name.clone(),
        role: child.role,
        device: child.device.clone(),
        exit_code: child.exit_code,
        busy_fraction: None,
        last_window_busy_fraction: None,
        tokens_per_second: None,
        samples: 0,
        loss: None,
        checkpoint: None,
        log: child.log.clone(),
    };
    if child.role == Role::Target {
        if let Some(target) = snapshot
            .targets
            .iter()
            .find(|target| target.target_id == child.name)
        {
            summary.samples = target.accepted_items;
            if let Some(stats) = &target.stats {
                summary.busy_fraction = Some(stats.busy_fraction);
                summary.tokens_per_second = Some(stats.tokens_per_second);
            }
        }
    } else if let Some(drafter) = snapshot
        .drafters
        .iter()
        .find(|drafter| drafter.drafter_id == child.name)
    {
        summary.samples = drafter.acked_items;
        if let Some(stats) = &drafter.stats {
            summary.busy_fraction = Some(stats.busy_fraction);
            summary.tokens_per_second = Some(stats.tokens_per_second);
            summary.loss = Some(stats.loss);
        }
    }
    if let Some(output) = &child.output {
        summary.checkpoint = dflash_model::draft::step_dirs::latest_checkpoint(output)
            .ok()
            .flatten();
    }
    summary.last_window_busy_fraction = summary.busy_fraction;
    if let Some(report) = child.report.as_deref().and_then(read_process_report) {
        apply_process_report(&mut summary, &report);
    }
    summary
}

/// A target's or drafter's `--report-file`, if it wrote one.
fn read_process_report(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// The whole run's figures from the process's own report, over the
/// broker's last stats window (which is often the drain, when a busy
/// drafter waits for the last items).
fn apply_process_report(summary: &mut ProcessSummary, report: &serde_json::Value) {
    if let Some(busy) = report["busy_fraction"].as_f64() {
        summary.busy_fraction = Some(busy);
    }
    if let Some(rate) = report["tokens_per_second"].as_f64() {
        summary.tokens_per_second = Some(rate);
    }
    if let Some(loss) = report["loss"].as_f64() {
        summary.loss = Some(loss);
    }
}

fn percent(value: Option<f64>) -> String {
    value.map_or("-".to_string(), |value| format!("{:.0}%", value * 100.0))
}

pub(super) fn print_summary(summary: &LocalSummary, interrupted: bool, timed_out: bool) {
    println!();
    println!("dflash local summary ({})", summary.workdir.display());
    if interrupted {
        println!("  interrupted (SIGINT/SIGTERM): children were stopped with SIGTERM");
    }
    if timed_out {
        println!("  timed out: children were stopped with SIGTERM");
    }
    println!(
        "  end-of-stream: {}{}",
        summary.end_of_stream,
        if summary.abort_reason.is_empty() {
            String::new()
        } else {
            format!(" ({})", summary.abort_reason)
        }
    );
    println!(
        "  samples: {} accepted, {} trained, {} dead letters{}; tokens: {}",
        summary.accepted_samples,
        summary.trained_samples,
        summary.dead_letters,
        summary
            .expected_samples
            .map_or(String::new(), |expected| format!(
                " (of {expected} expected)"
            )),
        summary.tokens
    );
    println!(
        "  wall time {:.1}s: data generation {:.1}s, pipeline {:.1}s, online evaluator after it {:.1}s, evaluation {:.1}s",
        summary.seconds,
        summary.generation_seconds,
        summary.pipeline_seconds,
        summary.evaluator_tail_seconds,
        summary.eval_seconds
    );
    println!(
        "  pipeline throughput {:.2} samples/s, {:.0} tokens/s (over the pipeline's {:.1}s only)",
        summary.samples_per_second, summary.tokens_per_second, summary.pipeline_seconds
    );
    for process in &summary.processes {
        println!(
            "  {:<10} {:<7} device {:<7} busy {:>4} (last window {:>4})  tok/s {:>8}  samples {:>5}  loss {:>7}  exit {}{}",
            process.name,
            process.role.name(),
            process.device,
            percent(process.busy_fraction),
            percent(process.last_window_busy_fraction),
            process.tokens_per_second.map_or("-".to_string(), |value| format!("{value:.0}")),
            process.samples,
            process.loss.map_or("-".to_string(), |loss| format!("{loss:.3}")),
            process.exit_code.map_or("?".to_string(), |code| code.to_string()),
            process.checkpoint.as_ref().map_or(String::new(), |path| format!("  checkpoint {}", path.display())),
        );
    }
    if let Some(loss) = summary.final_loss {
        println!("  final loss (mean over drafters): {loss:.4}");
    }
    if let Some(traces) = &summary.trace_export {
        println!(
            "  traces (as last reported): {} spans exported, {} dropped, {} failed by {} processes{}",
            traces.exported_spans,
            traces.dropped_spans,
            traces.failed_spans,
            traces.processes,
            if traces.losing.is_empty() {
                String::new()
            } else {
                format!("; losing spans: {}", traces.losing.join(", "))
            }
        );
    }
    match (summary.acceptance_length, &summary.acceptance_length_drafter) {
        (Some(tau), Some(drafter)) => println!(
            "  τ (mean acceptance length) on {} held-out prompts: {tau:.2} trained, {} untrained  [{drafter}]",
            summary.held_out_prompts,
            summary
                .untrained_acceptance_length
                .map_or("-".to_string(), |baseline| format!("{baseline:.2}")),
        ),
        _ => println!("  τ: not measured (no checkpoint or no held-out prompts)"),
    }
    if let Some(tokens) = summary.tokens_per_target_forward {
        println!("  accepted tokens per target forward (trained, prefills included): {tokens:.2}");
    }
    if let Some(tau) = summary.model_acceptance_length {
        println!("  τ of the shared model (the run's model, one model for all drafters): {tau:.2}");
    }
    print_tau_curve(summary);
    println!("  logs: {}", summary.workdir.join("logs").display());
    println!("  result: {}", if summary.ok { "OK" } else { "FAILED" });
    for failure in &summary.failures {
        println!("    because {failure}");
    }
}

/// The online evaluator's τ curve (version: τ, oldest first) and the best
/// model.
fn print_tau_curve(summary: &LocalSummary) {
    let Some(first) = summary.tau_curve.first() else {
        return;
    };
    let points: Vec<String> = summary
        .tau_curve
        .iter()
        .map(|point| format!("v{} {:.2}", point.model_version, point.tau))
        .collect();
    println!(
        "  τ while training (online evaluator, {} prompts each, {} points): {}",
        first.prompts,
        summary.tau_curve.len(),
        points.join(" → ")
    );
    if let Some(best) = &summary.best_model {
        println!(
            "  best model: v{} ({} samples) τ {:.2}{}",
            best.model_version,
            best.model_samples,
            best.tau,
            if best.path.is_empty() {
                String::new()
            } else {
                format!(", written to {}", best.path)
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafter(exit_code: Option<i32>) -> ProcessSummary {
        ProcessSummary {
            name: "drafter-0".to_string(),
            role: Role::Drafter,
            device: "cpu".to_string(),
            exit_code,
            busy_fraction: None,
            last_window_busy_fraction: None,
            tokens_per_second: None,
            samples: 0,
            loss: Some(1.0),
            checkpoint: None,
            log: PathBuf::from("logs/drafter-0.log"),
        }
    }

    fn complete() -> proto::StatusSnapshot {
        proto::StatusSnapshot {
            state: proto::BrokerState::Complete as i32,
            ..Default::default()
        }
    }

    const CLEAN: StopReason = StopReason {
        interrupted: false,
        timed_out: false,
        training_ended: None,
        drafters_gone: false,
        final_status_stale: false,
    };

    /// #23: the summary's busy fraction is the run's, from the process's own
    /// report, not the broker's last window (the drain); the window is kept
    /// apart.
    #[test]
    fn a_drafter_busy_for_the_whole_run_is_reported_so() {
        let mut summary = drafter(Some(0));
        summary.busy_fraction = Some(0.05);
        summary.last_window_busy_fraction = Some(0.05);
        apply_process_report(
            &mut summary,
            &serde_json::json!({"busy_fraction": 0.95, "tokens_per_second": 812.0, "loss": 2.5}),
        );
        assert_eq!(summary.busy_fraction, Some(0.95));
        assert_eq!(summary.last_window_busy_fraction, Some(0.05));
        assert_eq!(summary.tokens_per_second, Some(812.0));
        assert_eq!(summary.loss, Some(2.5));
    }

    /// #23: the summary's τ curve and best model are the broker's.
    #[test]
    fn the_tau_curve_and_the_best_model_come_from_the_broker() {
        let mut snapshot = complete();
        assert_eq!(tau_curve(&snapshot), (Vec::new(), None));
        let point = |version: u64, tau: f64| proto::TauPoint {
            model_version: version,
            model_samples: version * 16,
            tau,
            prompts: 32,
            ..Default::default()
        };
        snapshot.model_sync = Some(proto::ModelSyncStatus {
            tau_history: vec![point(0, 1.1), point(30, 2.4), point(60, 2.2)],
            best_tau: Some(point(30, 2.4)),
            best_path: "/runs/x/model-best".to_string(),
            ..Default::default()
        });
        let (curve, best) = tau_curve(&snapshot);
        let versions: Vec<(u64, f64)> = curve
            .iter()
            .map(|point| (point.model_version, point.tau))
            .collect();
        assert_eq!(versions, vec![(0, 1.1), (30, 2.4), (60, 2.2)]);
        let best = best.unwrap();
        assert_eq!((best.model_version, best.model_samples), (30, 480));
        assert_eq!(best.path, "/runs/x/model-best");
    }

    /// #22: a run is OK only when nothing failed, and each failure is said:
    /// a drafter's non-zero exit, dead letters, a non-finite model.
    #[test]
    fn a_run_reports_success_only_when_nothing_failed_and_says_why_otherwise() {
        let folder = tempfile::tempdir().unwrap();
        let model = folder.path().join("model");
        let ok = failures(&complete(), &[drafter(Some(0))], Some(1.0), &CLEAN, &model);
        assert!(ok.is_empty(), "{ok:?}");

        let mut lossy = complete();
        lossy.dead_letters = 2;
        let failed = failures(&lossy, &[drafter(Some(1))], Some(1.0), &CLEAN, &model);
        assert!(
            failed
                .iter()
                .any(|failure| failure.contains("drafter-0 exited 1")),
            "{failed:?}"
        );
        assert!(
            failed
                .iter()
                .any(|failure| failure.contains("2 samples were dead-lettered")),
            "{failed:?}"
        );

        std::fs::create_dir_all(&model).unwrap();
        let poisoned = tch::Tensor::from_slice(&[1.0f32, f32::NAN]);
        tch::Tensor::write_safetensors(
            &[("fc.weight", &poisoned)],
            model.join("model.safetensors"),
        )
        .unwrap();
        let failed = failures(&complete(), &[drafter(Some(0))], Some(1.0), &CLEAN, &model);
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].contains("is not finite"), "{}", failed[0]);

        // Stopped because every drafter was gone, and summarised from the
        // last status seen: each said.
        let stopped = StopReason {
            drafters_gone: true,
            final_status_stale: true,
            ..CLEAN
        };
        let empty = folder.path().join("no-model");
        let failed = failures(
            &complete(),
            &[drafter(Some(0))],
            Some(1.0),
            &stopped,
            &empty,
        );
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(failed[0].contains("every drafter exited"), "{}", failed[0]);
        assert!(failed[1].contains("last status seen"), "{}", failed[1]);
    }
}
