//! Speculative decoding with a DSpark drafter on the tiny target: every slot
//! of the block drafts (the anchor's included), slot by slot through the
//! Markov bias of the token drafted before; greedy verification stays
//! lossless, the cached path equals the uncached reference, temperature → 0
//! equals greedy, and the confidence threshold schedules the verify length.

use dflash_model::draft::{
    DraftConfig, DraftModel, DraftOptions, DsparkConfig, FrozenTargetHeads, MarkovHeadType,
    TargetDimensions,
};
use dflash_model::eval::{
    greedy_generate, speculative_generate, speculative_generate_sampled,
    speculative_generate_scheduled, speculative_generate_uncached,
};
use dflash_model::sampling::{sampling_probabilities, SamplingOptions};
use dflash_model::target_model::TargetModel;
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use tch::{Device, Kind, Tensor};

mod common;

const MAX_NEW_TOKENS: usize = 20;
const BLOCK_SIZE: i64 = 5;

fn prompts() -> Vec<Vec<i64>> {
    vec![vec![17, 40, 93, 5, 250, 61], vec![8, 8, 120, 33], vec![200]]
}

/// The tiny target and a DSpark drafter of the given head whose Markov
/// bias is large (W2 scaled up), so that it changes argmaxes, and whose
/// confidence head is far from its initialisation.
fn setup(
    directory: &std::path::Path,
    head_type: MarkovHeadType,
) -> anyhow::Result<(TargetModel, DraftModel)> {
    tch::set_num_threads(1);
    write_tiny_model(directory, &TinyModelSpec::default())?;
    let target = TargetModel::load(directory, Device::Cpu, Kind::Float)?;
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(BLOCK_SIZE),
        mask_token_id: dflash_model::tokens::mask_token_id(directory)?,
        target_layer_ids: None,
    };
    let config = DraftConfig::for_target(&TargetDimensions::from(target.config()), &options)?
        .with_dspark(DsparkConfig {
            markov_rank: 16,
            markov_head_type: head_type,
            ..DsparkConfig::default()
        })?;
    let heads = FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let drafter = DraftModel::new(config, heads, Device::Cpu, Kind::Float, 11)?;
    tch::manual_seed(5);
    tch::no_grad(|| {
        for (name, mut parameter) in drafter.var_store().variables() {
            if name == "markov_head.markov_w2.weight" {
                parameter.copy_(&(Tensor::randn_like(&parameter) * 20.0));
            } else if name.starts_with("markov_head.") {
                parameter.copy_(&(Tensor::randn_like(&parameter) * 3.0));
            } else if name.starts_with("confidence_head.") {
                // Confidence logits of a few units: probabilities strictly
                // inside (0, 1) in f32.
                parameter.copy_(&(Tensor::randn_like(&parameter) * 0.2));
            }
        }
    });
    Ok((target, drafter))
}

#[test]
fn dspark_greedy_decoding_is_lossless_and_the_cached_path_is_the_uncached_one() -> anyhow::Result<()>
{
    let directory = tempfile::tempdir()?;
    for head_type in [
        MarkovHeadType::Vanilla,
        MarkovHeadType::Gated,
        MarkovHeadType::Rnn,
    ] {
        let (target, drafter) = setup(directory.path(), head_type)?;
        for prompt in prompts() {
            let greedy = greedy_generate(&target, &prompt, MAX_NEW_TOKENS, &[])?;
            let cached = speculative_generate(&target, &drafter, &prompt, MAX_NEW_TOKENS, &[])?;
            let uncached =
                speculative_generate_uncached(&target, &drafter, &prompt, MAX_NEW_TOKENS, &[])?;
            assert_eq!(cached.token_ids, greedy, "{head_type:?}, prompt {prompt:?}");
            assert_eq!(cached.token_ids, uncached.token_ids);
            assert_eq!(cached.acceptance_lengths, uncached.acceptance_lengths);
            assert_eq!(cached.proposed_tokens, uncached.proposed_tokens);
            // Every slot drafts: a block of B proposes B tokens (fewer only
            // at the end of the generation).
            assert_eq!(cached.proposed_tokens[0].len(), BLOCK_SIZE as usize);
            assert_eq!(
                cached.acceptance_lengths.iter().sum::<usize>(),
                cached.token_ids.len() - prompt.len() - 1
            );
        }
    }
    Ok(())
}

