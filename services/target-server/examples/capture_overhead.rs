//! What the hidden-state capture costs on top of the target's forward, on
//! the CPU for the tiny target (or any model directory), interleaved rounds
//! in one process:
//!
//! - `forward`: the plain full forward a Hugging Face `model(input_ids)`
//!   does (every layer, final norm, LM head), no output kept;
//! - `forward to depth`: the forward up to the deepest DFlash layer, only
//!   that layer's output kept (what capture cannot do with less);
//! - `capture`: what the target-server does per batch: the forward up to
//!   the deepest DFlash layer with the layers' outputs kept and
//!   concatenated, cast to bf16, copied to host memory and cut into one
//!   encoded `Sample` per sequence.
//!
//! Prints tokens/s of each (median over rounds), the capture's hidden-state
//! bytes/s, capture / forward and capture / forward to depth (the capture's
//! own overhead). `scripts/bench/target_forward_hf.py` runs HF
//! transformers' forward on the same model directory for the ratio against
//! transformers.
//!
//! ```text
//! cargo run --release -p dflash-target-server --example capture_overhead -- \
//!     [--model-dir DIR] [--shape tiny|qwen3-8b] [--batch 8] [--seq-len 512] \
//!     [--rounds 7] [--draft-layers 5] [--device cpu|cuda:N] [--dtype f32|bf16] \
//!     [--save-hidden FILE]
//! ```
//!
//! `--save-hidden FILE` also writes the captured batch to a safetensors file
//! (`input_ids` int64 [B, T], `layer_ids` int64 [n], `hidden_states` bf16
//! [B, T, n*H], what the target-server sends): `scripts/bench/target_parity_hf.py`
//! compares it with transformers' hidden states of the same weights and ids.
//!
//! Without `--model-dir` the model of `--shape` is written to a temporary
//! folder; with a folder that does not exist yet it is written there (so the
//! Python script can load the same weights). `--shape qwen3-8b` is Qwen3-8B's
//! shape (36 layers, hidden 4096, 32/8 heads, intermediate 12288, vocab
//! 151936) with random bf16 weights: 16 GB on disk, no download
//! (`scripts/check-gpu.sh` runs it on a GPU). On a GPU each timed pass ends
//! with a device synchronize, so the times are the device's.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use bytes::Bytes;
use dflash_device::{configure_allocator, AllocatorMode};
use dflash_model::target_model::{build_target_layer_ids, TargetModel};
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_proto::v1::Dtype;
use tch::{Device, Kind, Tensor};

struct Arguments {
    model_dir: Option<PathBuf>,
    /// The model written when the directory has none.
    shape: TinyModelSpec,
    batch: i64,
    sequence_length: i64,
    rounds: usize,
    draft_layers: usize,
    device: Device,
    kind: Kind,
    save_hidden: Option<PathBuf>,
}

/// Qwen3-8B's shape (its config.json) with the tiny model's tokenizer.
fn qwen3_8b_shape() -> TinyModelSpec {
    TinyModelSpec {
        hidden_size: 4096,
        layers: 36,
        heads: 32,
        kv_heads: 8,
        intermediate: 12288,
        vocab: 151_936,
        ..TinyModelSpec::default()
    }
}

