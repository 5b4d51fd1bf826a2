//! Flags of the model-sync service (flattened into the broker's flags):
//! the run's model's ([`crate::run_model::RunModelSettings`]); the
//! lighthouse's are `crate::lighthouse::config`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::ConfigError;
use dflash_shell::parse_duration;

#[derive(Debug, Clone, Args)]
pub struct ModelSyncConfig {
    /// Folder the run's one draft model is written to, in the
    /// reference dflash format, every --model-save-every and at the end; a
    /// restarted broker resumes the model from it. Without it the model
    /// lives in memory only.
    #[arg(long, env = "DFLASH_MODEL_OUTPUT")]
    pub model_output: Option<PathBuf>,

    /// How often a changed model is written (0: only at the end).
    #[arg(long, env = "DFLASH_MODEL_SAVE_EVERY", default_value = "5m", value_parser = parse_duration)]
    pub model_save_every: Duration,

    /// After end-of-stream COMPLETE, how long the final model waits for the
    /// final snapshot of every drafter that still has a session open.
    #[arg(long, env = "DFLASH_MODEL_FINAL_SYNC_TIMEOUT", default_value = "2m", value_parser = parse_duration)]
    pub model_final_sync_timeout: Duration,

    /// The draft model's `config.json` this run trains: every drafter's
    /// snapshot (the first, which defines the model, included) must carry
    /// it, or is refused naming both. Without it the first snapshot defines
    /// the model and later ones must match its tensors' shapes.
    #[arg(long, env = "DFLASH_MODEL_CONFIG")]
    pub model_config: Option<PathBuf>,

    /// Versions of the run's model read by evaluators and not yet reported that the
    /// broker keeps (reading one more lets the oldest go). An evaluator
    /// that measures slower than it reads (a busy CPU) queues this many;
    /// each kept version may cost one f32 copy of the weights once a newer
    /// snapshot replaced it (4.2 GB for a 1 B-parameter drafter).
    #[arg(long, env = "DFLASH_MAX_PENDING_EVALUATIONS", default_value_t = crate::run_model::evaluation::DEFAULT_MAX_PENDING_READS, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_pending_evaluations: u32,
}

impl Default for ModelSyncConfig {
    fn default() -> Self {
        ModelSyncConfig {
            model_output: None,
            model_save_every: Duration::from_secs(300),
            model_final_sync_timeout: Duration::from_secs(120),
            model_config: None,
            max_pending_evaluations: crate::run_model::evaluation::DEFAULT_MAX_PENDING_READS,
        }
    }
}

impl ModelSyncConfig {
    /// What the run's model takes of these flags.
    pub fn run_model_settings(&self) -> crate::run_model::RunModelSettings {
        crate::run_model::RunModelSettings {
            model_output: self.model_output.clone(),
            save_every: self.model_save_every,
            final_snapshot_timeout: self.model_final_sync_timeout,
            model_config: self.model_config.clone(),
            max_pending_evaluations: self.max_pending_evaluations,
        }
    }

    /// Checks the values; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
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
    fn zero_durations_name_their_flag() {
        assert!(ModelSyncConfig::default().validate().is_ok());
        let config = ModelSyncConfig {
            model_final_sync_timeout: Duration::ZERO,
            ..ModelSyncConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(message.contains("--model-final-sync-timeout"), "{message}");
    }
}
