//! The `target-server` binary: flags, logging, signals; the work is in
//! [`dflash_target_server::run`].

use clap::Parser;
use dflash_target_server::{run, TargetServerConfig};
use tokio_util::sync::CancellationToken;

/// Exit code when stopped by a signal before the shard was done.
const EXIT_INTERRUPTED: u8 = 2;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = TargetServerConfig::parse();
    let telemetry = match dflash_telemetry::init("target-server", config.log_format) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("target-server: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let shutdown = CancellationToken::new();
    let signal_watch = tokio::spawn(cancel_on_signal(shutdown.clone()));
    let outcome = run(config, shutdown.clone()).await;
    signal_watch.abort();
    telemetry.flush();
    match outcome {
        Ok(report) if !report.completed => {
            tracing::warn!(
                sent = report.samples_sent,
                "stopped before the shard was done; a restart resumes"
            );
            std::process::ExitCode::from(EXIT_INTERRUPTED)
        }
        Ok(report) if !report.rejected.is_empty() => {
            let (seq, reason) = &report.rejected[0];
            tracing::error!(rejected = report.rejected.len(), first_seq = seq, first_reason = %reason, "the broker rejected items");
            std::process::ExitCode::FAILURE
        }
        Ok(report) => {
            println!(
                "target {} shard {}/{}: {} samples, {} tokens sent, {:.0} tokens/s, device {} busy {:.0}%",
                report.target_id,
                report.shard.index,
                report.shard.count,
                report.samples_sent,
                report.tokens_sent,
                report.tokens_per_second,
                report.device,
                report.busy_fraction * 100.0
            );
            std::process::ExitCode::SUCCESS
        }
        Err(error) => {
            tracing::error!("{error}");
            eprintln!("target-server: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Cancels `shutdown` on SIGINT or SIGTERM.
async fn cancel_on_signal(shutdown: CancellationToken) {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(terminate) => terminate,
                Err(error) => {
                    tracing::warn!(%error, "cannot watch SIGTERM");
                    let _ = interrupt.await;
                    shutdown.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    tracing::info!("signal received; shutting down");
    shutdown.cancel();
}