fn parse_arguments() -> anyhow::Result<Arguments> {
    let mut arguments = Arguments {
        model_dir: None,
        shape: TinyModelSpec::default(),
        batch: 8,
        sequence_length: 512,
        rounds: 7,
        draft_layers: 5,
        device: Device::Cpu,
        kind: Kind::Float,
        save_hidden: None,
    };
    let mut words = std::env::args().skip(1);
    while let Some(flag) = words.next() {
        let mut value = || {
            words
                .next()
                .with_context(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--model-dir" => arguments.model_dir = Some(PathBuf::from(value()?)),
            "--batch" => arguments.batch = value()?.parse().context("--batch")?,
            "--seq-len" => arguments.sequence_length = value()?.parse().context("--seq-len")?,
            "--rounds" => arguments.rounds = value()?.parse().context("--rounds")?,
            "--draft-layers" => {
                arguments.draft_layers = value()?.parse().context("--draft-layers")?
            }
            "--shape" => {
                arguments.shape = match value()?.as_str() {
                    "tiny" => TinyModelSpec::default(),
                    "qwen3-8b" => qwen3_8b_shape(),
                    other => bail!("--shape {other:?}: expected tiny or qwen3-8b"),
                }
            }
            "--device" => {
                let choice: dflash_shell::DeviceChoice =
                    value()?.parse().map_err(anyhow::Error::msg)?;
                arguments.device = dflash_model::device::resolve_device(choice)?;
            }
            "--dtype" => {
                let name = value()?;
                let choice = <dflash_shell::DtypeChoice as clap::ValueEnum>::from_str(&name, true)
                    .map_err(|error| anyhow::anyhow!("--dtype {name:?}: {error}"))?;
                arguments.kind = dflash_model::device::kind_of(choice);
            }
            "--save-hidden" => arguments.save_hidden = Some(PathBuf::from(value()?)),
            "--bench" => {} // cargo bench passes it
            other => bail!("unknown flag {other:?}"),
        }
    }
    if arguments.batch < 1 || arguments.sequence_length < 1 || arguments.rounds < 1 {
        bail!("--batch, --seq-len and --rounds must be at least 1");
    }
    Ok(arguments)
}

/// The target-server's per-batch work after the forward: bf16 on the host,
/// one encoded sample per sequence (every sequence is full length here).
fn to_samples(hidden: &Tensor, ids: &[i64], rows: usize) -> anyhow::Result<usize> {
    let host = hidden
        .f_to_kind(Kind::BFloat16)?
        .f_to_device(Device::Cpu)?
        .f_contiguous()?;
    let elements = host.numel();
    let mut buffer = vec![0u8; elements * 2];
    host.f_copy_data_u8(&mut buffer, elements)?;
    let buffer = Bytes::from(buffer);
    let row_bytes = buffer.len() / rows;
    let tokens = ids.len() / rows;
    let width = (row_bytes / 2 / tokens) as u64;
    let loss_mask = vec![1u8; tokens];
    let mut encoded = 0;
    for row in 0..rows {
        let sample = dflash_proto::sample::encode(
            &ids[row * tokens..(row + 1) * tokens],
            &loss_mask,
            buffer.slice(row * row_bytes..(row + 1) * row_bytes),
            Dtype::Bf16,
            width,
        );
        encoded += sample.tensors.len();
    }
    Ok(encoded)
}

/// Waits for the device's queued work, so a timer read after it timed the
/// device (a no-op on the CPU, whose work is done when the call returns).
fn settle(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> anyhow::Result<()> {
    configure_allocator(AllocatorMode::Retained);
    let arguments = parse_arguments()?;
    let scratch = tempfile::tempdir()?;
    let model_dir = arguments
        .model_dir
        .clone()
        .unwrap_or_else(|| scratch.path().join("tiny-qwen3"));
    if !model_dir.join("config.json").exists() {
        let started = Instant::now();
        write_tiny_model(&model_dir, &arguments.shape)?;
        println!(
            "wrote {} ({} layers, hidden {}) in {:.1} s",
            model_dir.display(),
            arguments.shape.layers,
            arguments.shape.hidden_size,
            started.elapsed().as_secs_f64()
        );
    }
    let (device, kind) = (arguments.device, arguments.kind);
    let model = TargetModel::load(&model_dir, device, kind)?;
    let layer_ids =
        build_target_layer_ids(model.config().num_hidden_layers, arguments.draft_layers);
    let vocab = model.config().vocab_size;
    let (rows, length) = (arguments.batch, arguments.sequence_length);
    let ids: Vec<i64> = (0..rows * length).map(|i| (i * 31 + 7) % vocab).collect();
    let input_ids = Tensor::from_slice(&ids)
        .view([rows, length])
        .to_device(device);
    let mask = input_ids.ones_like();
    let tokens = (rows * length) as f64;
    println!(
        "model {} ({} layers, hidden {}), batch {rows} x {length} tokens, capture layers {layer_ids:?}, \
         {} libtorch threads, {} rounds, device {device:?} {kind:?}",
        model_dir.display(),
        model.config().num_hidden_layers,
        model.config().hidden_size,
        tch::get_num_threads(),
        arguments.rounds
    );
    // One untimed pass of each: first-touch allocations and lazy init.
    drop(model.logits(&input_ids, &mask)?);
    let warm = model.capture_hidden_states(&input_ids, &mask, &layer_ids)?;
    to_samples(&warm, &ids, rows as usize)?;
    settle(device);
    if let Some(path) = &arguments.save_hidden {
        let layers: Vec<i64> = layer_ids.iter().map(|&id| id as i64).collect();
        Tensor::write_safetensors(
            &[
                ("input_ids", input_ids.to_device(Device::Cpu)),
                ("layer_ids", Tensor::from_slice(&layers)),
                (
                    "hidden_states",
                    warm.f_to_kind(Kind::BFloat16)?.f_to_device(Device::Cpu)?,
                ),
            ],
            path,
        )
        .with_context(|| format!("--save-hidden {}", path.display()))?;
        println!("saved the captured batch to {}", path.display());
    }
    drop(warm);
    // What the target sends per token: the kept layers' states in bf16.
    let bytes_per_token = (layer_ids.len() as i64 * model.config().hidden_size * 2) as f64;
    let deepest = layer_ids.iter().max().copied().unwrap_or(0);
    let (mut forward, mut to_depth, mut capture) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..arguments.rounds {
        let started = Instant::now();
        let logits = model.logits(&input_ids, &mask)?;
        settle(device);
        drop(logits);
        forward.push(tokens / started.elapsed().as_secs_f64());

        let started = Instant::now();
        let deepest_only = model.capture_hidden_states(&input_ids, &mask, &[deepest])?;
        settle(device);
        drop(deepest_only);
        to_depth.push(tokens / started.elapsed().as_secs_f64());

        let started = Instant::now();
        let hidden = model.capture_hidden_states(&input_ids, &mask, &layer_ids)?;
        let encoded = to_samples(&hidden, &ids, rows as usize)?;
        capture.push(tokens / started.elapsed().as_secs_f64());
        anyhow::ensure!(encoded == 3 * rows as usize, "every sample has 3 tensors");
    }
    let forward = median(&mut forward);
    let to_depth = median(&mut to_depth);
    let capture = median(&mut capture);
    println!("forward (HF-style full forward, logits): {forward:.0} tokens/s");
    println!("forward to layer {deepest} (its output only): {to_depth:.0} tokens/s");
    println!(
        "capture (forward to layer {deepest}, {} layers kept, bf16, host copy, samples): {capture:.0} tokens/s, {:.2} GB/s of hidden states",
        layer_ids.len(),
        capture * bytes_per_token / 1e9
    );
    println!("capture / forward: {:.3}", capture / forward);
    println!(
        "capture / forward to layer {deepest}: {:.3} (the capture's own cost)",
        capture / to_depth
    );
    Ok(())
}
