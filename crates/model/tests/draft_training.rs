//! Training behaviour of the draft model on a tiny configuration: the loss
//! falls on a learnable task, gradient accumulation equals one big batch,
//! a checkpoint resumes to the identical next step, and a step whose loss
//! or gradient is not finite (or spikes) is skipped without a trace.

use dflash_model::draft::{
    load_draft_model, save_draft_checkpoint, AdamWSettings, Contribution, DraftConfig, DraftError,
    DraftModel, DraftTrainer, SkippedStep, TrainerSettings, TrainingSequence, GRAD_NORM_WARMUP,
    MODEL_FILE_NAME,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

mod common;

use common::{frozen_heads, tiny_draft_config, uniform_tensor, HIDDEN, VOCAB};

fn tiny_config() -> DraftConfig {
    tiny_draft_config(0.02)
}

/// Sequences following a fixed random successor function over the
/// non-mask tokens, so block position k is predictable from the anchor
/// token; the first 4 tokens are an unsupervised "prompt".
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
            let loss_mask = (0..length)
                .map(|position| u8::from(position >= 4))
                .collect();
            let target_hidden = uniform_tensor(&[length as i64, 2 * HIDDEN], 1.0, &mut generator);
            TrainingSequence {
                target_last_hidden: None,
                input_ids,
                loss_mask,
                target_hidden,
            }
        })
        .collect()
}

fn settings(total_steps: u64, peak_learning_rate: f64) -> TrainerSettings {
    let mut settings = TrainerSettings::recipe_defaults(4, total_steps);
    settings.schedule.peak_learning_rate = peak_learning_rate;
    settings.num_anchors = 16;
    settings.seed = 11;
    settings
}

fn new_trainer(total_steps: u64, peak_learning_rate: f64) -> anyhow::Result<DraftTrainer> {
    let model = DraftModel::new(tiny_config(), frozen_heads(5), Device::Cpu, Kind::Float, 3)?;
    Ok(DraftTrainer::new(
        model,
        settings(total_steps, peak_learning_rate),
    ))
}

fn clone_sequences(sequences: &[TrainingSequence]) -> Vec<TrainingSequence> {
    sequences
        .iter()
        .map(|sequence| TrainingSequence {
            target_last_hidden: None,
            input_ids: sequence.input_ids.clone(),
            loss_mask: sequence.loss_mask.clone(),
            target_hidden: sequence.target_hidden.copy(),
        })
        .collect()
}

#[test]
fn loss_falls_on_a_learnable_sequence_task() -> anyhow::Result<()> {
    let total_steps = 200;
    let mut trainer = new_trainer(total_steps, 3e-3)?;
    let data = successor_sequences(32, 40, 21);
    let mut losses = Vec::new();
    for step in 0..total_steps as usize {
        let start = (step * 4) % data.len();
        trainer.accumulate(&data[start..start + 4])?;
        losses.push(trainer.step()?.loss);
    }
    let head: f64 = losses[..20].iter().sum::<f64>() / 20.0;
    let tail: f64 = losses[losses.len() - 20..].iter().sum::<f64>() / 20.0;
    eprintln!("loss: first 20 steps {head:.4}, last 20 steps {tail:.4}");
    assert!(losses.iter().all(|loss| loss.is_finite()));
    assert!(tail < 0.5 * head, "loss went from {head} to {tail}");
    assert_eq!(trainer.progress().step, total_steps);
    Ok(())
}

