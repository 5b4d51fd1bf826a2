//! The drafter's training step as the drafter-server runs it (forward,
//! chunked loss, backward, AdamW), for the tiny target (hidden 64, 5 draft
//! layers, block 16), for several anchor counts in one process: prints
//! tokens/s, minor page faults per step and peak RSS for each, and on a GPU
//! (`--device cuda:0`) which CUDA allocator is in force and the GPU memory's
//! peak after a step (NVML).
//!
//! ```text
//! cargo run --release --workspace --example drafter_step -- \
//!     [--anchors 64,512] [--steps 5] [--seq-len 512] [--seqs 8] \
//!     [--attention split|fused|concatenated] [--attention-chunk 8] [--logits-chunk 32|all] \
//!     [--checkpoint-layers] [--vocab 512] [--device cpu|cuda:N] [--dtype f32|bf16] \
//!     [--target-dir DIR] [--architecture dflash|dflash2|dspark]
//! ```
//!
//! `--architecture dflash2` measures a DFlash2 step (grouped dynamic
//! convolutions and the selector loss, speculators' defaults) on the same
//! shapes; `--architecture dspark` a DSpark step (Markov and confidence
//! heads, distillation from random bf16 last hidden states, speculators'
//! defaults).
//!
//! `--target-dir` takes the target (its shape, embeddings and LM head) from
//! a model directory instead of the tiny one: `scripts/check-gpu.sh` passes
//! the Qwen3-8B-shaped one `capture_overhead --shape qwen3-8b` wrote, for
//! the reference drafter shape (hidden 4096, 5 layers, vocab 151936).
//!
//! The allocator is set up like the binaries do (`DFLASH_MALLOC=system`
//! shows glibc's defaults for comparison). `scripts/bench/drafter_step_torch.py`
//! runs the same step in PyTorch eager for the ratio.

use std::time::Instant;

use anyhow::{bail, Context};
use dflash_device::{configure_allocator, AllocatorMode};
use dflash_model::draft::{
    AttentionImplementation, DraftConfig, DraftModel, DraftOptions, DraftTrainer,
    FrozenTargetHeads, TargetDimensions, TrainerSettings, TrainingSequence,
};
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_model::tokens::mask_token_id;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

struct Arguments {
    anchors: Vec<usize>,
    steps: usize,
    sequence_length: usize,
    sequences_per_step: usize,
    attention: AttentionImplementation,
    logits_chunk_blocks: Option<i64>,
    checkpoint_layers: bool,
    vocab: Option<i64>,
    device: Device,
    kind: Kind,
    /// A target model directory to draft for, instead of the tiny target.
    target_dir: Option<std::path::PathBuf>,
    dflash2: bool,
    dspark: bool,
}

