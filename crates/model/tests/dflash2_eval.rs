//! Speculative decoding with a DFlash2 drafter (its candidate selector
//! proposes the block) and sampled decoding (temperature, speculative
//! rejection sampling) for DFlash and DFlash2, on the tiny target. The
//! reference's own `spec_generate` is compared in `make check-dflash2`
//! (scripts/check_spec_generate.py); these check what needs no Python.

use dflash_model::draft::{
    Dflash2Config, DraftConfig, DraftModel, DraftOptions, FrozenTargetHeads, TargetDimensions,
};
use dflash_model::eval::{
    greedy_generate, speculative_generate, speculative_generate_sampled,
    speculative_generate_uncached,
};
use dflash_model::sampling::SamplingOptions;
use dflash_model::target_model::TargetModel;
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use tch::{Device, Kind, Tensor};

mod common;

const MAX_NEW_TOKENS: usize = 20;

fn prompts() -> Vec<Vec<i64>> {
    vec![vec![17, 40, 93, 5, 250, 61], vec![8, 8, 120, 33], vec![200]]
}

/// The tiny target, a DFlash drafter and a DFlash2 drafter of the same seed
/// whose convolutions and selector are far from their initial identity and
/// zero, so the selector's path differs from the unary argmax.
fn setup(directory: &std::path::Path) -> anyhow::Result<(TargetModel, [DraftModel; 2])> {
    tch::set_num_threads(1);
    write_tiny_model(directory, &TinyModelSpec::default())?;
    let target = TargetModel::load(directory, Device::Cpu, Kind::Float)?;
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(6),
        mask_token_id: dflash_model::tokens::mask_token_id(directory)?,
        target_layer_ids: None,
    };
    let dflash = DraftConfig::for_target(&TargetDimensions::from(target.config()), &options)?;
    let dflash2 = dflash.clone().with_dflash2(Dflash2Config {
        selector_rank: 16,
        selector_top_k: 8,
        ..Dflash2Config::default()
    })?;
    let heads = || FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let dflash = DraftModel::new(dflash, heads(), Device::Cpu, Kind::Float, 11)?;
    let dflash2 = DraftModel::new(dflash2, heads(), Device::Cpu, Kind::Float, 11)?;
    tch::manual_seed(5);
    tch::no_grad(|| {
        for (name, mut parameter) in dflash2.var_store().variables() {
            if name.contains("codebook") || name.contains("hidden_projection") {
                parameter.copy_(&(Tensor::randn_like(&parameter) * 2.0));
            } else if name.contains("kernel") {
                let noise = Tensor::randn_like(&parameter) * 0.3;
                let _ = parameter.g_add_(&noise);
            }
        }
    });
    Ok((target, [dflash, dflash2]))
}

#[test]
fn dflash2_decoding_goes_through_the_selector_and_stays_lossless() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let (target, [dflash, dflash2]) = setup(directory.path())?;
    for prompt in prompts() {
        let greedy = greedy_generate(&target, &prompt, MAX_NEW_TOKENS, &[])?;
        let cached = speculative_generate(&target, &dflash2, &prompt, MAX_NEW_TOKENS, &[])?;
        let uncached =
            speculative_generate_uncached(&target, &dflash2, &prompt, MAX_NEW_TOKENS, &[])?;
        // Greedy verification keeps exactly the target's own greedy output.
        assert_eq!(cached.token_ids, greedy, "prompt {prompt:?}");
        // The cached path is the uncached reference's, selector included.
        assert_eq!(cached.token_ids, uncached.token_ids);
        assert_eq!(cached.acceptance_lengths, uncached.acceptance_lengths);
        let unary = speculative_generate(&target, &dflash, &prompt, MAX_NEW_TOKENS, &[])?;
        assert_eq!(unary.token_ids, greedy);
    }

    // The selector's path differs from the unary argmax for this drafter:
    // otherwise the test above could not tell whether it was used.
    let hidden = Tensor::randn(
        [1, 5, target.config().hidden_size],
        (Kind::Float, Device::Cpu),
    );
    let path = tch::no_grad(|| dflash2.select_greedy(&hidden, &Tensor::from_slice(&[17i64])))?;
    let unary = dflash2.logits(&hidden).argmax(-1, false);
    assert!(
        !path.tokens.equal(&unary),
        "selector path {:?} equals the unary argmax",
        Vec::<i64>::try_from(path.tokens.view([-1]))?
    );
    Ok(())
}

