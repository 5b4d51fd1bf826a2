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

/// The environment variable of [`lose_decision`].
#[cfg(feature = "test-hooks")]
const LOSE_DECISIONS_VARIABLE: &str = "DFLASH_TEST_LOSE_DECISIONS";

/// With `DFLASH_TEST_LOSE_DECISIONS=<drafter id>:<n>` in the environment,
/// the first `n` tries of each commit-decision fetch of that drafter lose
/// the broker's answer after the broker recorded the vote (as a connection
/// cut at that moment would), so tests can check that the member fetches
/// the decision again and ends where the others do.
#[cfg(feature = "test-hooks")]
pub fn lose_decision(drafter_id: &str, attempt: u32) -> bool {
    let Ok(value) = std::env::var(LOSE_DECISIONS_VARIABLE) else {
        return false;
    };
    value.split(',').any(|entry| {
        entry.rsplit_once(':').is_some_and(|(id, count)| {
            id == drafter_id && count.parse::<u32>().is_ok_and(|count| attempt <= count)
        })
    })
}

/// Decisions are never lost on purpose in a build without the feature.
#[cfg(not(feature = "test-hooks"))]
pub fn lose_decision(_drafter_id: &str, _attempt: u32) -> bool {
    false
}
