//! Evaluation by speculative decoding on the tiny target: decoding is
//! lossless (identical to the target's own greedy output), a drafter
//! trained on the target's own greedy continuations accepts clearly more
//! tokens per verification (τ) than an untrained one, and the cached
//! evaluation (target KV cache, drafter context cache) reproduces the
//! uncached reference token for token while projecting each context
//! position into the drafter once.

mod common;

use common::{random_token_sequences, tiny_target_dir};
use dflash_model::draft::{
    load_draft_model, save_draft_checkpoint, DraftConfig, DraftModel, DraftOptions, DraftTrainer,
    FrozenTargetHeads, TargetDimensions, TrainerSettings, TrainingSequence,
};
use dflash_model::eval::{
    evaluate_with_options, greedy_generate, speculative_generate, speculative_generate_uncached,
    EvalOptions,
};
use dflash_model::target_model::TargetModel;
use tch::{Device, Kind, Tensor};

const PROMPT_LENGTH: usize = 6;
const CONTINUATION: usize = 24;
const MAX_NEW_TOKENS: usize = 32;
const BLOCK_SIZE: i64 = 8;

/// The target's exact greedy continuation, computed with few forwards:
/// guess that the last token repeats (random tiny models settle into
/// repeats), verify the guess in one forward, keep the agreeing prefix plus
/// the target's own next token. Prompt-lookup speculative decoding, so the
/// output is identical to token-by-token greedy decoding.
fn fast_greedy_continuation(
    target: &TargetModel,
    prompt: &[i64],
    new_tokens: usize,
) -> anyhow::Result<Vec<i64>> {
    let mut tokens = prompt.to_vec();
    let goal = prompt.len() + new_tokens;
    while tokens.len() < goal {
        let last = tokens[tokens.len() - 1];
        let guesses = goal - tokens.len();
        let mut candidate = tokens.clone();
        candidate.extend(std::iter::repeat_n(last, guesses - 1));
        let ids = Tensor::from_slice(&candidate).view([1, -1]);
        let predictions = Vec::<i64>::try_from(
            &target
                .logits(&ids, &ids.ones_like())?
                .get(0)
                .argmax(-1, false),
        )?;
        let mut position = tokens.len() - 1;
        loop {
            let next = predictions[position];
            tokens.push(next);
            position += 1;
            if tokens.len() >= goal || position >= candidate.len() || candidate[position] != next {
                break;
            }
        }
    }
    Ok(tokens)
}

/// Prompts continued greedily by the target itself, with its hidden states:
/// the data a drafter is meant to imitate.
fn self_generated_sequences(
    target: &TargetModel,
    layer_ids: &[usize],
    seed: u64,
    count: usize,
) -> anyhow::Result<Vec<TrainingSequence>> {
    random_token_sequences(count, PROMPT_LENGTH, seed)
        .into_iter()
        .map(|prompt| {
            let tokens = fast_greedy_continuation(target, &prompt, CONTINUATION)?;
            let ids = Tensor::from_slice(&tokens).view([1, -1]);
            let hidden = target
                .capture_hidden_states(&ids, &ids.ones_like(), layer_ids)?
                .get(0);
            let loss_mask = (0..tokens.len())
                .map(|position| u8::from(position >= PROMPT_LENGTH))
                .collect();
            Ok(TrainingSequence {
                target_last_hidden: None,
                input_ids: tokens,
                loss_mask,
                target_hidden: hidden,
            })
        })
        .collect()
}

