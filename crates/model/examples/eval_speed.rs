//! Time of τ evaluation on the tiny target, in one run: the uncached
//! speculative decoding of before (the reference: the target recomputes the
//! whole sequence for each verification, and the drafter re-projects its
//! whole context for each block) against the cached one `dflash eval` and
//! `dflash local` now use (the target's KV cache and the drafter's context
//! cache), on the same prompts; both must give identical tokens and
//! acceptance lengths.
//!
//!     cargo run --release -p dflash-model --example eval_speed -- [PROMPTS] [MAX_NEW_TOKENS] [CHECKPOINT]
//!
//! Defaults: 64 prompts of 6 tokens, 40 new tokens, and an untrained drafter
//! of `dflash local`'s tiny configuration (2 layers, block 8); pass a
//! checkpoint (e.g. `runs/local-*/checkpoints/drafter-0/step-*`) for a
//! trained drafter's τ.

use std::path::PathBuf;
use std::time::Instant;

use dflash_model::draft::{
    load_draft_model, save_draft_checkpoint, DraftConfig, DraftModel, DraftOptions,
    FrozenTargetHeads, TargetDimensions,
};
use dflash_model::eval::{speculative_generate, speculative_generate_uncached};
use dflash_model::target_model::TargetModel;
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_model::tokens::mask_token_id;
use tch::{Device, Kind};

// One measurement read top to bottom (set up, time, print): long on
// purpose, as splitting it would hide the order of what is timed.
fn main() -> anyhow::Result<()> {
    let mut arguments = std::env::args().skip(1);
    let prompts: usize = arguments.next().map_or(Ok(64), |text| text.parse())?;
    let max_new_tokens: usize = arguments.next().map_or(Ok(40), |text| text.parse())?;
    let checkpoint: Option<PathBuf> = arguments.next().map(PathBuf::from);
    let target_dir = tempfile::tempdir()?;
    write_tiny_model(target_dir.path(), &TinyModelSpec::default())?;
    let target = TargetModel::load(target_dir.path(), Device::Cpu, Kind::Float)?;
    let frozen = || FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let untrained_dir = tempfile::tempdir()?;
    let checkpoint = match checkpoint {
        Some(checkpoint) => checkpoint,
        None => {
            let options = DraftOptions {
                num_draft_layers: Some(2),
                block_size: Some(8),
                mask_token_id: mask_token_id(target_dir.path())?,
                target_layer_ids: None,
            };
            let config =
                DraftConfig::for_target(&TargetDimensions::from(target.config()), &options)?;
            let model = DraftModel::new(config, frozen(), Device::Cpu, Kind::Float, 0)?;
            save_draft_checkpoint(untrained_dir.path(), &model, None)?;
            untrained_dir.path().to_path_buf()
        }
    };
    let drafter = load_draft_model(&checkpoint, frozen(), Device::Cpu, Kind::Float)?;
    let prompt_list: Vec<Vec<i64>> = (0..prompts)
        .map(|index| {
            (0..6)
                .map(|position| ((index * 131 + position * 37 + 11) % 290) as i64 + 3)
                .collect()
        })
        .collect();
    println!(
        "tiny Qwen3 on the CPU ({} libtorch threads): {prompts} prompts, {max_new_tokens} new tokens, drafter {}",
        tch::get_num_threads(),
        checkpoint.display()
    );
    let started = Instant::now();
    let uncached = prompt_list
        .iter()
        .map(|prompt| speculative_generate_uncached(&target, &drafter, prompt, max_new_tokens, &[]))
        .collect::<Result<Vec<_>, _>>()?;
    let uncached_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let cached = prompt_list
        .iter()
        .map(|prompt| speculative_generate(&target, &drafter, prompt, max_new_tokens, &[]))
        .collect::<Result<Vec<_>, _>>()?;
    let cached_seconds = started.elapsed().as_secs_f64();
    let verifications: usize = cached
        .iter()
        .map(|trace| trace.acceptance_lengths.len())
        .sum();
    let accepted: usize = cached
        .iter()
        .flat_map(|trace| trace.acceptance_lengths.iter())
        .sum();
    let identical = cached.iter().zip(&uncached).all(|(cached, uncached)| {
        cached.token_ids == uncached.token_ids
            && cached.acceptance_lengths == uncached.acceptance_lengths
    });
    println!(
        "τ {:.3} over {verifications} verifications",
        accepted as f64 / verifications.max(1) as f64
    );
    let projected = |traces: &[dflash_model::eval::GenerationTrace]| -> usize {
        traces
            .iter()
            .map(|trace| trace.draft_context_positions)
            .sum()
    };
    println!(
        "uncached (before): {uncached_seconds:.2}s, drafter context positions projected {}",
        projected(&uncached)
    );
    println!(
        "cached (now):      {cached_seconds:.2}s, drafter context positions projected {}",
        projected(&cached)
    );
    println!(
        "speed-up {:.1}x; identical tokens and acceptance lengths: {identical}",
        uncached_seconds / cached_seconds
    );
    anyhow::ensure!(
        identical,
        "the cached evaluation differs from the uncached one"
    );
    Ok(())
}
