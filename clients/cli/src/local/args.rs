//! The flags of `dflash local`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::demo::DemoSpec;

/// The evaluator's schedule on the demo: about 240 model versions in a
/// minute of training; every 30 versions (or 15 s) gives 5 to 8 points.
const EVALUATOR_EVERY_VERSIONS: u64 = 30;
const EVALUATOR_EVERY: &str = "15s";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum View {
    /// Redraw the `dflash top` view in place (when stdout is a terminal).
    Top,
    /// One progress line every few seconds.
    Lines,
    /// Only the final summary.
    None,
}

#[derive(Debug, Clone, Args)]
pub struct LocalArgs {
    /// Number of target-server processes.
    #[arg(long, default_value_t = 2)]
    pub targets: u32,

    /// Number of drafter-server processes.
    #[arg(long, default_value_t = 2)]
    pub drafters: u32,

    /// The draft model the drafters train: `dflash`, `dflash2` (grouped
    /// dynamic convolutions and the path selector; docs/dflash2.md) or
    /// `dspark` (Markov and confidence heads, distilled from the target's
    /// distribution: the targets then send their last hidden state;
    /// docs/dspark.md). τ is measured the way each decodes.
    #[arg(long, default_value = "dflash", value_parser = ["dflash", "dflash2", "dspark"])]
    pub draft_architecture: String,

    /// Target model directory (Hugging Face layout). Default: the tiny model
    /// written by `dflash init-tiny` into the work directory.
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// Training data (JSONL). Default: data the tiny target generates itself.
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// Held-out prompts for the final τ measurement (pre-tokenized JSONL).
    /// Default: generated with the demo data; skipped when --data is given without it.
    #[arg(long)]
    pub held_out: Option<PathBuf>,

    /// Devices of the targets, assigned in turn (e.g. `cuda:0,cuda:1`;
    /// `auto`, `cpu`, `cuda`, `cuda:N` as the services take them). The CPU
    /// by default: the demo is for a laptop.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub target_devices: Vec<dflash_shell::DeviceChoice>,

    /// Devices of the drafters, assigned in turn.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub drafter_devices: Vec<dflash_shell::DeviceChoice>,

    /// Run without a model: synthetic hidden states and synthetic training,
    /// to load-test the plumbing.
    #[arg(long)]
    pub synthetic: bool,

    /// Where models, data, logs, checkpoints and summary.json go.
    /// Default: runs/local-<unix time>.
    #[arg(long)]
    pub workdir: Option<PathBuf>,

    /// Live view while running.
    #[arg(long, value_enum, default_value = "top")]
    pub view: View,

    /// Give up (and fail) after this long (`30m`, `90s`).
    #[arg(long, default_value = "30m", value_parser = dflash_shell::parse_duration)]
    pub timeout: Duration,

    /// Extra flags for every target-server (one string, split on spaces).
    /// A `--model` here replaces the run's: `--model
    /// synthetic:hidden=64,layers=2,vocab=512,tokens_per_s=0` gives real
    /// drafters random hidden states of the tiny default's shape at no
    /// target compute (the drafter side's throughput alone). A flag here
    /// replaces the tiny default's.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub target_args: String,

    /// Extra flags for every drafter-server (one string, split on spaces).
    /// A flag here replaces the tiny default's (`--learning-rate 6e-3
    /// --max-step-samples 32`).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub drafter_args: String,

    /// Unique sequences in the generated demo data.
    #[arg(long, default_value_t = DemoSpec::default().unique_sequences)]
    pub demo_sequences: usize,

    /// How many times the demo data repeats (more optimizer steps).
    #[arg(long, default_value_t = DemoSpec::default().epochs)]
    pub demo_epochs: usize,

    /// Held-out prompts generated with the demo data (the final τ).
    #[arg(long, default_value_t = DemoSpec::default().held_out_prompts)]
    pub demo_held_out: usize,

    /// Mask token id of the drafters. Default: the `mask_token` of the
    /// model's tokenizer_config.json, else (Qwen3 and Llama tokenizers have
    /// none) the reserved id just past the tokenizer's vocabulary, the
    /// convention of the published DFlash drafters (151669 for Qwen3-8B).
    /// Resolved and checked before anything starts.
    #[arg(long)]
    pub mask_token_id: Option<i64>,

    /// Do not run the online evaluator (`dflash evaluate --watch`), which
    /// measures τ of the shared model while the run trains.
    #[arg(long)]
    pub no_evaluator: bool,

    /// The evaluator evaluates when the run's model is this many versions past
    /// the last evaluation...
    #[arg(long, default_value_t = EVALUATOR_EVERY_VERSIONS)]
    pub evaluate_every_versions: u64,

    /// ...or this long after it (`20s`, `2m`), whichever comes first.
    #[arg(long, default_value = EVALUATOR_EVERY, value_parser = dflash_shell::parse_duration)]
    pub evaluate_every: Duration,

    /// The evaluator's device: its own, never a drafter's (`cpu`, `cuda:N`).
    #[arg(long, default_value = "cpu")]
    pub evaluator_device: dflash_shell::DeviceChoice,

    /// The evaluator's CPU priority, as `nice -n` (0 to 19; 19 the lowest):
    /// on CPUs the targets and drafters keep, it uses only the time they
    /// leave idle, so measuring τ does not slow training (its points come
    /// later on a fully busy machine). 0 runs it at their priority.
    #[arg(long, default_value_t = 19, value_parser = clap::value_parser!(u8).range(0..=19))]
    pub evaluator_nice: u8,
}
