//! KV-cached generation against the uncached reference, on the tiny Qwen3
//! and Llama models: batched cached greedy decoding gives exactly the tokens
//! of one-prompt-at-a-time uncached greedy decoding, with left or right
//! padding; cached logits equal uncached logits within float rounding (f32)
//! and within bf16 rounding (bf16); sampling is reproducible per sequence.
//!
//! Tolerance (f32): the cached and uncached forwards do the same arithmetic
//! in a different order (one [T, T] attention vs T attentions over the
//! cache), so logits of O(1) differ by a few float ulps summed over the
//! layers: 1e-4 is far above that and far below any real error (a wrong
//! position or mask moves logits by O(0.1)).

#![allow(clippy::expect_used, clippy::unwrap_used)]

use anyhow::{ensure, Result};
use dflash_model::generate::{
    generate, generate_batch, greedy_generate_uncached, GenerationOptions, GenerationRequest,
    Padding,
};
use dflash_model::sampling::SamplingOptions;
use dflash_model::target_model::{build_target_layer_ids, TargetModel};
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_model::tokens::{default_mask_token_id, MaskTokenSource};
use tch::{Device, Kind, Tensor};

const NEW_TOKENS: usize = 12;

fn tiny_model(spec: &TinyModelSpec, kind: Kind) -> Result<(tempfile::TempDir, TargetModel)> {
    let directory = tempfile::tempdir()?;
    write_tiny_model(directory.path(), spec)?;
    let model = TargetModel::load(directory.path(), Device::Cpu, kind)?;
    Ok((directory, model))
}

/// Prompts of unequal lengths with ids spread over the vocabulary (a fixed
/// linear congruence: the test needs variety, not randomness).
fn prompts() -> Vec<Vec<i64>> {
    [5usize, 1, 9, 3, 7]
        .iter()
        .enumerate()
        .map(|(row, &length)| {
            (0..length)
                .map(|position| ((row * 131 + position * 37 + 11) % 450) as i64 + 3)
                .collect()
        })
        .collect()
}

fn requests(prompts: &[Vec<i64>]) -> Vec<GenerationRequest> {
    GenerationRequest::numbered(prompts)
}

fn cached_equals_uncached(spec: &TinyModelSpec) -> Result<()> {
    let (_directory, model) = tiny_model(spec, Kind::Float)?;
    let prompts = prompts();
    let expected: Vec<Vec<i64>> = prompts
        .iter()
        .map(|prompt| greedy_generate_uncached(&model, prompt, NEW_TOKENS, &[]))
        .collect::<Result<_, _>>()?;
    // The comparison is not vacuous: continuations differ between prompts.
    ensure!(
        expected.iter().any(|tokens| tokens != &expected[0]),
        "{expected:?}"
    );
    for padding in [Padding::Left, Padding::Right] {
        let options = GenerationOptions {
            max_new_tokens: NEW_TOKENS,
            padding,
            pad_token_id: 0,
            ..GenerationOptions::default()
        };
        let generated = generate_batch(&model, &requests(&prompts), &options)?;
        for (row, (output, expected)) in generated.iter().zip(&expected).enumerate() {
            ensure!(
                &output.tokens == expected,
                "{:?} {padding:?} row {row}: cached {:?} != uncached {expected:?}",
                spec.architecture,
                output.tokens
            );
            ensure!(!output.stopped);
        }
    }
    // Batched by a small token budget (several batches, longest first), the
    // outputs still come back in request order.
    let batched = generate(
        &model,
        &requests(&prompts),
        &GenerationOptions {
            max_new_tokens: NEW_TOKENS,
            ..GenerationOptions::default()
        },
        60,
        |_, _| {},
    )?;
    let tokens: Vec<Vec<i64>> = batched.into_iter().map(|output| output.tokens).collect();
    ensure!(tokens == expected, "budgeted batches: {tokens:?}");
    Ok(())
}

