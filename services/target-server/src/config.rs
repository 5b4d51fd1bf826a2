//! Command-line flags (with environment-variable fallbacks), their checks,
//! and [`TargetServerConfig::validate`], which splits them into the typed
//! parts of [`crate::settings::TargetSettings`] once.

use clap::Parser;
use dflash_shell::parse_duration;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::TargetServerError;
use crate::settings::{
    ComputeSettings, Connection, InputSettings, PumpSettings, ShardRequest, TargetSettings,
};
pub use crate::settings::{ModelSource, NonFiniteAction, SyntheticSpec};

pub const DEFAULT_BROKER: &str = "http://127.0.0.1:50051";
pub const DEFAULT_TARGET_ID: &str = "target-0";
pub const DEFAULT_NUM_DRAFT_LAYERS: usize = 5;
pub const DEFAULT_MAX_LENGTH: usize = 3072;
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 16384;
pub const DEFAULT_SORT_WINDOW: usize = 512;
pub const DEFAULT_STATS_INTERVAL: &str = "5s";
pub const DEFAULT_MAX_RECONNECTS: u32 = 10;
pub const DEFAULT_FINISH_TIMEOUT: &str = "2m";

pub use dflash_shell::{DeviceChoice, DtypeChoice};

/// target-server: runs a frozen target LLM on one device over its shard of a
/// JSONL data set and streams the DFlash hidden states to the broker.
#[derive(Debug, Clone, Parser)]
#[command(name = "target-server", version = crate::test_hooks::VERSION, about, long_about = None)]
pub struct TargetServerConfig {
    /// Broker address.
    #[arg(long, env = "DFLASH_BROKER", default_value = DEFAULT_BROKER)]
    pub broker: String,

    /// This target's id at the broker; a trailing number (`target-3`, a
    /// StatefulSet pod name) is the default shard index.
    #[arg(long, env = "DFLASH_TARGET_ID", default_value = DEFAULT_TARGET_ID)]
    pub target_id: String,

    /// Hugging Face model directory (config.json, safetensors, tokenizer), or
    /// `synthetic:hidden=4096,layers=5,tokens_per_s=20000[,vocab=N,samples=N,seq_len=N,seed=N]`
    /// for correctly shaped random hidden states without a model.
    #[arg(long, env = "DFLASH_MODEL")]
    pub model: ModelSource,

    /// JSONL data: one conversation per line, pre-tokenized
    /// (`input_ids`/`loss_mask`), OpenAI `messages` or ShareGPT
    /// `conversations`. Optional only in synthetic mode.
    #[arg(long, env = "DFLASH_DATA")]
    pub data: Option<PathBuf>,

    /// Directory with tokenizer.json / tokenizer_config.json / chat template,
    /// if not the model directory (e.g. with a synthetic model).
    #[arg(long, env = "DFLASH_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,

    /// Device: auto, cpu, cuda or cuda:N.
    #[arg(long, env = "DFLASH_DEVICE", default_value = "auto")]
    pub device: DeviceChoice,

    /// Weight dtype; default bf16 on a GPU, f32 on the CPU. Hidden states
    /// are always sent as bf16.
    #[arg(long, env = "DFLASH_DTYPE", value_enum)]
    pub dtype: Option<DtypeChoice>,

    /// Target layers whose outputs are captured, comma separated; default
    /// the DFlash layers for --num-draft-layers.
    #[arg(long, env = "DFLASH_LAYER_IDS", value_delimiter = ',')]
    pub layer_ids: Option<Vec<usize>>,

    /// Draft layers of the drafter being trained (picks the default layer ids).
    #[arg(long, env = "DFLASH_NUM_DRAFT_LAYERS", default_value_t = DEFAULT_NUM_DRAFT_LAYERS)]
    pub num_draft_layers: usize,

    /// Longer sequences are truncated to this many tokens.
    #[arg(long, env = "DFLASH_MAX_LENGTH", default_value_t = DEFAULT_MAX_LENGTH)]
    pub max_length: usize,

    /// Token budget of one forward batch, padding included.
    #[arg(long, env = "DFLASH_MAX_BATCH_TOKENS", default_value_t = DEFAULT_MAX_BATCH_TOKENS)]
    pub max_batch_tokens: usize,

    /// Samples sorted by length together; part of the processing order, so
    /// keep it fixed across restarts of one run.
    #[arg(long, env = "DFLASH_SORT_WINDOW", default_value_t = DEFAULT_SORT_WINDOW)]
    pub sort_window: usize,

    /// Malformed lines tolerated (each is logged with its line number); one
    /// more stops the run.
    #[arg(long, env = "DFLASH_MAX_BAD_LINES", default_value_t = 0)]
    pub max_bad_lines: u64,

    /// This target's shard; default the trailing number of --target-id.
    #[arg(long, env = "DFLASH_SHARD_INDEX")]
    pub shard_index: Option<u32>,

