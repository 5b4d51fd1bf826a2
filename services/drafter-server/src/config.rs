//! The drafter-server's flags with environment-variable fallbacks (`clap`)
//! and their checks: [`DrafterServerConfig::validate`] turns them into the
//! typed parts of [`crate::settings::DrafterSettings`], once.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use dflash_shell::{parse_bytes, parse_duration, DeviceChoice, DtypeChoice};

pub use crate::settings::{AttentionChoice, DraftArchitecture, ModelMode};
use crate::settings::{
    ConfigError, Connection, DrafterSettings, EngineSettings, LoopSettings, OutputSettings,
    PumpSettings, ScheduleSettings, TrainingMode,
};

/// Parses a comma-separated list of layer ids.
fn parse_layer_ids(text: &str) -> Result<Vec<i64>, String> {
    text.split(',')
        .map(|part| {
            part.trim()
                .parse::<i64>()
                .map_err(|_| format!("invalid layer id {part:?} in {text:?}"))
        })
        .collect()
}

/// Every setting of a drafter-server.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct DrafterServerConfig {
    /// Broker gRPC address.
    #[arg(long, env = "DFLASH_BROKER", default_value = "http://127.0.0.1:50051")]
    pub broker: String,

    /// This drafter's name in the broker's status (e.g. the pod name).
    #[arg(long, env = "DFLASH_DRAFTER_ID")]
    pub drafter_id: String,

    /// Hugging Face directory of the target model: its embedding and LM head
    /// are loaded (frozen) and its config sets the draft's widths. Required
    /// unless --model is synthetic.
    #[arg(long, env = "DFLASH_TARGET_MODEL")]
    pub target_model: Option<PathBuf>,

    /// `dflash` to train the DFlash drafter, or
    /// `synthetic:ms_per_1k_tokens=N` to consume and ack at a set rate
    /// without any model (load tests).
    #[arg(long, env = "DFLASH_DRAFTER_MODEL", default_value = "dflash")]
    pub model: ModelMode,

    /// Folder for checkpoints (`step-NNNNNNNN/`, plus a `latest` pointer).
    #[arg(long, env = "DFLASH_OUTPUT")]
    pub output: PathBuf,

    /// Device to train on: auto (the first CUDA device when libtorch sees
    /// one, else the CPU), cpu, cuda or cuda:N. A CUDA device libtorch does
    /// not see is an error at start.
    #[arg(long, env = "DFLASH_DEVICE", default_value = "auto")]
    pub device: DeviceChoice,

    /// Compute dtype: f32 or bf16; by default f32 on the CPU and bf16 on a
    /// GPU. Master weights and optimizer state are f32 either way.
    #[arg(long, env = "DFLASH_DTYPE", value_enum)]
    pub dtype: Option<DtypeChoice>,

    /// Draft decoder layers.
    #[arg(long, env = "DFLASH_DRAFT_LAYERS", default_value_t = 5)]
    pub draft_layers: i64,

    /// Tokens per drafted block (anchor + masks).
    #[arg(long, env = "DFLASH_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: i64,

    /// Token id of the mask token; by default the `mask_token` of the
    /// target's tokenizer_config.json, else (Qwen3, Llama: no mask_token)
    /// the reserved id just past the tokenizer's vocabulary, as the
    /// published DFlash drafters do (151669 for Qwen3-8B).
    #[arg(long, env = "DFLASH_MASK_TOKEN_ID")]
    pub mask_token_id: Option<i64>,

    /// Target layers the hidden states come from, comma-separated; by
    /// default the DFlash spacing for --draft-layers. Must match what the
    /// target-servers send.
    #[arg(long, env = "DFLASH_TARGET_LAYER_IDS", value_parser = parse_layer_ids)]
    pub target_layer_ids: Option<Vec<i64>>,

    /// Most anchors (training blocks) drawn per sequence.
    #[arg(long, env = "DFLASH_NUM_ANCHORS", default_value_t = 512)]
    pub num_anchors: usize,

    /// How the draft layers compute the blocks' attention over the context:
    /// `fused` (libtorch's fused kernel, nothing of size queries × context
    /// materialised: what fits a GPU at Qwen3-8B sizes), `split` (the scores
    /// materialised), or `auto`: fused on a GPU, split on the CPU. The same
    /// function either way (equal within 1e-5 in f32, gradients included).
    #[arg(long, env = "DFLASH_ATTENTION", value_enum, default_value_t = AttentionChoice::Auto)]
    pub attention: AttentionChoice,

    /// The draft model trained: `dflash` or `dflash2` (docs/dflash2.md).
    /// A run's drafters must all train the same one (the broker refuses a
    /// model config that differs from the run's).
    #[arg(long, env = "DFLASH_DRAFT_ARCHITECTURE", value_enum, default_value_t = DraftArchitecture::Dflash)]
    pub draft_architecture: DraftArchitecture,

    /// Decay γ of the per-position loss weights exp(-(k-1)/γ); by default
    /// 7 for block 16 and 4 for block 8.
    #[arg(long, env = "DFLASH_LOSS_GAMMA")]
    pub loss_gamma: Option<f64>,

    /// Peak learning rate of AdamW.
    #[arg(long, env = "DFLASH_LEARNING_RATE", default_value_t = 6e-4)]
    pub learning_rate: f64,

    /// AdamW decoupled weight decay.
    #[arg(long, env = "DFLASH_WEIGHT_DECAY", default_value_t = 0.0)]
    pub weight_decay: f64,

    /// AdamW's first-moment decay β1 (PyTorch's 0.9).
    #[arg(long, env = "DFLASH_ADAM_BETA1", default_value_t = 0.9)]
    pub adam_beta1: f64,

    /// Fraction of the schedule spent in linear warmup before the cosine decay.
    #[arg(long, env = "DFLASH_WARMUP_FRACTION", default_value_t = 0.04)]
    pub warmup_fraction: f64,

    /// Global gradient-norm clipping bound.
    #[arg(long, env = "DFLASH_MAX_GRAD_NORM", default_value_t = 1.0)]
    pub max_grad_norm: f64,

    /// Micro-batches per optimizer step.
    #[arg(long, env = "DFLASH_GRAD_ACCUMULATION", default_value_t = 1)]
    pub grad_accumulation: u64,

    /// Token budget of one micro-batch (longest sequence × sequences, i.e.
    /// padded tokens).
    #[arg(long, env = "DFLASH_BATCH_TOKENS", default_value_t = 16384)]
    pub batch_tokens: usize,

    /// Most samples in one optimizer step of the run; a step is taken when
    /// this many are held even if the token budget is not reached, so the
    /// credit window can never stall. Data-parallel members each train
    /// their share (this over the members of the step) and each member's
    /// credit window is its share plus --prefetch-samples.
    #[arg(long, env = "DFLASH_MAX_STEP_SAMPLES", default_value_t = 64)]
    pub max_step_samples: usize,

    /// Extra deliveries requested beyond one step's worth, so the next batch
    /// is already here when a step ends (the credit window is
    /// max-step-samples + prefetch-samples items).
    #[arg(long, env = "DFLASH_PREFETCH_SAMPLES", default_value_t = 8)]
    pub prefetch_samples: usize,

    /// Byte limit of the credit window (`256MiB`; 0: none).
    #[arg(long, env = "DFLASH_CREDIT_BYTES", default_value = "0", value_parser = parse_bytes)]
    pub credit_bytes: u64,

    /// When no delivery has arrived for this long, train on what is held
    /// rather than wait for a full batch (the end of a run, slow targets).
    #[arg(long, env = "DFLASH_LINGER", default_value = "1s", value_parser = parse_duration)]
    pub linger: Duration,

    /// Length of the learning-rate schedule in optimizer steps. Without it
    /// the length is estimated from the broker's run summary (see README).
    #[arg(long, env = "DFLASH_TOTAL_STEPS")]
    pub total_steps: Option<u64>,

    /// Schedule length used while the broker does not know how many items
    /// the run will have.
    #[arg(long, env = "DFLASH_FALLBACK_TOTAL_STEPS", default_value_t = 10_000)]
    pub fallback_total_steps: u64,

    /// Write a checkpoint every this many optimizer steps (0: only at the end).
    #[arg(long, env = "DFLASH_SAVE_EVERY", default_value_t = 1000)]
    pub save_every: u64,

    /// Step checkpoints kept; older ones are deleted.
    #[arg(long, env = "DFLASH_KEEP_CHECKPOINTS", default_value_t = 3)]
    pub keep_checkpoints: usize,

    /// Continue from the latest checkpoint in --output when there is one.
    #[arg(long, env = "DFLASH_RESUME", default_value_t = false)]
    pub resume: bool,

    /// Seed of the draft initialisation and anchor sampling.
    #[arg(long, env = "DFLASH_SEED", default_value_t = 0)]
    pub seed: u64,

    /// Interval of the stats sent to the broker (and of schedule re-estimation).
    #[arg(long, env = "DFLASH_STATS_INTERVAL", default_value = "2s", value_parser = parse_duration)]
    pub stats_interval: Duration,

    /// Bound on a graceful stop (SIGTERM): finishing the current step,
    /// checkpointing and returning unused deliveries.
    #[arg(long, env = "DFLASH_SHUTDOWN_TIMEOUT", default_value = "2m", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,

    /// How long to keep reconnecting to a broker that went away.
    #[arg(long, env = "DFLASH_RECONNECT_TIMEOUT", default_value = "1m", value_parser = parse_duration)]
    pub reconnect_timeout: Duration,

    /// Leases are extended only while the trainer shows progress (a step,
    /// an ack) within this: a stuck trainer loses its leases to other
    /// drafters after the broker's lease timeout.
    #[arg(long, env = "DFLASH_TRAINER_STALL_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub trainer_stall_timeout: Duration,

    /// Skipped optimizer steps in a row (loss or gradient norm not finite,
    /// or a gradient spike) after which this drafter stops with an error
    /// and a non-zero exit; its held items go back to the queue. 0: never.
    #[arg(long, env = "DFLASH_MAX_SKIPPED_STEPS", default_value_t = 5)]
    pub max_skipped_steps: u64,

    /// A step whose gradient norm exceeds this many times the median norm
    /// of the last 32 steps taken is skipped (after 8 steps); 0 turns the
    /// bound off. Non-finite steps are always skipped.
    #[arg(long, env = "DFLASH_GRAD_NORM_SPIKE_RATIO", default_value_t = dflash_model::draft::DEFAULT_GRAD_NORM_SPIKE_RATIO)]
    pub grad_norm_spike_ratio: f64,

    /// Serve Prometheus metrics (`GET /metrics`, `dflash_drafter_*`) on this
    /// address, e.g. `0.0.0.0:9092`; off when unset.
    #[arg(long, env = "DFLASH_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// Write this process's final report here when it ends (JSON: busy
    /// fraction, tokens/s, samples, steps and loss over the whole run), for
    /// a supervisor such as `dflash local`.
    #[arg(long, env = "DFLASH_REPORT_FILE")]
    pub report_file: Option<PathBuf>,

    /// The link to the broker's copy of the run's model.
    #[command(flatten)]
    pub model_sync: crate::model_sync::SyncConfig,

    /// Data parallelism's collectives (`--model-sync data-parallel`).
    #[command(flatten)]
    pub data_parallel: crate::data_parallel::DataParallelConfig,

    /// TLS and the broker's bearer token.
    #[command(flatten)]
    pub security: dflash_client::ClientSecurityArgs,
}

