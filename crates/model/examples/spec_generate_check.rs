//! Writes what `scripts/check_spec_generate.py` compares with the
//! reference's `spec_generate`: the tiny target (`OUTPUT_DIR/target`), a
//! DFlash, a DFlash2 and a DSpark drafter trained on the target's own greedy
//! continuations of 960 prompts (4 epochs: enough to learn the target, not
//! to memorise a few sequences; the check requires a τ well above 1)
//! (`OUTPUT_DIR/dflash`, `OUTPUT_DIR/dflash2`, `OUTPUT_DIR/dspark`, reference
//! layout), and for each drafter `eval.json`: the held-out prompts, this
//! crate's greedy evaluation of them (the same `eval::evaluate_with_options`
//! that `dflash eval` and `dflash evaluate` run, the DFlash2 drafter
//! through its candidate selector), each prompt's output, its proposed
//! tokens and accepted length per verification, and τ.
//!
//!     cargo run -p dflash-model --example spec_generate_check -- OUTPUT_DIR

use std::path::{Path, PathBuf};

use anyhow::Context;
use dflash_model::draft::{
    Dflash2Config, DraftConfig, DraftModel, DraftOptions, DraftTrainer, DsparkConfig,
    FrozenTargetHeads, TargetDimensions, TrainerSettings, TrainingSequence,
};
use dflash_model::eval::{evaluate_with_options, greedy_generate, EvalOptions};
use dflash_model::sampling::SamplingOptions;
use dflash_model::target_model::TargetModel;
use dflash_model::tiny::{write_tiny_model, TinyModelSpec, ORDINARY_TOKEN_IDS};
use serde_json::json;
use tch::{Device, Kind, Tensor};

const PROMPT_LENGTH: usize = 6;
const CONTINUATION: usize = 20;
const TRAINING_PROMPTS: usize = 960;
const STEPS: usize = 480;
const BLOCK_SIZE: i64 = 6;
const MAX_NEW_TOKENS: usize = 24;

/// `count` prompts from a SplitMix64 stream (no `rand` release to depend on).
fn prompts(count: usize, seed: u64) -> Vec<Vec<i64>> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = state;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    };
    let span = (ORDINARY_TOKEN_IDS.end - ORDINARY_TOKEN_IDS.start) as u64;
    (0..count)
        .map(|_| {
            (0..PROMPT_LENGTH)
                .map(|_| ORDINARY_TOKEN_IDS.start + (next() % span) as i64)
                .collect()
        })
        .collect()
}

/// Prompts continued greedily by the target, with the states the drafter reads.
fn self_generated(
    target: &TargetModel,
    layer_ids: &[usize],
) -> anyhow::Result<Vec<TrainingSequence>> {
    prompts(TRAINING_PROMPTS, 1)
        .iter()
        .map(|prompt| {
            let tokens = greedy_generate(target, prompt, CONTINUATION, &[])?;
            let ids = Tensor::from_slice(&tokens).view([1, -1]);
            // The last hidden state too: the DSpark drafter distils from it
            // (DFlash and DFlash2 leave it unread).
            let (target_hidden, last_hidden) =
                target.capture_hidden_states_and_last(&ids, &ids.ones_like(), layer_ids)?;
            let loss_mask = (0..tokens.len())
                .map(|position| u8::from(position >= PROMPT_LENGTH))
                .collect();
            Ok(TrainingSequence {
                target_last_hidden: Some(last_hidden.get(0)),
                input_ids: tokens,
                loss_mask,
                target_hidden: target_hidden.get(0),
            })
        })
        .collect()
}

fn train_and_evaluate(
    target_dir: &Path,
    target: &TargetModel,
    config: DraftConfig,
    data: &[TrainingSequence],
    output: &Path,
) -> anyhow::Result<()> {
    let frozen = FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let model = DraftModel::new(config, frozen, Device::Cpu, Kind::Float, 7)?;
    let mut settings = TrainerSettings::recipe_defaults(BLOCK_SIZE, STEPS as u64);
    settings.schedule.peak_learning_rate = 3e-3;
    settings.num_anchors = 16;
    let mut trainer = DraftTrainer::new(model, settings);
    let mut first_loss = None;
    let mut last_loss = 0.0;
    for step in 0..STEPS {
        let start = (step * 8) % data.len();
        trainer.accumulate(&data[start..start + 8])?;
        last_loss = trainer.step()?.loss;
        first_loss.get_or_insert(last_loss);
    }
    trainer.save_checkpoint(output)?;
    let held_out = prompts(12, 99);
    let options = EvalOptions {
        max_new_tokens: MAX_NEW_TOKENS,
        stop_token_ids: dflash_model::tokens::eos_token_ids(target_dir),
        device: Device::Cpu,
        sampling: SamplingOptions::greedy(),
        confidence_threshold: None,
    };
    let report = evaluate_with_options(target_dir, output, &held_out, &options)?;
    // Each prompt's accepted lengths, split from the run's list by its
    // verifications (one proposal each).
    let mut lengths = report.acceptance_lengths.iter().copied();
    let per_prompt: Vec<Vec<usize>> = report
        .proposals
        .iter()
        .map(|steps| lengths.by_ref().take(steps.len()).collect())
        .collect();
    let proposals: usize = report.proposals.iter().map(Vec::len).sum();
    anyhow::ensure!(
        proposals == report.acceptance_lengths.len(),
        "{proposals} proposals for {} verifications",
        report.acceptance_lengths.len()
    );
    let eval = json!({
        "prompts": held_out,
        "outputs": report.outputs,
        "acceptance_lengths": per_prompt,
        "proposals": report.proposals,
        "tau": report.mean_acceptance_length,
        "max_new_tokens": MAX_NEW_TOKENS,
        "stop_token_ids": options.stop_token_ids,
    });
    std::fs::write(output.join("eval.json"), serde_json::to_vec_pretty(&eval)?)?;
    println!(
        "{}: loss {:.3} -> {:.3}, tau {:.3} over {} verifications",
        output.display(),
        first_loss.unwrap_or_default(),
        last_loss,
        report.mean_acceptance_length,
        report.verification_steps
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let output = PathBuf::from(
        std::env::args()
            .nth(1)
            .context("usage: spec_generate_check OUTPUT_DIR")?,
    );
    tch::set_num_threads(1);
    tch::manual_seed(3);
    let target_dir = output.join("target");
    write_tiny_model(&target_dir, &TinyModelSpec::default())?;
    let target = TargetModel::load(&target_dir, Device::Cpu, Kind::Float)?;
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(BLOCK_SIZE),
        mask_token_id: dflash_model::tokens::mask_token_id(&target_dir)?,
        target_layer_ids: None,
    };
    let dflash = DraftConfig::for_target(&TargetDimensions::from(target.config()), &options)?;
    let dflash2 = dflash.clone().with_dflash2(Dflash2Config {
        selector_rank: 32,
        selector_top_k: 8,
        ..Dflash2Config::default()
    })?;
    let dspark = dflash.clone().with_dspark(DsparkConfig {
        markov_rank: 16,
        ..DsparkConfig::default()
    })?;
    let layer_ids: Vec<usize> = dflash
        .target_layer_ids
        .iter()
        .map(|&layer| layer as usize)
        .collect();
    let data = self_generated(&target, &layer_ids)?;
    train_and_evaluate(&target_dir, &target, dflash, &data, &output.join("dflash"))?;
    train_and_evaluate(
        &target_dir,
        &target,
        dflash2,
        &data,
        &output.join("dflash2"),
    )?;
    train_and_evaluate(&target_dir, &target, dspark, &data, &output.join("dspark"))?;
    Ok(())
}
