//! The lighthouse's flags (the `broker` binary's data-parallel section).

use std::time::Duration;

use clap::Args;
use dflash_shell::parse_duration;

use super::LighthouseSettings;

/// Data-parallel drafters: quorum and commit (their own section of
/// `--help`, named where [`crate::config::BrokerConfig`] flattens it).
#[derive(Debug, Clone, PartialEq, Args)]
pub struct LighthouseConfig {
    /// Data-parallel drafters: the least a round waits for a live member of
    /// the last quorum that has not asked yet, and a step's vote for a
    /// member that has not voted. The wait used is never below the
    /// member's own --collective-timeout plus twice the longest recent
    /// step, so a member stuck in a collective a dead peer stalled is
    /// waited for, not dropped; a member whose Consume stream ended is not
    /// waited for at all.
    #[arg(long, env = "DFLASH_QUORUM_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub quorum_timeout: Duration,

    /// Data-parallel drafters: the fewest members a step is taken with.
    #[arg(long, env = "DFLASH_QUORUM_MIN_SIZE", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub quorum_min_size: u32,

    /// Data-parallel drafters: when no drafter holding the run's last
    /// committed step has asked for this long (they all died), roll the
    /// run's history back to the most advanced drafter that asks. The
    /// steps lost are logged as an error and counted in status
    /// (`rollbacks`, `steps_rolled_back`): their samples were trained into
    /// a model nobody holds any more. Without it (the default) the broker
    /// waits for a holder.
    #[arg(long, env = "DFLASH_ROLLBACK_AFTER", value_parser = parse_duration)]
    pub rollback_after: Option<Duration>,
}

impl Default for LighthouseConfig {
    fn default() -> Self {
        LighthouseConfig {
            quorum_timeout: Duration::from_secs(30),
            quorum_min_size: 1,
            rollback_after: None,
        }
    }
}

impl LighthouseConfig {
    pub fn settings(&self) -> LighthouseSettings {
        LighthouseSettings {
            timeout: self.quorum_timeout,
            min_size: self.quorum_min_size as usize,
            idle_wait: LighthouseSettings::default().idle_wait,
            rollback_after: self.rollback_after,
        }
    }

    /// Zero durations are refused naming the flag.
    pub fn zero_durations(&self) -> Vec<(&'static str, Duration)> {
        let mut durations = vec![("--quorum-timeout", self.quorum_timeout)];
        if let Some(after) = self.rollback_after {
            durations.push(("--rollback-after", after));
        }
        durations
    }
}
