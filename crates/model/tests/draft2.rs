//! DFlash2 (issue 42): parity of the forward and the candidate selector
//! with `dflash` 0.1.0's `DFlash2DraftModel` (`scripts/golden/draft2_golden.py`),
//! the selector loss of speculators 0.9.0 (gold at rank K, teacher forcing,
//! decayed weights), training, and the checkpoint round trip.

use std::collections::HashMap;

use dflash_model::draft::{
    checkpoint::read_safetensors, compute_objective, load_draft_model, pack_batch,
    save_draft_checkpoint, selector_training_candidates, Dflash2Config, DraftConfig, DraftModel,
    DraftTrainer, FrozenTargetHeads, TrainerSettings, TrainingSequence, CONFIG_FILE_NAME,
    MODEL_FILE_NAME, PREDECESSOR_CODEBOOK_NAME, SUCCESSOR_CODEBOOK_NAME,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

mod common;

use common::{
    dflash2_fixture_dir as fixture_dir, frozen_heads, gamma, take, tiny_draft_config,
    uniform_tensor, HIDDEN, VOCAB,
};

fn max_abs_difference(left: &Tensor, right: &Tensor) -> f64 {
    (left - right).abs().max().double_value(&[])
}

fn dflash2_settings() -> Dflash2Config {
    Dflash2Config {
        conv_kernel_size: 2,
        conv_group_size: 8,
        selector_rank: 8,
        selector_top_k: 8,
        selector_loss_alpha: 1.0,
    }
}

fn tiny_dflash2_config() -> anyhow::Result<DraftConfig> {
    Ok(tiny_draft_config(0.02).with_dflash2(dflash2_settings())?)
}

#[test]
fn dflash2_forward_selector_and_loss_match_the_reference() -> anyhow::Result<()> {
    let mut golden = read_safetensors(&fixture_dir().join("golden.safetensors"))?;
    let lm_head = take(&mut golden, "lm_head")?;
    let frozen = FrozenTargetHeads {
        embed_tokens: take(&mut golden, "embed_tokens")?,
        lm_head: lm_head.shallow_clone(),
    };
    let model = load_draft_model(&fixture_dir(), frozen, Device::Cpu, Kind::Float)?;
    let dflash2 = model
        .config()
        .dflash2
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the fixture is not read as DFlash2"))?;
    assert_eq!(dflash2.conv_group_size, 8);
    assert_eq!(dflash2.selector_top_k, 8);
    assert_eq!(dflash2.selector_loss_alpha, 0.5);
    let block_size = model.config().block_size;
    let hidden_size = model.config().hidden_size;

    let mut sequences = Vec::new();
    let mut anchors = Vec::new();
    for index in 0..2 {
        let input_ids =
            Vec::<i64>::try_from(&take(&mut golden, &format!("seq{index}.input_ids"))?)?;
        let loss_mask = Vec::<u8>::try_from(&take(&mut golden, &format!("seq{index}.loss_mask"))?)?;
        anchors.push(Vec::<i64>::try_from(&take(
            &mut golden,
            &format!("seq{index}.anchors"),
        )?)?);
        sequences.push(TrainingSequence {
            target_last_hidden: None,
            input_ids,
            loss_mask,
            target_hidden: take(&mut golden, &format!("seq{index}.target_hidden"))?,
        });
    }
    let gamma_decay = take(&mut golden, "gamma")?.double_value(&[0]);
    let batch = pack_batch(&sequences, &anchors)?;
    let output = tch::no_grad(|| compute_objective(&model, &batch, gamma_decay))?;

    // Bound on the draft hidden states. Both sides evaluate the same
    // function in f32 and differ only in the order of their sums (matmul
    // blocking, a split softmax here against one dense softmax there). Each
    // reduction of n terms is off by at most γ_n·Σ|terms| (Higham §3.1);
    // the longest here has n = 64 (fc over 2×32 inputs, the MLP's 64-wide
    // down projection). A draft layer chains 14 of them (norm, conv, q/k/v,
    // scores, softmax, values, o_proj, conv, norm, conv, gate/up, down,
    // conv), there are 2 layers plus fc, hidden_norm and norm (3 more), and
    // activations stay below 8 in magnitude after the norms (weights
    // 0.15·N(0,1), norm scales 1 ± 0.2), each error being amplified by at
    // most the same factor 8 through the following normalisation:
    // 31 × γ_64 × 8 × 8 ≈ 7.6e-3.
    let hidden_bound = 31.0 * gamma(64) * 8.0 * 8.0;
    let mut max_hidden_error: f64 = 0.0;
    let mut max_logit_error: f64 = 0.0;
    let mut max_score_error: f64 = 0.0;
    for (index, sequence_anchors) in anchors.iter().enumerate() {
        let num_blocks = sequence_anchors.len() as i64;
        let expected_hidden = take(&mut golden, &format!("seq{index}.draft_hidden"))?;
        let hidden = output
            .draft_hidden
            .get(index as i64)
            .narrow(0, 0, num_blocks);
        let hidden_error = max_abs_difference(&hidden.reshape([-1, hidden_size]), &expected_hidden);
        assert!(
            hidden_error < hidden_bound,
            "sequence {index}: draft hidden max |Δ| {hidden_error} over the bound {hidden_bound}"
        );
        max_hidden_error = max_hidden_error.max(hidden_error);

        // Logits = hidden · lm_headᵀ: the hidden error times the largest
        // row L1 norm of the LM head, plus γ_32 of the 32-term dot product.
        let drafted = hidden.narrow(1, 1, block_size - 1);
        let logits = tch::no_grad(|| model.logits(&drafted));
        let row_l1 = lm_head.abs().sum_dim_intlist(-1, false, Kind::Float).max();
        let dot_magnitude = drafted
            .abs()
            .matmul(&lm_head.abs().transpose(0, 1))
            .max()
            .double_value(&[]);
        let logit_bound =
            hidden_bound * row_l1.double_value(&[]) + gamma(hidden_size) * dot_magnitude;
        let expected_logits = take(&mut golden, &format!("seq{index}.logits"))?;
        let logit_error = max_abs_difference(&logits, &expected_logits);
        assert!(
            logit_error < logit_bound,
            "sequence {index}: logits max |Δ| {logit_error} over the bound {logit_bound}"
        );
        max_logit_error = max_logit_error.max(logit_error);

        // The reference's greedy path, and the scores of its candidates
        // along it. The transition ⟨pred ⊙ P·h, succ⟩ moves by at most
        // max_ab Σ_r |pred_a,r|·|succ_b,r|·‖P_r‖₁ per unit of hidden error,
        // and its own sums (32 terms in P·h, 16 in the rank) by γ_48 of the
        // magnitudes; the unary part carries the logit bound.
        let expected_path = take(&mut golden, &format!("seq{index}.selector_path"))?;
        let expected_candidates = take(&mut golden, &format!("seq{index}.selector_candidates"))?;
        let expected_scores = take(&mut golden, &format!("seq{index}.selector_scores"))?;
        let anchor_tokens = Tensor::from_slice(
            &sequence_anchors
                .iter()
                .map(|&anchor| sequences[index].input_ids[anchor as usize])
                .collect::<Vec<_>>(),
        );
        let path = tch::no_grad(|| model.select_greedy(&drafted, &anchor_tokens))?;
        assert_eq!(
            Vec::<i64>::try_from(&path.tokens.flatten(0, -1))?,
            Vec::<i64>::try_from(&expected_path.flatten(0, -1))?,
            "sequence {index}: selector path"
        );
        let (sorted_candidates, _) = path.candidates.sort(-1, false);
        let (sorted_expected, _) = expected_candidates.sort(-1, false);
        assert!(
            sorted_candidates.equal(&sorted_expected),
            "sequence {index}: top-k sets"
        );
        let predecessors = Tensor::cat(
            &[
                &anchor_tokens.unsqueeze(-1),
                &expected_path.narrow(1, 0, block_size - 2),
            ],
            1,
        );
        let scores = tch::no_grad(|| {
            model.selector_scores(&drafted, &logits, &predecessors, &expected_candidates)
        })?;
        let variables = model.var_store().variables();
        let codebook = |name: &str| -> anyhow::Result<Tensor> {
            variables
                .get(name)
                .map(|tensor| tensor.detach().abs())
                .ok_or_else(|| anyhow::anyhow!("no parameter {name}"))
        };
        let projection_l1 = codebook("candidate_selector.hidden_projection.weight")?
            .sum_dim_intlist(-1, false, Kind::Float);
        let transition_sensitivity = (codebook(PREDECESSOR_CODEBOOK_NAME)? * &projection_l1)
            .matmul(&codebook(SUCCESSOR_CODEBOOK_NAME)?.transpose(0, 1))
            .max()
            .double_value(&[]);
        let transition_magnitude = transition_sensitivity * drafted.abs().max().double_value(&[]);
        let score_bound = logit_bound
            + hidden_bound * transition_sensitivity
            + gamma(hidden_size + dflash2.selector_rank) * transition_magnitude;
        let score_error = max_abs_difference(&scores, &expected_scores);
        assert!(
            score_error < score_bound,
            "sequence {index}: selector scores max |Δ| {score_error} over the bound {score_bound}"
        );
        max_score_error = max_score_error.max(score_error);
    }
    println!(
        "max |Δ|: hidden {max_hidden_error:.3e} (bound {hidden_bound:.3e}), logits {max_logit_error:.3e}, selector scores {max_score_error:.3e}"
    );

    // The loss terms: sums of a few dozen O(1..10) cross-entropies, each
    // within the logit bound of the reference's (a log-sum-exp moves by at
    // most the largest logit error), so 1e-3 is far above both.
    let selector = output
        .selector
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no selector totals for a DFlash2 model"))?;
    let weight_sum = output.weight_sum;
    let check =
        |name: &str, actual: f64, golden: &mut HashMap<String, Tensor>| -> anyhow::Result<()> {
            let expected = take(golden, name)?.double_value(&[0]);
            assert!(
                (actual - expected).abs() < 1e-3,
                "{name}: {actual}, reference {expected}"
            );
            Ok(())
        };
    check("loss", output.loss.double_value(&[]), &mut golden)?;
    check(
        "unary_loss",
        selector.unary_weighted_cross_entropy / weight_sum,
        &mut golden,
    )?;
    check(
        "selector_loss",
        selector.selector_weighted_cross_entropy / weight_sum,
        &mut golden,
    )?;
    // Counts: exact.
    let expected_recall = take(&mut golden, "recall_at_k")?.double_value(&[0]);
    assert_eq!(selector.recall_at_k(), expected_recall);
    assert!(
        expected_recall > 0.0 && expected_recall < 1.0,
        "both branches of the gold rule"
    );
    let expected_accuracy =
        take(&mut golden, "teacher_forced_selector_accuracy")?.double_value(&[0]);
    assert_eq!(
        selector.teacher_forced_selector_accuracy(),
        expected_accuracy
    );
    Ok(())
}

#[test]
fn a_missing_gold_token_goes_in_at_rank_k() -> anyhow::Result<()> {
    // Row 0 holds its gold (9) at rank 2; row 1 misses its gold (7), which
    // replaces the weakest candidate (8) at rank K − 1 = 3.
    let candidates = Tensor::from_slice(&[5i64, 3, 9, 1, 2, 4, 6, 8]).view([2, 4]);
    let gold = Tensor::from_slice(&[9i64, 7]);
    let (training, positions, contains) = selector_training_candidates(&candidates, &gold)?;
    assert_eq!(
        Vec::<i64>::try_from(&training.flatten(0, -1))?,
        vec![5, 3, 9, 1, 2, 4, 6, 7]
    );
    assert_eq!(Vec::<i64>::try_from(&positions)?, vec![2, 3]);
    assert_eq!(Vec::<bool>::try_from(&contains)?, vec![true, false]);
    Ok(())
}

/// Sequences that follow a fixed successor function, first 4 tokens unsupervised.
fn successor_sequences(count: usize, length: usize, seed: u64) -> Vec<TrainingSequence> {
    let mut generator = StdRng::seed_from_u64(seed);
    let successor: Vec<i64> = (0..VOCAB - 1)
        .map(|_| generator.random_range(0..VOCAB - 1))
        .collect();
    (0..count)
        .map(|_| {
            let mut token = generator.random_range(0..VOCAB - 1);
            let input_ids: Vec<i64> = (0..length)
                .map(|_| {
                    let current = token;
                    token = successor[current as usize];
                    current
                })
                .collect();
            TrainingSequence {
                target_last_hidden: None,
                input_ids,
                loss_mask: (0..length)
                    .map(|position| u8::from(position >= 4))
                    .collect(),
                target_hidden: uniform_tensor(&[length as i64, 2 * HIDDEN], 1.0, &mut generator),
            }
        })
        .collect()
}

#[test]
fn selector_loss_follows_the_gold_at_rank_k_rule_on_a_real_model() -> anyhow::Result<()> {
    // With zero codebooks the selector scores are the unary logits of the
    // training candidates, so the selector loss can be recomputed here from
    // the logits alone: CE = logsumexp(candidate logits) − gold logit.
    let model = DraftModel::new(
        tiny_dflash2_config()?,
        frozen_heads(5),
        Device::Cpu,
        Kind::Float,
        3,
    )?;
    tch::no_grad(|| {
        for (name, tensor) in model.var_store().variables() {
            if name.contains("codebook") {
                let _ = tensor.detach().zero_();
            }
        }
    });
    let sequences = successor_sequences(2, 14, 9);
    let anchors = vec![vec![4, 6, 9], vec![5, 10]];
    let batch = pack_batch(&sequences, &anchors)?;
    let gamma_decay = 2.0;
    let output = tch::no_grad(|| compute_objective(&model, &batch, gamma_decay))?;
    let selector = output
        .selector
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no selector totals"))?;
    let top_k = 8;
    let mut expected_selector = 0.0;
    let mut expected_unary = 0.0;
    for (row, sequence_anchors) in anchors.iter().enumerate() {
        for (block, &anchor) in sequence_anchors.iter().enumerate() {
            let hidden = output.draft_hidden.get(row as i64).get(block as i64);
            let logits = tch::no_grad(|| model.logits(&hidden));
            for k in 1..4 {
                let position = anchor as usize + k;
                let gold = sequences[row].input_ids[position];
                let weight = (-((k - 1) as f64) / gamma_decay).exp();
                let row_logits = Vec::<f64>::try_from(&logits.get(k as i64).to_kind(Kind::Double))?;
                let mut order: Vec<usize> = (0..row_logits.len()).collect();
                order.sort_by(|&a, &b| row_logits[b].total_cmp(&row_logits[a]));
                let mut candidates: Vec<usize> = order[..top_k].to_vec();
                if !candidates.contains(&(gold as usize)) {
                    candidates[top_k - 1] = gold as usize;
                }
                let maximum = candidates
                    .iter()
                    .map(|&token| row_logits[token])
                    .fold(f64::NEG_INFINITY, f64::max);
                let log_sum = maximum
                    + candidates
                        .iter()
                        .map(|&token| (row_logits[token] - maximum).exp())
                        .sum::<f64>()
                        .ln();
                expected_selector += weight * (log_sum - row_logits[gold as usize]);
                let all_maximum = row_logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let all_log_sum = all_maximum
                    + row_logits
                        .iter()
                        .map(|logit| (logit - all_maximum).exp())
                        .sum::<f64>()
                        .ln();
                expected_unary += weight * (all_log_sum - row_logits[gold as usize]);
            }
        }
    }
    // f32 against f64 over 15 positions of O(5) cross-entropies, each off
    // by at most γ_64 of its log-sum-exp's terms: 15 × 5 × γ_64 ≈ 3e-4;
    // 1e-3 leaves room for the logits' own f32 rounding.
    assert!(
        (selector.selector_weighted_cross_entropy - expected_selector).abs() < 1e-3,
        "selector Σ w·CE {}, recomputed {expected_selector}",
        selector.selector_weighted_cross_entropy
    );
    assert!(
        (selector.unary_weighted_cross_entropy - expected_unary).abs() < 1e-3,
        "unary Σ w·CE {}, recomputed {expected_unary}",
        selector.unary_weighted_cross_entropy
    );
    // The loss is (unary + α·selector) / Σ w with α = 1.
    let expected_loss = (expected_unary + expected_selector) / output.weight_sum;
    assert!((output.loss.double_value(&[]) - expected_loss).abs() < 1e-4);
    Ok(())
}

#[test]
fn dflash2_training_lowers_the_loss_and_reports_the_selector() -> anyhow::Result<()> {
    let model = DraftModel::new(
        tiny_dflash2_config()?,
        frozen_heads(5),
        Device::Cpu,
        Kind::Float,
        3,
    )?;
    let mut settings = TrainerSettings::recipe_defaults(4, 30);
    settings.schedule.peak_learning_rate = 3e-3;
    settings.num_anchors = 16;
    settings.seed = 11;
    let mut trainer = DraftTrainer::new(model, settings);
    let sequences = successor_sequences(4, 24, 21);
    let mut reports = Vec::new();
    for _ in 0..30 {
        trainer.accumulate(&sequences)?;
        reports.push(trainer.step()?);
    }
    let first = &reports[0];
    let last = &reports[reports.len() - 1];
    for report in &reports {
        let selector = report
            .selector
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("step {} has no selector report", report.step))?;
        assert!(selector.selector_loss.is_finite(), "step {}", report.step);
        assert!((0.0..=1.0).contains(&selector.recall_at_k));
        assert!((0.0..=1.0).contains(&selector.teacher_forced_selector_accuracy));
        // loss = unary + α·selector, α = 1.
        assert!((report.loss - selector.unary_loss - selector.selector_loss).abs() < 1e-9);
    }
    assert!(
        last.loss < 0.8 * first.loss,
        "loss {} → {}",
        first.loss,
        last.loss
    );
    let (first_selector, last_selector) = (
        first.selector.as_ref().map(|s| s.selector_loss),
        last.selector.as_ref().map(|s| s.selector_loss),
    );
    assert!(
        last_selector < first_selector,
        "selector loss {first_selector:?} → {last_selector:?}"
    );
    Ok(())
}

