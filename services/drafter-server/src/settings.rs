//! The drafter's flags once checked, split into the typed part each layer
//! uses: [`crate::config::DrafterServerConfig::validate`] makes a
//! [`DrafterSettings`] once, in [`crate::run()`], and no layer below takes
//! the flag struct. The choices the flags name ([`ModelMode`],
//! [`DraftArchitecture`], [`AttentionChoice`]) and [`ConfigError`] (a value
//! that cannot work) live here with them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use dflash_model::draft::{AttentionImplementation, DEFAULT_BLOCKS_PER_ATTENTION_CHUNK};
use dflash_shell::{DeviceChoice, DtypeChoice};
use tch::{Device, Kind};

use crate::data_parallel::DataParallelConfig;
use crate::model_sync::SyncConfig;

/// What trains on the deliveries.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelMode {
    /// The DFlash draft model, trained for real.
    DFlash,
    /// No model: each micro-batch "takes" `ms_per_1k_tokens` per thousand
    /// tokens, then is acked, to load-test the pipeline without weights.
    Synthetic { ms_per_1k_tokens: f64 },
}

impl FromStr for ModelMode {
    type Err = String;

    /// `dflash` or `synthetic:ms_per_1k_tokens=N`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "dflash" {
            return Ok(ModelMode::DFlash);
        }
        let Some(options) = text.strip_prefix("synthetic") else {
            return Err(format!(
                "invalid --model {text:?}: expected dflash or synthetic:ms_per_1k_tokens=N"
            ));
        };
        let mut ms_per_1k_tokens = 0.0;
        for option in options
            .trim_start_matches(':')
            .split(',')
            .filter(|option| !option.is_empty())
        {
            match option.split_once('=') {
                Some(("ms_per_1k_tokens", value)) => {
                    ms_per_1k_tokens = value
                        .parse::<f64>()
                        .ok()
                        .filter(|value| value.is_finite() && *value >= 0.0)
                        .ok_or_else(|| {
                            format!("invalid ms_per_1k_tokens {value:?} in --model {text:?}")
                        })?;
                }
                _ => {
                    return Err(format!(
                        "unknown synthetic option {option:?} in --model {text:?}"
                    ))
                }
            }
        }
        Ok(ModelMode::Synthetic { ms_per_1k_tokens })
    }
}

/// `--draft-architecture`: which reference draft model is trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftArchitecture {
    /// `DFlashDraftModel`.
    Dflash,
    /// `DFlash2DraftModel`: grouped dynamic convolutions in each layer and
    /// the candidate selector, trained with the selector loss (speculators'
    /// defaults: kernel 2, group 16, rank 256, top-k 16, α 1).
    Dflash2,
    /// speculators' `DSparkDraftModel`: the Markov and confidence heads,
    /// trained by distillation from the target's distribution (needs the
    /// broker's `--target-capture last-hidden-states`; speculators' defaults: rank
    /// 256, vanilla head, confidence head on `[h, W1[prev]]`, α 1).
    Dspark,
}

/// `--attention`: see [`EngineSettings::attention_for`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionChoice {
    Auto,
    Split,
    Fused,
}

/// A configuration that cannot work, naming the flag.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("--target-model is required with --model dflash")]
    NoTargetModel,
    #[error("--drafter-id must not be empty")]
    EmptyDrafterId,
    #[error("{flag} must be positive, got {value}")]
    NotPositive { flag: &'static str, value: String },
    #[error("--dtype {0} is not supported for training: use f32 or bf16")]
    UnsupportedDtype(&'static str),
    #[error("{0}")]
    Device(String),
    #[error("--warmup-fraction must be in [0, 1), got {0}")]
    WarmupFraction(f64),
    #[error("--adam-beta1 must be in [0, 1), got {0}")]
    AdamBeta1(f64),
    #[error("--grad-norm-spike-ratio must be 0 (off) or a finite ratio above 1, got {0}")]
    GradNormSpikeRatio(f64),
    #[error(
        "--resume continues this drafter's own checkpoint, but with --model-sync data-parallel \
         the drafter trains the run's model (read from the broker, its state from rank 0 at \
         the first quorum): its own weights and moments would be mixed with the run's. \
         Resume a run by restarting the broker on its --state-dir; --resume is for \
         --model-sync off"
    )]
    ResumeInDataParallel,
}

/// Every part of a checked configuration.
#[derive(Debug, Clone)]
pub struct DrafterSettings {
    pub connection: Connection,
    /// `--metrics-listen`.
    pub metrics_listen: Option<SocketAddr>,
    pub output: OutputSettings,
    pub engine: EngineSettings,
    pub schedule: ScheduleSettings,
    pub training_loop: LoopSettings,
    pub pump: PumpSettings,
    /// How this drafter trains, decided once at validation.
    pub mode: TrainingMode,
}

