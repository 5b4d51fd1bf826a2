//! What the training thread drives: the real DFlash trainer or the
//! synthetic stand-in. Both sit behind one trait so the queue discipline
//! (batching, acks, checkpoints, shutdown) is the same code in load tests
//! and in real training.

use std::path::{Path, PathBuf};
use std::time::Duration;

use dflash_model::draft::{
    DraftConfig, DraftError, DraftModel, DraftOptions, DraftTrainer, FrozenTargetHeads, StepReport,
    TargetDimensions, TrainerSettings, TrainingSequence,
};
use dflash_proto::v1::Sample;
use tracing::info;

use crate::samples::{decode_sample, require_last_hidden, SampleError, SampleExpectations};
use crate::settings::{DraftArchitecture, EngineSettings, ModelMode};

/// Errors of the engine; a failing micro-batch hands its items back.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Draft(#[from] DraftError),
    #[error("--target-model is required to train the DFlash drafter")]
    NoTargetModel,
    #[error("{0}")]
    Device(String),
    #[error("mask token: {0} (pass --mask-token-id)")]
    MaskToken(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A sample checked and converted, ready to batch.
pub struct PreparedSample {
    /// Tokens in the sample (for budgets and throughput).
    pub tokens: usize,
    /// The decoded sequence; `None` in synthetic mode.
    pub sequence: Option<TrainingSequence>,
}

/// One model (or stand-in) as the training thread sees it.
pub trait TrainingEngine {
    /// Checks a delivery's sample; an error dead-letters the item.
    fn prepare(&self, sample: &Sample) -> Result<PreparedSample, SampleError>;
    /// Forward and backward of one micro-batch.
    fn accumulate(&mut self, batch: Vec<PreparedSample>) -> Result<(), EngineError>;
    /// One optimizer step over the accumulated micro-batches.
    fn step(&mut self) -> Result<StepReport, EngineError>;
    /// Forgets accumulated, unstepped micro-batches.
    fn discard(&mut self);
    fn set_total_steps(&mut self, total_steps: u64);
    fn steps_done(&self) -> u64;
    /// Writes a checkpoint to `dir` atomically.
    fn save_checkpoint(&self, dir: &Path) -> Result<(), EngineError>;
    /// The device, as reported in stats.
    fn device_name(&self) -> String;
    /// The draft model whose weights the model sync sends and loads
    /// (`None`: nothing to sync, as in synthetic mode).
    fn draft_model(&self) -> Option<&DraftModel> {
        None
    }
    /// The trainer, for data parallelism (`None`: nothing to train as one
    /// model, as in synthetic mode).
    fn trainer_mut(&mut self) -> Option<&mut DraftTrainer> {
        None
    }
    fn trainer(&self) -> Option<&DraftTrainer> {
        None
    }
}

/// Builds the engine `config` asks for, resuming from `resume_from` when given.
pub fn build_engine(
    config: &EngineSettings,
    resume_from: Option<&Path>,
    total_steps: u64,
) -> Result<Box<dyn TrainingEngine>, EngineError> {
    match config.model {
        ModelMode::Synthetic { ms_per_1k_tokens } => {
            Ok(Box::new(SyntheticEngine::new(ms_per_1k_tokens)))
        }
        ModelMode::DFlash => Ok(Box::new(DFlashEngine::new(
            config,
            resume_from,
            total_steps,
        )?)),
    }
}

/// The real DFlash trainer.
pub struct DFlashEngine {
    trainer: DraftTrainer,
    expectations: SampleExpectations,
}

impl DFlashEngine {
    fn new(
        config: &EngineSettings,
        resume_from: Option<&Path>,
        total_steps: u64,
    ) -> Result<Self, EngineError> {
        let target_dir = config
            .target_model
            .as_deref()
            .ok_or(EngineError::NoTargetModel)?;
        let device = config
            .resolve_device()
            .map_err(|error| EngineError::Device(error.to_string()))?;
        let compute_kind = config.compute_kind(device);
        let (target_config, frozen) = FrozenTargetHeads::load(target_dir, device, compute_kind)?;
        let mut settings = TrainerSettings::recipe_defaults(config.block_size, total_steps);
        settings.num_anchors = config.num_anchors;
        if let Some(gamma) = config.loss_gamma {
            settings.loss_decay_gamma = gamma;
        }
        settings.max_grad_norm = config.max_grad_norm;
        settings.grad_norm_spike_ratio = config.grad_norm_spike_ratio;
        settings.adamw.weight_decay = config.weight_decay;
        settings.adamw.beta1 = config.adam_beta1;
        settings.schedule.peak_learning_rate = config.learning_rate;
        settings.schedule.warmup_fraction = config.warmup_fraction;
        settings.seed = config.seed;
        let mut trainer = match resume_from {
            Some(checkpoint) => {
                info!(checkpoint = %checkpoint.display(), "resuming from checkpoint");
                DraftTrainer::resume(checkpoint, frozen, device, compute_kind, settings)?
            }
            None => {
                let mask_token_id = match config.mask_token_id {
                    Some(id) => id,
                    None => {
                        let (id, source) = dflash_model::tokens::default_mask_token_id(target_dir)
                            .map_err(|error| EngineError::MaskToken(error.to_string()))?;
                        info!(mask_token_id = id, %source, "mask token");
                        id
                    }
                };
                let options = DraftOptions {
                    num_draft_layers: Some(config.draft_layers),
                    block_size: Some(config.block_size),
                    mask_token_id,
                    target_layer_ids: config.target_layer_ids.clone(),
                };
                let mut draft_config =
                    DraftConfig::for_target(&TargetDimensions::from(&target_config), &options)?;
                match config.architecture {
                    DraftArchitecture::Dflash => {}
                    DraftArchitecture::Dflash2 => {
                        draft_config = draft_config
                            .with_dflash2(dflash_model::draft::config::Dflash2Config::default())?;
                    }
                    DraftArchitecture::Dspark => {
                        draft_config = draft_config
                            .with_dspark(dflash_model::draft::DsparkConfig::default())?;
                    }
                }
                let model =
                    DraftModel::new(draft_config, frozen, device, compute_kind, config.seed)?;
                DraftTrainer::new(model, settings)
            }
        };
        let attention = config.attention_for(device);
        trainer.set_attention(attention)?;
        let draft_config = trainer.model().config();
        info!(
            parameters = trainer.model().num_parameters(),
            layers = draft_config.num_draft_layers,
            block_size = draft_config.block_size,
            target_layer_ids = ?draft_config.target_layer_ids,
            step = trainer.progress().step,
            ?attention,
            "draft model ready"
        );
        let expectations = SampleExpectations {
            hidden_width: draft_config.target_hidden_width(),
            vocab_size: draft_config.vocab_size,
        };
        Ok(DFlashEngine {
            trainer,
            expectations,
        })
    }
}

impl TrainingEngine for DFlashEngine {
    fn prepare(&self, sample: &Sample) -> Result<PreparedSample, SampleError> {
        let sequence = decode_sample(sample, self.expectations)?;
        if self.trainer.model().is_dspark() {
            require_last_hidden(&sequence, self.trainer.model().config().hidden_size)?;
        }
        Ok(PreparedSample {
            tokens: sequence.len(),
            sequence: Some(sequence),
        })
    }

    fn accumulate(&mut self, batch: Vec<PreparedSample>) -> Result<(), EngineError> {
        let sequences: Vec<TrainingSequence> = batch
            .into_iter()
            .filter_map(|prepared| prepared.sequence)
            .collect();
        self.trainer.accumulate(&sequences)?;
        Ok(())
    }

    fn step(&mut self) -> Result<StepReport, EngineError> {
        Ok(self.trainer.step()?)
    }

    fn discard(&mut self) {
        self.trainer.discard_accumulation();
    }

    fn set_total_steps(&mut self, total_steps: u64) {
        self.trainer.set_total_steps(total_steps);
    }

    fn steps_done(&self) -> u64 {
        self.trainer.progress().step
    }

    fn save_checkpoint(&self, dir: &Path) -> Result<(), EngineError> {
        Ok(self.trainer.save_checkpoint(dir)?)
    }

    fn device_name(&self) -> String {
        dflash_model::device::device_label(self.trainer.model().device())
    }

    fn trainer_mut(&mut self) -> Option<&mut DraftTrainer> {
        Some(&mut self.trainer)
    }

    fn trainer(&self) -> Option<&DraftTrainer> {
        Some(&self.trainer)
    }

    fn draft_model(&self) -> Option<&DraftModel> {
        Some(self.trainer.model())
    }
}

/// Consumes at a set rate without a model.
pub struct SyntheticEngine {
    ms_per_1k_tokens: f64,
    pending_samples: u64,
    pending_tokens: u64,
    steps: u64,
    samples: u64,
    tokens: u64,
}

impl SyntheticEngine {
    pub fn new(ms_per_1k_tokens: f64) -> Self {
        SyntheticEngine {
            ms_per_1k_tokens,
            pending_samples: 0,
            pending_tokens: 0,
            steps: 0,
            samples: 0,
            tokens: 0,
        }
    }
}

impl TrainingEngine for SyntheticEngine {
    fn prepare(&self, sample: &Sample) -> Result<PreparedSample, SampleError> {
        sample
            .validate()
            .map_err(dflash_proto::sample::SampleError::from)?;
        Ok(PreparedSample {
            tokens: dflash_proto::sample::token_count(sample) as usize,
            sequence: None,
        })
    }

    fn accumulate(&mut self, batch: Vec<PreparedSample>) -> Result<(), EngineError> {
        let tokens: usize = batch.iter().map(|prepared| prepared.tokens).sum();
        // The stand-in for compute: this thread is busy for the modelled time.
        std::thread::sleep(Duration::from_secs_f64(
            self.ms_per_1k_tokens * tokens as f64 / 1e6,
        ));
        self.pending_samples += batch.len() as u64;
        self.pending_tokens += tokens as u64;
        Ok(())
    }

    fn step(&mut self) -> Result<StepReport, EngineError> {
        self.steps += 1;
        self.samples += self.pending_samples;
        self.tokens += self.pending_tokens;
        let report = StepReport {
            step: self.steps,
            loss: 0.0,
            accuracy: 0.0,
            accuracy_per_position: Vec::new(),
            learning_rate: 0.0,
            grad_norm: 0.0,
            samples: self.pending_samples as usize,
            tokens: self.pending_tokens as usize,
            selector: None,
            dspark: None,
        };
        self.pending_samples = 0;
        self.pending_tokens = 0;
        Ok(report)
    }

    fn discard(&mut self) {
        self.pending_samples = 0;
        self.pending_tokens = 0;
    }

    fn set_total_steps(&mut self, _total_steps: u64) {}

    fn steps_done(&self) -> u64 {
        self.steps
    }

    /// Synthetic checkpoints hold only the progress, so the checkpoint
    /// machinery (atomic rename, pruning, `latest`) is exercised too.
    fn save_checkpoint(&self, dir: &Path) -> Result<(), EngineError> {
        let staging = dir.with_extension("tmp");
        std::fs::create_dir_all(&staging).map_err(|source| EngineError::Io {
            path: staging.clone(),
            source,
        })?;
        let progress = serde_json::json!({ "synthetic": true, "step": self.steps, "samples_trained": self.samples });
        let state_path = staging.join(dflash_model::draft::TRAINER_STATE_FILE_NAME);
        std::fs::write(&state_path, progress.to_string()).map_err(|source| EngineError::Io {
            path: state_path,
            source,
        })?;
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|source| EngineError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        std::fs::rename(&staging, dir).map_err(|source| EngineError::Io {
            path: dir.to_path_buf(),
            source,
        })
    }

    fn device_name(&self) -> String {
        "synthetic".to_string()
    }
}
