//! # dflash-ops
//!
//! The operator's commands against a live broker, in a binary that links no
//! libtorch (`dflash-ops`), and as a library the full `dflash` CLI flattens
//! into its own subcommands, so both spell them alike.
//!
//! # Layout
//! - [`top`]: renders a broker status snapshot as the `top` / `status`
//!   table, idle devices marked (pure, tested without a terminal).
//! - [`commands`]: [`OpsCommand`] (`status`, `top`, `health`) and
//!   [`run`], which connects through `dflash-client` and prints.
//! - `main.rs`: the `dflash-ops` binary.
//!
//! Depends on the proto, the client and the shell only: never on libtorch,
//! the model crate or the servers.

pub mod commands;
pub mod top;

pub use commands::{run, OpsCommand};

/// The command-line tools' logging: warnings and errors on stderr (stdout
/// is the tools' output), `RUST_LOG` to see more.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
