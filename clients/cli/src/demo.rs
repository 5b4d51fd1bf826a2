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
            // Enough distinct prompts that the drafter must learn the target
            // rather than memorise sequences (held-out τ needs it).
            unique_sequences: 640,
            epochs: 4,
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

/// Reads evaluation prompts: pre-tokenized lines (`input_ids`, with an
/// optional `loss_mask` whose first supervised token ends the prompt), or
/// conversations (`messages` / `conversations`) rendered with the model's
/// chat template up to the assistant's turn.
pub fn read_prompts(path: &Path, model_dir: &Path) -> anyhow::Result<Vec<Vec<i64>>> {
    use dflash_target_server::data::{parse_line, ChatEncoder, Conversation};
    let mut encoder: Option<ChatEncoder> = None;
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
            Conversation::PreTokenized {
                input_ids,
                loss_mask,
            } => {
                // A prompt is what precedes the first supervised token.
                let prompt_length = loss_mask
                    .iter()
                    .position(|&mask| mask != 0)
                    .unwrap_or(input_ids.len());
                input_ids[..prompt_length.max(1).min(input_ids.len())].to_vec()
            }
            Conversation::Messages(mut messages) => {
                // Trailing assistant turns are what gets generated: drop them.
                while messages
                    .last()
                    .is_some_and(|message| message.role == "assistant")
                {
                    messages.pop();
                }
                if encoder.is_none() {
                    encoder = Some(
                        ChatEncoder::from_directory(model_dir, usize::MAX, None)
                            .map_err(|error| anyhow::anyhow!("{}: {error}", model_dir.display()))?,
                    );
                }
                let Some(encoder) = encoder.as_ref() else {
                    continue;
                };
                encoder
                    .encode_prompt(&messages)
                    .map_err(|error| anyhow::anyhow!("{}:{line_number}: {error}", path.display()))?
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_come_from_token_ids_or_chat_conversations() {
        let directory = tempfile::tempdir().unwrap();
        let model = directory.path().join("model");
        dflash_model::tiny::write_tiny_model(&model, &dflash_model::tiny::TinyModelSpec::default())
            .unwrap();
        let data = directory.path().join("held_out.jsonl");
        std::fs::write(
            &data,
            concat!(
                "{\"input_ids\": [5, 6, 7, 8], \"loss_mask\": [0, 0, 1, 1]}\n",
                "\n",
                "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello, how are you today?\"},",
                " {\"role\": \"assistant\", \"content\": \"I am fine.\"}]}\n"
            ),
        )
        .unwrap();
        let prompts = read_prompts(&data, &model).unwrap();
        assert_eq!(prompts.len(), 2);
        assert_eq!(
            prompts[0],
            vec![5, 6],
            "the prompt ends before the first supervised token"
        );
        // ChatML: <|im_start|>user ... <|im_end|> then the opened assistant turn.
        let im_start = 457;
        let im_end = 458;
        let chat = &prompts[1];
        assert_eq!(chat[0], im_start);
        assert_eq!(
            chat.iter().filter(|&&id| id == im_start).count(),
            2,
            "{chat:?}"
        );
        let last_start = chat.iter().rposition(|&id| id == im_start).unwrap();
        assert!(
            !chat[last_start..].contains(&im_end),
            "the assistant turn must be open: {chat:?}"
        );

        std::fs::write(&data, "{\"input_ids\": [1, 2]}\nnot json\n").unwrap();
        let error = read_prompts(&data, &model).unwrap_err().to_string();
        assert!(error.contains("held_out.jsonl:2"), "{error}");
    }
}