#[test]
fn accumulated_micro_batches_equal_one_batch() -> anyhow::Result<()> {
    // 16 tokens give 11 anchor candidates, under the 16-anchor cap, so both
    // runs train on every candidate block whatever their anchor seeds.
    let data = successor_sequences(4, 16, 8);
    let mut whole = new_trainer(10, 1e-3)?;
    whole.accumulate(&data)?;
    let mut split = new_trainer(10, 1e-3)?;
    split.accumulate(&data[..2])?;
    split.accumulate(&data[2..])?;
    assert_eq!(split.pending_micro_batches(), 2);

    // What the math makes equal is the accumulated (unnormalised) gradient:
    // Σ over all samples either way, only summed in another order. Each
    // element is a float32 sum of at most a few thousand products, so
    // reordering moves it by at most n·u·Σ|terms| with u = 2^-24 and
    // n ≲ 4096: 2.4e-4 of Σ|terms|. Σ|terms| is not observable, so the bound
    // is taken relative to the tensor's largest gradient with a 4x margin
    // (1e-3); a lost or doubly counted micro-batch moves gradients by tens
    // of percent. The weights after the AdamW step are NOT compared
    // element-wise: Adam's first update is lr·g/(|g|+ε), which maps a
    // rounding-level difference in a gradient near ε to a difference of up
    // to lr in the weight (the source of an earlier flaky bound).
    let whole_weights = whole.model().var_store().variables();
    let split_weights = split.model().var_store().variables();
    let mut compared = 0;
    for (name, tensor) in &whole_weights {
        let whole_gradient = tensor.grad();
        if !whole_gradient.defined() {
            continue;
        }
        let split_gradient = split_weights[name].grad();
        let scale = whole_gradient.abs().max().double_value(&[]);
        let difference = (&whole_gradient - &split_gradient)
            .abs()
            .max()
            .double_value(&[]);
        assert!(
            difference <= 1e-3 * scale + f64::from(f32::MIN_POSITIVE),
            "gradient of {name} differs by {difference} (largest gradient {scale})"
        );
        compared += 1;
    }
    assert!(compared > 0, "no parameter had a gradient");

    let whole_report = whole.step()?;
    let split_report = split.step()?;
    assert_eq!(split_report.samples, 4);
    assert_eq!(split_report.tokens, whole_report.tokens);
    assert_eq!(split_report.learning_rate, whole_report.learning_rate);
    // Σ w·CE / Σ w in f64 from per-micro-batch f32 sums: same reordering
    // argument, relative to the loss itself.
    assert!(
        (whole_report.loss - split_report.loss).abs() <= 1e-5 * whole_report.loss.abs(),
        "loss {} vs {}",
        whole_report.loss,
        split_report.loss
    );
    Ok(())
}

#[test]
fn checkpoint_resumes_to_the_identical_next_step() -> anyhow::Result<()> {
    let data = successor_sequences(8, 30, 3);
    let mut original = new_trainer(20, 2e-3)?;
    for step in 0..3 {
        original.accumulate(&data[step * 2..step * 2 + 2])?;
        original.step()?;
    }
    let directory = tempfile::tempdir()?;
    let checkpoint = directory.path().join("step-3");
    original.save_checkpoint(&checkpoint)?;
    let next_batch = clone_sequences(&data[6..8]);
    original.accumulate(&data[6..8])?;
    let expected = original.step()?;

    let mut resumed = DraftTrainer::resume(
        &checkpoint,
        frozen_heads(5),
        Device::Cpu,
        Kind::Float,
        settings(0, 2e-3),
    )?;
    assert_eq!(resumed.progress().step, 3);
    assert_eq!(resumed.progress().total_steps, 20);
    resumed.accumulate(&next_batch)?;
    let actual = resumed.step()?;
    assert_eq!(actual.step, 4);
    assert_eq!(actual.learning_rate, expected.learning_rate);
    assert!(
        (actual.loss - expected.loss).abs() < 1e-9,
        "{} vs {}",
        actual.loss,
        expected.loss
    );
    assert!((actual.grad_norm - expected.grad_norm).abs() < 1e-9);
    // And the step after that agrees too (optimizer moments were restored).
    original.accumulate(&data[0..2])?;
    resumed.accumulate(&data[0..2])?;
    let (expected_next, actual_next) = (original.step()?, resumed.step()?);
    assert!((expected_next.loss - actual_next.loss).abs() < 1e-9);
    Ok(())
}