/// The proposal of the first block is the semi-autoregressive walk through
/// the Markov bias, and it is not the unbiased argmax: the test would fail
/// if decoding dropped the bias or fed it the wrong previous token.
#[test]
fn the_first_block_is_the_markov_biased_walk_not_the_unbiased_argmax() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    for head_type in [
        MarkovHeadType::Vanilla,
        MarkovHeadType::Gated,
        MarkovHeadType::Rnn,
    ] {
        let (target, drafter) = setup(directory.path(), head_type)?;
        let prompt = prompts()[0].clone();
        let trace = speculative_generate(&target, &drafter, &prompt, MAX_NEW_TOKENS, &[])?;
        let anchor_token = trace.token_ids[prompt.len()];
        let (biased, unbiased) = tch::no_grad(|| -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
            let hidden = common::first_block_hidden(&target, &drafter, &prompt, anchor_token)?;
            let unbiased: Vec<i64> =
                Vec::<i64>::try_from(drafter.logits(&hidden).argmax(-1, false))?;
            let mut state = drafter.markov_start();
            let mut previous = anchor_token;
            let mut biased = Vec::new();
            for slot in 0..BLOCK_SIZE {
                let slot_hidden = hidden.narrow(0, slot, 1);
                let heads = drafter.dspark_position(
                    &mut state,
                    &slot_hidden,
                    &Tensor::from_slice(&[previous]),
                )?;
                let bias = heads
                    .markov_bias
                    .ok_or_else(|| anyhow::anyhow!("no Markov bias"))?;
                let token = (drafter.logits(&slot_hidden) + bias)
                    .argmax(-1, false)
                    .int64_value(&[0]);
                biased.push(token);
                previous = token;
            }
            Ok((biased, unbiased))
        })?;
        assert_eq!(trace.proposed_tokens[0], biased, "{head_type:?}");
        assert_ne!(
            biased, unbiased,
            "{head_type:?}: the Markov bias changed no argmax; the test has no power"
        );
    }
    Ok(())
}

#[test]
fn sampling_at_a_vanishing_temperature_is_greedy() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let (target, drafter) = setup(directory.path(), MarkovHeadType::Rnn)?;
    let cold = SamplingOptions {
        temperature: 1e-6,
        top_p: 1.0,
        seed: 3,
    };
    let warm = SamplingOptions {
        temperature: 1.0,
        ..cold.clone()
    };
    let mut warm_differs = false;
    for (index, prompt) in prompts().iter().enumerate() {
        let greedy = speculative_generate(&target, &drafter, prompt, MAX_NEW_TOKENS, &[])?;
        let sampled = speculative_generate_sampled(
            &target,
            &drafter,
            prompt,
            MAX_NEW_TOKENS,
            &[],
            &cold,
            index as u64,
        )?;
        assert_eq!(sampled.token_ids, greedy.token_ids, "prompt {prompt:?}");
        assert_eq!(sampled.acceptance_lengths, greedy.acceptance_lengths);
        assert_eq!(sampled.proposed_tokens, greedy.proposed_tokens);
        let hot = speculative_generate_sampled(
            &target,
            &drafter,
            prompt,
            MAX_NEW_TOKENS,
            &[],
            &warm,
            index as u64,
        )?;
        warm_differs |= hot.token_ids != greedy.token_ids;
    }
    // At temperature 1 the same seeds give other outputs: the cold run's
    // equality is the temperature's doing, not a sampler that never samples.
    assert!(warm_differs);
    Ok(())
}