impl DrafterServerConfig {
    /// Checks values clap cannot, then splits the flags into the parts each
    /// layer uses. The one place the flag struct is read.
    pub fn validate(self) -> Result<DrafterSettings, ConfigError> {
        if self.drafter_id.trim().is_empty() {
            return Err(ConfigError::EmptyDrafterId);
        }
        if self.model == ModelMode::DFlash && self.target_model.is_none() {
            return Err(ConfigError::NoTargetModel);
        }
        let positive_counts = [
            ("--grad-accumulation", self.grad_accumulation as usize),
            ("--batch-tokens", self.batch_tokens),
            ("--max-step-samples", self.max_step_samples),
            ("--num-anchors", self.num_anchors),
            ("--fallback-total-steps", self.fallback_total_steps as usize),
        ];
        for (flag, value) in positive_counts {
            if value == 0 {
                return Err(ConfigError::NotPositive {
                    flag,
                    value: value.to_string(),
                });
            }
        }
        for (flag, value) in [
            ("--learning-rate", self.learning_rate),
            ("--max-grad-norm", self.max_grad_norm),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(ConfigError::NotPositive {
                    flag,
                    value: value.to_string(),
                });
            }
        }
        if !(0.0..1.0).contains(&self.warmup_fraction) {
            return Err(ConfigError::WarmupFraction(self.warmup_fraction));
        }
        if !(0.0..1.0).contains(&self.adam_beta1) {
            return Err(ConfigError::AdamBeta1(self.adam_beta1));
        }
        let spike = self.grad_norm_spike_ratio;
        if !(spike == 0.0 || (spike.is_finite() && spike > 1.0)) {
            return Err(ConfigError::GradNormSpikeRatio(spike));
        }
        if self.dtype == Some(DtypeChoice::F16) {
            return Err(ConfigError::UnsupportedDtype("f16"));
        }
        let data_parallel =
            self.model_sync.model_sync == crate::model_sync::ModelSyncMode::DataParallel;
        if self.resume && data_parallel {
            return Err(ConfigError::ResumeInDataParallel);
        }
        let mode = if data_parallel && self.model == ModelMode::DFlash {
            TrainingMode::DataParallel {
                model: self.model_sync.clone(),
                group: self.data_parallel.clone(),
            }
        } else {
            TrainingMode::Independent
        };
        let credit_items =
            u32::try_from(self.max_step_samples + self.prefetch_samples).unwrap_or(u32::MAX);
        Ok(DrafterSettings {
            connection: Connection {
                broker: self.broker,
                drafter_id: self.drafter_id,
                security: self.security,
                reconnect_timeout: self.reconnect_timeout,
            },
            metrics_listen: self.metrics_listen,
            output: OutputSettings {
                output: self.output.clone(),
                resume: self.resume,
            },
            engine: EngineSettings {
                model: self.model,
                target_model: self.target_model,
                device: self.device,
                dtype: self.dtype,
                attention: self.attention,
                architecture: self.draft_architecture,
                draft_layers: self.draft_layers,
                block_size: self.block_size,
                mask_token_id: self.mask_token_id,
                target_layer_ids: self.target_layer_ids,
                seed: self.seed,
                num_anchors: self.num_anchors,
                loss_gamma: self.loss_gamma,
                learning_rate: self.learning_rate,
                weight_decay: self.weight_decay,
                adam_beta1: self.adam_beta1,
                warmup_fraction: self.warmup_fraction,
                max_grad_norm: self.max_grad_norm,
                grad_norm_spike_ratio: self.grad_norm_spike_ratio,
            },
            schedule: ScheduleSettings {
                total_steps: self.total_steps,
                fallback_total_steps: self.fallback_total_steps,
                samples_per_step: self.max_step_samples as u64,
            },
            training_loop: LoopSettings {
                batch_tokens: self.batch_tokens,
                grad_accumulation: self.grad_accumulation,
                max_step_samples: self.max_step_samples,
                save_every: self.save_every,
                keep_checkpoints: self.keep_checkpoints,
                output: self.output,
            },
            pump: PumpSettings {
                credit_items,
                prefetch_items: u32::try_from(self.prefetch_samples).unwrap_or(u32::MAX),
                credit_bytes: self.credit_bytes,
                linger: self.linger,
                stats_period: self.stats_interval.max(Duration::from_millis(10)),
                shutdown_timeout: self.shutdown_timeout,
                trainer_stall_timeout: self.trainer_stall_timeout,
                max_skipped_steps: self.max_skipped_steps,
            },
            mode,
        })
    }

    /// A configuration with every default, for tests and the local launcher.
    pub fn with_defaults(drafter_id: &str, broker: &str, output: PathBuf) -> Self {
        DrafterServerConfig {
            broker: broker.to_string(),
            drafter_id: drafter_id.to_string(),
            target_model: None,
            model: ModelMode::DFlash,
            output,
            device: DeviceChoice::Auto,
            dtype: None,
            draft_layers: 5,
            block_size: 16,
            mask_token_id: None,
            target_layer_ids: None,
            num_anchors: 512,
            attention: AttentionChoice::Auto,
            draft_architecture: DraftArchitecture::Dflash,
            loss_gamma: None,
            learning_rate: 6e-4,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            warmup_fraction: 0.04,
            max_grad_norm: 1.0,
            grad_accumulation: 1,
            batch_tokens: 16384,
            max_step_samples: 64,
            prefetch_samples: 8,
            credit_bytes: 0,
            linger: Duration::from_secs(1),
            total_steps: None,
            fallback_total_steps: 10_000,
            save_every: 1000,
            keep_checkpoints: 3,
            resume: false,
            seed: 0,
            stats_interval: Duration::from_secs(2),
            shutdown_timeout: Duration::from_secs(120),
            reconnect_timeout: Duration::from_secs(60),
            trainer_stall_timeout: Duration::from_secs(600),
            max_skipped_steps: 5,
            report_file: None,
            grad_norm_spike_ratio: dflash_model::draft::DEFAULT_GRAD_NORM_SPIKE_RATIO,
            metrics_listen: None,
            model_sync: crate::model_sync::SyncConfig::default(),
            data_parallel: crate::data_parallel::DataParallelConfig::default(),
            security: dflash_client::ClientSecurityArgs::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_model::draft::{AttentionImplementation, DEFAULT_BLOCKS_PER_ATTENTION_CHUNK};
    use tch::Device;

    #[test]
    fn model_modes_parse() {
        assert_eq!("dflash".parse::<ModelMode>(), Ok(ModelMode::DFlash));
        assert_eq!(
            "synthetic:ms_per_1k_tokens=2.5".parse::<ModelMode>(),
            Ok(ModelMode::Synthetic {
                ms_per_1k_tokens: 2.5
            })
        );
        assert_eq!(
            "synthetic".parse::<ModelMode>(),
            Ok(ModelMode::Synthetic {
                ms_per_1k_tokens: 0.0
            })
        );
        assert!("synthetic:speed=3".parse::<ModelMode>().is_err());
        assert!("synthetic:ms_per_1k_tokens=-1"
            .parse::<ModelMode>()
            .is_err());
        assert!("llama".parse::<ModelMode>().is_err());
    }

    /// The drafter-server's flags as clap parses them: drafter id `d`,
    /// output `/tmp/x`, then `extra`.
    fn parse_flags(extra: &[&str]) -> Result<DrafterServerConfig, clap::Error> {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            config: DrafterServerConfig,
        }
        let base = ["drafter-server", "--drafter-id", "d", "--output", "/tmp/x"];
        <Flags as clap::Parser>::try_parse_from(base.iter().chain(extra)).map(|flags| flags.config)
    }

    #[test]
    fn with_defaults_equals_the_flag_defaults() {
        let parsed = parse_flags(&["--broker", "http://x"]).unwrap();
        assert_eq!(
            parsed,
            DrafterServerConfig::with_defaults("d", "http://x", PathBuf::from("/tmp/x"))
        );
    }

    #[test]
    fn attention_is_fused_on_a_gpu_unless_the_flag_says_otherwise() {
        let fused = AttentionImplementation::Fused {
            blocks_per_chunk: DEFAULT_BLOCKS_PER_ATTENTION_CHUNK,
        };
        let engine = |extra: &[&str]| {
            let mut flags = parse_flags(extra).unwrap();
            flags.model = ModelMode::Synthetic {
                ms_per_1k_tokens: 0.0,
            };
            flags.validate().unwrap().engine
        };
        let auto = engine(&[]);
        assert_eq!(auto.attention, AttentionChoice::Auto);
        assert_eq!(
            auto.attention_for(Device::Cpu),
            AttentionImplementation::Split
        );
        assert_eq!(auto.attention_for(Device::Cuda(0)), fused);
        let forced = engine(&["--attention", "fused"]);
        assert_eq!(forced.attention_for(Device::Cpu), fused);
        let split = engine(&["--attention", "split"]);
        assert_eq!(
            split.attention_for(Device::Cuda(0)),
            AttentionImplementation::Split
        );
        assert!(parse_flags(&["--attention", "flash"]).is_err());
    }

    #[test]
    fn metrics_listen_parses_a_socket_address() {
        let parsed = parse_flags(&["--metrics-listen", "127.0.0.1:9092"]).unwrap();
        assert_eq!(
            parsed.metrics_listen,
            Some(SocketAddr::from(([127, 0, 0, 1], 9092)))
        );
        assert!(parse_flags(&["--metrics-listen", "localhost"]).is_err());
    }

    #[test]
    fn durations_take_units_and_the_old_millisecond_flags_are_gone() {
        let new = parse_flags(&["--linger", "250ms", "--shutdown-timeout", "3m"]).unwrap();
        assert_eq!(new.linger, Duration::from_millis(250));
        assert_eq!(new.shutdown_timeout, Duration::from_secs(180));
        assert_eq!(
            parse_flags(&["--sync-timeout", "90s"])
                .unwrap()
                .model_sync
                .sync_timeout,
            Duration::from_secs(90)
        );
        for old in [
            "--linger-ms",
            "--stats-interval-ms",
            "--shutdown-timeout-ms",
            "--reconnect-timeout-ms",
            "--sync-timeout-ms",
        ] {
            assert!(parse_flags(&[old, "250"]).is_err(), "{old} still parses");
        }
        // The broker's AdamW over drafters' gradients went (issue 37), and
        // asynchronous local SGD with its flags (issue 49).
        for retired in [
            "--sync-gradients",
            "--sync-every=10",
            "--sync-dtype=f32",
            "--sync-adam-beta1=0",
            "--sync-lr-scaling=none",
            "--sync-batch-scaling=none",
            "--model-sync=local-sgd",
        ] {
            assert!(parse_flags(&[retired]).is_err(), "{retired} still parses");
        }
        assert!(parse_flags(&["--linger", "soon"]).is_err());
    }

    /// The error `validate` gives for a copy of `config`, if any.
    fn check(config: &DrafterServerConfig) -> Result<(), ConfigError> {
        config.clone().validate().map(|_| ())
    }

    #[test]
    fn validation_names_the_flag() {
        let mut config =
            DrafterServerConfig::with_defaults("d", "http://x", PathBuf::from("/tmp/x"));
        assert_eq!(check(&config), Err(ConfigError::NoTargetModel));
        config.model = ModelMode::Synthetic {
            ms_per_1k_tokens: 1.0,
        };
        assert_eq!(check(&config), Ok(()));
        config.grad_accumulation = 0;
        assert!(check(&config)
            .unwrap_err()
            .to_string()
            .contains("--grad-accumulation"));
        config.grad_accumulation = 1;
        config.dtype = Some(DtypeChoice::F16);
        assert_eq!(check(&config), Err(ConfigError::UnsupportedDtype("f16")));
        config.dtype = Some(DtypeChoice::Bf16);
        assert_eq!(check(&config), Ok(()));
        assert_eq!(config.clone().validate().unwrap().pump.credit_items, 72);
        for bad in [1.0, -0.1, f64::NAN] {
            config.adam_beta1 = bad;
            let error = check(&config).unwrap_err().to_string();
            assert!(
                error.contains("--adam-beta1") && error.contains(&bad.to_string()),
                "{error}"
            );
        }
        config.adam_beta1 = 0.0;
        assert_eq!(check(&config), Ok(()));
        config.resume = true;
        let error = check(&config).unwrap_err().to_string();
        assert!(
            error.contains("--resume") && error.contains("data-parallel"),
            "{error}"
        );
        config.model_sync.model_sync = crate::model_sync::ModelSyncMode::Off;
        assert_eq!(check(&config), Ok(()));
    }

    /// The mode is decided once, here: a DFlash drafter is a data-parallel
    /// member unless `--model-sync off`; a synthetic one (no weights) is
    /// independent.
    #[test]
    fn validation_decides_the_training_mode_once() {
        let mut config =
            DrafterServerConfig::with_defaults("d", "http://x", PathBuf::from("/tmp/x"));
        config.target_model = Some(PathBuf::from("/tmp/target"));
        let mode = |config: &DrafterServerConfig| config.clone().validate().unwrap().mode;
        assert_eq!(
            mode(&config),
            TrainingMode::DataParallel {
                model: config.model_sync.clone(),
                group: config.data_parallel.clone(),
            }
        );
        config.model_sync.model_sync = crate::model_sync::ModelSyncMode::Off;
        assert_eq!(mode(&config), TrainingMode::Independent);
        config.model_sync.model_sync = crate::model_sync::ModelSyncMode::DataParallel;
        config.model = ModelMode::Synthetic {
            ms_per_1k_tokens: 1.0,
        };
        assert_eq!(mode(&config), TrainingMode::Independent);
    }
}
