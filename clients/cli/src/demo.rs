//! The embedded default of `dflash local`: the tiny model from `init-tiny`
//! and a data set the tiny target generates itself (random prompts continued
//! greedily), so a drafter trained on it has something real to learn and τ
//! measures it. Nothing is downloaded.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use dflash_model::target::TargetModel;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{Device, Kind};

/// How much demo data to make.
#[derive(Debug, Clone)]
pub struct DemoSpec {
    pub unique_sequences: usize,
    /// Each unique sequence appears this many times in train.jsonl (shuffled),
    /// so a short run still gives the drafters enough optimizer steps.
    pub epochs: usize,
    pub prompt_tokens: usize,
    pub continuation_tokens: usize,
    pub held_out_prompts: usize,
    pub seed: u64,
}

impl Default for DemoSpec {
    fn default() -> Self {
        DemoSpec {
            unique_sequences: 64,
            epochs: 6,
            prompt_tokens: 6,
            continuation_tokens: 40,
            held_out_prompts: 8,
            seed: 17,
        }
    }
}

/// Where the demo data went.
#[derive(Debug, Clone)]
pub struct DemoData {
    pub train: PathBuf,
    pub held_out: PathBuf,
    pub train_samples: usize,
}

fn random_prompts(count: usize, length: usize, generator: &mut StdRng) -> Vec<Vec<i64>> {
    (0..count)
        .map(|_| {
            (0..length)
                .map(|_| generator.random_range(3..300))
                .collect()
        })
        .collect()
}

/// Writes `train.jsonl` (pre-tokenized: prompt + greedy continuation, loss
/// on the continuation) and `held_out.jsonl` (prompts only) into `out_dir`.
pub fn write_demo_data(
    model_dir: &Path,
    out_dir: &Path,
    spec: &DemoSpec,
) -> anyhow::Result<DemoData> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let target = TargetModel::load(model_dir, Device::Cpu, Kind::Float)
        .with_context(|| format!("loading the target model from {}", model_dir.display()))?;
    let mut generator = StdRng::seed_from_u64(spec.seed);
    let prompts = random_prompts(spec.unique_sequences, spec.prompt_tokens, &mut generator);
    let mut lines = Vec::with_capacity(prompts.len());
    for prompt in &prompts {
        let tokens = dflash_drafter_server::eval::greedy_generate(
            &target,
            prompt,
            spec.continuation_tokens,
            &[],
        )
        .context("greedy generation with the tiny target")?;
        let loss_mask: Vec<u8> = (0..tokens.len())
            .map(|position| u8::from(position >= prompt.len()))
            .collect();
        lines.push(serde_json::json!({ "input_ids": tokens, "loss_mask": loss_mask }).to_string());
    }
    let mut order: Vec<usize> = (0..lines.len())
        .cycle()
        .take(lines.len() * spec.epochs.max(1))
        .collect();
    for index in (1..order.len()).rev() {
        let other = generator.random_range(0..=index);
        order.swap(index, other);
    }
    let train = out_dir.join("train.jsonl");
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(&train).with_context(|| format!("creating {}", train.display()))?,
    );
    for &index in &order {
        writeln!(file, "{}", lines[index])?;
    }
    file.flush()?;
    let held_out = out_dir.join("held_out.jsonl");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&held_out)?);
    for prompt in random_prompts(spec.held_out_prompts, spec.prompt_tokens, &mut generator) {
        writeln!(file, "{}", serde_json::json!({ "input_ids": prompt }))?;
    }
    file.flush()?;
    Ok(DemoData {
        train,
        held_out,
        train_samples: order.len(),
    })
}

/// Reads evaluation prompts from pre-tokenized lines (`input_ids`, with an
/// optional `loss_mask` whose first supervised token ends the prompt).
pub fn read_prompts(path: &Path) -> anyhow::Result<Vec<Vec<i64>>> {
    use dflash_target_server::data::{parse_line, Conversation};
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut prompts = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let line_number = index + 1;
        let conversation = parse_line(line)
            .map_err(|error| anyhow::anyhow!("{}:{line_number}: {error}", path.display()))?;
        let prompt = match conversation {
            Conversation::PreTokenized { input_ids, loss_mask } => {
                // A prompt is what precedes the first supervised token.
                let prompt_length = loss_mask.iter().position(|&mask| mask != 0).unwrap_or(input_ids.len());
                input_ids[..prompt_length.max(1).min(input_ids.len())].to_vec()
            }
            Conversation::Messages(_) => anyhow::bail!(
                "{}:{line_number}: text conversations are not supported by eval yet; give pre-tokenized prompts ({{\"input_ids\": [...]}})",
                path.display()
            ),
        };
        if prompt.is_empty() {
            anyhow::bail!("{}:{line_number}: empty prompt", path.display());
        }
        prompts.push(prompt);
    }
    if prompts.is_empty() {
        anyhow::bail!("{}: no prompts", path.display());
    }
    Ok(prompts)
}
