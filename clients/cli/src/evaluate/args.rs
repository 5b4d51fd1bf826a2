//! `dflash evaluate`'s flags, and the decoding flags `dflash eval` shares.

use std::path::PathBuf;
use std::time::Duration;

use dflash_client::ClientSecurityArgs;

/// The broker's address when `--broker` and `DFLASH_BROKER` are not given.
const DEFAULT_BROKER: &str = "http://127.0.0.1:50051";

/// `dflash evaluate`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct EvaluateArgs {
    #[arg(long, env = "DFLASH_BROKER", default_value = DEFAULT_BROKER)]
    pub broker: String,
    /// Follow the run: evaluate every --every-versions versions or --every,
    /// and the final model, then exit. Without it: the current model once.
    #[arg(long)]
    pub watch: bool,
    /// The target model directory (Hugging Face layout).
    #[arg(long)]
    pub target: PathBuf,
    /// Held-out prompts (JSONL), as `dflash eval --data` reads them.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Use only the first N prompts (0: all).
    #[arg(long, default_value_t = 0)]
    pub max_prompts: usize,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Evaluate when the run's model is this many versions past the last one evaluated.
    #[arg(long, default_value_t = 20)]
    pub every_versions: u64,
    /// Evaluate at least this often while the run's model changes (`90s`, `5m`).
    #[arg(long, default_value = "5m", value_parser = dflash_shell::parse_duration)]
    pub every: Duration,
    /// Versions read and not yet measured at most (capped by the broker's
    /// --max-pending-evaluations): a version due while the evaluator is
    /// still measuring an earlier one is read now and measured later.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub backlog: u32,
    /// How often to read the broker's status.
    #[arg(long, default_value = "1s", value_parser = dflash_shell::parse_duration)]
    pub poll: Duration,
    /// Where to evaluate: its own device, never the drafters' (`cpu`,
    /// `cuda:N`, `auto`).
    #[arg(long, default_value = "cpu")]
    pub device: dflash_shell::DeviceChoice,
    /// libtorch intra-op threads of this process (its CPU share).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value = "evaluator")]
    pub evaluator_id: String,
    /// Write the τ curve (JSON) here when done.
    #[arg(long)]
    pub report_file: Option<PathBuf>,
    #[command(flatten)]
    pub security: ClientSecurityArgs,
}

/// How `dflash eval` and `dflash evaluate` decode: greedy by default (what
/// τ is usually quoted for), or sampled with speculative rejection sampling
/// (a DFlash2 drafter samples its selector's path, as the reference's
/// `propose` does).
#[derive(Debug, Clone, clap::Args)]
pub struct SamplingArgs {
    /// 0: greedy; otherwise the target's and the drafter's logits are divided by it.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling of the target and of a DFlash drafter (1 keeps every token).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Seed of the sampling (each prompt draws from its own generator).
    #[arg(long, default_value_t = 0)]
    pub sampling_seed: u64,
    /// DSpark drafters: propose each block only while the cumulative product
    /// of the confidence head's acceptance probabilities stays at or above
    /// this (in [0, 1]; at least one token); unset proposes whole blocks.
    /// Other drafters ignore it.
    #[arg(long)]
    pub confidence_threshold: Option<f64>,
}

impl SamplingArgs {
    pub fn options(&self) -> dflash_model::sampling::SamplingOptions {
        dflash_model::sampling::SamplingOptions {
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.sampling_seed,
        }
    }
}