#[test]
fn cached_batched_greedy_equals_uncached_greedy_qwen3() -> Result<()> {
    cached_equals_uncached(&TinyModelSpec::default())
}

#[test]
fn cached_batched_greedy_equals_uncached_greedy_llama() -> Result<()> {
    cached_equals_uncached(&TinyModelSpec::llama())
}

#[test]
fn generation_stops_at_a_stop_token_per_row() -> Result<()> {
    let (_directory, model) = tiny_model(&TinyModelSpec::default(), Kind::Float)?;
    let prompts = prompts();
    let reference = greedy_generate_uncached(&model, &prompts[0], NEW_TOKENS, &[])?;
    // Stop at the 4th token of row 0's continuation.
    let stop = reference[3];
    let first_stop = reference
        .iter()
        .position(|&token| token == stop)
        .unwrap_or(3);
    let options = GenerationOptions {
        max_new_tokens: NEW_TOKENS,
        stop_token_ids: vec![stop],
        ..GenerationOptions::default()
    };
    let generated = generate_batch(&model, &requests(&prompts), &options)?;
    ensure!(generated[0].stopped);
    ensure!(
        generated[0].tokens == reference[..=first_stop],
        "{:?} vs {reference:?}",
        generated[0].tokens
    );
    // Other rows go on to their own stop or the limit, unaffected by row 0.
    for (row, prompt) in prompts.iter().enumerate().skip(1) {
        let expected = greedy_generate_uncached(&model, prompt, NEW_TOKENS, &[stop])?;
        ensure!(generated[row].tokens == expected, "row {row}");
    }
    Ok(())
}

/// Logits of a left-padded batch, prefilled and then decoded one token at a
/// time through the cache, against the uncached forward of each row alone.
fn cached_logits_difference(kind: Kind) -> Result<(f64, f64)> {
    let (_directory, model) = tiny_model(&TinyModelSpec::default(), kind)?;
    let sequences = [
        vec![17i64, 204, 9, 77, 301, 42, 8, 150],
        vec![99i64, 3, 250, 61, 5, 5, 7, 400],
    ];
    let prompt_lengths = [5usize, 2];
    let longest = 5;
    let layer_ids = build_target_layer_ids(8, 3);
    let mut worst = 0.0f64;
    let mut worst_hidden = 0.0f64;
    let mut scale = 0.0f64;
    // Prefill: row 1 left-padded by 3.
    let mut ids = vec![0i64; 2 * longest];
    let mut mask = vec![0i64; 2 * longest];
    for row in 0..2 {
        let offset = longest - prompt_lengths[row];
        for position in 0..prompt_lengths[row] {
            ids[row * longest + offset + position] = sequences[row][position];
            mask[row * longest + offset + position] = 1;
        }
    }
    let mut cache = model.new_cache(2, 4);
    let prefill = model.forward_cached(
        &Tensor::from_slice(&ids).view([2, longest as i64]),
        &Tensor::from_slice(&mask).view([2, longest as i64]),
        &mut cache,
        &layer_ids,
    )?;
    let mut per_step = vec![(
        model.lm_head_logits(&prefill.hidden.narrow(1, longest as i64 - 1, 1)),
        prefill
            .captured
            .expect("layer ids given")
            .narrow(1, longest as i64 - 1, 1),
    )];
    for step in 0..3 {
        let next: Vec<i64> = (0..2)
            .map(|row| sequences[row][prompt_lengths[row] + step])
            .collect();
        let output = model.forward_cached(
            &Tensor::from_slice(&next).view([2, 1]),
            &Tensor::ones([2, 1], (Kind::Int64, Device::Cpu)),
            &mut cache,
            &layer_ids,
        )?;
        per_step.push((
            model.lm_head_logits(&output.hidden),
            output.captured.expect("layer ids given"),
        ));
    }
    ensure!(cache.len() == longest as i64 + 3);
    for row in 0..2 {
        let length = prompt_lengths[row] + 3;
        let ids = Tensor::from_slice(&sequences[row][..length]).view([1, length as i64]);
        let logits = model.logits(&ids, &ids.ones_like())?.to_kind(Kind::Float);
        let hidden = model
            .capture_hidden_states(&ids, &ids.ones_like(), &layer_ids)?
            .to_kind(Kind::Float);
        for (step, (cached_logits, cached_hidden)) in per_step.iter().enumerate() {
            let position = (prompt_lengths[row] - 1 + step) as i64;
            let expected = logits.get(0).get(position);
            let actual = cached_logits.get(row as i64).get(0).to_kind(Kind::Float);
            worst = worst.max((&actual - &expected).abs().max().double_value(&[]));
            scale = scale.max(expected.abs().max().double_value(&[]));
            let expected_hidden = hidden.get(0).get(position);
            let actual_hidden = cached_hidden.get(row as i64).get(0).to_kind(Kind::Float);
            worst_hidden = worst_hidden.max(
                (&actual_hidden - &expected_hidden)
                    .abs()
                    .max()
                    .double_value(&[]),
            );
        }
    }
    ensure!(scale > 0.1, "logits are not vacuous: scale {scale}");
    Ok((worst.max(worst_hidden), scale))
}

