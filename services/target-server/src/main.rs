//! The `target-server` binary: flags, logging, signals; the work is in
//! [`dflash_target_server::run`]. Exit codes follow the one table of every
//! dflash binary (`dflash_shell::Exit`): 0 shard done and reported, 1
//! failed (including items the broker rejected), 2 wrong command line, 4
//! stopped by a signal before the shard was done (a restart resumes).

use clap::Parser;
use dflash_shell::Exit;
use dflash_target_server::{run, TargetServerConfig};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // First: with huge pages this may re-execute the process.
    let allocator = dflash_device::configure_allocator(dflash_device::AllocatorMode::Retained);
    let config = TargetServerConfig::parse();
    let identity = dflash_telemetry::ServiceIdentity::new(
        dflash_telemetry::Service::TargetServer,
        config.target_id.clone(),
        env!("CARGO_PKG_VERSION"),
    );
    // Held to the end: dropping it sends the last spans (bounded).
    let _telemetry = match dflash_telemetry::init(&identity, config.log_format) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("target-server: {error}");
            return Exit::Failed.into();
        }
    };
    tracing::info!(%allocator, "allocator set up");
    let shutdown = dflash_shell::shutdown_signal();
    let report_file = config.report_file.clone();
    let outcome = run(config, shutdown).await;
    if let (Some(path), Ok(report)) = (&report_file, &outcome) {
        let json = serde_json::json!({
            "role": "target",
            "id": report.target_id,
            "busy_fraction": report.busy_fraction,
            "tokens_per_second": report.tokens_per_second,
            "samples": report.samples_sent,
            "non_finite_skipped": report.non_finite_skipped,
        });
        if let Err(error) = std::fs::write(path, json.to_string()) {
            tracing::error!(%error, path = %path.display(), "the report file could not be written");
        }
    }
    match outcome {
        Ok(report) if !report.completed => {
            tracing::warn!(
                sent = report.samples_sent,
                "stopped before the shard was done; a restart resumes"
            );
            Exit::Interrupted.into()
        }
        Ok(report) if !report.rejected.is_empty() => {
            let (seq, reason) = &report.rejected[0];
            tracing::error!(rejected = report.rejected.len(), first_seq = seq, first_reason = %reason, "the broker rejected items");
            Exit::Failed.into()
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
            if let Some(peak) = report.device_memory_peak_bytes {
                println!(
                    "target {}: GPU memory peak {:.2} GiB (NVML, after a batch)",
                    report.target_id,
                    peak as f64 / (1u64 << 30) as f64
                );
            }
            Exit::Done.into()
        }
        Err(error) => {
            tracing::error!("{error}");
            eprintln!("target-server: {error}");
            Exit::Failed.into()
        }
    }
}