#[test]
fn a_drafter_trained_on_self_generated_data_has_a_clearly_higher_acceptance_length() {
    let target_dir = tiny_target_dir();
    // Tiny ops: libtorch's thread pool costs more than it saves here.
    tch::set_num_threads(1);
    let target = TargetModel::load(target_dir, Device::Cpu, Kind::Float).unwrap();
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(BLOCK_SIZE),
        mask_token_id: dflash_model::tokens::mask_token_id(target_dir).unwrap(),
        target_layer_ids: None,
    };
    let config =
        DraftConfig::for_target(&TargetDimensions::from(target.config()), &options).unwrap();
    let layer_ids: Vec<usize> = config
        .target_layer_ids
        .iter()
        .map(|&layer| layer as usize)
        .collect();
    let frozen = FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let model = DraftModel::new(config, frozen, Device::Cpu, Kind::Float, 7).unwrap();
    let checkpoints = tempfile::tempdir().unwrap();
    let untrained = checkpoints.path().join("untrained");
    save_draft_checkpoint(&untrained, &model, None).unwrap();

    // Enough distinct prompts that the drafter must learn to predict the
    // target rather than memorise sequences: held-out accuracy needs it.
    let data = self_generated_sequences(&target, &layer_ids, 100, 640).unwrap();
    let steps = 320;
    let mut settings = TrainerSettings::recipe_defaults(BLOCK_SIZE, steps);
    settings.schedule.peak_learning_rate = 3e-3;
    settings.num_anchors = 32;
    let mut trainer = DraftTrainer::new(model, settings);
    let mut losses = Vec::new();
    for step in 0..steps as usize {
        let start = (step * 16) % data.len();
        trainer.accumulate(&data[start..start + 16]).unwrap();
        losses.push(trainer.step().unwrap().loss);
    }
    let trained = checkpoints.path().join("trained");
    trainer.save_checkpoint(&trained).unwrap();

    // Prompts never seen in training (a different seed).
    let held_out = random_token_sequences(6, PROMPT_LENGTH, 999);
    let eval_options = EvalOptions {
        max_new_tokens: MAX_NEW_TOKENS,
        stop_token_ids: Vec::new(),
        device: Device::Cpu,
        sampling: dflash_model::sampling::SamplingOptions::greedy(),
        confidence_threshold: None,
    };
    let before = evaluate_with_options(target_dir, &untrained, &held_out, &eval_options).unwrap();
    let after = evaluate_with_options(target_dir, &trained, &held_out, &eval_options).unwrap();
    eprintln!(
        "loss {:.3} -> {:.3}; tau untrained {:.2} ({} verifications), trained {:.2} ({} verifications)",
        losses[0],
        losses[losses.len() - 1],
        before.mean_acceptance_length,
        before.verification_steps,
        after.mean_acceptance_length,
        after.verification_steps
    );

    // The cached evaluation is the reference's, with a drafter that gets
    // blocks accepted (so both caches are cut back after rejections).
    let trained_drafter = load_draft_model(
        &trained,
        FrozenTargetHeads {
            embed_tokens: target.embed_tokens_weight().shallow_clone(),
            lm_head: target.lm_head_weight().shallow_clone(),
        },
        Device::Cpu,
        Kind::Float,
    )
    .unwrap();
    for (index, prompt) in held_out.iter().enumerate() {
        let reference =
            speculative_generate_uncached(&target, &trained_drafter, prompt, MAX_NEW_TOKENS, &[])
                .unwrap();
        assert_eq!(
            after.outputs[index], reference.token_ids,
            "prompt {index}: cached evaluation differs from the reference"
        );
        // The report keeps each verification's proposed block
        // (`check_spec_generate.py` compares them with the reference's).
        assert_eq!(
            after.proposals[index], reference.proposed_tokens,
            "prompt {index}: cached evaluation proposed other blocks than the reference"
        );
    }
    assert_eq!(
        after
            .proposals
            .iter()
            .flatten()
            .map(Vec::len)
            .sum::<usize>(),
        after.proposed_tokens
    );
    let reference_lengths: Vec<usize> = held_out
        .iter()
        .flat_map(|prompt| {
            speculative_generate_uncached(&target, &trained_drafter, prompt, MAX_NEW_TOKENS, &[])
                .unwrap()
                .acceptance_lengths
        })
        .collect();
    assert_eq!(after.acceptance_lengths, reference_lengths);

    // Speculative decoding is lossless: both give the target's greedy output.
    for (index, prompt) in held_out.iter().enumerate() {
        let greedy = greedy_generate(&target, prompt, eval_options.max_new_tokens, &[]).unwrap();
        assert_eq!(
            before.outputs[index], greedy,
            "untrained drafter changed prompt {index}'s output"
        );
        assert_eq!(
            after.outputs[index], greedy,
            "trained drafter changed prompt {index}'s output"
        );
    }
    assert_eq!(
        after.generated_tokens,
        held_out.len() * eval_options.max_new_tokens
    );
    let accepted: usize = after.acceptance_lengths.iter().sum();
    // Every token after the prefill comes from a verification.
    assert_eq!(accepted, after.generated_tokens - held_out.len());
    assert!(after
        .acceptance_lengths
        .iter()
        .all(|&length| (1..=BLOCK_SIZE as usize).contains(&length)));
    // An untrained drafter is never right (τ = 1: only the bonus token);
    // the trained one measured 1.92 on these held-out prompts.
    assert!(
        before.mean_acceptance_length < 1.1,
        "untrained tau {}",
        before.mean_acceptance_length
    );
    assert!(
        after.mean_acceptance_length > before.mean_acceptance_length + 0.5,
        "tau untrained {} vs trained {}",
        before.mean_acceptance_length,
        after.mean_acceptance_length
    );
}