#[test]
fn dflash2_checkpoint_round_trips_in_the_reference_layout() -> anyhow::Result<()> {
    let model = DraftModel::new(
        tiny_dflash2_config()?,
        frozen_heads(5),
        Device::Cpu,
        Kind::Float,
        3,
    )?;
    // Move every parameter off its initialisation so the check means something.
    tch::no_grad(|| {
        let mut generator = StdRng::seed_from_u64(17);
        for (_, tensor) in model.var_store().variables() {
            let noise = uniform_tensor(&tensor.size(), 0.1, &mut generator);
            let _ = tensor.detach().g_add_(&noise);
        }
    });
    let directory = tempfile::tempdir()?;
    save_draft_checkpoint(directory.path(), &model, None)?;
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        directory.path().join(CONFIG_FILE_NAME),
    )?)?;
    assert_eq!(config["architectures"][0], "DFlash2DraftModel");
    for key in [
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    ] {
        assert!(
            config[key].is_i64() && config["dflash_config"][key].is_i64(),
            "{key}"
        );
    }
    let stored = read_safetensors(&directory.path().join(MODEL_FILE_NAME))?;
    assert!(stored.contains_key(PREDECESSOR_CODEBOOK_NAME));
    assert!(stored.contains_key("layers.1.mlp_conv.base_kernel"));
    assert!(stored.contains_key("layers.0.attention_conv.kernel_projection.weight"));

    let loaded = load_draft_model(directory.path(), frozen_heads(5), Device::Cpu, Kind::Float)?;
    assert_eq!(loaded.config(), model.config());
    let original = model.var_store().variables();
    for (name, tensor) in loaded.var_store().variables() {
        assert!(tensor.equal(&original[&name]), "{name}");
    }
    let sequences = successor_sequences(1, 16, 3);
    let batch = pack_batch(&sequences, &[vec![4, 8]])?;
    let before = tch::no_grad(|| compute_objective(&model, &batch, 2.0))?;
    let after = tch::no_grad(|| compute_objective(&loaded, &batch, 2.0))?;
    assert!(before.draft_hidden.equal(&after.draft_hidden));
    assert_eq!(before.selector, after.selector);
    Ok(())
}

