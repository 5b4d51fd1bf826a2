//! The `dflash` binary: subcommand parsing and dispatch.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use dflash_cli::{demo, evaluate, local, regenerate};
use tokio_util::sync::CancellationToken;

/// dflash: train DFlash speculative-decoding drafters from a target model's
/// hidden states, with every GPU busy.
#[derive(Debug, Parser)]
#[command(name = "dflash", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the whole pipeline on this machine: a broker, targets and drafters
    /// as separate processes on loopback (default: the tiny model on the CPU).
    Local(local::LocalArgs),
    /// The operator's commands (`status`, `top`, `health`), as in `dflash-ops`.
    #[command(flatten)]
    Ops(dflash_ops::OpsCommand),
    /// Speculative decoding with a trained drafter; prints the mean acceptance length τ.
    Eval(EvalArgs),
    /// τ of the run's shared model while it trains: reads the broker's
    /// model (read-only), measures τ as `eval` does and reports it to the
    /// broker, which keeps the history and the best model (`--watch`:
    /// follow the run to its end).
    Evaluate(evaluate::EvaluateArgs),
    /// Regenerate the assistant turns of a chat JSONL with the target (batched,
    /// KV cached): the drafter then learns the target's own distribution.
    Regenerate(regenerate::RegenerateArgs),
    /// Write the tiny Qwen3 test model (config, weights, tokenizer, chat template) into DIR.
    InitTiny {
        dir: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write the tiny Llama-3 instead.
        #[arg(long)]
        llama: bool,
    },
}

/// `dflash eval`'s flags.
#[derive(Debug, clap::Args)]
struct EvalArgs {
    #[arg(long)]
    target_model: PathBuf,
    /// A drafter checkpoint directory, or a drafter-server --output folder (its latest checkpoint).
    #[arg(long)]
    drafter: PathBuf,
    /// Held-out prompts (JSONL): pre-tokenized `{"input_ids": [...]}` or conversations, rendered with the chat template.
    #[arg(long)]
    data: PathBuf,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: evaluate::SamplingArgs,
    /// auto (the first CUDA device when libtorch sees one, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: dflash_shell::DeviceChoice,
    /// Also measure a freshly initialised drafter of the same configuration
    /// (the untrained baseline). The mask token is the checkpoint's own
    /// (`dflash_config.mask_token_id`), the one the drafter was trained with.
    #[arg(long)]
    compare_untrained: bool,
}

/// A temporary folder for the untrained baseline drafter, removed on drop.
fn tempfile_dir() -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("dflash-untrained-")
        .tempdir()
        .context("creating a temporary folder for the untrained baseline")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The evaluator runs beside the services for a whole run: it logs and
    // exports spans as they do, under its own resource. The other commands
    // only log.
    let _telemetry = match &cli.command {
        Command::Evaluate(args) => Some(dflash_telemetry::init(
            &dflash_telemetry::ServiceIdentity::new(
                dflash_telemetry::Service::Evaluator,
                args.evaluator_id.clone(),
                env!("CARGO_PKG_VERSION"),
            ),
            dflash_telemetry::LogFormat::Text,
        )?),
        _ => {
            dflash_ops::init_logging();
            None
        }
    };
    match cli.command {
        Command::Local(args) => {
            // SIGINT or SIGTERM: stop the children, then print the summary.
            let interrupt: CancellationToken = dflash_shell::shutdown_signal();
            let summary = local::run(args, interrupt).await?;
            if !summary.ok {
                std::process::exit(i32::from(dflash_shell::Exit::Failed.code()));
            }
        }
        Command::Ops(command) => dflash_ops::run(command).await?,
        Command::Eval(args) => eval(args).await?,
        Command::Evaluate(args) => {
            let interrupt: CancellationToken = dflash_shell::shutdown_signal();
            evaluate::run(args, interrupt).await?;
        }
        Command::Regenerate(args) => {
            let report = tokio::task::spawn_blocking(move || regenerate::run(&args)).await??;
            println!(
                "regenerated {} lines ({} already written, {} in this shard), {} tokens in {:.1}s ({:.0} tokens/s)",
                report.written,
                report.skipped,
                report.shard_records,
                report.generated_tokens,
                report.seconds,
                report.generated_tokens as f64 / report.seconds.max(1e-9)
            );
        }
        Command::InitTiny { dir, seed, llama } => init_tiny(&dir, seed, llama)?,
    }
    Ok(())
}

/// `dflash eval`: τ of a checkpoint (and of an untrained baseline).
async fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let EvalArgs {
        target_model,
        drafter,
        data,
        max_new_tokens,
        sampling,
        device,
        compare_untrained,
    } = args;
    let device = dflash_model::device::resolve_device(device)?;
    let checkpoint = match dflash_model::draft::step_dirs::latest_checkpoint(&drafter)? {
        Some(latest) if !drafter.join("config.json").exists() => latest,
        _ => drafter.clone(),
    };
    let prompts = demo::read_prompts(&data, &target_model)?;
    let (report, untrained) = tokio::task::spawn_blocking(move || {
        let options = dflash_model::eval::EvalOptions {
            max_new_tokens,
            stop_token_ids: dflash_model::tokens::eos_token_ids(&target_model),
            device,
            sampling: sampling.options(),
            confidence_threshold: sampling.confidence_threshold,
        };
        let evaluate = |checkpoint: &std::path::Path| {
            dflash_model::eval::evaluate_with_options(&target_model, checkpoint, &prompts, &options)
        };
        let trained = evaluate(&checkpoint)?;
        let untrained = if compare_untrained {
            let baseline_dir = tempfile_dir()?;
            let baseline = dflash_model::eval::write_untrained_baseline(
                &target_model,
                &checkpoint,
                baseline_dir.path(),
            )?;
            Some(evaluate(&baseline)?)
        } else {
            None
        };
        anyhow::Ok((trained, untrained))
    })
    .await??;
    println!(
        "τ (mean acceptance length) {:.3} over {} prompts, {} verification steps, {} tokens generated, {:.2} tokens per target forward, {:.2} tokens proposed per verification, block size {}, {:.1}s",
        report.mean_acceptance_length,
        report.prompts,
        report.verification_steps,
        report.generated_tokens,
        report.tokens_per_target_forward(),
        report.proposed_tokens as f64 / report.verification_steps.max(1) as f64,
        report.block_size,
        report.seconds
    );
    if let Some(baseline) = untrained {
        println!(
            "untrained baseline: τ {:.3}, {:.2} tokens per target forward, {:.1}s",
            baseline.mean_acceptance_length,
            baseline.tokens_per_target_forward(),
            baseline.seconds
        );
    }
    Ok(())
}

/// `dflash init-tiny`: the tiny Qwen3 (or Llama-3) test model.
fn init_tiny(dir: &std::path::Path, seed: u64, llama: bool) -> anyhow::Result<()> {
    let mut spec = if llama {
        dflash_model::tiny::TinyModelSpec::llama()
    } else {
        dflash_model::tiny::TinyModelSpec::default()
    };
    spec.seed = seed;
    dflash_model::tiny::write_tiny_model(dir, &spec)
        .with_context(|| format!("writing the tiny model to {}", dir.display()))?;
    println!(
        "wrote a tiny {:?} model to {}",
        spec.architecture,
        dir.display()
    );
    Ok(())
}