#[test]
fn cached_speculative_decoding_reproduces_the_reference_and_projects_each_position_once() {
    let target_dir = tiny_target_dir();
    tch::set_num_threads(1);
    let target = TargetModel::load(target_dir, Device::Cpu, Kind::Float).unwrap();
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(BLOCK_SIZE),
        mask_token_id: dflash_model::tokens::mask_token_id(target_dir).unwrap(),
        target_layer_ids: None,
    };
    let config =
        DraftConfig::for_target(&TargetDimensions::from(target.config()), &options).unwrap();
    let frozen = FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let drafter = DraftModel::new(config, frozen, Device::Cpu, Kind::Float, 11).unwrap();
    // Prompts of several lengths; one budget ends mid-block, one is a
    // single token (the prefill alone).
    let prompts = [
        random_token_sequences(1, 1, 5).remove(0),
        random_token_sequences(1, 6, 6).remove(0),
        random_token_sequences(1, 13, 7).remove(0),
    ];
    for (index, prompt) in prompts.iter().enumerate() {
        for max_new_tokens in [1, 19, MAX_NEW_TOKENS] {
            let cached =
                speculative_generate(&target, &drafter, prompt, max_new_tokens, &[]).unwrap();
            let reference =
                speculative_generate_uncached(&target, &drafter, prompt, max_new_tokens, &[])
                    .unwrap();
            let case = format!("prompt {index}, {max_new_tokens} new tokens");
            assert_eq!(cached.token_ids, reference.token_ids, "{case}");
            assert_eq!(
                cached.acceptance_lengths, reference.acceptance_lengths,
                "{case}"
            );
            assert_eq!(cached.target_forwards, reference.target_forwards, "{case}");
            assert_eq!(
                cached.token_ids.len(),
                prompt.len() + max_new_tokens,
                "{case}"
            );
            // Each committed position enters the drafter's context once: the
            // whole sequence but its newest token (never a context yet).
            assert_eq!(
                cached.draft_context_positions,
                cached.token_ids.len() - 1,
                "{case}"
            );
            // The reference re-projects the whole context for every block:
            // block i is anchored after prompt + the tokens of blocks < i.
            let mut anchor = prompt.len();
            let mut reprojected = 0;
            for &accepted in &reference.acceptance_lengths {
                reprojected += anchor;
                anchor += accepted;
            }
            assert_eq!(reference.draft_context_positions, reprojected, "{case}");
        }
    }
}