#[test]
fn dflash2_starts_as_the_dflash_model_of_the_same_seed() -> anyhow::Result<()> {
    // Identity convolutions at initialisation, DFlash's parameters drawn
    // first: the draft hidden states are DFlash's exactly.
    let dflash = DraftModel::new(
        tiny_draft_config(0.02),
        frozen_heads(5),
        Device::Cpu,
        Kind::Float,
        3,
    )?;
    let dflash2 = DraftModel::new(
        tiny_dflash2_config()?,
        frozen_heads(5),
        Device::Cpu,
        Kind::Float,
        3,
    )?;
    let sequences = successor_sequences(2, 16, 4);
    let batch = pack_batch(&sequences, &[vec![4, 9], vec![5]])?;
    let plain = tch::no_grad(|| compute_objective(&dflash, &batch, 2.0))?;
    let convolved = tch::no_grad(|| compute_objective(&dflash2, &batch, 2.0))?;
    assert!(plain.selector.is_none());
    // The identity convolution multiplies by exactly 1 and adds exact zeros.
    assert!(plain.draft_hidden.equal(&convolved.draft_hidden));
    Ok(())
}

#[test]
fn bad_dflash2_settings_are_refused_with_the_value() -> anyhow::Result<()> {
    let cases = [
        (
            Dflash2Config {
                conv_group_size: 5,
                ..dflash2_settings()
            },
            "conv_group_size 5",
        ),
        (
            Dflash2Config {
                selector_top_k: VOCAB + 1,
                ..dflash2_settings()
            },
            "selector_top_k 65",
        ),
        (
            Dflash2Config {
                conv_kernel_size: 0,
                ..dflash2_settings()
            },
            "conv_kernel_size 0",
        ),
    ];
    for (settings, expected) in cases {
        let error = tiny_draft_config(0.02)
            .with_dflash2(settings)
            .expect_err(expected);
        assert!(error.to_string().contains(expected), "{error}");
    }
    let mut json = tiny_dflash2_config()?.to_hf_json("float32");
    json["final_logit_softcapping"] = serde_json::json!(30.0);
    let error = DraftConfig::from_hf_json(&json).expect_err("softcapping is not implemented");
    assert!(
        error.to_string().contains("final_logit_softcapping 30"),
        "{error}"
    );
    let mut json = tiny_dflash2_config()?.to_hf_json("float32");
    json["dflash_config"]["output_multiplier"] = serde_json::json!(2.0);
    let error = DraftConfig::from_hf_json(&json).expect_err("output_multiplier is not implemented");
    assert!(error.to_string().contains("output_multiplier 2"), "{error}");
    Ok(())
}

