//! Generation tokens/s on the tiny model, in one run: today's per-prompt
//! uncached greedy decoding (the whole prefix recomputed for every token)
//! against batched KV-cached greedy decoding, on the same prompts, and a
//! check that both produced the same tokens.
//!
//!     cargo run --release -p dflash-model --example generation_throughput -- [PROMPTS] [NEW_TOKENS]
//!
//! Defaults: 64 prompts of 6 tokens, 40 new tokens each (the demo's shape).

use std::time::Instant;

use dflash_model::generate::{
    generate, greedy_generate_uncached, GenerationOptions, GenerationRequest,
};
use dflash_model::target_model::TargetModel;
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use tch::{Device, Kind};

fn main() -> anyhow::Result<()> {
    let mut arguments = std::env::args().skip(1);
    let prompts: usize = arguments.next().map_or(Ok(64), |text| text.parse())?;
    let new_tokens: usize = arguments.next().map_or(Ok(40), |text| text.parse())?;
    let directory = tempfile::tempdir()?;
    write_tiny_model(directory.path(), &TinyModelSpec::default())?;
    let target = TargetModel::load(directory.path(), Device::Cpu, Kind::Float)?;
    let requests: Vec<GenerationRequest> = (0..prompts)
        .map(|index| GenerationRequest {
            prompt: (0..6)
                .map(|position| ((index * 131 + position * 37 + 11) % 290) as i64 + 3)
                .collect(),
            sequence_id: index as u64,
        })
        .collect();
    println!(
        "tiny Qwen3 on the CPU ({} libtorch threads): {prompts} prompts x {new_tokens} new tokens",
        tch::get_num_threads()
    );

    let started = Instant::now();
    let uncached: Vec<Vec<i64>> = requests
        .iter()
        .map(|request| greedy_generate_uncached(&target, &request.prompt, new_tokens, &[]))
        .collect::<Result<_, _>>()?;
    let uncached_seconds = started.elapsed().as_secs_f64();
    let tokens: usize = uncached.iter().map(Vec::len).sum();

    let options = GenerationOptions {
        max_new_tokens: new_tokens,
        ..GenerationOptions::default()
    };
    let started = Instant::now();
    let cached = generate(&target, &requests, &options, 8192, |_, _| {})?;
    let cached_seconds = started.elapsed().as_secs_f64();
    let identical = cached
        .iter()
        .zip(&uncached)
        .all(|(cached, uncached)| &cached.tokens == uncached);

    let uncached_rate = tokens as f64 / uncached_seconds;
    let cached_rate = tokens as f64 / cached_seconds;
    println!("per-prompt uncached: {tokens} tokens in {uncached_seconds:.2}s = {uncached_rate:.0} tokens/s");
    println!(
        "batched KV cache:    {tokens} tokens in {cached_seconds:.2}s = {cached_rate:.0} tokens/s"
    );
    println!(
        "speed-up {:.1}x; identical tokens: {identical}",
        cached_rate / uncached_rate
    );
    anyhow::ensure!(identical, "cached decoding changed the tokens");
    Ok(())
}
