//! Hooks for the integration tests, compiled in only with the cargo feature
//! `test-hooks` (off by default): a release `drafter-server` does not even
//! read their environment variables. `make test` builds the binaries with
//! it (`--features dflash-drafter-server/test-hooks`); a test that needs a
//! hook first checks [`VERSION`] through `drafter-server --version`.
//!
//! Apart from [`crate::config`] so the settings a release binary reads are
//! all there, and what a test build adds is all here.

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

/// The environment variable of [`hang_trainer_after_steps`].
#[cfg(feature = "test-hooks")]
const HANG_TRAINER_AFTER_STEPS_VARIABLE: &str = "DFLASH_TEST_HANG_TRAINER_AFTER_STEPS";

/// With `DFLASH_TEST_HANG_TRAINER_AFTER_STEPS=N` in the environment the
/// training thread stops working for good once N steps are done and a
/// command arrives (as a trainer stuck in a device call would), so tests can
/// check that its leases go to other drafters.
#[cfg(feature = "test-hooks")]
pub fn hang_trainer_after_steps() -> Option<u64> {
    std::env::var(HANG_TRAINER_AFTER_STEPS_VARIABLE)
        .ok()
        .and_then(|value| value.parse::<u64>().ok())
}

/// The training thread never hangs on purpose in a build without the
/// feature (the variable is not read).
#[cfg(not(feature = "test-hooks"))]
pub fn hang_trainer_after_steps() -> Option<u64> {
    None
}