#[test]
fn the_confidence_threshold_schedules_the_verify_length_and_stays_lossless() -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let (target, drafter) = setup(directory.path(), MarkovHeadType::Vanilla)?;
    let greedy = SamplingOptions::greedy();
    let mut proposed = Vec::new();
    for threshold in [0.0, 0.3, 1.0] {
        let mut total = 0;
        let mut verifications = 0;
        for (index, prompt) in prompts().iter().enumerate() {
            let expected = greedy_generate(&target, prompt, MAX_NEW_TOKENS, &[])?;
            let trace = speculative_generate_scheduled(
                &target,
                &drafter,
                prompt,
                MAX_NEW_TOKENS,
                &[],
                &greedy,
                index as u64,
                threshold,
            )?;
            assert_eq!(trace.token_ids, expected, "threshold {threshold}");
            assert!(trace
                .proposed_tokens
                .iter()
                .all(|tokens| !tokens.is_empty()));
            if threshold == 1.0 {
                // A product of probabilities below 1 stops after the first.
                assert!(trace.proposed_tokens.iter().all(|tokens| tokens.len() == 1));
            }
            total += trace.proposed_tokens.iter().map(Vec::len).sum::<usize>();
            verifications += trace.proposed_tokens.len();
        }
        proposed.push(total as f64 / verifications as f64);
    }
    // Whole blocks at 0 (at most B, fewer only at the end), then shorter.
    assert!(proposed[0] > 4.0, "{proposed:?}");
    assert!(
        proposed[0] >= proposed[1] && proposed[1] >= proposed[2],
        "{proposed:?}"
    );
    assert_eq!(proposed[2], 1.0);
    let error = speculative_generate_scheduled(
        &target,
        &drafter,
        &prompts()[0],
        MAX_NEW_TOKENS,
        &[],
        &greedy,
        0,
        1.5,
    )
    .err()
    .map(|error| error.to_string())
    .unwrap_or_default();
    assert!(
        error.contains("confidence threshold must lie in [0, 1], got 1.5"),
        "{error}"
    );
    Ok(())
}

/// The target's next-token distribution after `tokens` at `options`'s
/// temperature, as the sampler computes it.
fn target_distribution(
    target: &TargetModel,
    tokens: &[i64],
    options: &SamplingOptions,
) -> anyhow::Result<Vec<f64>> {
    let ids = Tensor::from_slice(tokens).view([1, -1]);
    let logits = target.logits(&ids, &ids.ones_like())?;
    let last = logits.get(0).get(tokens.len() as i64 - 1);
    let probabilities = sampling_probabilities(&last, options).to_kind(Kind::Double);
    Ok(Vec::<f64>::try_from(probabilities)?)
}

