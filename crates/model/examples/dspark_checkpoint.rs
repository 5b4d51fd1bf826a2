//! Writes what `scripts/check_dspark_checkpoint.py` compares with
//! speculators 0.9.0's `DSparkDraftModel`: the tiny target
//! (`OUTPUT_DIR/target`), a DSpark drafter trained briefly on the target's
//! own greedy continuations with this crate's trainer (its tapped states and
//! last hidden state captured by `TargetModel::capture_hidden_states_and_last`,
//! what the target-server streams), saved by the drafter's one checkpoint
//! writer (`OUTPUT_DIR/dspark`, speculators' format), and
//! `forward_check.json`: one held-out sequence, its anchors (every valid
//! one, as speculators selects them when `max_anchors` is their number) and
//! this crate's loss (speculators' normalisation) and metrics on it.
//!
//!     cargo run -p dflash-model --example dspark_checkpoint -- OUTPUT_DIR [vanilla|gated|rnn]

use std::path::PathBuf;

use anyhow::Context;
use dflash_model::draft::{
    compute_objective, pack_batch, DraftConfig, DraftModel, DraftOptions, DraftTrainer,
    DsparkConfig, FrozenTargetHeads, MarkovHeadType, TargetDimensions, TrainerSettings,
    TrainingSequence,
};
use dflash_model::eval::greedy_generate;
use dflash_model::target_model::TargetModel;
use dflash_model::tiny::{write_tiny_model, TinyModelSpec, ORDINARY_TOKEN_IDS};
use serde_json::json;
use tch::{Device, Kind, Tensor};

const PROMPT_LENGTH: usize = 6;
const CONTINUATION: usize = 18;
const TRAINING_PROMPTS: usize = 48;
const STEPS: usize = 30;
const BLOCK_SIZE: i64 = 4;
const GAMMA: f64 = 4.0;

/// `count` prompts from a SplitMix64 stream.
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

/// A prompt continued greedily by the target, with the states a DSpark
/// drafter reads: the tapped layers and the last hidden state.
fn self_generated(
    target: &TargetModel,
    prompt: &[i64],
    layer_ids: &[usize],
) -> anyhow::Result<TrainingSequence> {
    let tokens = greedy_generate(target, prompt, CONTINUATION, &[])?;
    let ids = Tensor::from_slice(&tokens).view([1, -1]);
    let (target_hidden, last_hidden) =
        target.capture_hidden_states_and_last(&ids, &ids.ones_like(), layer_ids)?;
    let loss_mask = (0..tokens.len())
        .map(|position| u8::from(position >= PROMPT_LENGTH))
        .collect();
    Ok(TrainingSequence {
        input_ids: tokens,
        loss_mask,
        target_hidden: target_hidden.get(0),
        target_last_hidden: Some(last_hidden.get(0)),
    })
}

fn main() -> anyhow::Result<()> {
    let mut arguments = std::env::args().skip(1);
    let output = PathBuf::from(
        arguments
            .next()
            .context("usage: dspark_checkpoint OUTPUT_DIR [vanilla|gated|rnn]")?,
    );
    let head_type = MarkovHeadType::parse(&arguments.next().unwrap_or("vanilla".to_string()))?;
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
    let config = DraftConfig::for_target(&TargetDimensions::from(target.config()), &options)?
        .with_dspark(DsparkConfig {
            markov_rank: 16,
            markov_head_type: head_type,
            confidence_head_alpha: 0.5,
            ..DsparkConfig::default()
        })?;
    let layer_ids: Vec<usize> = config
        .target_layer_ids
        .iter()
        .map(|&layer| layer as usize)
        .collect();
    let data = prompts(TRAINING_PROMPTS, 1)
        .iter()
        .map(|prompt| self_generated(&target, prompt, &layer_ids))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let frozen = || FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let model = DraftModel::new(config, frozen(), Device::Cpu, Kind::Float, 7)?;
    let mut settings = TrainerSettings::recipe_defaults(BLOCK_SIZE, STEPS as u64);
    settings.schedule.peak_learning_rate = 3e-3;
    settings.num_anchors = 8;
    settings.loss_decay_gamma = GAMMA;
    let mut trainer = DraftTrainer::new(model, settings);
    for step in 0..STEPS {
        let start = (step * 4) % data.len();
        trainer.accumulate(&data[start..start + 4])?;
        let report = trainer.step()?;
        if step == 0 || step + 1 == STEPS {
            println!(
                "step {}: loss {:.4} {:?}",
                report.step, report.loss, report.dspark
            );
        }
    }
    let checkpoint = output.join("dspark");
    trainer.save_checkpoint(&checkpoint)?;

    // One held-out sequence through this crate's objective, every valid
    // anchor (speculators': supervised and at least a block before the end).
    let held_out = self_generated(&target, &prompts(1, 99)[0], &layer_ids)?;
    let length = held_out.len();
    let anchors: Vec<i64> = (0..length.saturating_sub(BLOCK_SIZE as usize))
        .filter(|&position| held_out.loss_mask[position] != 0)
        .map(|position| position as i64)
        .collect();
    let batch = pack_batch(
        std::slice::from_ref(&held_out),
        std::slice::from_ref(&anchors),
    )?;
    let objective = tch::no_grad(|| compute_objective(trainer.model(), &batch, GAMMA))?;
    let totals = objective
        .dspark
        .context("a DSpark model's objective has DSpark totals")?;
    let supervised = totals.supervised + 1e-8;
    let check = json!({
        "input_ids": held_out.input_ids,
        "loss_mask": held_out.loss_mask,
        "anchors": anchors,
        "gamma": GAMMA,
        "confidence_head_alpha": totals.confidence_head_alpha,
        "loss": totals.loss() * totals.weight_sum / supervised,
        "accept_rate_sum": totals.accept_rate_sum,
        "accept_len_sum": totals.accept_length_sum,
        "eal_sum": totals.greedy_accept_length_sum,
        "confidence_loss": totals.weighted_confidence / supervised,
        "full_acc_sum": objective.correct_per_position.iter().sum::<f64>(),
    });
    std::fs::write(
        checkpoint.join("forward_check.json"),
        serde_json::to_vec_pretty(&check)?,
    )?;
    println!("wrote {}", checkpoint.display());
    Ok(())
}
