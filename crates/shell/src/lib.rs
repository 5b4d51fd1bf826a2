//! # dflash-shell
//!
//! The shell the broker, the target-server, the drafter-server and the
//! `dflash` CLI share, so flags, signals, exit codes and durable files mean
//! the same thing in every binary.
//!
//! # Layout
//! - [`units`]: flag values with units: [`parse_duration`] (`500ms`, `5s`,
//!   `2m`) and [`parse_bytes`] (`64MiB`).
//! - [`device`]: [`DeviceChoice`] (`auto`, `cpu`, `cuda:N`) and
//!   [`DtypeChoice`] (`bf16`, `f16`, `f32`) as flags; `dflash-model` turns
//!   them into libtorch devices and kinds.
//! - `signal` (feature `signal`): `shutdown_signal`, one
//!   `CancellationToken` cancelled on SIGINT or SIGTERM, or when the parent
//!   named by `STOP_WITH_PARENT_ENV` dies (`dflash local`'s children).
//! - [`exit`]: [`Exit`], the exit-code table of every binary.
//! - [`durable`]: files that survive a crash: [`write_synced`], [`write_parts_synced`],
//!   [`sync_directory`], and [`replace_directory`], a checkpoint directory
//!   replaced as a whole (the draft model's and the run's model).
//!
//! Must not depend on libtorch, tonic or any other crate of ours, and on
//! tokio only through the `signal` feature: the broker and the operator CLI
//! link it without libtorch, the model crate without tokio. The device
//! thread, the allocator and GPU memory live in `dflash-device`.

pub mod device;
pub mod durable;
pub mod exit;
#[cfg(feature = "signal")]
pub mod signal;
pub mod units;

pub use device::{DeviceChoice, DtypeChoice};
pub use durable::{
    replace_directory, sync_directory, write_parts_synced, write_synced, DurableError,
};
pub use exit::Exit;
#[cfg(feature = "signal")]
pub use signal::{shutdown_signal, STOP_WITH_PARENT_ENV};
pub use units::{parse_bytes, parse_duration};