fn parse_arguments() -> anyhow::Result<Arguments> {
    let mut arguments = Arguments {
        anchors: vec![64, 512],
        steps: 5,
        sequence_length: 512,
        sequences_per_step: 8,
        attention: AttentionImplementation::default(),
        logits_chunk_blocks: TrainerSettings::recipe_defaults(16, 1)
            .memory
            .logits_chunk_blocks,
        checkpoint_layers: false,
        vocab: None,
        device: Device::Cpu,
        kind: Kind::Float,
        target_dir: None,
        dflash2: false,
        dspark: false,
    };
    let mut attention_chunk = dflash_model::draft::DEFAULT_BLOCKS_PER_ATTENTION_CHUNK;
    let mut attention_name = "split".to_string();
    let mut raw = std::env::args().skip(1);
    while let Some(flag) = raw.next() {
        if flag == "--checkpoint-layers" {
            arguments.checkpoint_layers = true;
            continue;
        }
        let value = raw
            .next()
            .with_context(|| format!("{flag} needs a value"))?;
        let number = |value: &str| -> anyhow::Result<usize> {
            value
                .parse()
                .with_context(|| format!("{flag} {value:?}: not a number"))
        };
        match flag.as_str() {
            "--anchors" => {
                arguments.anchors = value
                    .split(',')
                    .map(number)
                    .collect::<anyhow::Result<_>>()?
            }
            "--steps" => arguments.steps = number(&value)?.max(1),
            "--seq-len" => arguments.sequence_length = number(&value)?,
            "--seqs" => arguments.sequences_per_step = number(&value)?,
            "--attention" => attention_name = value,
            "--attention-chunk" => attention_chunk = number(&value)? as i64,
            "--logits-chunk" => {
                arguments.logits_chunk_blocks = if value == "all" {
                    None
                } else {
                    Some(number(&value)? as i64)
                }
            }
            "--vocab" => arguments.vocab = Some(number(&value)? as i64),
            "--target-dir" => arguments.target_dir = Some(value.into()),
            "--architecture" => {
                (arguments.dflash2, arguments.dspark) = match value.as_str() {
                    "dflash" => (false, false),
                    "dflash2" => (true, false),
                    "dspark" => (false, true),
                    other => bail!("--architecture {other:?}: expected dflash, dflash2 or dspark"),
                }
            }
            "--device" => {
                let choice: dflash_shell::DeviceChoice =
                    value.parse().map_err(anyhow::Error::msg)?;
                arguments.device = dflash_model::device::resolve_device(choice)?;
            }
            "--dtype" => {
                let choice = <dflash_shell::DtypeChoice as clap::ValueEnum>::from_str(&value, true)
                    .map_err(|error| anyhow::anyhow!("--dtype {value:?}: {error}"))?;
                arguments.kind = dflash_model::device::kind_of(choice);
            }
            other => bail!("unknown flag {other:?}"),
        }
    }
    arguments.attention = match attention_name.as_str() {
        "fused" => AttentionImplementation::Fused {
            blocks_per_chunk: attention_chunk,
        },
        "concatenated" => AttentionImplementation::FusedConcatenated {
            blocks_per_chunk: attention_chunk,
        },
        "split" => AttentionImplementation::Split,
        other => bail!("--attention {other:?}: expected fused, concatenated or split"),
    };
    Ok(arguments)
}

/// Minor page faults of this process so far (`/proc/self/stat`, field 10).
fn minor_faults() -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let after_name = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("/proc/self/stat without a command name")?;
    // Fields after the name start at field 3 (state); minflt is field 10.
    let field = after_name
        .split_whitespace()
        .nth(7)
        .context("/proc/self/stat too short")?;
    Ok(field.parse()?)
}

/// Resets the peak resident set size (`VmHWM`) to the current one.
fn reset_peak_rss() -> anyhow::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5").context("/proc/self/clear_refs")
}

/// Peak resident set size in bytes since the last reset.
fn peak_rss_bytes() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .context("no VmHWM in /proc/self/status")?;
    let kilobytes: u64 = line
        .split_whitespace()
        .nth(1)
        .context("VmHWM without a value")?
        .parse()?;
    Ok(kilobytes * 1024)
}

