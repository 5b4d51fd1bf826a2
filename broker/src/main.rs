//! The `broker` binary: flags, telemetry, signals and bind; everything else
//! is in the library. Exit codes follow the one table of every dflash binary
//! (`dflash_shell::Exit`): 0 after serving until SIGTERM/SIGINT, 1 on an
//! error (a bad flag value, an address that cannot be bound), 2 on a wrong
//! command line.

use clap::Parser;

/// jemalloc keeps freed large blocks for reuse (dirty pages decay over
/// seconds) where glibc returns blocks over its mmap threshold (at most
/// 32 MiB) to the kernel at once: with glibc every received item of tens of
/// MiB is a fresh mapping that faults in page by page (43 % of the broker's
/// time at 16 MiB items, measured), with jemalloc it reuses a block that is
/// already mapped. `make bench` prints the minor faults per GiB. Feature
/// `jemalloc`, on by default; off only in `make run`'s build
/// (broker/Cargo.toml says why).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
use dflash_shell::Exit;
use dflash_telemetry::LogFormat;

/// The dflash broker: the shared hidden-state queue between target-servers
/// and drafter-servers, with the completion counter and end-of-stream.
#[derive(Debug, Parser)]
#[command(name = "broker", version)]
struct Cli {
    /// Log format. Spans are exported over OTLP/gRPC when
    /// OTEL_EXPORTER_OTLP_ENDPOINT is set.
    #[arg(long, env = "DFLASH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    /// Once listening, write the bound address (`host:port`) to this file
    /// (whole, by rename): a launcher passes `--listen 127.0.0.1:0` and
    /// reads the port the kernel chose, with no race for a free port.
    #[arg(long)]
    ready_file: Option<std::path::PathBuf>,

    // Last: its own last flags have headings of their own (`--help`).
    #[command(flatten)]
    config: dflash_broker::BrokerConfig,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match serve(cli).await {
        Ok(()) => Exit::Done.into(),
        Err(error) => {
            eprintln!("broker: {error:#}");
            Exit::Failed.into()
        }
    }
}

async fn serve(cli: Cli) -> anyhow::Result<()> {
    // Held to the end: dropping it flushes the last spans.
    let identity = dflash_telemetry::ServiceIdentity::new(
        dflash_telemetry::Service::Broker,
        dflash_telemetry::process_instance_id(),
        env!("CARGO_PKG_VERSION"),
    );
    let _telemetry = dflash_telemetry::init(&identity, cli.log_format)?;
    cli.config.validate()?;
    let listener = tokio::net::TcpListener::bind(cli.config.listen)
        .await
        .map_err(|error| anyhow::anyhow!("cannot listen on {}: {error}", cli.config.listen))?;
    if let Some(ready_file) = &cli.ready_file {
        let address = listener.local_addr()?;
        let partial = ready_file.with_extension("partial");
        std::fs::write(&partial, format!("{address}\n"))
            .and_then(|()| std::fs::rename(&partial, ready_file))
            .map_err(|error| anyhow::anyhow!("writing {}: {error}", ready_file.display()))?;
    }
    let shutdown = dflash_shell::shutdown_signal();
    dflash_broker::serve(listener, cli.config, shutdown).await?;
    Ok(())
}
