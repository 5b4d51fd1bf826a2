//! The `dflash` binary: subcommand parsing and dispatch.

use std::io::IsTerminal as _;
#[cfg(feature = "model")]
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use dflash_cli::top;
#[cfg(feature = "model")]
use dflash_cli::{demo, local, regenerate};
use dflash_client::{BrokerClient, ClientSecurityArgs};
#[cfg(feature = "model")]
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
    #[cfg(feature = "model")]
    Local(local::LocalArgs),
    /// Print one snapshot of the broker's status (`--json` for scripts).
    Status {
        #[arg(long, env = "DFLASH_BROKER", default_value = "http://127.0.0.1:50051")]
        broker: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        security: ClientSecurityArgs,
    },
    /// Live view of every target and drafter, redrawn in place; idle devices stand out.
    Top {
        #[arg(long, env = "DFLASH_BROKER", default_value = "http://127.0.0.1:50051")]
        broker: String,
        /// Redraw interval (`500ms`, `2s`).
        #[arg(long, default_value = "1s", value_parser = dflash_service::parse_duration)]
        interval: Duration,
        /// The previous release's spelling, in milliseconds (hidden).
        #[arg(long = "interval-ms", hide = true)]
        interval_ms: Option<u64>,
        #[command(flatten)]
        security: ClientSecurityArgs,
    },
    /// gRPC health check of the broker (grpc.health.v1): exits 0 when the
    /// service is SERVING, 1 otherwise (container health checks, probes).
    Health {
        #[arg(long, env = "DFLASH_BROKER", default_value = "http://127.0.0.1:50051")]
        broker: String,
        /// The service to check; "" is the whole server.
        #[arg(long, default_value = "dflash.v1.Broker")]
        service: String,
        /// Give up after this long (`3s`, `500ms`).
        #[arg(long, default_value = "3s", value_parser = dflash_service::parse_duration)]
        timeout: Duration,
        /// The previous release's spelling, in milliseconds (hidden).
        #[arg(long = "timeout-ms", hide = true)]
        timeout_ms: Option<u64>,
        #[command(flatten)]
        security: ClientSecurityArgs,
    },
    /// Speculative decoding with a trained drafter; prints the mean acceptance length τ.
    #[cfg(feature = "model")]
    Eval(EvalArgs),
    /// Regenerate the assistant turns of a chat JSONL with the target (batched,
    /// KV cached): the drafter then learns the target's own distribution.
    #[cfg(feature = "model")]
    Regenerate(regenerate::RegenerateArgs),
    /// Write the tiny Qwen3 test model (config, weights, tokenizer, chat template) into DIR.
    #[cfg(feature = "model")]
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
#[cfg(feature = "model")]
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
    /// auto (the first CUDA device when libtorch sees one, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: dflash_service::DeviceChoice,
    /// Also measure a freshly initialised drafter of the same configuration
    /// (the untrained baseline). The mask token is the checkpoint's own
    /// (`dflash_config.mask_token_id`), the one the drafter was trained with.
    #[arg(long)]
    compare_untrained: bool,
}

/// A temporary folder for the untrained baseline drafter, removed on drop.
#[cfg(feature = "model")]
fn tempfile_dir() -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("dflash-untrained-")
        .tempdir()
        .context("creating a temporary folder for the untrained baseline")
}

async fn connect(broker: &str, security: &ClientSecurityArgs) -> anyhow::Result<BrokerClient> {
    BrokerClient::connect(broker.to_string(), security.client_options()?)
        .await
        .with_context(|| format!("connecting to the broker at {broker}"))
}

