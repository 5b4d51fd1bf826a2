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