#[test]
fn loading_rejects_missing_and_unexpected_tensors() -> anyhow::Result<()> {
    let model = DraftModel::new(tiny_config(), frozen_heads(5), Device::Cpu, Kind::Float, 3)?;
    let directory = tempfile::tempdir()?;
    let checkpoint = directory.path().join("model");
    save_draft_checkpoint(&checkpoint, &model, None)?;
    let reloaded = load_draft_model(&checkpoint, frozen_heads(5), Device::Cpu, Kind::Float)?;
    assert_eq!(reloaded.num_parameters(), model.num_parameters());

    let mut tensors = Tensor::read_safetensors(checkpoint.join(MODEL_FILE_NAME))?;
    tensors.push((
        "extra.weight".to_string(),
        Tensor::zeros([2], (Kind::Float, Device::Cpu)),
    ));
    let error = load_rewritten(&checkpoint, &tensors)?
        .ok_or_else(|| anyhow::anyhow!("an unexpected tensor was accepted"))?;
    assert!(
        error
            .to_string()
            .contains("unexpected tensor \"extra.weight\""),
        "{error}"
    );

    tensors.retain(|(name, _)| name != "extra.weight" && name != "norm.weight");
    let error = load_rewritten(&checkpoint, &tensors)?
        .ok_or_else(|| anyhow::anyhow!("a missing tensor was accepted"))?;
    assert!(
        error.to_string().contains("missing tensor \"norm.weight\""),
        "{error}"
    );
    Ok(())
}

/// Rewrites the checkpoint's weights as `tensors` and loads it: the load
/// error, `None` when it loaded.
fn load_rewritten(
    checkpoint: &std::path::Path,
    tensors: &[(String, Tensor)],
) -> anyhow::Result<Option<dflash_model::draft::DraftError>> {
    dflash_model::draft::checkpoint::write_safetensors(&checkpoint.join(MODEL_FILE_NAME), tensors)?;
    Ok(load_draft_model(checkpoint, frozen_heads(5), Device::Cpu, Kind::Float).err())
}

/// Writes a trained checkpoint for `scripts/check_dflash_checkpoint.py`:
/// to `$DFLASH_WRITE_DRAFT_CHECKPOINT` when set (so `make test` can hand it
/// to the reference loader), else to a temporary folder.
#[test]
fn checkpoint_for_the_reference_loader_has_every_file() -> anyhow::Result<()> {
    let mut trainer = new_trainer(5, 1e-3)?;
    trainer.accumulate(&successor_sequences(2, 12, 4))?;
    trainer.step()?;
    let temporary = tempfile::tempdir()?;
    let directory = match std::env::var_os("DFLASH_WRITE_DRAFT_CHECKPOINT") {
        Some(path) => std::path::PathBuf::from(path),
        None => temporary.path().join("checkpoint"),
    };
    trainer.save_checkpoint(&directory)?;
    for file in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(directory.join(file).is_file(), "{file} missing");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(directory.join("config.json"))?)?;
    assert_eq!(config["architectures"][0], "DFlashDraftModel");
    assert_eq!(
        config["dflash_config"]["target_layer_ids"],
        serde_json::json!([1, 3])
    );
    assert_eq!(config["num_target_layers"], 6);
    Ok(())
}

/// The GPU recipe computes in bf16 over f32 master weights; the same casts
/// run on the CPU, so check them here: the bf16 loss is close to the f32
/// one, and a bf16 step updates the f32 master weights.
#[test]
fn bf16_compute_tracks_f32_and_trains_f32_master_weights() -> anyhow::Result<()> {
    let data = successor_sequences(4, 20, 12);
    let mut losses = Vec::new();
    for kind in [Kind::Float, Kind::BFloat16] {
        let model = DraftModel::new(tiny_config(), frozen_heads(5), Device::Cpu, kind, 3)?;
        let mut trainer = DraftTrainer::new(model, settings(10, 1e-3));
        let before = trainer.model().var_store().variables()["fc.weight"].copy();
        trainer.accumulate(&data)?;
        let report = trainer.step()?;
        let after = &trainer.model().var_store().variables()["fc.weight"];
        assert_eq!(after.kind(), Kind::Float, "master weights stay f32");
        assert!(
            (after - before).abs().max().double_value(&[]) > 0.0,
            "{kind:?} step changed nothing"
        );
        losses.push(report.loss);
    }
    let (float_loss, bf16_loss) = (losses[0], losses[1]);
    eprintln!(
        "loss f32 {float_loss}, bf16 {bf16_loss}: relative difference {:.5} ({:.2} u)",
        (float_loss - bf16_loss).abs() / float_loss,
        (float_loss - bf16_loss).abs() / float_loss * 256.0
    );
    assert!(bf16_loss.is_finite());
    // Not derived, and said so: a first-order worst case through the bf16
    // path (target states, fc, two draft layers of about 18 rounded results
    // each, the final norm and the head: about 41 roundings of u = 2^-8,
    // each moving the logits by u of their size, up to about 10 (the head
    // uniform in [-1, 1), 32 wide, on normalised states: a standard
    // deviation of sqrt(32 / 3) = 3.3), and the cross-entropy by at most
    // twice a logit's error) allows about 3.2 on a loss of 6.6, half of
    // it, so it cannot tell a broken cast from a correct one. The bound is an engineering one: 5 % = 12.8 u, against a
    // measured 0.16 % (0.41 u; f32 6.5810, bf16 6.5916). Seeded weights
    // and data: every run on one machine computes the same figures, so the
    // margin (31x) covers other CPUs' kernels, not run-to-run noise.
    assert!(
        (float_loss - bf16_loss).abs() < 0.05 * float_loss,
        "f32 loss {float_loss}, bf16 loss {bf16_loss}"
    );
    Ok(())
}

