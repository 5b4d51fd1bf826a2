//! `drafter-server`: flags, telemetry (logs, span export) and signals
//! around [`dflash_drafter_server::run`].

use clap::Parser;
use dflash_drafter_server::{run, DrafterServerConfig, RunEnd};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// Trains a DFlash draft model from the dflash broker's hidden-state queue.
/// Exits 0 when the broker ends the run COMPLETE or after a graceful stop
/// (SIGTERM/SIGINT), 2 after checkpointing when the run is ABORTED, 1 on errors.
#[derive(Debug, Parser)]
#[command(name = "drafter-server", version)]
struct Cli {
    #[command(flatten)]
    config: DrafterServerConfig,

    /// Log line format on stderr: text or json.
    #[arg(long, env = "DFLASH_LOG_FORMAT", value_enum, default_value_t = dflash_telemetry::LogFormat::Text)]
    log_format: dflash_telemetry::LogFormat,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Held to the end: dropping it flushes the spans still buffered.
    let telemetry = match dflash_telemetry::init("drafter-server", cli.log_format) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("drafter-server: {error}");
            return std::process::ExitCode::from(1);
        }
    };
    let shutdown = CancellationToken::new();
    let signal_task = tokio::spawn(forward_signals(shutdown.clone()));
    let result = run(cli.config, shutdown.clone()).await;
    signal_task.abort();
    telemetry.flush();
    match result {
        Ok(report) => {
            info!(
                end = ?report.end,
                steps = report.steps,
                samples = report.samples_trained,
                tokens_per_second = report.tokens_per_second,
                busy_fraction = report.busy_fraction,
                checkpoint = ?report.final_checkpoint,
                "drafter-server finished"
            );
            if let RunEnd::Aborted { reason } = &report.end {
                error!(%reason, "run aborted by the broker");
            }
            std::process::ExitCode::from(report.exit_code() as u8)
        }
        Err(error) => {
            error!(%error, "drafter-server failed");
            std::process::ExitCode::from(1)
        }
    }
}

/// Cancels `shutdown` on SIGTERM (a pod being scaled down) or Ctrl-C.
async fn forward_signals(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(error) => {
                    error!(%error, "cannot listen for SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = terminate.recv() => info!("SIGTERM received"),
            _ = tokio::signal::ctrl_c() => info!("interrupt received"),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    shutdown.cancel();
}
