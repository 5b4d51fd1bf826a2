//! DSpark in this project's own terms (the parity with speculators is
//! `dspark_golden.rs`): checkpoints round-trip through the one writer and a
//! mismatched one is refused naming the tensor; training lowers the loss
//! and reports DSpark's metrics; micro-batch accumulation is exact; a batch
//! without the target's last hidden state is refused.

use dflash_model::draft::{
    compute_objective, load_draft_model, pack_batch, save_draft_checkpoint, DraftConfig,
    DraftModel, DraftTrainer, DsparkConfig, MarkovHeadType, TrainerSettings, TrainingSequence,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tch::{Device, Kind, Tensor};

mod common;

use common::{frozen_heads, tiny_draft_config, uniform_tensor, HIDDEN, VOCAB};

fn dspark_config(head_type: MarkovHeadType) -> anyhow::Result<DraftConfig> {
    Ok(tiny_draft_config(0.05).with_dspark(DsparkConfig {
        markov_rank: 8,
        markov_head_type: head_type,
        ..DsparkConfig::default()
    })?)
}

/// A sequence whose teacher (last hidden state) is a fixed function of the
/// next token, so the drafter can learn it.
fn sequence(seed: u64, length: usize) -> TrainingSequence {
    let mut generator = StdRng::seed_from_u64(seed);
    let input_ids: Vec<i64> = (0..length as i64)
        .map(|position| (position * 5 + seed as i64) % (VOCAB - 1))
        .collect();
    let width = 2 * HIDDEN;
    let target_hidden = uniform_tensor(&[length as i64, width], 1.0, &mut generator);
    let embedding = frozen_heads(1).lm_head;
    let next: Vec<i64> = (0..length)
        .map(|position| input_ids[(position + 1).min(length - 1)])
        .collect();
    let last_hidden = embedding.index_select(0, &Tensor::from_slice(&next)) * 3.0;
    let mut loss_mask = vec![1u8; length];
    loss_mask[0] = 0;
    loss_mask[1] = 0;
    TrainingSequence {
        input_ids,
        loss_mask,
        target_hidden,
        target_last_hidden: Some(last_hidden),
    }
}

#[test]
fn a_dspark_checkpoint_round_trips_and_a_mismatch_is_refused_naming_the_tensor(
) -> anyhow::Result<()> {
    let directory = tempfile::tempdir()?;
    let model = DraftModel::new(
        dspark_config(MarkovHeadType::Rnn)?,
        frozen_heads(1),
        Device::Cpu,
        Kind::Float,
        3,
    )?;
    let saved = directory.path().join("rnn");
    save_draft_checkpoint(&saved, &model, None)?;
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(saved.join("config.json"))?)?;
    assert_eq!(config["speculators_model_type"], "dspark");
    assert_eq!(config["markov_head_type"], "rnn");
    let loaded = load_draft_model(&saved, frozen_heads(1), Device::Cpu, Kind::Float)?;
    assert_eq!(loaded.config(), model.config());
    let batch = pack_batch(&[sequence(1, 20)], &[vec![2, 7, 11]])?;
    let before = tch::no_grad(|| compute_objective(&model, &batch, 4.0))?;
    let after = tch::no_grad(|| compute_objective(&loaded, &batch, 4.0))?;
    assert!(
        before.loss.equal(&after.loss),
        "the loaded model computes otherwise"
    );

    // The config says rank 4, the tensors are rank 8.
    let mut other_rank = config.clone();
    other_rank["markov_rank"] = serde_json::json!(4);
    std::fs::write(saved.join("config.json"), serde_json::to_vec(&other_rank)?)?;
    let error = load_draft_model(&saved, frozen_heads(1), Device::Cpu, Kind::Float)
        .err()
        .map(|error| error.to_string())
        .unwrap_or_default();
    assert!(
        error.contains("markov_head.markov_w1.weight") && error.contains("[64, 8]"),
        "{error}"
    );
    // The config says vanilla, the file holds the rnn head's joint_proj.
    let mut vanilla = config.clone();
    vanilla["markov_head_type"] = serde_json::json!("vanilla");
    std::fs::write(saved.join("config.json"), serde_json::to_vec(&vanilla)?)?;
    let error = load_draft_model(&saved, frozen_heads(1), Device::Cpu, Kind::Float)
        .err()
        .map(|error| error.to_string())
        .unwrap_or_default();
    assert!(
        error.contains("unexpected tensor") && error.contains("joint_proj"),
        "{error}"
    );

    // A DFlash checkpoint read as DSpark: the heads are missing, by name.
    let dflash = DraftModel::new(
        tiny_draft_config(0.05),
        frozen_heads(1),
        Device::Cpu,
        Kind::Float,
        3,
    )?;
    let dflash_dir = directory.path().join("dflash");
    save_draft_checkpoint(&dflash_dir, &dflash, None)?;
    std::fs::write(dflash_dir.join("config.json"), serde_json::to_vec(&config)?)?;
    let error = load_draft_model(&dflash_dir, frozen_heads(1), Device::Cpu, Kind::Float)
        .err()
        .map(|error| error.to_string())
        .unwrap_or_default();
    assert!(error.contains("missing tensor \"markov_head."), "{error}");
    Ok(())
}