/// Speculative sampling through a DSpark drafter keeps the target's
/// distribution. Each draw generates two tokens: t1 from the target's
/// prefill, t2 through the first draft block (the Markov walk proposes, the
/// target accepts or resamples from the residual). The pairs must follow
/// p(t1 | prompt) · p(t2 | prompt, t1): Pearson's χ² over the cells whose
/// expected count is at least 5 (the others pooled into one cell), against
/// the Laurent–Massart bound P(X ≥ d + 2√(d·x) + 2x) ≤ e^(−x) of a χ² with d
/// degrees of freedom, x = ln 10^6: a sampler that keeps the target's
/// distribution fails it with probability below 10^-6 (and the draws are
/// seeded, so the test is deterministic). A sampler that accepted every
/// draft would follow the drafter's distribution, whose total variation
/// from the target's is asserted to be large.
#[test]
fn speculative_sampling_keeps_the_targets_distribution() -> anyhow::Result<()> {
    const DRAWS: u64 = 3000;
    let directory = tempfile::tempdir()?;
    let (target, drafter) = setup(directory.path(), MarkovHeadType::Vanilla)?;
    let prompt = prompts()[1].clone();
    // The tiny target's logits are peaked: at temperature 1, 3000 draws
    // gave 15 distinct (t1, t2) pairs and 8 cells; at 3, 518 pairs and 49
    // cells of expected count 5 or more.
    let options = SamplingOptions {
        temperature: 3.0,
        top_p: 1.0,
        seed: 17,
    };
    let mut pairs: std::collections::BTreeMap<(i64, i64), u64> = Default::default();
    let mut drafted_first: Vec<i64> = Vec::new();
    for draw in 0..DRAWS {
        let trace =
            speculative_generate_sampled(&target, &drafter, &prompt, 2, &[], &options, draw)?;
        let generated = &trace.token_ids[prompt.len()..];
        anyhow::ensure!(generated.len() == 2, "draw {draw} generated {generated:?}");
        *pairs.entry((generated[0], generated[1])).or_default() += 1;
        if let Some(first) = trace
            .proposed_tokens
            .first()
            .and_then(|block| block.first())
        {
            drafted_first.push(*first);
        }
    }
    let first = target_distribution(&target, &prompt, &options)?;
    let mut seconds: std::collections::BTreeMap<i64, Vec<f64>> = Default::default();
    for &(t1, _) in pairs.keys() {
        if let std::collections::btree_map::Entry::Vacant(entry) = seconds.entry(t1) {
            let mut context = prompt.clone();
            context.push(t1);
            entry.insert(target_distribution(&target, &context, &options)?);
        }
    }
    let draws = DRAWS as f64;
    let (mut statistic, mut cells) = (0.0f64, 0usize);
    let (mut pooled_observed, mut pooled_expected) = (0.0f64, 0.0f64);
    let mut covered = 0.0f64;
    for (&t1, second) in &seconds {
        for (t2, &p2) in second.iter().enumerate() {
            let expected = draws * first[t1 as usize] * p2;
            let observed = pairs.get(&(t1, t2 as i64)).copied().unwrap_or(0) as f64;
            covered += first[t1 as usize] * p2;
            if expected >= 5.0 {
                statistic += (observed - expected).powi(2) / expected;
                cells += 1;
            } else {
                pooled_observed += observed;
                pooled_expected += expected;
            }
        }
    }
    // The first tokens never drawn: their mass, observed 0 times.
    pooled_expected += draws * (1.0 - covered).max(0.0);
    if pooled_expected > 0.0 {
        statistic += (pooled_observed - pooled_expected).powi(2) / pooled_expected;
        cells += 1;
    }
    let freedom = (cells - 1) as f64;
    let x = (1e6f64).ln();
    let bound = freedom + 2.0 * (freedom * x).sqrt() + 2.0 * x;
    eprintln!(
        "χ² {statistic:.1} over {cells} cells (bound {bound:.1}); {} distinct pairs",
        pairs.len()
    );
    assert!(cells >= 10, "only {cells} cells: the test has no power");
    assert!(
        statistic <= bound,
        "χ² {statistic:.1} over {cells} cells is above {bound:.1}: the sampled tokens do not follow the target"
    );
    // The drafter's first proposal does not follow the target: a sampler
    // that kept every draft would fail the test above.
    let mut drafted: std::collections::BTreeMap<i64, f64> = Default::default();
    for token in &drafted_first {
        *drafted.entry(*token).or_default() += 1.0 / drafted_first.len() as f64;
    }
    let mut target_second: std::collections::BTreeMap<i64, f64> = Default::default();
    for (&t1, second) in &seconds {
        for (t2, &p2) in second.iter().enumerate() {
            *target_second.entry(t2 as i64).or_default() += first[t1 as usize] * p2;
        }
    }
    let total_variation: f64 = 0.5
        * target_second
            .keys()
            .chain(drafted.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|token| {
                (drafted.get(token).copied().unwrap_or(0.0)
                    - target_second.get(token).copied().unwrap_or(0.0))
                .abs()
            })
            .sum::<f64>();
    eprintln!("total variation of the first proposal from the target's t2: {total_variation:.3}");
    assert!(
        total_variation > 0.3,
        "the drafter proposes nearly the target's distribution ({total_variation:.3}): the test has no power"
    );
    Ok(())
}
