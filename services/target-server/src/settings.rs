//! The target's flags once checked, split into the typed part each layer
//! uses: [`crate::config::TargetServerConfig::validate`] makes a
//! [`TargetSettings`] once, in [`crate::run()`], and no layer below takes
//! the flag struct. The choices the flags name ([`ModelSource`],
//! [`SyntheticSpec`], [`NonFiniteAction`]) live here with them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use dflash_shell::{DeviceChoice, DtypeChoice};

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

/// What a target does with a capture that holds a NaN or an infinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NonFiniteAction {
    /// Count and log it, send the rest (the default: a restart would meet
    /// the same sample again).
    Skip,
    /// Stop the target with an error naming the sample's seq.
    Fail,
}

/// Every part of a checked configuration.
#[derive(Debug, Clone)]
pub struct TargetSettings {
    pub connection: Connection,
    pub shard: ShardRequest,
    pub input: InputSettings,
    pub compute: ComputeSettings,
    pub pump: PumpSettings,
    /// `--metrics-listen`.
    pub metrics_listen: Option<SocketAddr>,
}

/// Who this target is and how it reaches the broker.
#[derive(Debug, Clone)]
pub struct Connection {
    /// `--broker`.
    pub broker: String,
    /// `--target-id`.
    pub target_id: String,
    pub security: dflash_client::ClientSecurityArgs,
    /// `--max-reconnects` of the Produce stream.
    pub max_reconnects: u32,
}

/// `--shard-index` and `--num-shards`, resolved against the broker's
/// expected targets when the run starts (`crate::shard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRequest {
    pub shard_index: Option<u32>,
    pub num_shards: Option<u32>,
}

/// What the reader thread reads and how it batches.
#[derive(Debug, Clone)]
pub struct InputSettings {
    /// `--data`; `None` with a synthetic model (records are generated).
    pub data: Option<PathBuf>,
    /// `--tokenizer`, else the model directory; `None`: pre-tokenized only.
    pub tokenizer: Option<PathBuf>,
    /// The synthetic model's spec, whose records the reader generates.
    pub synthetic: Option<SyntheticSpec>,
    pub max_length: usize,
    pub sort_window: usize,
    pub max_batch_tokens: usize,
    pub max_bad_lines: u64,
}

/// What the compute thread loads and runs.
#[derive(Debug, Clone)]
pub struct ComputeSettings {
    pub model: ModelSource,
    pub device: DeviceChoice,
    pub dtype: Option<DtypeChoice>,
    /// `--layer-ids`, else chosen from `--num-draft-layers`.
    pub layer_ids: Option<Vec<usize>>,
    pub num_draft_layers: usize,
    pub on_non_finite: NonFiniteAction,
    /// The compute thread hangs after this many batches (test hook; always
    /// `None` in a build without the feature `test-hooks`).
    pub hang_compute_after_batches: Option<u64>,
}

/// The async loop's pacing and its bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PumpSettings {
    /// `--stats-interval`, at least 10 ms (a zero interval would spin).
    pub stats_period: Duration,
    /// `--watchdog-timeout`.
    pub watchdog_timeout: Duration,
    /// `--finish-timeout`.
    pub finish_timeout: Duration,
}