#[test]
fn cached_logits_and_states_equal_uncached_f32() -> Result<()> {
    let (difference, scale) = cached_logits_difference(Kind::Float)?;
    eprintln!("f32: max abs difference {difference:e} (logit scale {scale})");
    ensure!(difference < 1e-4, "cached logits differ by {difference}");
    Ok(())
}

#[test]
fn cached_logits_equal_uncached_within_bf16_rounding() -> Result<()> {
    // bf16 keeps 8 significant bits: one rounding is a relative 2^-9; the
    // two paths round different intermediate sums over 8 layers, so allow
    // 2^-4 of the largest |value| (still far below a wrong mask or position,
    // which changes logits by their own order).
    let (difference, scale) = cached_logits_difference(Kind::BFloat16)?;
    eprintln!("bf16: max abs difference {difference:e} (logit scale {scale})");
    ensure!(
        difference < scale.max(1.0) / 16.0,
        "bf16 cached logits differ by {difference} (scale {scale})"
    );
    Ok(())
}

#[test]
fn truncating_the_cache_forgets_the_rejected_positions() -> Result<()> {
    let (_directory, model) = tiny_model(&TinyModelSpec::default(), Kind::Float)?;
    let prompt = Tensor::from_slice(&[12i64, 80, 33, 7]).view([1, 4]);
    let block = Tensor::from_slice(&[5i64, 6, 7]).view([1, 3]);
    let mut cache = model.new_cache(1, 16);
    model.forward_cached(&prompt, &prompt.ones_like(), &mut cache, &[])?;
    model.forward_cached(&block, &block.ones_like(), &mut cache, &[])?;
    cache.truncate(5)?;
    let next = Tensor::from_slice(&[200i64]).view([1, 1]);
    let after = model.forward_cached(&next, &next.ones_like(), &mut cache, &[])?;
    let whole = Tensor::from_slice(&[12i64, 80, 33, 7, 5, 200]).view([1, 6]);
    let expected = model.logits(&whole, &whole.ones_like())?.get(0).get(5);
    let actual = model.lm_head_logits(&after.hidden).get(0).get(0);
    let difference = (actual - expected).abs().max().double_value(&[]);
    ensure!(
        difference < 1e-4,
        "after truncation logits differ by {difference}"
    );
    ensure!(cache.truncate(9).is_err(), "cannot grow by truncation");
    Ok(())
}

