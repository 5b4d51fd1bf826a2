//! `dflash regenerate`: rewrites the assistant turns of a chat data set with
//! the target itself, the standard step before draft-model training (the
//! drafter must learn the target's own distribution).
//!
//! Each line keeps its system and user turns (and every other field); each
//! assistant turn is replaced by the target's continuation of the
//! conversation so far, earlier assistant turns already regenerated. Lines
//! are processed in chunks; within a chunk, the k-th assistant turns of all
//! conversations form one generation round, batched by a token budget
//! (`dflash_model::generate`, KV cached). Pre-tokenized lines
//! (`input_ids` + `loss_mask`) keep their prompt (the tokens before the first
//! supervised one) and get a new supervised continuation.
//!
//! Sharded like the target's data (record `r` belongs to shard `r % N`),
//! and resumable: output lines are written in input order, whole lines only,
//! so a rerun skips the records already written.

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Args;
use dflash_model::chat::{parse_line, ChatEncoder, Conversation};
use dflash_model::generate::{generate, GenerationOptions, GenerationRequest};
use dflash_model::sampling::SamplingOptions;
use dflash_model::target_model::TargetModel;
use serde_json::Value;

#[derive(Debug, Clone, Args)]
pub struct RegenerateArgs {
    /// Target model directory (Hugging Face layout, with tokenizer and chat template).
    #[arg(long)]
    pub model: PathBuf,
    /// Chat JSONL to read (`messages` or ShareGPT `conversations`, or pre-tokenized).
    #[arg(long)]
    pub input: PathBuf,
    /// JSONL to write; when it exists, its lines are kept and skipped (resume).
    #[arg(long)]
    pub output: PathBuf,
    /// New tokens per assistant turn at most.
    #[arg(long, default_value_t = 512)]
    pub max_new_tokens: usize,
    /// 0 is greedy; otherwise the sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling mass (with --temperature > 0).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Sampling seed (each record samples from its own stream, so shards and
    /// resumed runs give the same lines).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// This process's shard of the records, `i/N` (records r with r % N == i).
    #[arg(long, default_value = "0/1", value_parser = parse_shard)]
    pub shard: (u64, u64),
    /// Padded tokens (rows × (prompt + max new tokens)) per generation batch.
    #[arg(long, default_value_t = 32768)]
    pub token_budget: usize,
    /// Records generated and written together (larger batches, coarser resume).
    #[arg(long, default_value_t = 256)]
    pub chunk_lines: usize,
    /// auto (the first CUDA device when libtorch sees one, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: dflash_shell::DeviceChoice,
}

