//! The drafter's model-sync flags ([`SyncConfig`]) and their enums.

use std::time::Duration;

use clap::{Args, ValueEnum};
use dflash_proto::v1 as proto;
use tch::Kind;

/// Element type of weights on the sync wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SyncDtype {
    /// Exact: the drafter's master weights are f32.
    F32,
    /// Half the bytes; deltas and the center are rounded to bf16 on the
    /// wire (the broker's center stays f32).
    Bf16,
}

impl SyncDtype {
    pub(super) fn kind(self) -> Kind {
        match self {
            SyncDtype::F32 => Kind::Float,
            SyncDtype::Bf16 => Kind::BFloat16,
        }
    }

    pub(super) fn proto(self) -> proto::Dtype {
        match self {
            SyncDtype::F32 => proto::Dtype::F32,
            SyncDtype::Bf16 => proto::Dtype::Bf16,
        }
    }
}

/// How this drafter trains one model with the run's other drafters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelSyncMode {
    /// The drafters are one data-parallel trainer: each trains its share of
    /// every step, gradients all-reduced over c10d (`crate::data_parallel`).
    DataParallel,
    /// Asynchronous local SGD through the broker's center: `--sync-every`
    /// local steps, then a delta (for drafters across slow links).
    LocalSgd,
    /// An independent drafter: no model sync at all.
    Off,
}

/// The drafter's model-sync flags.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct SyncConfig {
    /// How this drafter trains one model with the others: `data-parallel`
    /// (the default; adding drafters needs no other flag), `local-sgd` or
    /// `off`.
    #[arg(
        long,
        env = "DFLASH_MODEL_SYNC",
        value_enum,
        default_value = "data-parallel"
    )]
    pub model_sync: ModelSyncMode,

    /// With `--model-sync local-sgd`: exchange with the broker's center
    /// every this many optimizer steps. 0 trains an independent drafter,
    /// whatever `--model-sync` says.
    #[arg(long, env = "DFLASH_SYNC_EVERY", default_value_t = 10)]
    pub sync_every: u64,

    /// Element type of weights on the sync wire.
    #[arg(long, env = "DFLASH_SYNC_DTYPE", value_enum, default_value = "f32")]
    pub sync_dtype: SyncDtype,

    /// Bound on one exchange (e.g. `90s`, `2m`); past it the drafter
    /// continues on its own weights and re-joins at the next sync point.
    #[arg(long, env = "DFLASH_SYNC_TIMEOUT", default_value = "2m", value_parser = dflash_shell::parse_duration)]
    pub sync_timeout: Duration,
}

impl SyncConfig {
    /// The mode in force: `--sync-every 0` is an independent drafter.
    pub fn mode(&self) -> ModelSyncMode {
        if self.sync_every == 0 {
            ModelSyncMode::Off
        } else {
            self.model_sync
        }
    }
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            model_sync: ModelSyncMode::DataParallel,
            sync_every: 10,
            sync_dtype: SyncDtype::F32,
            sync_timeout: Duration::from_secs(120),
        }
    }
}