    /// Number of shards; default the broker's expected target count.
    #[arg(long, env = "DFLASH_NUM_SHARDS")]
    pub num_shards: Option<u32>,

    /// Interval of the stats messages to the broker (`500ms`, `2s`; a bare
    /// number is seconds).
    #[arg(long, env = "DFLASH_STATS_INTERVAL", default_value = DEFAULT_STATS_INTERVAL, value_parser = parse_duration)]
    pub stats_interval: Duration,

    /// Attempts to reopen a broken Produce stream (resuming where the broker
    /// is) in one outage before giving up. The count starts again once a
    /// reopened stream shows the broker accepted more of this target's items,
    /// so routine broker restarts over a long run never add up to it.
    #[arg(long, env = "DFLASH_MAX_RECONNECTS", default_value_t = DEFAULT_MAX_RECONNECTS)]
    pub max_reconnects: u32,

    /// Log line format on stderr: text or json.
    #[arg(long, env = "DFLASH_LOG_FORMAT", value_enum, default_value_t = dflash_telemetry::LogFormat::Text)]
    pub log_format: dflash_telemetry::LogFormat,

    /// How long to wait for the broker to answer the last items (at the
    /// end; an interrupted run waits at most 5 s of it).
    #[arg(long, env = "DFLASH_FINISH_TIMEOUT", default_value = DEFAULT_FINISH_TIMEOUT, value_parser = parse_duration)]
    pub finish_timeout: Duration,

    /// Serve Prometheus metrics (`GET /metrics`) on this address, e.g.
    /// `0.0.0.0:9091`; off when unset.
    #[arg(long, env = "DFLASH_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// Write this process's final report here when it ends (JSON: busy
    /// fraction, tokens/s and samples over the whole run), for a supervisor
    /// such as `dflash local`.
    #[arg(long, env = "DFLASH_REPORT_FILE")]
    pub report_file: Option<PathBuf>,

    /// TLS and the broker's bearer token.
    #[command(flatten)]
    pub security: dflash_client::ClientSecurityArgs,

    /// Exit non-zero when the compute pipeline hands the sender no batch for
    /// this long while the shard is not done (a stuck compute thread inside a
    /// live process: stats would still flow). Time spent waiting on the
    /// broker (a full queue) does not count. 0 off. Shorter than the
    /// broker's --target-stall-timeout (5m) on purpose: the process exits
    /// (and a supervisor restarts it, resuming within the broker's grace)
    /// before the broker gives the target up.
    #[arg(long, env = "DFLASH_WATCHDOG_TIMEOUT", default_value = "4m", value_parser = parse_duration)]
    pub watchdog_timeout: Duration,

    /// A captured sample whose hidden states hold a NaN or an infinity (a
    /// bf16 overflow, a faulty GPU or kernel) is never sent: `skip` counts
    /// and logs it and goes on (ReportDone's total leaves it out), `fail`
    /// stops this target with an error naming its seq.
    #[arg(long, env = "DFLASH_ON_NON_FINITE", value_enum, default_value_t = NonFiniteAction::Skip)]
    pub on_non_finite: NonFiniteAction,

    /// Test-only flags: none without the cargo feature `test-hooks`.
    #[command(flatten)]
    pub test_hooks: crate::test_hooks::TestHooks,
}

impl TargetServerConfig {
    /// A configuration with every optional flag at its default, for tests
    /// and launchers that build it in code.
    pub fn new(
        broker: impl Into<String>,
        target_id: impl Into<String>,
        model: ModelSource,
        data: Option<PathBuf>,
    ) -> Self {
        TargetServerConfig {
            broker: broker.into(),
            target_id: target_id.into(),
            model,
            data,
            tokenizer: None,
            device: DeviceChoice::Auto,
            dtype: None,
            layer_ids: None,
            num_draft_layers: DEFAULT_NUM_DRAFT_LAYERS,
            max_length: DEFAULT_MAX_LENGTH,
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
            sort_window: DEFAULT_SORT_WINDOW,
            max_bad_lines: 0,
            shard_index: None,
            num_shards: None,
            stats_interval: Duration::from_secs(5),
            max_reconnects: DEFAULT_MAX_RECONNECTS,
            log_format: dflash_telemetry::LogFormat::Text,
            finish_timeout: Duration::from_secs(120),
            metrics_listen: None,
            security: dflash_client::ClientSecurityArgs::default(),
            watchdog_timeout: Duration::from_secs(240),
            on_non_finite: NonFiniteAction::Skip,
            report_file: None,
            test_hooks: crate::test_hooks::TestHooks::default(),
        }
    }

