//! The data-parallel flags of `drafter-server`.

use std::time::Duration;

use clap::Args;
use dflash_shell::parse_duration;

/// The data-parallel flags.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct DataParallelConfig {
    /// This drafter's address on the drafters' network (e.g. its pod IP):
    /// its c10d store and Gloo's transport listen there and the other
    /// drafters connect to it. Plain TCP without authentication: keep it
    /// on a network only drafters reach (see docs/model-sync.md).
    #[arg(long, env = "DFLASH_COLLECTIVE_HOST", default_value = "127.0.0.1")]
    pub collective_host: String,

    /// Port of this drafter's c10d store (0: any free port; it is told to
    /// the others through the broker).
    #[arg(long, env = "DFLASH_COLLECTIVE_PORT", default_value_t = 0)]
    pub collective_port: u16,

    /// Bound on one collective (an all-reduce, a heal): past it a member
    /// that hangs is given up on and the step fails for everyone.
    #[arg(long, env = "DFLASH_COLLECTIVE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub collective_timeout: Duration,

    /// Rank 0 sends the trained model to the broker (the run's checkpoint
    /// in --model-output, the online evaluator) every this many committed
    /// steps; every member sends it when it stops. 0: only when stopping.
    #[arg(long, env = "DFLASH_SNAPSHOT_EVERY", default_value_t = 50)]
    pub snapshot_every: u64,

    /// Test hook (cargo feature `test-hooks`; no flag): the first this many
    /// tries of every decision fetch lose the broker's answer after the
    /// broker recorded the vote, as a connection cut at that moment would.
    #[cfg(feature = "test-hooks")]
    #[arg(skip)]
    pub lose_decisions: u32,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        DataParallelConfig {
            collective_host: "127.0.0.1".to_string(),
            collective_port: 0,
            collective_timeout: Duration::from_secs(60),
            snapshot_every: 50,
            #[cfg(feature = "test-hooks")]
            lose_decisions: 0,
        }
    }
}
