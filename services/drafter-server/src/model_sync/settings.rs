//! The drafter's model-sync flags ([`SyncConfig`]) and its mode.

use std::time::Duration;

use clap::{Args, ValueEnum};

/// How this drafter trains one model with the run's other drafters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelSyncMode {
    /// The drafters are one data-parallel trainer: each trains its share of
    /// every step, gradients all-reduced over c10d (`crate::data_parallel`).
    DataParallel,
    /// An independent drafter: no model sync at all.
    Off,
}

/// The drafter's model-sync flags.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct SyncConfig {
    /// How this drafter trains one model with the others: `data-parallel`
    /// (the default; adding drafters needs no other flag) or `off` (an
    /// independent drafter).
    #[arg(
        long,
        env = "DFLASH_MODEL_SYNC",
        value_enum,
        default_value = "data-parallel"
    )]
    pub model_sync: ModelSyncMode,

    /// Bound on one call to the broker about the run's model (the
    /// read when this drafter starts, a snapshot; e.g. `90s`, `2m`); past
    /// it training goes on and the next snapshot tries again.
    #[arg(long, env = "DFLASH_SYNC_TIMEOUT", default_value = "2m", value_parser = dflash_shell::parse_duration)]
    pub sync_timeout: Duration,
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            model_sync: ModelSyncMode::DataParallel,
            sync_timeout: Duration::from_secs(120),
        }
    }
}
