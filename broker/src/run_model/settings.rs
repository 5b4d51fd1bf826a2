//! [`RunModelSettings`]: what the run's model takes of the broker's flags
//! (`crate::config::ModelSyncConfig` parses and checks them).

use std::path::PathBuf;
use std::time::Duration;

/// Where the run's model is written, when, and how many versions the
/// evaluator may have kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunModelSettings {
    /// `--model-output`: the folder the model is written to and resumed
    /// from; `None`: in memory only.
    pub model_output: Option<PathBuf>,
    /// `--model-save-every`: how often a changed model is written (zero:
    /// only at the end).
    pub save_every: Duration,
    /// `--model-final-sync-timeout`: after COMPLETE, how long the final
    /// model waits for the final snapshots of open sessions.
    pub final_snapshot_timeout: Duration,
    /// `--model-config`: the `config.json` every snapshot must carry.
    pub model_config: Option<PathBuf>,
    /// `--max-pending-evaluations`: versions kept for the evaluator.
    pub max_pending_evaluations: u32,
}