// One measurement read top to bottom (set up, time, print): long on
// purpose, as splitting it would hide the order of what is timed.
fn main() -> anyhow::Result<()> {
    let allocator = configure_allocator(AllocatorMode::Retained);
    let arguments = parse_arguments()?;
    let scratch = tempfile::tempdir()?;
    let target_dir = match &arguments.target_dir {
        Some(dir) => dir.clone(),
        None => {
            let mut spec = TinyModelSpec::default();
            if let Some(vocab) = arguments.vocab {
                spec.vocab = vocab;
            }
            write_tiny_model(scratch.path(), &spec)?;
            scratch.path().to_path_buf()
        }
    };
    let (target_config, _) = FrozenTargetHeads::load(&target_dir, Device::Cpu, Kind::Float)?;
    let options = DraftOptions {
        mask_token_id: mask_token_id(&target_dir)?,
        ..DraftOptions::default()
    };
    let mut config = DraftConfig::for_target(&TargetDimensions::from(&target_config), &options)?;
    if arguments.dflash2 {
        config = config.with_dflash2(dflash_model::draft::Dflash2Config::default())?;
    }
    if arguments.dspark {
        config = config.with_dspark(dflash_model::draft::DsparkConfig::default())?;
    }
    let width = config.target_hidden_width();
    let hidden_size = config.hidden_size;
    let block_size = config.block_size;
    println!(
        "drafter step ({}): target {} (hidden {}, vocab {}), {} draft layers, block {block_size}, \
         {} × {} tokens per step, {} threads, {allocator}, attention {:?}, logits chunk {:?}, \
         checkpoint layers {}, device {:?} {:?}",
        if arguments.dflash2 {
            "DFlash2"
        } else if arguments.dspark {
            "DSpark"
        } else {
            "DFlash"
        },
        if arguments.target_dir.is_some() {
            target_dir.display().to_string()
        } else {
            "tiny".to_string()
        },
        config.hidden_size,
        config.vocab_size,
        config.num_draft_layers,
        arguments.sequences_per_step,
        arguments.sequence_length,
        tch::get_num_threads(),
        arguments.attention,
        arguments.logits_chunk_blocks,
        arguments.checkpoint_layers,
        arguments.device,
        arguments.kind,
    );
    let gpu_memory = match arguments.device {
        Device::Cuda(index) => {
            let settings = dflash_device::CudaAllocatorSettings::from_environment();
            println!(
                "{settings}{}",
                settings
                    .warning()
                    .map(|w| format!(": {w}"))
                    .unwrap_or_default()
            );
            dflash_device::GpuMemoryMonitor::start(index)
        }
        _ => None,
    };
    let mut generator = StdRng::seed_from_u64(0);
    let vocab_for_tokens = config.vocab_size.min(500);
    let batches: Vec<Vec<TrainingSequence>> = (0..2)
        .map(|_| {
            (0..arguments.sequences_per_step)
                .map(|_| TrainingSequence {
                    target_last_hidden: arguments.dspark.then(|| {
                        Tensor::randn(
                            [arguments.sequence_length as i64, hidden_size],
                            (Kind::BFloat16, Device::Cpu),
                        )
                    }),
                    input_ids: (0..arguments.sequence_length)
                        .map(|_| generator.random_range(3..vocab_for_tokens))
                        .collect(),
                    loss_mask: (0..arguments.sequence_length)
                        .map(|position| u8::from(position >= arguments.sequence_length / 4))
                        .collect(),
                    target_hidden: Tensor::randn(
                        [arguments.sequence_length as i64, width],
                        (Kind::BFloat16, Device::Cpu),
                    ),
                })
                .collect()
        })
        .collect();

    for &num_anchors in &arguments.anchors {
        let frozen = FrozenTargetHeads::load(&target_dir, arguments.device, arguments.kind)?.1;
        let mut model =
            DraftModel::new(config.clone(), frozen, arguments.device, arguments.kind, 0)?;
        model.set_attention(arguments.attention)?;
        let mut settings = TrainerSettings::recipe_defaults(block_size, arguments.steps as u64 + 1);
        settings.num_anchors = num_anchors;
        settings.memory.logits_chunk_blocks = arguments.logits_chunk_blocks;
        settings.memory.checkpoint_layers = arguments.checkpoint_layers;
        let mut trainer = DraftTrainer::new(model, settings);
        reset_peak_rss()?;
        // One warm-up step (allocator and thread pools), then the timed ones.
        trainer.accumulate(&batches[0])?;
        let first = trainer.step()?;
        let faults_before = minor_faults()?;
        let started = Instant::now();
        let mut last = first.clone();
        for step in 0..arguments.steps {
            trainer.accumulate(&batches[(step + 1) % 2])?;
            last = trainer.step()?;
        }
        let seconds = started.elapsed().as_secs_f64();
        let faults_per_step = (minor_faults()? - faults_before) as f64 / arguments.steps as f64;
        let tokens =
            (arguments.steps * arguments.sequences_per_step * arguments.sequence_length) as f64;
        println!(
            "anchors {num_anchors}: {:.0} tokens/s ({:.1} ms per step), {:.0} minor faults per step, \
             peak RSS {:.1} MiB, loss {:.4} -> {:.4}",
            tokens / seconds,
            seconds * 1000.0 / arguments.steps as f64,
            faults_per_step,
            peak_rss_bytes()? as f64 / (1024.0 * 1024.0),
            first.loss,
            last.loss
        );
        if let Some(reading) = gpu_memory.as_ref().and_then(|monitor| monitor.sample()) {
            println!(
                "anchors {num_anchors}: GPU memory {:.2} GiB in use after the last step, peak {:.2} GiB",
                reading.used_bytes as f64 / (1u64 << 30) as f64,
                reading.peak_bytes as f64 / (1u64 << 30) as f64
            );
        }
    }
    Ok(())
}
