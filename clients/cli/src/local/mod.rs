//! `dflash local`: the whole pipeline on one machine, as separate processes
//! of the real binaries talking real gRPC on loopback: one broker, T
//! target-servers and D drafter-servers. Shows the live status while it
//! runs, stops every child on Ctrl-C, and ends with a summary (also written
//! as `summary.json` in the work directory) and the trained drafter's τ.
//!
//! # Layout
//! This module holds the flags ([`LocalArgs`]) and [`run`], which walks the
//! stages in order; each stage lives apart so that the order reads here:
//! - `inputs`: the work directory, the model (given or the embedded tiny
//!   one), the drafters' mask token and the data (given or generated).
//! - `launch`: what each child runs with (binaries, flags, threads) and
//!   starting the broker, the targets, the drafters and the online
//!   evaluator (`dflash evaluate --watch`: τ of the center while it trains).
//! - `supervise`: the children as processes: spawning, the live view
//!   while they run, and stopping them (SIGTERM, then SIGKILL).
//! - `quality`: τ of the trained drafter, its untrained baseline and the
//!   shared center, and whether the center's weights are finite.
//! - `summary`: the end-of-run report (`summary.json` and the printed
//!   table), the per-process figures and the list of failures.

mod inputs;
mod launch;
mod quality;
mod summary;
mod supervise;

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::{Args, ValueEnum};
use dflash_ops::top::{self, RenderOptions};
use tokio_util::sync::CancellationToken;

use crate::demo::DemoSpec;
use inputs::{prepare_inputs, prepare_workdir};
use launch::{start_broker, start_drafters, start_evaluator, start_targets};
use quality::{measure_taus, Taus};
use summary::{print_summary, process_summary, summarize, Timings};
pub use summary::{LocalSummary, ProcessSummary};
use supervise::{stop_broker, Watch};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum View {
    /// Redraw the `dflash top` view in place (when stdout is a terminal).
    Top,
    /// One progress line every few seconds.
    Lines,
    /// Only the final summary.
    None,
}

#[derive(Debug, Clone, Args)]
pub struct LocalArgs {
    /// Number of target-server processes.
    #[arg(long, default_value_t = 2)]
    pub targets: u32,

    /// Number of drafter-server processes.
    #[arg(long, default_value_t = 2)]
    pub drafters: u32,

    /// Target model directory (Hugging Face layout). Default: the tiny model
    /// written by `dflash init-tiny` into the work directory.
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// Training data (JSONL). Default: data the tiny target generates itself.
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// Held-out prompts for the final τ measurement (pre-tokenized JSONL).
    /// Default: generated with the demo data; skipped when --data is given without it.
    #[arg(long)]
    pub held_out: Option<PathBuf>,

    /// Devices of the targets, assigned in turn (e.g. `cuda:0,cuda:1`;
    /// `auto`, `cpu`, `cuda`, `cuda:N` as the services take them). The CPU
    /// by default: the demo is for a laptop.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub target_devices: Vec<dflash_shell::DeviceChoice>,

    /// Devices of the drafters, assigned in turn.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub drafter_devices: Vec<dflash_shell::DeviceChoice>,

    /// Run without a model: synthetic hidden states and synthetic training,
    /// to load-test the plumbing.
    #[arg(long)]
    pub synthetic: bool,

    /// Where models, data, logs, checkpoints and summary.json go.
    /// Default: runs/local-<unix time>.
    #[arg(long)]
    pub workdir: Option<PathBuf>,

    /// Live view while running.
    #[arg(long, value_enum, default_value = "top")]
    pub view: View,

    /// Give up (and fail) after this long (`30m`, `90s`).
    #[arg(long, default_value = "30m", value_parser = dflash_shell::parse_duration)]
    pub timeout: Duration,

    /// Extra flags for every target-server (one string, split on spaces).
    /// A `--model` here replaces the run's: `--model
    /// synthetic:hidden=64,layers=2,vocab=512,tokens_per_s=0` gives real
    /// drafters random hidden states of the tiny default's shape at no
    /// target compute (the drafter side's throughput alone). A flag here
    /// replaces the tiny default's.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub target_args: String,

    /// Extra flags for every drafter-server (one string, split on spaces).
    /// A flag here replaces the tiny default's (`--learning-rate 12e-3
    /// --sync-lr-scaling inverse --sync-batch-scaling inverse`: N drafters
    /// share one drafter's steps).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub drafter_args: String,

    /// Unique sequences in the generated demo data.
    #[arg(long, default_value_t = DemoSpec::default().unique_sequences)]
    pub demo_sequences: usize,

    /// How many times the demo data repeats (more optimizer steps).
    #[arg(long, default_value_t = DemoSpec::default().epochs)]
    pub demo_epochs: usize,

    /// Held-out prompts generated with the demo data (the final τ).
    #[arg(long, default_value_t = DemoSpec::default().held_out_prompts)]
    pub demo_held_out: usize,

    /// Mask token id of the drafters. Default: the `mask_token` of the
    /// model's tokenizer_config.json, else (Qwen3 and Llama tokenizers have
    /// none) the reserved id just past the tokenizer's vocabulary, the
    /// convention of the published DFlash drafters (151669 for Qwen3-8B).
    /// Resolved and checked before anything starts.
    #[arg(long)]
    pub mask_token_id: Option<i64>,

    /// Do not run the online evaluator (`dflash evaluate --watch`), which
    /// measures τ of the shared model while the run trains.
    #[arg(long)]
    pub no_evaluator: bool,

    /// The evaluator evaluates when the center is this many versions past
    /// the last evaluation...
    #[arg(long, default_value_t = EVALUATOR_EVERY_VERSIONS)]
    pub evaluate_every_versions: u64,

    /// ...or this long after it (`20s`, `2m`), whichever comes first.
    #[arg(long, default_value = EVALUATOR_EVERY, value_parser = dflash_shell::parse_duration)]
    pub evaluate_every: Duration,

    /// The evaluator's device: its own, never a drafter's (`cpu`, `cuda:N`).
    #[arg(long, default_value = "cpu")]
    pub evaluator_device: dflash_shell::DeviceChoice,

    /// The evaluator's CPU priority, as `nice -n` (0 to 19; 19 the lowest):
    /// on CPUs the targets and drafters keep, it uses only the time they
    /// leave idle, so measuring τ does not slow training (its points come
    /// later on a fully busy machine). 0 runs it at their priority.
    #[arg(long, default_value_t = 19, value_parser = clap::value_parser!(u8).range(0..=19))]
    pub evaluator_nice: u8,
}

/// The evaluator's schedule on the demo: about 240 center versions in a
/// minute of training; every 30 versions (or 15 s) gives 5 to 8 points.
const EVALUATOR_EVERY_VERSIONS: u64 = 30;
const EVALUATOR_EVERY: &str = "15s";

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
        measure_taus(&inputs, &processes, &workdir).await?
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