#[test]
fn training_a_dspark_drafter_lowers_its_loss_and_reports_its_metrics() -> anyhow::Result<()> {
    for head_type in [
        MarkovHeadType::Vanilla,
        MarkovHeadType::Gated,
        MarkovHeadType::Rnn,
    ] {
        let model = DraftModel::new(
            dspark_config(head_type)?,
            frozen_heads(1),
            Device::Cpu,
            Kind::Float,
            5,
        )?;
        let mut settings = TrainerSettings::recipe_defaults(4, 40);
        settings.num_anchors = 8;
        settings.schedule.peak_learning_rate = 1e-2;
        let mut trainer = DraftTrainer::new(model, settings);
        let data: Vec<TrainingSequence> = (0..4).map(|seed| sequence(seed, 24)).collect();
        let copy = |sequence: &TrainingSequence| TrainingSequence {
            input_ids: sequence.input_ids.clone(),
            loss_mask: sequence.loss_mask.clone(),
            target_hidden: sequence.target_hidden.copy(),
            target_last_hidden: sequence.target_last_hidden.as_ref().map(Tensor::copy),
        };
        let mut reports = Vec::new();
        for _ in 0..40 {
            trainer.accumulate(&data.iter().map(copy).collect::<Vec<_>>())?;
            reports.push(trainer.step()?);
        }
        let first = &reports[0];
        let last = &reports[39];
        let first_dspark = first
            .dspark
            .clone()
            .ok_or_else(|| anyhow::anyhow!("no DSpark report"))?;
        let last_dspark = last
            .dspark
            .clone()
            .ok_or_else(|| anyhow::anyhow!("no DSpark report"))?;
        assert!(
            last.loss < 0.5 * first.loss,
            "{head_type:?}: loss {} -> {}",
            first.loss,
            last.loss
        );
        assert!(
            last_dspark.accept_rate > first_dspark.accept_rate,
            "{head_type:?}: acceptance {} -> {}",
            first_dspark.accept_rate,
            last_dspark.accept_rate
        );
        assert!(last_dspark.accept_length > 1.0 && last_dspark.accept_length <= 5.0);
        assert!(last_dspark.greedy_accept_length >= 1.0 && last_dspark.greedy_accept_length <= 5.0);
        assert!(last_dspark.confidence_loss.is_some_and(f64::is_finite));
        assert_eq!(
            last.accuracy_per_position.len(),
            4,
            "DSpark reports slots 0..B−1"
        );
    }
    Ok(())
}

#[test]
fn two_micro_batches_step_like_one_batch_of_both() -> anyhow::Result<()> {
    let config = dspark_config(MarkovHeadType::Gated)?;
    let new_trainer = || -> anyhow::Result<DraftTrainer> {
        let model = DraftModel::new(config.clone(), frozen_heads(1), Device::Cpu, Kind::Float, 9)?;
        let mut settings = TrainerSettings::recipe_defaults(4, 10);
        settings.num_anchors = 64;
        Ok(DraftTrainer::new(model, settings))
    };
    let mut whole = new_trainer()?;
    let mut split = new_trainer()?;
    whole.accumulate(&[sequence(1, 20), sequence(2, 16)])?;
    split.accumulate(&[sequence(1, 20)])?;
    split.accumulate(&[sequence(2, 16)])?;
    let whole_report = whole.step()?;
    let split_report = split.step()?;
    assert!((whole_report.loss - split_report.loss).abs() < 1e-5 * whole_report.loss);
    assert!(
        (whole_report.grad_norm - split_report.grad_norm).abs() < 1e-5 * whole_report.grad_norm
    );
    let whole_dspark = whole_report
        .dspark
        .ok_or_else(|| anyhow::anyhow!("no report"))?;
    let split_dspark = split_report
        .dspark
        .ok_or_else(|| anyhow::anyhow!("no report"))?;
    assert!((whole_dspark.accept_length - split_dspark.accept_length).abs() < 1e-6);
    Ok(())
}

#[test]
fn a_batch_without_the_last_hidden_state_is_refused_and_bf16_states_train() -> anyhow::Result<()> {
    let model = DraftModel::new(
        dspark_config(MarkovHeadType::Vanilla)?,
        frozen_heads(1),
        Device::Cpu,
        Kind::Float,
        3,
    )?;
    let mut without = sequence(1, 12);
    without.target_last_hidden = None;
    let batch = pack_batch(&[without], &[vec![2, 5]])?;
    let error = compute_objective(&model, &batch, 4.0)
        .err()
        .map(|error| error.to_string())
        .unwrap_or_default();
    assert!(error.contains("last hidden state"), "{error}");
    // The wire's bf16 states (tapped and last) train like f32 ones, within
    // bf16's rounding.
    let f32_sequence = sequence(1, 12);
    let bf16_sequence = TrainingSequence {
        input_ids: f32_sequence.input_ids.clone(),
        loss_mask: f32_sequence.loss_mask.clone(),
        target_hidden: f32_sequence.target_hidden.to_kind(Kind::BFloat16),
        target_last_hidden: f32_sequence
            .target_last_hidden
            .as_ref()
            .map(|last| last.to_kind(Kind::BFloat16)),
    };
    let f32_loss = tch::no_grad(|| {
        compute_objective(&model, &pack_batch(&[f32_sequence], &[vec![2, 5]])?, 4.0)
    })?
    .loss
    .double_value(&[]);
    let bf16_loss = tch::no_grad(|| {
        compute_objective(&model, &pack_batch(&[bf16_sequence], &[vec![2, 5]])?, 4.0)
    })?
    .loss
    .double_value(&[]);
    assert!(
        (f32_loss - bf16_loss).abs() < 0.05 * f32_loss,
        "{f32_loss} vs {bf16_loss}"
    );
    let mut short = sequence(1, 12);
    short.target_last_hidden = Some(Tensor::zeros([11, HIDDEN], (Kind::Float, Device::Cpu)));
    let error = pack_batch(&[short], &[vec![2]])
        .err()
        .map(|error| error.to_string())
        .unwrap_or_default();
    assert!(error.contains("[11, 32]"), "{error}");
    Ok(())
}
