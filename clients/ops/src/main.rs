//! The `dflash-ops` binary: `status`, `top` and `health` against a broker,
//! without libtorch.

use clap::Parser;

/// dflash-ops: inspect a dflash broker (status, live top view, health).
#[derive(Debug, Parser)]
#[command(name = "dflash-ops", version)]
struct Cli {
    #[command(subcommand)]
    command: dflash_ops::OpsCommand,
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
    dflash_ops::run(cli.command).await
}
