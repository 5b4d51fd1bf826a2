//! Hooks for the integration tests, compiled in only with the cargo feature
//! `test-hooks` (off by default): a release `target-server` neither accepts
//! their flags nor behaves differently. `make test` builds the binaries with
//! it (`--features dflash-target-server/test-hooks`); a test that needs a
//! hook first checks [`VERSION`] through `target-server --version`.
//!
//! Apart from [`crate::config`] so the flags a release binary accepts are
//! all there, and what a test build adds is all here.

use clap::Args;

/// `--version`: the package version, with `+test-hooks` in a build that has
/// the hooks, so a test can tell it runs the binary it needs and a deployed
/// one shows it has none.
#[cfg(not(feature = "test-hooks"))]
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// `--version`: the package version, with `+test-hooks` in a build that has
/// the hooks, so a test can tell it runs the binary it needs and a deployed
/// one shows it has none.
#[cfg(feature = "test-hooks")]
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "+test-hooks");

/// The test-only flags (hidden from `--help`); empty without the feature.
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct TestHooks {
    /// The compute thread hangs (until shutdown) after this many batches,
    /// to exercise the watchdog and the broker's stall detection.
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true)]
    pub test_hang_compute_after_batches: Option<u64>,
}

impl TestHooks {
    /// After how many batches the compute thread hangs.
    #[cfg(feature = "test-hooks")]
    pub fn hang_compute_after_batches(&self) -> Option<u64> {
        self.test_hang_compute_after_batches
    }

    /// After how many batches the compute thread hangs: never, in a build
    /// without the feature.
    #[cfg(not(feature = "test-hooks"))]
    pub fn hang_compute_after_batches(&self) -> Option<u64> {
        None
    }
}
