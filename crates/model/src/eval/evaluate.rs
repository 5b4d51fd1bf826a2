//! The entry points: a drafter checkpoint (or tensors) against its target
//! on a set of prompts, and the untrained baseline.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use crate::draft::{
    draft_model_from_tensors, load_draft_model, DraftConfig, DraftModel, FrozenTargetHeads,
};
use crate::sampling::SamplingOptions;
use crate::target_model::TargetModel;
use tch::{Device, Kind, Tensor};

use super::decoding::Decoding;

use super::error::EvalError;
use super::generation::generate_cached;
use super::report::{EvalOptions, EvalReport};

/// Loads the target and the drafter checkpoint and runs speculative decoding
/// on every prompt, stopping at the target's `eos_token_id` (from its
/// `generation_config.json` or `config.json`) when it declares one.
pub fn evaluate(
    target_dir: &Path,
    drafter_checkpoint_dir: &Path,
    prompts: &[Vec<i64>],
    max_new_tokens: usize,
    device: Device,
) -> Result<EvalReport, EvalError> {
    let options = EvalOptions {
        max_new_tokens,
        stop_token_ids: crate::tokens::eos_token_ids(target_dir),
        device,
        sampling: SamplingOptions::greedy(),
        confidence_threshold: None,
    };
    evaluate_with_options(target_dir, drafter_checkpoint_dir, prompts, &options)
}

/// [`evaluate`] with explicit options.
pub fn evaluate_with_options(
    target_dir: &Path,
    drafter_checkpoint_dir: &Path,
    prompts: &[Vec<i64>],
    options: &EvalOptions,
) -> Result<EvalReport, EvalError> {
    let target = load_target(target_dir, options.device)?;
    evaluate_loaded(&target, drafter_checkpoint_dir, prompts, options)
}

/// The element type evaluation runs in on `device`: f32 on the CPU, bf16
/// on a GPU.
fn compute_kind(device: Device) -> Kind {
    if device == Device::Cpu {
        Kind::Float
    } else {
        Kind::BFloat16
    }
}

/// The target as [`evaluate`] loads it, for callers that evaluate many
/// drafters against one target ([`evaluate_loaded`], [`evaluate_tensors`]:
/// the online evaluator).
pub fn load_target(target_dir: &Path, device: Device) -> Result<TargetModel, EvalError> {
    Ok(TargetModel::load(target_dir, device, compute_kind(device))?)
}

/// [`evaluate_with_options`] against a target already loaded with
/// [`load_target`] on `options.device`: the same τ, without loading the
/// target again.
pub fn evaluate_loaded(
    target: &TargetModel,
    drafter_checkpoint_dir: &Path,
    prompts: &[Vec<i64>],
    options: &EvalOptions,
) -> Result<EvalReport, EvalError> {
    let drafter = load_draft_model(
        drafter_checkpoint_dir,
        frozen_heads(target),
        options.device,
        compute_kind(options.device),
    )?;
    evaluate_drafter(target, &drafter, prompts, options)
}

/// [`evaluate_loaded`] of a drafter whose parameters are in memory (the
/// online evaluator's model as read over the network; `origin` names it
/// in errors): the same τ as of the checkpoint those tensors would make,
/// without writing it.
pub fn evaluate_tensors(
    target: &TargetModel,
    config: DraftConfig,
    tensors: HashMap<String, Tensor>,
    origin: &str,
    prompts: &[Vec<i64>],
    options: &EvalOptions,
) -> Result<EvalReport, EvalError> {
    let drafter = draft_model_from_tensors(
        config,
        tensors,
        origin,
        frozen_heads(target),
        options.device,
        compute_kind(options.device),
    )?;
    evaluate_drafter(target, &drafter, prompts, options)
}

/// The target's embedding and LM head, which the drafter shares.
fn frozen_heads(target: &TargetModel) -> FrozenTargetHeads {
    FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    }
}

/// Speculative decoding of every prompt with `drafter` against `target`.
fn evaluate_drafter(
    target: &TargetModel,
    drafter: &DraftModel,
    prompts: &[Vec<i64>],
    options: &EvalOptions,
) -> Result<EvalReport, EvalError> {
    if drafter.config().vocab_size != target.config().vocab_size {
        return Err(EvalError::VocabularyMismatch {
            drafter: drafter.config().vocab_size,
            target: target.config().vocab_size,
        });
    }
    options.sampling.validate().map_err(EvalError::Sampling)?;
    super::generation::validate_confidence_threshold(options.confidence_threshold)?;
    let started = Instant::now();
    let mut report = EvalReport {
        mean_acceptance_length: 0.0,
        acceptance_lengths: Vec::new(),
        prompts: prompts.len(),
        generated_tokens: 0,
        verification_steps: 0,
        block_size: drafter.config().block_size,
        seconds: 0.0,
        target_forwards: 0,
        proposed_tokens: 0,
        outputs: Vec::with_capacity(prompts.len()),
        proposals: Vec::with_capacity(prompts.len()),
    };
    for (index, prompt) in prompts.iter().enumerate() {
        if prompt.is_empty() {
            return Err(EvalError::EmptyPrompt { index });
        }
        let trace = generate_cached(
            target,
            drafter,
            prompt,
            options.max_new_tokens,
            &options.stop_token_ids,
            &mut Decoding::new(&options.sampling, index as u64),
            options.confidence_threshold,
        )?;
        report.proposed_tokens += trace.proposed_tokens.iter().map(Vec::len).sum::<usize>();
        report.generated_tokens += trace.token_ids.len() - prompt.len();
        report.target_forwards += trace.target_forwards;
        report.acceptance_lengths.extend(&trace.acceptance_lengths);
        report.outputs.push(trace.token_ids);
        report.proposals.push(trace.proposed_tokens);
    }
    report.verification_steps = report.acceptance_lengths.len();
    report.mean_acceptance_length = if report.verification_steps == 0 {
        0.0
    } else {
        report.acceptance_lengths.iter().sum::<usize>() as f64 / report.verification_steps as f64
    };
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Writes a freshly initialised drafter with the configuration of
/// `trained_checkpoint` (same layers, block size, mask token, target layers)
/// to `baseline_dir`: the untrained baseline whose τ shows what training
/// bought.
pub fn write_untrained_baseline(
    target_dir: &Path,
    trained_checkpoint: &Path,
    baseline_dir: &Path,
) -> Result<std::path::PathBuf, EvalError> {
    use crate::draft::checkpoint::load_draft_config;
    use crate::draft::save_draft_checkpoint;
    let config = load_draft_config(trained_checkpoint)?;
    let (_, frozen) = FrozenTargetHeads::load(target_dir, Device::Cpu, Kind::Float)?;
    let model = DraftModel::new(config, frozen, Device::Cpu, Kind::Float, 0)?;
    save_draft_checkpoint(baseline_dir, &model, None)?;
    Ok(baseline_dir.to_path_buf())
}