#[test]
fn sampling_is_reproducible_per_sequence_whatever_the_batch() -> Result<()> {
    let (_directory, model) = tiny_model(&TinyModelSpec::default(), Kind::Float)?;
    let prompts = prompts();
    let options = GenerationOptions {
        max_new_tokens: NEW_TOKENS,
        sampling: SamplingOptions {
            temperature: 1.5,
            top_p: 0.95,
            seed: 3,
        },
        ..GenerationOptions::default()
    };
    let all = generate_batch(&model, &requests(&prompts), &options)?;
    let alone = generate_batch(&model, &requests(&prompts)[2..3], &options)?;
    ensure!(all[2] == alone[0], "{:?} vs {:?}", all[2], alone[0]);
    let again = generate_batch(&model, &requests(&prompts), &options)?;
    ensure!(all == again);
    // A hot temperature leaves greedy decoding: the samples differ from it.
    let greedy = generate_batch(
        &model,
        &requests(&prompts),
        &GenerationOptions {
            max_new_tokens: NEW_TOKENS,
            ..GenerationOptions::default()
        },
    )?;
    ensure!(all != greedy, "sampling gave the greedy tokens");
    let other_seed = GenerationOptions {
        sampling: SamplingOptions {
            seed: 4,
            ..options.sampling.clone()
        },
        ..options.clone()
    };
    ensure!(generate_batch(&model, &requests(&prompts), &other_seed)? != all);
    Ok(())
}

#[test]
fn bad_generation_input_is_an_error_naming_the_value() -> Result<()> {
    let (_directory, model) = tiny_model(&TinyModelSpec::default(), Kind::Float)?;
    let empty = vec![GenerationRequest {
        prompt: Vec::new(),
        sequence_id: 0,
    }];
    let error = generate_batch(&model, &empty, &GenerationOptions::default()).unwrap_err();
    ensure!(error.to_string().contains("empty"), "{error}");
    let out_of_vocabulary = vec![GenerationRequest {
        prompt: vec![1, 100_000],
        sequence_id: 0,
    }];
    let error =
        generate_batch(&model, &out_of_vocabulary, &GenerationOptions::default()).unwrap_err();
    ensure!(error.to_string().contains("100000"), "{error}");
    let hot = GenerationOptions {
        sampling: SamplingOptions {
            temperature: 1.0,
            top_p: 2.0,
            seed: 0,
        },
        ..GenerationOptions::default()
    };
    let error = generate_batch(&model, &requests(&prompts()), &hot).unwrap_err();
    ensure!(error.to_string().contains("top_p"), "{error}");
    Ok(())
}

#[test]
fn mask_token_defaults_to_the_reserved_id_past_the_tokenizer_vocabulary() -> Result<()> {
    let directory = tempfile::tempdir()?;
    write_tiny_model(directory.path(), &TinyModelSpec::default())?;
    let (id, source) = default_mask_token_id(directory.path())?;
    ensure!(source == MaskTokenSource::Tokenizer);
    // A Qwen3/Llama tokenizer has no mask_token: remove it.
    let config_path = directory.path().join("tokenizer_config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&config_path)?)?;
    config
        .as_object_mut()
        .expect("an object")
        .remove("mask_token");
    std::fs::write(&config_path, serde_json::to_string(&config)?)?;
    let (reserved, source) = default_mask_token_id(directory.path())?;
    ensure!(source == MaskTokenSource::ReservedPastVocabulary);
    // The tiny tokenizer's last id is the <|MASK|> token itself.
    ensure!(
        reserved == id + 1,
        "reserved {reserved}, tokenizer mask {id}"
    );
    // No room past the tokenizer: an error naming both numbers.
    let model_config_path = directory.path().join("config.json");
    let mut model_config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&model_config_path)?)?;
    model_config["vocab_size"] = serde_json::json!(reserved);
    std::fs::write(&model_config_path, serde_json::to_string(&model_config)?)?;
    let error = default_mask_token_id(directory.path())
        .unwrap_err()
        .to_string();
    ensure!(
        error.contains(&reserved.to_string()) && error.contains("--mask-token-id"),
        "{error}"
    );
    Ok(())
}