/// The proposal of the first block, as decoding made it, is the selector's
/// path from the anchor, computed here from the drafter's own block hidden
/// states, and not the unary argmax of the same states: the test fails if
/// decoding proposed with the plain argmax instead of the selector.
#[test]
fn the_first_block_is_the_selectors_path_not_the_unary_argmax() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let (target, [_, dflash2]) = setup(directory.path())?;
    let mut differs = false;
    for prompt in prompts() {
        let trace = speculative_generate(&target, &dflash2, &prompt, MAX_NEW_TOKENS, &[])?;
        let anchor_token = trace.token_ids[prompt.len()];
        let block_size = dflash2.config().block_size;
        let (selected, unary) = tch::no_grad(|| -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
            // Slot 0 is the anchor; slots 1.. draft.
            let hidden = common::first_block_hidden(&target, &dflash2, &prompt, anchor_token)?
                .narrow(0, 1, block_size - 1);
            let unary = Vec::<i64>::try_from(dflash2.logits(&hidden).argmax(-1, false))?;
            let path = dflash2
                .select_greedy(&hidden.unsqueeze(0), &Tensor::from_slice(&[anchor_token]))?;
            Ok((Vec::<i64>::try_from(path.tokens.get(0))?, unary))
        })?;
        assert_eq!(trace.proposed_tokens[0], selected, "prompt {prompt:?}");
        differs |= selected != unary;
    }
    assert!(
        differs,
        "the selector's path equals the unary argmax for every prompt: the test has no power"
    );
    Ok(())
}

#[test]
fn sampling_at_a_vanishing_temperature_is_greedy_decoding() -> anyhow::Result<()> {
    // softmax(logits / 1e-4) is one-hot at the argmax unless two logits are
    // within about 1e-3 of each other (e^-10 mass left): the draft is then
    // accepted exactly when it is the target's argmax, and every draw is
    // the argmax, so the outputs and accepted lengths are greedy decoding's.
    let directory = tempfile::tempdir()?;
    let (target, drafters) = setup(directory.path())?;
    let cold = SamplingOptions {
        temperature: 1e-4,
        top_p: 1.0,
        seed: 3,
    };
    for drafter in &drafters {
        for (index, prompt) in prompts().iter().enumerate() {
            let greedy = speculative_generate(&target, drafter, prompt, MAX_NEW_TOKENS, &[])?;
            let sampled = speculative_generate_sampled(
                &target,
                drafter,
                prompt,
                MAX_NEW_TOKENS,
                &[],
                &cold,
                index as u64,
            )?;
            assert_eq!(sampled.token_ids, greedy.token_ids);
            assert_eq!(sampled.acceptance_lengths, greedy.acceptance_lengths);
        }
    }
    Ok(())
}

#[test]
fn sampled_decoding_is_seeded_and_its_steps_are_whole() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let (target, drafters) = setup(directory.path())?;
    let warm = |seed| SamplingOptions {
        temperature: 1.0,
        top_p: 0.9,
        seed,
    };
    let prompt = &prompts()[0];
    for drafter in &drafters {
        let run = |seed| {
            speculative_generate_sampled(
                &target,
                drafter,
                prompt,
                MAX_NEW_TOKENS,
                &[],
                &warm(seed),
                0,
            )
        };
        let first = run(1)?;
        assert_eq!(first.token_ids, run(1)?.token_ids, "same seed, same draws");
        let others: Vec<Vec<i64>> = (2..6)
            .map(|seed| run(seed).map(|trace| trace.token_ids))
            .collect::<Result<_, _>>()?;
        assert!(
            others.iter().any(|other| *other != first.token_ids),
            "five seeds gave one output at temperature 1"
        );
        assert_eq!(first.token_ids.len(), prompt.len() + MAX_NEW_TOKENS);
        // Every token after the prefill's comes from a verification of at
        // most a block (block_size 6).
        let accepted: usize = first.acceptance_lengths.iter().sum();
        assert_eq!(accepted, MAX_NEW_TOKENS - 1);
        assert!(first
            .acceptance_lengths
            .iter()
            .all(|&length| (1..=6).contains(&length)));
    }
    let error = speculative_generate_sampled(
        &target,
        &drafters[1],
        prompt,
        MAX_NEW_TOKENS,
        &[],
        &SamplingOptions {
            temperature: -0.5,
            top_p: 1.0,
            seed: 0,
        },
        0,
    )
    .expect_err("a negative temperature");
    assert!(error.to_string().contains("-0.5"), "{error}");
    Ok(())
}
