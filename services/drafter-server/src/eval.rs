//! Evaluation of a drafter by real speculative decoding against its
//! target, as the reference `dflash_generate` does with greedy decoding:
//! the drafter proposes a block from the target's hidden states, the target
//! verifies the whole block in one forward, the longest agreeing prefix plus
//! the target's own next token (the bonus) is kept, and the accepted
//! length (bonus included) per verification is recorded; τ is its mean.
//!
//! No KV cache: each verification recomputes the target over the whole
//! sequence so far (and a second time for the tapped hidden states). That is
//! exact, and fast enough for the tiny models tests use, but quadratic in
//! length: it measures τ, not speed.

use std::path::Path;
use std::time::Instant;

use dflash_model::draft::{
    load_draft_model, BlockInputs, DraftError, DraftModel, FrozenTargetHeads,
};
use dflash_model::target::{ModelError, TargetModel};
use tch::{Device, Kind, Tensor};

/// Errors of evaluation, naming the file or input at fault.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("target model: {0}")]
    Target(#[from] ModelError),
    #[error("drafter checkpoint: {0}")]
    Drafter(#[from] DraftError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("prompt {index} is empty")]
    EmptyPrompt { index: usize },
    #[error("the drafter's vocabulary ({drafter}) differs from the target's ({target})")]
    VocabularyMismatch { drafter: i64, target: i64 },
}

/// Evaluation settings beyond the data.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalOptions {
    pub max_new_tokens: usize,
    /// Generation stops after any of these tokens (e.g. the EOS token).
    pub stop_token_ids: Vec<i64>,
    pub device: Device,
}

/// What speculative decoding achieved over a prompt set.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// τ: mean tokens accepted per target verification, bonus token included.
    pub mean_acceptance_length: f64,
    /// Every verification's accepted length, all prompts in order.
    pub acceptance_lengths: Vec<usize>,
    pub prompts: usize,
    pub generated_tokens: usize,
    pub verification_steps: usize,
    pub block_size: i64,
    pub seconds: f64,
    /// Each prompt followed by its generated tokens.
    pub outputs: Vec<Vec<i64>>,
}

