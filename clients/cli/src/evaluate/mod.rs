//! `dflash evaluate`: τ of the run's shared model while the run trains.
//!
//! The evaluator reads the run's model with `ModelSync.ReadModel` (read-only:
//! it opens no sync session, so it never counts as a drafter, changes
//! nothing of the run's model and is never waited for), builds the drafter from
//! the model's files read (`config.json`, `model.safetensors`: read from the
//! bytes in memory, nothing is written), measures τ on held-out
//! prompts with `dflash_model::eval` (the same code as `dflash eval`: greedy, the
//! target's KV cache, the bonus token counted; the target is loaded once),
//! and reports it with `ModelSync.ReportTau`; the broker keeps the history
//! and writes the best version to `model-best/`.
//!
//! With `--watch` it follows the run: it polls the broker's status and
//! reads the run's model every `--every-versions` model versions or every
//! `--every` (whichever comes first, and only a version not read yet), and
//! when the run is over (COMPLETE with the final model written, or
//! ABORTED) it reads the final model if it has not, measures what it has
//! read, then exits. Reading and measuring are apart: a version is read
//! when it is due and measured in turn, up to `--backlog` versions ahead
//! (at most the broker's `--max-pending-evaluations`, which keeps their
//! weights until their report). A version due is read header-only (the
//! broker keeps it) and its weights are read from the broker when its
//! measurement starts, so the versions waiting cost the evaluator no
//! memory: it holds one version's weights at a time. So on a CPU the training keeps busy, an
//! evaluator at the lowest priority still has a point per due version: it
//! measures them when the CPU has time, at the latest after the run. Each
//! point carries when its version was read. Without `--watch` it evaluates
//! the current model once.
//!
//! It must not slow the drafters: on the CPU it runs with its own libtorch
//! thread budget (`--threads`, 1 by default), on a GPU on its own
//! `--device`.
//!
//! # Layout
//! - `args`: the flags (`EvaluateArgs`, and `SamplingArgs`, shared with
//!   `dflash eval`).
//! - `report`: what was measured (`EvaluatorReport`, `Point`).
//! - `broker`: the connection (`Evaluator`: status, `ReadModel`,
//!   `ReportTau`) and the drafter a model's files make.
//! - `measure`: the measurements (`Bench`: the target and prompts, one
//!   version at a time on a blocking thread).
//! - `watch`: `--watch` (`Schedule`, `Watcher`, the loop).
//!
//! This file only runs them; the modules depend on each other in that
//! order and never on this file.

use std::sync::Arc;

use anyhow::{bail, Context as _};
use tokio_util::sync::CancellationToken;

use crate::demo;

mod args;
mod broker;
mod measure;
mod report;
mod watch;

pub use args::{EvaluateArgs, SamplingArgs};
pub use broker::{draft_of_read, Evaluator, ReadError, ReadModel};
use measure::Bench;
pub use report::{EvaluatorReport, Point};
use watch::watch;
pub use watch::{Next, Schedule, Watcher};

/// Runs the evaluator to its end (see the module's doc); returns what it
/// measured (also written to `--report-file`).
pub async fn run(
    args: EvaluateArgs,
    interrupt: CancellationToken,
) -> anyhow::Result<EvaluatorReport> {
    if args.threads == 0 {
        bail!("--threads must be at least 1");
    }
    tch::set_num_threads(i32::try_from(args.threads).unwrap_or(i32::MAX));
    let device = dflash_model::device::resolve_device(args.device)?;
    let mut prompts = demo::read_prompts(&args.prompts, &args.target)?;
    if args.max_prompts > 0 {
        prompts.truncate(args.max_prompts);
    }
    let target_dir = args.target.clone();
    let target =
        tokio::task::spawn_blocking(move || dflash_model::eval::load_target(&target_dir, device))
            .await
            .context("loading the target")?
            .with_context(|| format!("loading the target model from {}", args.target.display()))?;
    let mut bench = Bench {
        target: Some(target),
        options: dflash_model::eval::EvalOptions {
            max_new_tokens: args.max_new_tokens,
            stop_token_ids: dflash_model::tokens::eos_token_ids(&args.target),
            device,
            sampling: args.sampling.options(),
            confidence_threshold: args.sampling.confidence_threshold,
        },
        prompts: Arc::new(prompts),
    };
    let mut evaluator =
        Evaluator::connect(&args.broker, &args.security, &args.evaluator_id).await?;
    let mut report = EvaluatorReport::default();
    let outcome = if args.watch {
        watch(&args, &mut bench, &mut evaluator, &mut report, &interrupt).await
    } else {
        bench
            .evaluate_now(&mut evaluator, &mut report, args.poll)
            .await
            .map(|_| ())
    };
    if let Some(path) = &args.report_file {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    outcome?;
    Ok(report)
}

#[cfg(test)]
mod tests;