    /// Checks what needs no thread (flags that cannot work together, a
    /// model directory without a config), then splits the flags into the
    /// parts each layer uses. The one place the flag struct is read.
    pub fn validate(self) -> Result<TargetSettings, TargetServerError> {
        if self.data.is_none() && matches!(self.model, ModelSource::Directory(_)) {
            return Err(TargetServerError::Config(
                "--data is required unless --model is synthetic".into(),
            ));
        }
        if self.max_length == 0 || self.max_batch_tokens == 0 || self.sort_window == 0 {
            return Err(TargetServerError::Config(format!(
                "--max-length ({}), --max-batch-tokens ({}) and --sort-window ({}) must be positive",
                self.max_length, self.max_batch_tokens, self.sort_window
            )));
        }
        if let ModelSource::Directory(directory) = &self.model {
            let config_file = directory.join(dflash_model::target_model::CONFIG_FILE_NAME);
            if !config_file.is_file() {
                return Err(TargetServerError::Model(dflash_model::ModelError::Io {
                    path: config_file,
                    source: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "no such file (is --model a model directory?)",
                    ),
                }));
            }
        }
        let (tokenizer, synthetic) = match &self.model {
            ModelSource::Directory(directory) => {
                (self.tokenizer.clone().or(Some(directory.clone())), None)
            }
            ModelSource::Synthetic(spec) => (self.tokenizer.clone(), Some(spec.clone())),
        };
        Ok(TargetSettings {
            connection: Connection {
                broker: self.broker,
                target_id: self.target_id,
                security: self.security,
                max_reconnects: self.max_reconnects,
            },
            shard: ShardRequest {
                shard_index: self.shard_index,
                num_shards: self.num_shards,
            },
            input: InputSettings {
                data: self.data,
                tokenizer,
                synthetic,
                max_length: self.max_length,
                sort_window: self.sort_window,
                max_batch_tokens: self.max_batch_tokens,
                max_bad_lines: self.max_bad_lines,
            },
            compute: ComputeSettings {
                hang_compute_after_batches: self.test_hooks.hang_compute_after_batches(),
                model: self.model,
                device: self.device,
                dtype: self.dtype,
                layer_ids: self.layer_ids,
                num_draft_layers: self.num_draft_layers,
                on_non_finite: self.on_non_finite,
            },
            pump: PumpSettings {
                stats_period: self.stats_interval.max(Duration::from_millis(10)),
                watchdog_timeout: self.watchdog_timeout,
                finish_timeout: self.finish_timeout,
            },
            metrics_listen: self.metrics_listen,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_specs_parse_with_defaults() {
        let parsed: Result<ModelSource, String> =
            "synthetic:hidden=64,layers=3,tokens_per_s=0,samples=7".parse();
        let Ok(ModelSource::Synthetic(spec)) = parsed else {
            panic!("{parsed:?}");
        };
        assert_eq!((spec.hidden, spec.layers, spec.samples), (64, 3, 7));
        assert_eq!(spec.tokens_per_second, 0.0);
        assert_eq!(spec.seq_len, SyntheticSpec::default().seq_len);
        assert!("synthetic:hidden=x".parse::<ModelSource>().is_err());
        assert!("synthetic:colour=red".parse::<ModelSource>().is_err());
        assert!("synthetic:layers=0".parse::<ModelSource>().is_err());
        assert_eq!(
            "/models/synthetic-qwen".parse::<ModelSource>(),
            Ok(ModelSource::Directory("/models/synthetic-qwen".into()))
        );
        assert_eq!(
            "synthetic_model".parse::<ModelSource>(),
            Ok(ModelSource::Directory("synthetic_model".into()))
        );
    }

    #[test]
    fn devices_parse() {
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        assert_eq!("cpu".parse(), Ok(DeviceChoice::Cpu));
        assert!("tpu".parse::<DeviceChoice>().is_err());
    }

    #[test]
    fn flags_parse_and_bad_dtype_is_rejected() {
        let parsed = TargetServerConfig::try_parse_from([
            "target-server",
            "--model",
            "/m",
            "--data",
            "d.jsonl",
            "--dtype",
            "bf16",
            "--layer-ids",
            "1,5,9",
            "--metrics-listen",
            "127.0.0.1:9091",
        ]);
        let config = parsed.map_err(|error| error.to_string());
        assert_eq!(
            config.as_ref().map(|config| config.layer_ids.clone()),
            Ok(Some(vec![1, 5, 9]))
        );
        assert_eq!(
            config.as_ref().map(|config| config.dtype),
            Ok(Some(DtypeChoice::Bf16))
        );
        assert_eq!(
            config.as_ref().map(|config| config.metrics_listen),
            Ok(Some(SocketAddr::from(([127, 0, 0, 1], 9091))))
        );
        let bad_address = TargetServerConfig::try_parse_from([
            "target-server",
            "--model",
            "/m",
            "--metrics-listen",
            "localhost",
        ]);
        assert!(bad_address.is_err());
        let wrong = TargetServerConfig::try_parse_from([
            "target-server",
            "--model",
            "/m",
            "--dtype",
            "int4",
        ]);
        let message = wrong
            .err()
            .map(|error| error.to_string())
            .unwrap_or_default();
        assert!(message.contains("int4"), "{message}");
    }
}
