//! `dflash local`: the whole pipeline on one machine, as separate processes
//! of the real binaries talking real gRPC on loopback: one broker, T
//! target-servers and D drafter-servers. Shows the live status while it
//! runs, stops every child on Ctrl-C, and ends with a summary (also written
//! as `summary.json` in the work directory) and the trained drafter's τ.
//!
//! # Layout
//! This module holds [`run`], which walks the stages in order; each stage
//! lives apart so that the order reads here, and each depends only on the
//! ones listed before it:
//! - `args`: the flags ([`LocalArgs`], [`View`]).
//! - `inputs`: the work directory, the model (given or the embedded tiny
//!   one), the drafters' mask token and the data (given or generated).
//! - `launch`: what each child runs with (binaries, flags, threads) and
//!   starting the broker, the targets, the drafters and the online
//!   evaluator (`dflash evaluate --watch`: τ of the run's model while it trains).
//! - `supervise`: the children as processes: spawning, the live view
//!   while they run, and stopping them (SIGTERM, then SIGKILL).
//! - `quality`: τ of the trained drafter, its untrained baseline and the
//!   shared model, and whether the model's weights are finite.
//! - `summary`: the end-of-run report (`summary.json` and the printed
//!   table), the per-process figures and the list of failures.

mod args;
mod inputs;
mod launch;
mod quality;
mod summary;
mod supervise;

use std::io::IsTerminal as _;
use std::time::Instant;

use anyhow::{bail, Context as _};
use dflash_ops::top::{self, RenderOptions};
use tokio_util::sync::CancellationToken;

pub use args::{LocalArgs, View};
use inputs::{prepare_inputs, prepare_workdir};
use launch::{start_broker, start_drafters, start_evaluator, start_targets};
use quality::{measure_taus, Taus};
use summary::{print_summary, process_summary, summarize, Timings};
pub use summary::{LocalSummary, ProcessSummary};
use supervise::{stop_broker, Watch};

/// Runs the pipeline; returns the summary (also printed and written):
/// inputs, broker, targets and drafters, watch until they exit, τ,
/// summary.
pub async fn run(args: LocalArgs, interrupt: CancellationToken) -> anyhow::Result<LocalSummary> {
    check_args(&args)?;
    let started = Instant::now();
    let (workdir, logs) = prepare_workdir(&args)?;
    let inputs = prepare_inputs(&args, &workdir, &interrupt).await?;
    let generation_seconds = started.elapsed().as_secs_f64();

    let pipeline_started = Instant::now();
    let (mut broker, address, client) = start_broker(&args, &workdir, &logs).await?;
    println!("dflash local: broker at {address} (watch it with `dflash top --broker {address}`); logs in {}", logs.display());
    let mut children = start_targets(&args, &inputs, &address, &logs)?;
    children.extend(start_drafters(&args, &inputs, &address, &workdir, &logs)?);
    children.extend(start_evaluator(&args, &inputs, &address, &logs)?);

    let view = if args.view == View::Top && !std::io::stdout().is_terminal() {
        View::Lines
    } else {
        args.view
    };
    let deadline = started + args.timeout;
    let watch = Watch {
        client: &client,
        address: &address,
        view,
        started,
    };
    let (mut stop, last_seen) = watch.until_exit(&mut children, deadline, &interrupt).await;
    let snapshot = match (client.status().await, last_seen) {
        (Ok(snapshot), _) => snapshot,
        (Err(error), Some(last_seen)) => {
            eprintln!(
                "dflash local: the broker did not answer the final status ({error}); \
                 the summary uses the last status seen"
            );
            stop.final_status_stale = true;
            last_seen
        }
        (Err(error), None) => {
            return Err(error).context("final broker status (no status was ever read)")
        }
    };
    if view == View::Top {
        print!(
            "\x1b[H\x1b[2J{}",
            top::render(&snapshot, &address, RenderOptions { color: true })
        );
    }
    stop_broker(&mut broker).await;
    // The training's own time: until the targets and drafters exited. The
    // evaluator may then still measure versions it read while they ran.
    let all_exited = Instant::now();
    let training_ended = stop.training_ended.unwrap_or(all_exited);
    let pipeline_seconds = training_ended
        .saturating_duration_since(pipeline_started)
        .as_secs_f64();
    let evaluator_tail_seconds = all_exited
        .saturating_duration_since(training_ended)
        .as_secs_f64();

    let eval_started = Instant::now();
    let processes: Vec<ProcessSummary> = children
        .iter()
        .map(|child| process_summary(child, &snapshot))
        .collect();
    let taus = if stop.interrupted {
        Taus::default()
    } else {
        let checkpoint = processes
            .iter()
            .find_map(|process| process.checkpoint.clone());
        measure_taus(&inputs, checkpoint, &workdir).await?
    };
    let eval_seconds = eval_started.elapsed().as_secs_f64();
    let timings = Timings {
        seconds: started.elapsed().as_secs_f64(),
        generation_seconds,
        pipeline_seconds,
        evaluator_tail_seconds,
        eval_seconds,
    };
    let summary = summarize(&snapshot, processes, taus, timings, &inputs, &workdir, stop);
    std::fs::write(
        workdir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    print_summary(&summary, stop.interrupted, stop.timed_out);
    Ok(summary)
}

fn check_args(args: &LocalArgs) -> anyhow::Result<()> {
    if args.targets == 0 || args.drafters == 0 {
        bail!(
            "--targets and --drafters must be at least 1 (got {} and {})",
            args.targets,
            args.drafters
        );
    }
    if args.target_devices.is_empty() || args.drafter_devices.is_empty() {
        bail!("--target-devices and --drafter-devices must name at least one device");
    }
    Ok(())
}
