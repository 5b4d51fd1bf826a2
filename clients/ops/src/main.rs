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
    dflash_ops::init_logging();
    dflash_ops::run(cli.command).await
}
