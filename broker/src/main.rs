//! The `broker` binary: flags, telemetry, signals and bind; everything else
//! is in the library.

use clap::Parser;
use dflash_telemetry::LogFormat;
use tokio_util::sync::CancellationToken;

/// The dflash broker: the shared hidden-state queue between target-servers
/// and drafter-servers, with the completion counter and end-of-stream.
#[derive(Debug, Parser)]
#[command(name = "broker", version)]
struct Cli {
    #[command(flatten)]
    config: dflash_broker::BrokerConfig,

    /// Log format. Spans are exported over OTLP/gRPC when
    /// OTEL_EXPORTER_OTLP_ENDPOINT is set.
    #[arg(long, env = "DFLASH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Held to the end of main: dropping it flushes the last spans.
    let _telemetry = dflash_telemetry::init("dflash-broker", cli.log_format)?;
    cli.config.validate()?;
    let listener = tokio::net::TcpListener::bind(cli.config.listen)
        .await
        .map_err(|error| anyhow::anyhow!("cannot listen on {}: {error}", cli.config.listen))?;
    let shutdown = CancellationToken::new();
    let signal_shutdown = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        signal_shutdown.cancel();
    });
    dflash_broker::serve(listener, cli.config, shutdown).await?;
    Ok(())
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
