//! Command-line flags (with environment-variable fallbacks) and their
//! parsing into typed values.

use clap::Parser;
use dflash_shell::parse_duration;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

pub const DEFAULT_BROKER: &str = "http://127.0.0.1:50051";
pub const DEFAULT_TARGET_ID: &str = "target-0";
pub const DEFAULT_NUM_DRAFT_LAYERS: usize = 5;
pub const DEFAULT_MAX_LENGTH: usize = 3072;
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 16384;
pub const DEFAULT_SORT_WINDOW: usize = 512;
pub const DEFAULT_STATS_INTERVAL: &str = "5s";
pub const DEFAULT_MAX_RECONNECTS: u32 = 10;
pub const DEFAULT_FINISH_TIMEOUT: &str = "2m";

/// Where hidden states come from.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// A Hugging Face model directory (Qwen3 or Llama).
    Directory(PathBuf),
    /// No model: random hidden states of the right shape at a set rate.
    Synthetic(SyntheticSpec),
}

/// `synthetic:hidden=4096,layers=5,tokens_per_s=20000,...`
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    /// Hidden size of the pretend target.
    pub hidden: usize,
    /// Number of captured layers (the hidden_states width is layers × hidden).
    pub layers: usize,
    /// Production rate; 0 means as fast as possible.
    pub tokens_per_second: f64,
    /// Range of generated token ids.
    pub vocab: i64,
    /// Samples generated when no `--data` is given (over all shards).
    pub samples: u64,
    /// Length of generated samples.
    pub seq_len: usize,
    pub seed: u64,
    /// The sample with this seq gets a NaN in its hidden states, as a bf16
    /// overflow or a faulty device would give it (fault drills of the
    /// non-finite guards).
    pub nan_at_seq: Option<u64>,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        SyntheticSpec {
            hidden: 4096,
            layers: 5,
            tokens_per_second: 20_000.0,
            vocab: 151_936,
            samples: 1000,
            seq_len: 512,
            seed: 0,
            nan_at_seq: None,
        }
    }
}

impl FromStr for ModelSource {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let Some(parameters) = text.strip_prefix("synthetic") else {
            return Ok(ModelSource::Directory(PathBuf::from(text)));
        };
        let parameters = match parameters.strip_prefix(':') {
            Some(rest) => rest,
            None if parameters.is_empty() => "",
            // A directory that merely starts with "synthetic".
            None => return Ok(ModelSource::Directory(PathBuf::from(text))),
        };
        let mut spec = SyntheticSpec::default();
        for pair in parameters.split(',').filter(|pair| !pair.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("synthetic parameter {pair:?} is not key=value"))?;
            let invalid =
                |error: &dyn std::fmt::Display| format!("synthetic {key}={value:?}: {error}");
            match key {
                "hidden" => spec.hidden = value.parse().map_err(|error| invalid(&error))?,
                "layers" => spec.layers = value.parse().map_err(|error| invalid(&error))?,
                "tokens_per_s" | "tokens_per_second" => {
                    spec.tokens_per_second = value.parse().map_err(|error| invalid(&error))?
                }
                "vocab" => spec.vocab = value.parse().map_err(|error| invalid(&error))?,
                "samples" => spec.samples = value.parse().map_err(|error| invalid(&error))?,
                "seq_len" => spec.seq_len = value.parse().map_err(|error| invalid(&error))?,
                "seed" => spec.seed = value.parse().map_err(|error| invalid(&error))?,
                "nan_at_seq" => {
                    spec.nan_at_seq = Some(value.parse().map_err(|error| invalid(&error))?)
                }
                other => {
                    return Err(format!(
                        "unknown synthetic parameter {other:?} (known: hidden, layers, tokens_per_s, vocab, samples, seq_len, seed, nan_at_seq)"
                    ))
                }
            }
        }
        if spec.hidden == 0 || spec.layers == 0 || spec.seq_len == 0 || spec.vocab <= 0 {
            return Err("synthetic hidden, layers, seq_len and vocab must be positive".to_string());
        }
        if !(spec.tokens_per_second >= 0.0 && spec.tokens_per_second.is_finite()) {
            return Err("synthetic tokens_per_s must be a finite number >= 0".to_string());
        }
        Ok(ModelSource::Synthetic(spec))
    }
}

pub use dflash_shell::{DeviceChoice, DtypeChoice};

/// What a target does with a capture that holds a NaN or an infinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NonFiniteAction {
    /// Count and log it, send the rest (the default: a restart would meet
    /// the same sample again).
    Skip,
    /// Stop the target with an error naming the sample's seq.
    Fail,
}

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

    /// The stats interval, at least 10 ms (a zero interval would spin).
    pub fn stats_period(&self) -> Duration {
        self.stats_interval.max(Duration::from_millis(10))
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
