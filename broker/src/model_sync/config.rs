//! Flags of the model-sync service (flattened into the broker's flags).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::center::{OuterSettings, StalenessScaling};
use crate::config::ConfigError;
use dflash_shell::parse_duration;

#[derive(Debug, Clone, Args)]
pub struct ModelSyncConfig {
    /// Folder the run's one draft model (the center) is written to, in the
    /// reference dflash format, every --model-save-every and at the end; a
    /// restarted broker resumes the center from it. Without it the center
    /// lives in memory only.
    #[arg(long, env = "DFLASH_MODEL_OUTPUT")]
    pub model_output: Option<PathBuf>,

    /// How often a changed center is written (0: only at the end).
    #[arg(long, env = "DFLASH_MODEL_SAVE_EVERY", default_value = "5m", value_parser = parse_duration)]
    pub model_save_every: Duration,

    /// After end-of-stream COMPLETE, how long the final center waits for the
    /// final sync of every drafter that still has a sync session open.
    #[arg(long, env = "DFLASH_MODEL_FINAL_SYNC_TIMEOUT", default_value = "2m", value_parser = parse_duration)]
    pub model_final_sync_timeout: Duration,

    /// Outer learning rate η: each drafter's delta moves the center by η·delta.
    #[arg(long, env = "DFLASH_OUTER_LEARNING_RATE", default_value_t = 1.0)]
    pub outer_learning_rate: f32,

    /// Nesterov momentum μ of the outer step, in [0, 1). 0 (the default) is
    /// plain asynchronous local SGD and keeps no optimizer state: in the
    /// model-sync study (BENCHMARKS.md) outer momentum only added to the
    /// momentum asynchrony already brings (0.7 cost 0.13-0.25 of one
    /// drafter's τ at 2 drafters).
    #[arg(long, env = "DFLASH_OUTER_MOMENTUM", default_value_t = 0.0)]
    pub outer_momentum: f32,

    /// Deltas averaged per momentum step (N of the delayed Nesterov update;
    /// 0: the number of drafters syncing at the time).
    #[arg(long, env = "DFLASH_OUTER_MOMENTUM_DELAY", default_value_t = 0)]
    pub outer_momentum_delay: u32,

    /// How a delta's weight follows its staleness: `none` (every delta
    /// counts fully) or `inverse` (a delta s center updates old counts
    /// 1/s; Zhang et al. 2016).
    #[arg(long, env = "DFLASH_OUTER_STALENESS_SCALING", value_enum, default_value_t = StalenessScaling::None)]
    pub outer_staleness_scaling: StalenessScaling,

    /// A delta whose base is more than this many center updates old is
    /// discarded and its drafter restarts from the center (0: no bound).
    #[arg(long, env = "DFLASH_SYNC_MAX_STALENESS", default_value_t = 0)]
    pub sync_max_staleness: u64,

    /// A delta whose L2 norm is over this many times the largest norm of the
    /// last 32 applied deltas is discarded (after 4 applied; 0: no bound).
    /// A delta with a NaN or an infinity is always discarded.
    #[arg(long, env = "DFLASH_MAX_DELTA_NORM_RATIO", default_value_t = super::center::DEFAULT_MAX_DELTA_NORM_RATIO)]
    pub max_delta_norm_ratio: f32,

    /// The draft model's `config.json` this run trains: every drafter's
    /// JOIN (the first, which defines the center, included) must carry it,
    /// or is refused naming both. Without it the first JOIN defines the
    /// model and later ones must match its tensors' shapes.
    #[arg(long, env = "DFLASH_MODEL_CONFIG")]
    pub model_config: Option<PathBuf>,

    /// Center versions read by evaluators and not yet reported that the
    /// broker keeps (reading one more lets the oldest go). An evaluator
    /// that measures slower than it reads (a busy CPU) queues this many;
    /// each kept version may cost one f32 copy of the weights while the
    /// drafters update the center (4.2 GB for a 1 B-parameter drafter).
    #[arg(long, env = "DFLASH_MAX_PENDING_EVALUATIONS", default_value_t = super::evaluation::DEFAULT_MAX_PENDING_READS, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_pending_evaluations: u32,
}

impl Default for ModelSyncConfig {
    fn default() -> Self {
        let outer = OuterSettings::default();
        ModelSyncConfig {
            model_output: None,
            model_save_every: Duration::from_secs(300),
            model_final_sync_timeout: Duration::from_secs(120),
            outer_learning_rate: outer.learning_rate,
            outer_momentum: outer.momentum,
            outer_momentum_delay: outer.momentum_delay,
            sync_max_staleness: outer.max_staleness,
            max_delta_norm_ratio: outer.max_delta_norm_ratio,
            outer_staleness_scaling: outer.staleness_scaling,
            model_config: None,
            max_pending_evaluations: super::evaluation::DEFAULT_MAX_PENDING_READS,
        }
    }
}

impl ModelSyncConfig {
    pub fn outer_settings(&self) -> OuterSettings {
        OuterSettings {
            learning_rate: self.outer_learning_rate,
            momentum: self.outer_momentum,
            momentum_delay: self.outer_momentum_delay,
            max_staleness: self.sync_max_staleness,
            max_delta_norm_ratio: self.max_delta_norm_ratio,
            staleness_scaling: self.outer_staleness_scaling,
        }
    }

    /// Checks the values; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.outer_learning_rate.is_finite() && self.outer_learning_rate > 0.0) {
            return Err(ConfigError::Parse(format!(
                "--outer-learning-rate must be a positive number, got {}",
                self.outer_learning_rate
            )));
        }
        if !(self.outer_momentum.is_finite() && (0.0..1.0).contains(&self.outer_momentum)) {
            return Err(ConfigError::Parse(format!(
                "--outer-momentum must be in [0, 1), got {}",
                self.outer_momentum
            )));
        }
        let ratio = self.max_delta_norm_ratio;
        if !(ratio == 0.0 || (ratio.is_finite() && ratio > 1.0)) {
            return Err(ConfigError::Parse(format!(
                "--max-delta-norm-ratio must be 0 (no bound) or a finite ratio above 1, got {ratio}"
            )));
        }
        if self.model_final_sync_timeout.is_zero() {
            return Err(ConfigError::NonPositiveDuration {
                flag: "--model-final-sync-timeout",
                value: self.model_final_sync_timeout,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_outer_parameters_name_their_flag() {
        assert!(ModelSyncConfig::default().validate().is_ok());
        let config = ModelSyncConfig {
            outer_momentum: 1.0,
            ..ModelSyncConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(message.starts_with("--outer-momentum"), "{message}");
        let config = ModelSyncConfig {
            outer_learning_rate: f32::NAN,
            ..ModelSyncConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(message.starts_with("--outer-learning-rate"), "{message}");
    }
}