/// How a drafter trains with the run's other drafters. Decided once, at
/// validation (`DrafterServerConfig::validate`), from `--model-sync` and
/// the model: nothing after it asks the flags again.
#[derive(Debug, Clone, PartialEq)]
pub enum TrainingMode {
    /// A member of the run's one data-parallel trainer (the default): each
    /// step's quorum and commit from the broker's lighthouse, its gradient
    /// all-reduced over c10d, and the run's model read at the start and
    /// sent as snapshots (rank 0, and every member when it stops).
    DataParallel {
        /// The broker's copy of the run's model (`--sync-timeout`).
        model: SyncConfig,
        /// The c10d group (`--collective-*`, `--snapshot-every`, ...).
        group: DataParallelConfig,
    },
    /// Trains its own model: `--model-sync off`, or a synthetic model
    /// (no weights to all-reduce or send).
    Independent,
}

/// Who this drafter is and how it reaches the broker.
#[derive(Debug, Clone)]
pub struct Connection {
    /// `--broker`.
    pub broker: String,
    /// `--drafter-id`, not empty.
    pub drafter_id: String,
    pub security: dflash_client::ClientSecurityArgs,
    /// `--reconnect-timeout`.
    pub reconnect_timeout: Duration,
}

/// `--output` and `--resume`.
#[derive(Debug, Clone)]
pub struct OutputSettings {
    pub output: PathBuf,
    pub resume: bool,
}

/// What the training thread builds: the model and its trainer's recipe.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    pub model: ModelMode,
    /// `--target-model`; present when `model` is DFlash.
    pub target_model: Option<PathBuf>,
    pub device: DeviceChoice,
    /// f32 or bf16 (f16 refused), or the device's default.
    pub dtype: Option<DtypeChoice>,
    pub attention: AttentionChoice,
    pub architecture: DraftArchitecture,
    pub draft_layers: i64,
    pub block_size: i64,
    pub mask_token_id: Option<i64>,
    pub target_layer_ids: Option<Vec<i64>>,
    pub seed: u64,
    pub num_anchors: usize,
    pub loss_gamma: Option<f64>,
    pub learning_rate: f64,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub warmup_fraction: f64,
    pub max_grad_norm: f64,
    pub grad_norm_spike_ratio: f64,
}

impl EngineSettings {
    /// The device `--device` names, checked against what libtorch sees.
    pub fn resolve_device(&self) -> Result<Device, ConfigError> {
        dflash_model::device::resolve_device(self.device)
            .map_err(|error| ConfigError::Device(error.to_string()))
    }

    /// The attention implementation `--attention` asks for on `device`.
    pub fn attention_for(&self, device: Device) -> AttentionImplementation {
        let fused = AttentionImplementation::Fused {
            blocks_per_chunk: DEFAULT_BLOCKS_PER_ATTENTION_CHUNK,
        };
        match self.attention {
            AttentionChoice::Split => AttentionImplementation::Split,
            AttentionChoice::Fused => fused,
            AttentionChoice::Auto if device == Device::Cpu => AttentionImplementation::Split,
            AttentionChoice::Auto => fused,
        }
    }

    /// The compute dtype: --dtype, else f32 on the CPU and bf16 on a GPU.
    pub fn compute_kind(&self, device: Device) -> Kind {
        dflash_model::device::kind_for(self.dtype, device)
    }
}

/// How long the learning-rate schedule is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScheduleSettings {
    /// `--total-steps`: fixed; `None` estimates it from the broker's summary.
    pub total_steps: Option<u64>,
    /// `--fallback-total-steps`: the estimate when the broker knows nothing yet.
    pub fallback_total_steps: u64,
    /// `--max-step-samples`: the samples one step assumes.
    pub samples_per_step: u64,
}

impl ScheduleSettings {
    /// The schedule's length before anything is known of the run.
    pub fn initial_total_steps(&self) -> u64 {
        self.total_steps.unwrap_or(self.fallback_total_steps)
    }
}

/// Batching and checkpoint settings of the loop.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    pub batch_tokens: usize,
    pub grad_accumulation: u64,
    /// The run's step: a data-parallel member trains its share of it.
    pub max_step_samples: usize,
    pub save_every: u64,
    pub keep_checkpoints: usize,
    pub output: PathBuf,
}

/// The async loop's pacing and its bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PumpSettings {
    /// The credit window at the start: one step's worth of items plus the
    /// prefetch. A data-parallel member's window follows its share of the
    /// step once its quorums say how many members share it.
    pub credit_items: u32,
    /// `--prefetch-samples`: the window beyond a step's (or a share's)
    /// worth.
    pub prefetch_items: u32,
    /// `--credit-bytes` (0: no byte bound).
    pub credit_bytes: u64,
    pub linger: Duration,
    /// `--stats-interval`, at least 10 ms (a zero interval would spin).
    pub stats_period: Duration,
    pub shutdown_timeout: Duration,
    pub trainer_stall_timeout: Duration,
    pub max_skipped_steps: u64,
}
