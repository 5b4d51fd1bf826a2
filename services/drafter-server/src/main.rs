//! `drafter-server`: flags, telemetry (logs, span export) and signals
//! around [`dflash_drafter_server::run`].

use clap::Parser;
use dflash_drafter_server::{run, DrafterServerConfig, RunEnd};
use dflash_shell::Exit;
use tracing::{error, info};

/// Trains a DFlash draft model from the dflash broker's hidden-state queue.
/// Exit codes (the same table for every dflash binary): 0 when the broker
/// ends the run COMPLETE or after a graceful stop (SIGTERM/SIGINT), 1 on
/// errors, 2 on a wrong command line, 3 after checkpointing when the run is
/// ABORTED.
#[derive(Debug, Parser)]
#[command(name = "drafter-server", version = dflash_drafter_server::test_hooks::VERSION)]
struct Cli {
    #[command(flatten)]
    config: DrafterServerConfig,

    /// Log line format on stderr: text or json.
    #[arg(long, env = "DFLASH_LOG_FORMAT", value_enum, default_value_t = dflash_telemetry::LogFormat::Text)]
    log_format: dflash_telemetry::LogFormat,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // First: with huge pages this may re-execute the process.
    let allocator = dflash_device::configure_allocator(dflash_device::AllocatorMode::Retained);
    let cli = Cli::parse();
    let identity = dflash_telemetry::ServiceIdentity::new(
        dflash_telemetry::Service::DrafterServer,
        cli.config.drafter_id.clone(),
        dflash_drafter_server::test_hooks::VERSION,
    );
    // Held to the end: dropping it sends the last spans (bounded).
    let _telemetry = match dflash_telemetry::init(&identity, cli.log_format) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("drafter-server: {error}");
            return Exit::Failed.into();
        }
    };
    tracing::info!(%allocator, "allocator set up");
    let shutdown = dflash_shell::shutdown_signal();
    let report_file = cli.config.report_file.clone();
    let result = run(cli.config, shutdown).await;
    match result {
        Ok(report) => {
            if let Some(path) = &report_file {
                let json = serde_json::json!({
                    "role": "drafter",
                    "id": report.drafter_id,
                    "busy_fraction": report.busy_fraction,
                    "tokens_per_second": report.tokens_per_second,
                    "samples": report.samples_trained,
                    "steps": report.steps,
                    "loss": report.last_loss,
                    "skipped_steps": report.skipped_steps,
                    "non_finite_samples": report.non_finite_samples,
                });
                if let Err(error) = std::fs::write(path, json.to_string()) {
                    error!(%error, path = %path.display(), "the report file could not be written");
                }
            }
            info!(
                end = ?report.end,
                steps = report.steps,
                samples = report.samples_trained,
                tokens_per_second = report.tokens_per_second,
                busy_fraction = report.busy_fraction,
                checkpoint = ?report.final_checkpoint,
                device_memory_peak_bytes = ?report.device_memory_peak_bytes,
                "drafter-server finished"
            );
            if let RunEnd::Aborted { reason } = &report.end {
                error!(%reason, "run aborted by the broker");
            }
            report.exit().into()
        }
        Err(error) => {
            error!(%error, "drafter-server failed");
            eprintln!("drafter-server: {error}");
            Exit::Failed.into()
        }
    }
}