/// One prompt's speculative generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationTrace {
    /// Prompt plus generated tokens.
    pub token_ids: Vec<i64>,
    pub acceptance_lengths: Vec<usize>,
}

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
        stop_token_ids: eos_token_ids(target_dir),
        device,
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
    let kind = if options.device == Device::Cpu {
        Kind::Float
    } else {
        Kind::BFloat16
    };
    let target = TargetModel::load(target_dir, options.device, kind)?;
    let frozen = FrozenTargetHeads {
        embed_tokens: target.embed_tokens_weight().shallow_clone(),
        lm_head: target.lm_head_weight().shallow_clone(),
    };
    let drafter = load_draft_model(drafter_checkpoint_dir, frozen, options.device, kind)?;
    if drafter.config().vocab_size != target.config().vocab_size {
        return Err(EvalError::VocabularyMismatch {
            drafter: drafter.config().vocab_size,
            target: target.config().vocab_size,
        });
    }
    let started = Instant::now();
    let mut report = EvalReport {
        mean_acceptance_length: 0.0,
        acceptance_lengths: Vec::new(),
        prompts: prompts.len(),
        generated_tokens: 0,
        verification_steps: 0,
        block_size: drafter.config().block_size,
        seconds: 0.0,
        outputs: Vec::with_capacity(prompts.len()),
    };
    for (index, prompt) in prompts.iter().enumerate() {
        if prompt.is_empty() {
            return Err(EvalError::EmptyPrompt { index });
        }
        let trace = speculative_generate(
            &target,
            &drafter,
            prompt,
            options.max_new_tokens,
            &options.stop_token_ids,
        )?;
        report.generated_tokens += trace.token_ids.len() - prompt.len();
        report.acceptance_lengths.extend(&trace.acceptance_lengths);
        report.outputs.push(trace.token_ids);
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

fn ids_tensor(token_ids: &[i64], device: Device) -> (Tensor, Tensor) {
    let ids = Tensor::from_slice(token_ids)
        .view([1, -1])
        .to_device(device);
    let mask = ids.ones_like();
    (ids, mask)
}

/// Greedy next-token predictions of the target at every position of `token_ids`.
fn target_argmax(target: &TargetModel, token_ids: &[i64]) -> Result<Vec<i64>, EvalError> {
    let (ids, mask) = ids_tensor(token_ids, target.device());
    let logits = target.logits(&ids, &mask)?;
    Ok(Vec::<i64>::try_from(
        &logits.get(0).argmax(-1, false).to_device(Device::Cpu),
    )?)
}

/// Plain greedy decoding with the target alone (the output speculative
/// decoding must reproduce exactly).
pub fn greedy_generate(
    target: &TargetModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
) -> Result<Vec<i64>, EvalError> {
    let mut token_ids = prompt.to_vec();
    for _ in 0..max_new_tokens {
        let predictions = target_argmax(target, &token_ids)?;
        let next = predictions[predictions.len() - 1];
        token_ids.push(next);
        if stop_token_ids.contains(&next) {
            break;
        }
    }
    Ok(token_ids)
}

/// Speculative decoding of one prompt (greedy verification).
pub fn speculative_generate(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
) -> Result<GenerationTrace, EvalError> {
    let _no_grad = tch::no_grad_guard();
    let device = target.device();
    let config = drafter.config();
    let layer_ids: Vec<usize> = config
        .target_layer_ids
        .iter()
        .map(|&layer| layer as usize)
        .collect();
    let max_length = prompt.len() + max_new_tokens;
    let mut acceptance_lengths = Vec::new();
    // Prefill: the first new token comes from the target alone.
    let mut token_ids = prompt.to_vec();
    if max_new_tokens == 0 {
        return Ok(GenerationTrace {
            token_ids,
            acceptance_lengths,
        });
    }
    let predictions = target_argmax(target, &token_ids)?;
    token_ids.push(predictions[predictions.len() - 1]);
    // `start` is the position of the newest token, the next block's anchor;
    // the drafter sees the target's hidden states strictly before it.
    let mut start = prompt.len();
    let mut stopped = stop_token_ids.contains(&token_ids[start]);
    while start + 1 < max_length && !stopped {
        let verify_size = (config.block_size as usize).min(max_length - start);
        let mut block = vec![config.mask_token_id; verify_size];
        block[0] = token_ids[start];
        if verify_size > 1 {
            let (context_ids, context_mask) = ids_tensor(&token_ids[..start], device);
            let context_hidden =
                target.capture_hidden_states(&context_ids, &context_mask, &layer_ids)?;
            let block_tensor = Tensor::from_slice(&block)
                .view([1, 1, verify_size as i64])
                .to_device(device);
            let anchor = Tensor::from_slice(&[start as i64])
                .view([1, 1])
                .to_device(device);
            let draft_hidden = drafter.forward_blocks(&BlockInputs {
                target_hidden: &context_hidden,
                block_token_ids: &block_tensor,
                anchor_positions: &anchor,
            })?;
            let proposals = drafter
                .logits(
                    &draft_hidden
                        .get(0)
                        .get(0)
                        .narrow(0, 1, verify_size as i64 - 1),
                )
                .argmax(-1, false)
                .to_device(Device::Cpu);
            let proposals = Vec::<i64>::try_from(&proposals)?;
            block[1..].copy_from_slice(&proposals);
        }
        // Verify: the target's greedy choice after each block position.
        let mut candidate = token_ids[..start].to_vec();
        candidate.extend_from_slice(&block);
        let predictions = target_argmax(target, &candidate)?;
        let posterior = &predictions[start..start + verify_size];
        let accepted = block[1..]
            .iter()
            .zip(posterior)
            .take_while(|(proposed, verified)| proposed == verified)
            .count();
        let bonus = posterior[accepted];
        token_ids.truncate(start + 1);
        token_ids.extend_from_slice(&block[1..=accepted]);
        token_ids.push(bonus);
        let mut produced = (accepted + 1).min(max_length - start - 1);
        if let Some(offset) = token_ids[start + 1..start + 1 + produced]
            .iter()
            .position(|token| stop_token_ids.contains(token))
        {
            produced = offset + 1;
            stopped = true;
        }
        start += produced;
        token_ids.truncate(start + 1);
        acceptance_lengths.push(produced);
    }
    token_ids.truncate((start + 1).min(max_length));
    Ok(GenerationTrace {
        token_ids,
        acceptance_lengths,
    })
}

/// `eos_token_id` (a number or a list) from `generation_config.json`, else
/// `config.json`; empty when neither declares one.
fn eos_token_ids(target_dir: &Path) -> Vec<i64> {
    for file in ["generation_config.json", "config.json"] {
        let Ok(text) = std::fs::read_to_string(target_dir.join(file)) else {
            continue;
        };
        let Ok(value) = serde_json::from_str::<serde_json::Value>(&text) else {
            continue;
        };
        match value.get("eos_token_id") {
            Some(serde_json::Value::Number(number)) => {
                return number.as_i64().into_iter().collect()
            }
            Some(serde_json::Value::Array(ids)) => {
                return ids.iter().filter_map(serde_json::Value::as_i64).collect()
            }
            _ => {}
        }
    }
    Vec::new()
}