fn parse_shard(text: &str) -> Result<(u64, u64), String> {
    let (index, count) = text
        .split_once('/')
        .ok_or_else(|| format!("shard {text:?} is not i/N"))?;
    let index: u64 = index
        .trim()
        .parse()
        .map_err(|_| format!("shard index {index:?} is not a number"))?;
    let count: u64 = count
        .trim()
        .parse()
        .map_err(|_| format!("shard count {count:?} is not a number"))?;
    if count == 0 || index >= count {
        return Err(format!("shard {text:?}: need 0 <= i < N"));
    }
    Ok((index, count))
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct RegenerateReport {
    /// Records of this shard in the input.
    pub shard_records: usize,
    /// Records already in the output before this run (resume).
    pub skipped: usize,
    /// Records written by this run.
    pub written: usize,
    pub generated_tokens: usize,
    pub seconds: f64,
}

/// One record being regenerated.
struct Record {
    /// The parsed JSON line, updated in place.
    value: Value,
    /// The record's index in the whole file (seeds its sampling).
    record_index: u64,
}

/// Where a record's turns are and how to write them back.
enum Turns {
    /// Indices of assistant entries in the `messages`/`conversations` list.
    Chat {
        list_key: &'static str,
        content_key: &'static str,
        assistant_entries: Vec<usize>,
    },
    /// Pre-tokenized: the prompt to continue.
    PreTokenized { prompt: Vec<i64> },
}

/// The target's end-of-sequence and end-of-turn ids: `eos_token_id` of
/// generation_config.json / config.json plus the chat end-of-turn tokens the
/// tokenizer knows (`<|im_end|>`, `<|eot_id|>`, `<|end|>`).
fn stop_token_ids(model_dir: &Path, tokenizer: &tokenizers::Tokenizer) -> Vec<i64> {
    let mut ids = dflash_model::tokens::eos_token_ids(model_dir);
    for token in ["<|im_end|>", "<|eot_id|>", "<|end|>"] {
        if let Some(id) = tokenizer.token_to_id(token) {
            ids.push(i64::from(id));
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn turns_of(value: &Value, line_number: usize) -> anyhow::Result<Turns> {
    let conversation = parse_line(&value.to_string())
        .map_err(|error| anyhow::anyhow!("line {line_number}: {error}"))?;
    match conversation {
        Conversation::PreTokenized {
            input_ids,
            loss_mask,
        } => {
            let has_mask = value.get("loss_mask").is_some_and(|mask| !mask.is_null());
            let prompt_length = if has_mask {
                loss_mask
                    .iter()
                    .position(|&mask| mask != 0)
                    .unwrap_or(input_ids.len())
            } else {
                input_ids.len()
            };
            if prompt_length == 0 {
                bail!("line {line_number}: the first token is supervised, no prompt to continue");
            }
            Ok(Turns::PreTokenized {
                prompt: input_ids[..prompt_length].to_vec(),
            })
        }
        Conversation::Messages(messages) => {
            let (list_key, content_key) = if value.get("messages").is_some() {
                ("messages", "content")
            } else {
                ("conversations", "value")
            };
            let assistant_entries = messages
                .iter()
                .enumerate()
                .filter(|(_, message)| message.role == "assistant")
                .map(|(index, _)| index)
                .collect();
            Ok(Turns::Chat {
                list_key,
                content_key,
                assistant_entries,
            })
        }
    }
}

/// Counts the output's complete lines, cutting a partial last line (a run
/// stopped mid-write) so that the resumed output stays valid JSONL.
fn complete_output_lines(output: &Path) -> anyhow::Result<usize> {
    let Ok(bytes) = std::fs::read(output) else {
        return Ok(0);
    };
    let complete = bytes
        .iter()
        .rposition(|&byte| byte == b'\n')
        .map_or(0, |last| last + 1);
    if complete < bytes.len() {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(output)
            .with_context(|| format!("opening {}", output.display()))?;
        file.set_len(complete as u64)?;
    }
    Ok(bytes[..complete]
        .split(|&byte| byte == b'\n')
        .filter(|line| !line.iter().all(u8::is_ascii_whitespace))
        .count())
}

/// Progress every few seconds: a line rewritten in place on a terminal, a
/// new line otherwise.
struct Progress {
    started: Instant,
    last: Instant,
    total: usize,
    terminal: bool,
}

impl Progress {
    fn report(&mut self, done: usize, tokens: usize, force: bool) {
        if !force && self.last.elapsed() < Duration::from_secs(3) {
            return;
        }
        self.last = Instant::now();
        let seconds = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = done as f64 / seconds;
        let remaining = self.total.saturating_sub(done);
        let eta = if rate > 0.0 {
            format!("{:.0}s", remaining as f64 / rate)
        } else {
            "-".to_string()
        };
        let line = format!(
            "regenerate: {done}/{} lines ({:.0}%), {tokens} tokens, {:.0} tokens/s, ETA {eta}",
            self.total,
            100.0 * done as f64 / self.total.max(1) as f64,
            tokens as f64 / seconds
        );
        if self.terminal {
            eprint!("\r{line}\x1b[K");
            if force {
                eprintln!();
            }
        } else {
            eprintln!("{line}");
        }
    }
}

/// Runs `dflash regenerate`: load the target, read this shard's records,
/// skip what the output already has, regenerate the rest chunk by chunk.
pub fn run(args: &RegenerateArgs) -> anyhow::Result<RegenerateReport> {
    let started = Instant::now();
    let sampling = SamplingOptions {
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
    };
    sampling.validate()?;
    if args.chunk_lines == 0 || args.token_budget == 0 {
        bail!("--chunk-lines and --token-budget must be at least 1");
    }
    let generator = Generator::load(args, sampling)?;
    let shard_lines = read_shard_lines(args)?;
    let (skipped, mut output) = open_output(args, shard_lines.len())?;
    let mut progress = Progress {
        started: Instant::now(),
        last: Instant::now(),
        total: shard_lines.len(),
        terminal: std::io::stderr().is_terminal(),
    };
    let mut generated_tokens = 0;
    let mut written = 0;
    for chunk in shard_lines[skipped..].chunks(args.chunk_lines) {
        let (mut records, turns) = parse_chunk(args, chunk)?;
        regenerate_chunk(
            &ChunkContext {
                target: &generator.target,
                encoder: &generator.encoder,
                tokenizer: &generator.tokenizer,
                options: &generator.options,
                token_budget: args.token_budget,
            },
            &mut records,
            &turns,
            &mut |tokens| {
                generated_tokens += tokens;
                progress.report(skipped + written, generated_tokens, false);
            },
        )?;
        let mut text = String::new();
        for record in &records {
            text.push_str(&record.value.to_string());
            text.push('\n');
        }
        output
            .write_all(text.as_bytes())
            .and_then(|()| output.flush())
            .with_context(|| format!("writing {}", args.output.display()))?;
        written += records.len();
        progress.report(skipped + written, generated_tokens, false);
    }
    progress.report(skipped + written, generated_tokens, true);
    Ok(RegenerateReport {
        shard_records: shard_lines.len(),
        skipped,
        written,
        generated_tokens,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The target and what generating with it needs.
struct Generator {
    target: TargetModel,
    encoder: ChatEncoder,
    tokenizer: tokenizers::Tokenizer,
    options: GenerationOptions,
}

impl Generator {
    fn load(args: &RegenerateArgs, sampling: SamplingOptions) -> anyhow::Result<Self> {
        let device = dflash_model::device::resolve_device(args.device)?;
        let kind = if device == tch::Device::Cpu {
            tch::Kind::Float
        } else {
            tch::Kind::BFloat16
        };
        let encoder = ChatEncoder::from_directory(&args.model, usize::MAX, None)
            .map_err(|error| anyhow::anyhow!("{}: {error}", args.model.display()))?;
        let tokenizer_path = args.model.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
            .map_err(|error| anyhow::anyhow!("{}: {error}", tokenizer_path.display()))?;
        let target = TargetModel::load(&args.model, device, kind)
            .with_context(|| format!("loading the target model from {}", args.model.display()))?;
        let options = GenerationOptions {
            max_new_tokens: args.max_new_tokens,
            stop_token_ids: stop_token_ids(&args.model, &tokenizer),
            sampling,
            ..GenerationOptions::default()
        };
        Ok(Self {
            target,
            encoder,
            tokenizer,
            options,
        })
    }
}

/// This shard's records, as (record index, line number, text); blank lines
/// are not records.
fn read_shard_lines(args: &RegenerateArgs) -> anyhow::Result<Vec<(u64, usize, String)>> {
    let input = std::fs::File::open(&args.input)
        .with_context(|| format!("opening {}", args.input.display()))?;
    let (shard_index, shard_count) = args.shard;
    let mut shard_lines = Vec::new();
    let mut record_index = 0u64;
    for (index, line) in std::io::BufReader::new(input).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", args.input.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        if record_index % shard_count == shard_index {
            shard_lines.push((record_index, index + 1, line));
        }
        record_index += 1;
    }
    Ok(shard_lines)
}

/// Opens the output for appending: the lines it already has (a resumed
/// run skips them) and the file.
fn open_output(
    args: &RegenerateArgs,
    shard_records: usize,
) -> anyhow::Result<(usize, std::fs::File)> {
    let skipped = complete_output_lines(&args.output)?;
    if skipped > shard_records {
        let (shard_index, shard_count) = args.shard;
        bail!(
            "{} has {skipped} lines, more than the {shard_records} records of shard {shard_index}/{shard_count}: a different input or shard?",
            args.output.display(),
        );
    }
    if let Some(parent) = args.output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let output = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.output)
        .with_context(|| format!("opening {}", args.output.display()))?;
    Ok((skipped, output))
}

/// Parses a chunk of lines into records and their turns to regenerate.
fn parse_chunk(
    args: &RegenerateArgs,
    chunk: &[(u64, usize, String)],
) -> anyhow::Result<(Vec<Record>, Vec<Turns>)> {
    let mut records = Vec::with_capacity(chunk.len());
    let mut turns = Vec::with_capacity(chunk.len());
    for (record_index, line_number, line) in chunk {
        let value: Value = serde_json::from_str(line)
            .map_err(|error| anyhow::anyhow!("{}:{line_number}: {error}", args.input.display()))?;
        turns.push(
            turns_of(&value, *line_number).with_context(|| args.input.display().to_string())?,
        );
        records.push(Record {
            value,
            record_index: *record_index,
        });
    }
    Ok((records, turns))
}

/// What every chunk is generated with.
struct ChunkContext<'a> {
    target: &'a TargetModel,
    encoder: &'a ChatEncoder,
    tokenizer: &'a tokenizers::Tokenizer,
    options: &'a GenerationOptions,
    token_budget: usize,
}

impl ChunkContext<'_> {
    /// Continues `requests` in batches of the token budget.
    fn generate(
        &self,
        requests: &[GenerationRequest],
        on_batch: &mut OnBatch<'_>,
    ) -> anyhow::Result<Vec<dflash_model::generate::Generated>> {
        Ok(generate(
            self.target,
            requests,
            self.options,
            self.token_budget,
            on_batch,
        )?)
    }
}

/// Regenerates every assistant turn of `records` in rounds (the k-th turn
/// of every conversation together), telling `on_tokens` how many tokens
/// each finished batch generated.
fn regenerate_chunk(
    context: &ChunkContext<'_>,
    records: &mut [Record],
    turns: &[Turns],
    on_tokens: &mut dyn FnMut(usize),
) -> anyhow::Result<()> {
    let mut on_batch = |_: &[usize], outputs: &[dflash_model::generate::Generated]| {
        on_tokens(outputs.iter().map(|output| output.tokens.len()).sum());
    };
    regenerate_pre_tokenized(context, records, turns, &mut on_batch)?;
    // Chat records: round k regenerates every conversation's k-th assistant turn.
    let rounds = turns
        .iter()
        .map(|turn| match turn {
            Turns::Chat {
                assistant_entries, ..
            } => assistant_entries.len(),
            Turns::PreTokenized { .. } => 0,
        })
        .max()
        .unwrap_or(0);
    for round in 0..rounds {
        regenerate_chat_round(context, records, turns, round, &mut on_batch)?;
    }
    Ok(())
}

/// The callback [`generate`] reports each finished batch to.
type OnBatch<'a> = dyn FnMut(&[usize], &[dflash_model::generate::Generated]) + 'a;

/// Pre-tokenized records: one round, the continuation after the prompt.
fn regenerate_pre_tokenized(
    context: &ChunkContext<'_>,
    records: &mut [Record],
    turns: &[Turns],
    on_batch: &mut OnBatch<'_>,
) -> anyhow::Result<()> {
    let mut requests = Vec::new();
    let mut owners = Vec::new();
    for (position, turn) in turns.iter().enumerate() {
        if let Turns::PreTokenized { prompt } = turn {
            requests.push(GenerationRequest {
                prompt: prompt.clone(),
                sequence_id: records[position].record_index << 16,
            });
            owners.push(position);
        }
    }
    let outputs = context.generate(&requests, on_batch)?;
    for ((position, request), output) in owners.iter().zip(&requests).zip(outputs) {
        let input_ids = [request.prompt.as_slice(), output.tokens.as_slice()].concat();
        let loss_mask: Vec<u8> = (0..input_ids.len())
            .map(|index| u8::from(index >= request.prompt.len()))
            .collect();
        let value = &mut records[*position].value;
        value["input_ids"] = serde_json::json!(input_ids);
        value["loss_mask"] = serde_json::json!(loss_mask);
    }
    Ok(())
}

/// Round `round` of the chat records: every conversation's assistant turn
/// number `round`, generated after the (already regenerated) turns before it.
fn regenerate_chat_round(
    context: &ChunkContext<'_>,
    records: &mut [Record],
    turns: &[Turns],
    round: usize,
    on_batch: &mut OnBatch<'_>,
) -> anyhow::Result<()> {
    let mut requests = Vec::new();
    let mut owners = Vec::new();
    for (position, turn) in turns.iter().enumerate() {
        let Turns::Chat {
            list_key,
            assistant_entries,
            ..
        } = turn
        else {
            continue;
        };
        let Some(&entry) = assistant_entries.get(round) else {
            continue;
        };
        let record = &records[position];
        let prompt = chat_prompt(context.encoder, record, list_key, entry, round)?;
        requests.push(GenerationRequest {
            prompt,
            sequence_id: (record.record_index << 16) + round as u64 + 1,
        });
        owners.push(position);
    }
    let outputs = context.generate(&requests, on_batch)?;
    for (position, output) in owners.into_iter().zip(outputs) {
        let mut tokens = output.tokens;
        if output.stopped {
            tokens.pop();
        }
        let ids: Vec<u32> = tokens.iter().map(|&id| id as u32).collect();
        let text = context
            .tokenizer
            .decode(&ids, true)
            .map_err(|error| anyhow::anyhow!("decoding: {error}"))?;
        let Turns::Chat {
            list_key,
            content_key,
            assistant_entries,
        } = &turns[position]
        else {
            continue;
        };
        let entry = assistant_entries[round];
        records[position].value[*list_key][entry][*content_key] = Value::String(text);
    }
    Ok(())
}

/// The conversation before assistant entry `entry` of `record`, rendered
/// with the generation prompt.
fn chat_prompt(
    encoder: &ChatEncoder,
    record: &Record,
    list_key: &str,
    entry: usize,
    round: usize,
) -> anyhow::Result<Vec<i64>> {
    let history: Vec<Value> = record.value[list_key]
        .as_array()
        .map(|entries| entries[..entry].to_vec())
        .unwrap_or_default();
    let mut prefix = serde_json::Map::new();
    prefix.insert(list_key.to_string(), Value::Array(history));
    let prefix = Value::Object(prefix).to_string();
    let Ok(Conversation::Messages(messages)) = parse_line(&prefix) else {
        bail!(
            "record {}: cannot parse the turns before assistant turn {round}",
            record.record_index
        );
    };
    encoder
        .encode_prompt(&messages)
        .map_err(|error| anyhow::anyhow!("record {}: {error}", record.record_index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_parse_as_index_over_count() {
        assert_eq!(parse_shard("1/4"), Ok((1, 4)));
        assert!(parse_shard("4/4").unwrap_err().contains("4/4"));
        assert!(parse_shard("x/2").unwrap_err().contains("\"x\""));
        assert!(parse_shard("3").is_err());
    }
}