/// Every trainable tensor, copied.
/// Two data-parallel members whose flags differ (clipping bound, AdamW's
/// hyper-parameters, learning rate) take one identical step: rank 0's. The
/// reduction is done here by hand (the sum c10d's all-reduce computes), and
/// both members are given the same reduced tensors, as an all-reduce gives
/// every member the same bits; so their states must be bit-identical, and
/// the step taken must be rank 0's (its learning rate, its clipping).
#[test]
fn data_parallel_members_take_rank_zeros_step_whatever_their_flags() -> anyhow::Result<()> {
    let data = successor_sequences(4, 16, 21);
    let mut rank_zero = new_trainer(10, 1e-3)?;
    let mut other = {
        let model = DraftModel::new(tiny_config(), frozen_heads(5), Device::Cpu, Kind::Float, 3)?;
        let mut flags = settings(40, 5e-2);
        flags.max_grad_norm = 1e3;
        flags.adamw = AdamWSettings {
            beta1: 0.5,
            beta2: 0.9,
            epsilon: 1e-3,
            weight_decay: 0.1,
        };
        DraftTrainer::new(model, flags)
    };
    assert_same_weights(&weights_of(&rank_zero), &weights_of(&other));
    rank_zero.accumulate(&data[..2])?;
    other.accumulate(&data[2..])?;
    let reduce = |left: &Contribution, right: &Contribution| Contribution {
        gradient: &left.gradient + &right.gradient,
        sums: &left.sums + &right.sums,
    };
    let mine = rank_zero.contribution(true, None);
    let theirs = other.contribution(false, None);
    let step_zero = rank_zero.check_reduced(reduce(&mine, &theirs));
    let step_other = other.check_reduced(reduce(&mine, &theirs));
    let (Ok(step_zero), Ok(step_other)) = (step_zero, step_other) else {
        anyhow::bail!("a guard refused the reduced step");
    };
    let grad_norm = step_zero.grad_norm();
    // The tiny model's first gradient norm is far above 1e-3, so rank 0's
    // bound clips and the other's (1e3) would not: a member using its own
    // flag would take another step.
    assert!(
        grad_norm > 1e-2,
        "gradient norm {grad_norm} would not be clipped"
    );
    let scheduled = rank_zero.scheduled_learning_rate();
    let report_zero = rank_zero.apply_reduced(step_zero)?;
    let report_other = other.apply_reduced(step_other)?;
    assert_eq!(report_zero.learning_rate, scheduled);
    assert_eq!(report_other.learning_rate, scheduled);
    assert_eq!(report_other.samples, 4);
    assert_same_weights(&weights_of(&rank_zero), &weights_of(&other));
    assert_eq!(rank_zero.state_checksum(), other.state_checksum());
    Ok(())
}