#[test]
fn a_checkpoint_whose_tensors_do_not_match_its_config_is_refused_by_name() -> anyhow::Result<()> {
    let write = |config: DraftConfig| -> anyhow::Result<tempfile::TempDir> {
        let model = DraftModel::new(config, frozen_heads(5), Device::Cpu, Kind::Float, 3)?;
        let directory = tempfile::tempdir()?;
        save_draft_checkpoint(directory.path(), &model, None)?;
        Ok(directory)
    };
    let dflash2 = write(tiny_dflash2_config()?)?;
    let dflash = write(tiny_draft_config(0.02))?;
    let config_of = |directory: &tempfile::TempDir| -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(
            directory.path().join(CONFIG_FILE_NAME),
        )?)
    };
    let dflash2_config = config_of(&dflash2)?;
    let dflash_config = config_of(&dflash)?;
    // DFlash2 tensors under a DFlash config: the selector and convolutions
    // are tensors the config does not make.
    std::fs::write(dflash2.path().join(CONFIG_FILE_NAME), &dflash_config)?;
    let error = load_draft_model(dflash2.path(), frozen_heads(5), Device::Cpu, Kind::Float)
        .err()
        .ok_or_else(|| anyhow::anyhow!("DFlash2 tensors loaded under a DFlash config"))?;
    let message = error.to_string();
    assert!(
        message.contains("candidate_selector") || message.contains("_conv."),
        "{message}"
    );
    // A DFlash checkpoint under a DFlash2 config: the config's convolutions
    // and selector are missing from the file.
    std::fs::write(dflash.path().join(CONFIG_FILE_NAME), &dflash2_config)?;
    let error = load_draft_model(dflash.path(), frozen_heads(5), Device::Cpu, Kind::Float)
        .err()
        .ok_or_else(|| anyhow::anyhow!("a DFlash checkpoint loaded under a DFlash2 config"))?;
    let message = error.to_string();
    assert!(
        message.contains("candidate_selector") || message.contains("_conv."),
        "{message}"
    );
    // A selector rank the codebooks were not written with.
    let mut json: serde_json::Value = serde_json::from_str(&dflash2_config)?;
    json["selector_rank"] = serde_json::json!(4);
    json["dflash_config"]["selector_rank"] = serde_json::json!(4);
    let dflash2 = write(tiny_dflash2_config()?)?;
    std::fs::write(
        dflash2.path().join(CONFIG_FILE_NAME),
        serde_json::to_string(&json)?,
    )?;
    let error = load_draft_model(dflash2.path(), frozen_heads(5), Device::Cpu, Kind::Float)
        .err()
        .ok_or_else(|| anyhow::anyhow!("codebooks of rank 8 loaded as rank 4"))?;
    let message = error.to_string();
    assert!(
        message.contains("candidate_selector") && message.contains('4') && message.contains('8'),
        "{message}"
    );
    Ok(())
}