/// `dflash health`: one grpc.health.v1 Check, bounded in time.
async fn health(
    broker: &str,
    service: &str,
    timeout: Duration,
    security: &ClientSecurityArgs,
) -> anyhow::Result<()> {
    let check = async {
        let mut options = security.client_options()?;
        options.connect_timeout = timeout;
        let channel = dflash_client::connect_channel(broker, &options).await?;
        let response = tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .with_context(|| format!("health check of {service:?} at {broker}"))?;
        anyhow::Ok(response.into_inner().status)
    };
    let status = tokio::time::timeout(timeout, check).await.map_err(|_| {
        anyhow::anyhow!("health check of {service:?} at {broker}: no answer within {timeout:?}")
    })??;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    anyhow::ensure!(
        status == serving,
        "{service:?} at {broker} is not serving (status {status})"
    );
    println!("{service:?} at {broker}: SERVING");
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        #[cfg(feature = "model")]
        Command::Local(args) => {
            // SIGINT or SIGTERM: stop the children, then print the summary.
            let interrupt: CancellationToken = dflash_service::shutdown_signal();
            let summary = local::run(args, interrupt).await?;
            if !summary.ok {
                std::process::exit(i32::from(dflash_service::Exit::Failed.code()));
            }
        }
        Command::Status {
            broker,
            json,
            security,
        } => status(&broker, json, &security).await?,
        Command::Top {
            broker,
            interval,
            interval_ms,
            security,
        } => {
            let interval = interval_ms.map_or(interval, Duration::from_millis);
            watch_top(&broker, interval, &security).await?
        }
        Command::Health {
            broker,
            service,
            timeout,
            timeout_ms,
            security,
        } => {
            let timeout = timeout_ms.map_or(timeout, Duration::from_millis);
            health(&broker, &service, timeout, &security).await?
        }
        #[cfg(feature = "model")]
        Command::Eval(args) => eval(args).await?,
        #[cfg(feature = "model")]
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
        #[cfg(feature = "model")]
        Command::InitTiny { dir, seed, llama } => init_tiny(&dir, seed, llama)?,
    }
    Ok(())
}

/// `dflash status`: one snapshot, as text or JSON.
async fn status(broker: &str, json: bool, security: &ClientSecurityArgs) -> anyhow::Result<()> {
    let snapshot = connect(broker, security).await?.status().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        print!(
            "{}",
            top::render(&snapshot, broker, top::RenderOptions { color: false })
        );
    }
    Ok(())
}

/// `dflash top`: the status stream, redrawn in place until SIGINT or SIGTERM.
async fn watch_top(
    broker: &str,
    interval: Duration,
    security: &ClientSecurityArgs,
) -> anyhow::Result<()> {
    let client = connect(broker, security).await?;
    let mut stream = client.watch_status(interval).await?;
    let color = std::io::stdout().is_terminal();
    let stop = dflash_service::shutdown_signal();
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            message = stream.message() => match message {
                Ok(Some(snapshot)) => print!("\x1b[H\x1b[2J{}", top::render(&snapshot, broker, top::RenderOptions { color })),
                Ok(None) => return Ok(()),
                Err(status) => anyhow::bail!("broker status stream ended: {status}"),
            },
        }
    }
}

/// `dflash eval`: τ of a checkpoint (and of an untrained baseline).
#[cfg(feature = "model")]
async fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let EvalArgs {
        target_model,
        drafter,
        data,
        max_new_tokens,
        device,
        compare_untrained,
    } = args;
    let device = dflash_model::device::resolve_device(device)?;
    let checkpoint = match dflash_drafter_server::checkpoints::latest_checkpoint(&drafter)? {
        Some(latest) if !drafter.join("config.json").exists() => latest,
        _ => drafter.clone(),
    };
    let prompts = demo::read_prompts(&data, &target_model)?;
    let (report, untrained) = tokio::task::spawn_blocking(move || {
        let evaluate = |checkpoint: &std::path::Path| {
            dflash_drafter_server::eval::evaluate(
                &target_model,
                checkpoint,
                &prompts,
                max_new_tokens,
                device,
            )
        };
        let trained = evaluate(&checkpoint)?;
        let untrained = if compare_untrained {
            let baseline_dir = tempfile_dir()?;
            let baseline = dflash_drafter_server::eval::write_untrained_baseline(
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
        "τ (mean acceptance length) {:.3} over {} prompts, {} verification steps, {} tokens generated, {:.2} tokens per target forward, block size {}, {:.1}s",
        report.mean_acceptance_length,
        report.prompts,
        report.verification_steps,
        report.generated_tokens,
        report.tokens_per_target_forward(),
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
#[cfg(feature = "model")]
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