/// Rank 0's hyper-parameters summed twice (two members that both think they
/// are rank 0) are refused, never applied.
#[test]
fn a_reduction_with_two_rank_zeros_is_refused() -> anyhow::Result<()> {
    let data = successor_sequences(2, 16, 22);
    let mut first = new_trainer(10, 1e-3)?;
    let mut second = new_trainer(10, 1e-3)?;
    first.accumulate(&data[..1])?;
    second.accumulate(&data[1..])?;
    let (mine, theirs) = (
        first.contribution(true, None),
        second.contribution(true, None),
    );
    let reduced = Contribution {
        gradient: &mine.gradient + &theirs.gradient,
        sums: &mine.sums + &theirs.sums,
    };
    match first.check_reduced(reduced) {
        Err(SkippedStep::InconsistentReduction { what }) => {
            // AdamW's β1 0.9 summed twice is 1.8: named in the reason.
            assert!(what.contains("1.8"), "{what}");
        }
        Err(other) => anyhow::bail!("refused for another reason: {other}"),
        Ok(_) => anyhow::bail!("a reduction with two rank 0s was accepted"),
    }
    Ok(())
}

fn weights_of(trainer: &DraftTrainer) -> Vec<(String, Tensor)> {
    let mut weights: Vec<(String, Tensor)> = trainer
        .model()
        .var_store()
        .variables()
        .into_iter()
        .map(|(name, tensor)| (name, tensor.copy()))
        .collect();
    weights.sort_by(|left, right| left.0.cmp(&right.0));
    weights
}

fn assert_same_weights(left: &[(String, Tensor)], right: &[(String, Tensor)]) {
    assert_eq!(left.len(), right.len());
    for ((name, a), (_, b)) in left.iter().zip(right) {
        assert!(a.equal(b), "{name} differs");
    }
}

#[test]
fn a_step_whose_loss_is_not_finite_is_skipped_and_leaves_no_trace() -> anyhow::Result<()> {
    let good = successor_sequences(4, 24, 5);
    let poisoned = clone_sequences(&good[..2]);
    let _ = poisoned[1].target_hidden.get(3).get(0).fill_(f64::NAN);

    // Trainer A: a poisoned step (skipped), then a good one.
    let mut skipping = new_trainer(20, 1e-2)?;
    let before = weights_of(&skipping);
    skipping.accumulate(&poisoned)?;
    let error = skipping.step().expect_err("the poisoned step is skipped");
    assert!(
        matches!(
            error,
            DraftError::StepSkipped(
                SkippedStep::NonFiniteLoss { .. } | SkippedStep::NonFiniteGradient { .. }
            )
        ),
        "{error}"
    );
    assert_eq!(skipping.progress().step, 0);
    assert_eq!(skipping.skipped_steps(), 1);
    assert_same_weights(&before, &weights_of(&skipping));
    skipping.accumulate(&clone_sequences(&good))?;
    let after_skip = skipping.step()?;

    // Trainer B: only the good step. Same weights, step count and moments,
    // so the same update to the bit.
    let mut clean = new_trainer(20, 1e-2)?;
    clean.accumulate(&clone_sequences(&good))?;
    let clean_report = clean.step()?;
    assert_eq!(after_skip.step, 1);
    assert_eq!(after_skip.loss, clean_report.loss);
    assert_same_weights(&weights_of(&skipping), &weights_of(&clean));
    Ok(())
}

#[test]
fn a_gradient_spike_over_the_median_bound_is_skipped() -> anyhow::Result<()> {
    let mut settings = settings(100, 1e-3);
    // A bound below any real norm: every step after the warm-up is a spike.
    settings.grad_norm_spike_ratio = 1e-12;
    let model = DraftModel::new(tiny_config(), frozen_heads(5), Device::Cpu, Kind::Float, 3)?;
    let mut trainer = DraftTrainer::new(model, settings);
    for index in 0..GRAD_NORM_WARMUP {
        trainer.accumulate(&successor_sequences(2, 24, index as u64))?;
        trainer.step()?;
    }
    let before = weights_of(&trainer);
    trainer.accumulate(&successor_sequences(2, 24, 99))?;
    match trainer.step() {
        Err(DraftError::StepSkipped(SkippedStep::GradientSpike {
            grad_norm, median, ..
        })) => assert!(grad_norm > 0.0 && median > 0.0, "{grad_norm} {median}"),
        other => panic!("expected a skipped spike, got {other:?}"),
    }
    assert_eq!(trainer.progress().step, GRAD_NORM_WARMUP as u64);
    assert_same_weights(&before, &weights_of(&trainer));
    Ok(())
}
