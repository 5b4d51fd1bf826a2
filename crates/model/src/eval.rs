//! Evaluation of a drafter by real speculative decoding against its
//! target, as the reference `dflash_generate` does: the drafter proposes a
//! block from the target's hidden states (a DFlash2 drafter through its
//! candidate selector, as the reference's `propose`), the target verifies
//! the whole block in one forward, the accepted prefix plus the target's
//! own next token (the bonus) is kept, and the accepted length (bonus
//! included) per verification is recorded; τ is its mean. Decoding is
//! greedy (the longest prefix equal to the target's argmax) or sampled
//! (temperature and top-p, speculative rejection sampling), see
//! `decoding`.
//!
//! The target runs with its KV cache: the prompt is prefilled once, each
//! verification runs only the block's positions, and the rejected part of
//! the block is cut from the cache. The same forward captures the hidden
//! states the drafter reads. The drafter keeps its own cache of the context
//! (`DraftContextCache`: each draft layer's keys and values of every
//! committed token), extended by the committed positions after each
//! verification, so each block's draft runs only the block's queries. Both
//! the target's and the drafter's cost are proportional to the tokens
//! generated. The uncached original ([`speculative_generate_uncached`],
//! recomputing the whole sequence for every verification and the drafter's
//! whole context for every block) is kept as the reference the cached path
//! must reproduce token for token, and as the benchmark's baseline.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use crate::draft::{
    draft_model_from_tensors, load_draft_model, BlockInputs, DraftConfig, DraftContextCache,
    DraftError, DraftModel, FrozenTargetHeads,
};
use crate::sampling::SamplingOptions;
use crate::target_model::{KeyValueCache, ModelError, TargetModel};
use tch::{Device, Kind, Tensor};

mod decoding;

use decoding::{Decoding, Proposal};

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
    #[error("sampling: {0}")]
    Sampling(ModelError),
}

/// Evaluation settings beyond the data.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalOptions {
    pub max_new_tokens: usize,
    /// Generation stops after any of these tokens (e.g. the EOS token).
    pub stop_token_ids: Vec<i64>,
    pub device: Device,
    /// Greedy ([`SamplingOptions::greedy`], what τ is usually quoted
    /// for) or sampled decoding; prompt `i` draws from its own generator,
    /// seeded from `seed` and `i`.
    pub sampling: SamplingOptions,
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
    /// Target forwards run: one prefill per prompt plus one per verification.
    pub target_forwards: usize,
    /// Each prompt followed by its generated tokens.
    pub outputs: Vec<Vec<i64>>,
}

/// One prompt's speculative generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationTrace {
    /// Prompt plus generated tokens.
    pub token_ids: Vec<i64>,
    pub acceptance_lengths: Vec<usize>,
    /// Target forwards run (prefill and verifications).
    pub target_forwards: usize,
    /// Context positions the drafter projected into its layers' keys and
    /// values: each committed position once with the cache, the whole
    /// context again for every block without it.
    pub draft_context_positions: usize,
}

impl GenerationTrace {
    /// Nothing generated: the prompt alone, no target forward.
    fn prompt_only(prompt: &[i64]) -> Self {
        GenerationTrace {
            token_ids: prompt.to_vec(),
            acceptance_lengths: Vec::new(),
            target_forwards: 0,
            draft_context_positions: 0,
        }
    }
}

impl EvalReport {
    /// Generated tokens per target forward (prefills included): what the
    /// target's work buys, the speed-up bound of speculative decoding.
    pub fn tokens_per_target_forward(&self) -> f64 {
        if self.target_forwards == 0 {
            0.0
        } else {
            self.generated_tokens as f64 / self.target_forwards as f64
        }
    }
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
        stop_token_ids: crate::tokens::eos_token_ids(target_dir),
        device,
        sampling: SamplingOptions::greedy(),
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
/// online evaluator's center as read over the network; `origin` names it
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
        outputs: Vec::with_capacity(prompts.len()),
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
        )?;
        report.generated_tokens += trace.token_ids.len() - prompt.len();
        report.target_forwards += trace.target_forwards;
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

/// The target's logits `[positions, vocab]` after every position of `token_ids`.
fn target_logits(target: &TargetModel, token_ids: &[i64]) -> Result<Tensor, EvalError> {
    let (ids, mask) = ids_tensor(token_ids, target.device());
    Ok(target.logits(&ids, &mask)?.get(0))
}

/// Plain greedy decoding with the target alone (the output speculative
/// decoding must reproduce exactly): the prompt followed by its
/// continuation. Uncached, one prompt at a time (the reference); batched
/// cached decoding is `crate::generate`.
pub fn greedy_generate(
    target: &TargetModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
) -> Result<Vec<i64>, EvalError> {
    let continuation =
        crate::generate::greedy_generate_uncached(target, prompt, max_new_tokens, stop_token_ids)?;
    Ok([prompt, continuation.as_slice()].concat())
}

/// Speculative decoding of one prompt (greedy verification) without any
/// cache: every verification recomputes the target over the whole sequence
/// so far, and once more for the drafter's context. The reference
/// [`speculative_generate`] must reproduce.
pub fn speculative_generate_uncached(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
) -> Result<GenerationTrace, EvalError> {
    generate_uncached(
        target,
        drafter,
        prompt,
        max_new_tokens,
        stop_token_ids,
        &mut Decoding::Greedy,
    )
}

/// [`speculative_generate_uncached`] with greedy or sampled `decoding`.
fn generate_uncached(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
    decoding: &mut Decoding,
) -> Result<GenerationTrace, EvalError> {
    let _no_grad = tch::no_grad_guard();
    let device = target.device();
    let config = drafter.config();
    let layer_ids = target_layer_ids(config);
    let max_length = prompt.len() + max_new_tokens;
    if max_new_tokens == 0 {
        return Ok(GenerationTrace::prompt_only(prompt));
    }
    let mut acceptance_lengths = Vec::new();
    let mut draft_context_positions = 0;
    // Prefill: the first new token comes from the target alone.
    let mut token_ids = prompt.to_vec();
    let logits = target_logits(target, &token_ids)?;
    token_ids.push(decoding.next_token(&logits.get(prompt.len() as i64 - 1))?);
    // `start` is the position of the newest token, the next block's anchor;
    // the drafter sees the target's hidden states strictly before it.
    let mut start = prompt.len();
    let mut stopped = stop_token_ids.contains(&token_ids[start]);
    while start + 1 < max_length && !stopped {
        let mut block = masked_block(config, token_ids[start], max_length - start);
        let verify_size = block.len();
        let mut proposal = Proposal::empty();
        if verify_size > 1 {
            let (context_ids, context_mask) = ids_tensor(&token_ids[..start], device);
            let context_hidden =
                target.capture_hidden_states(&context_ids, &context_mask, &layer_ids)?;
            let draft_hidden = draft_block(drafter, &context_hidden, &block, start)?;
            proposal = decoding.propose(drafter, &draft_hidden, block[0])?;
            draft_context_positions += start;
            block[1..].copy_from_slice(&proposal.tokens);
        }
        // Verify: the target's logits after each block position.
        let mut candidate = token_ids[..start].to_vec();
        candidate.extend_from_slice(&block);
        let logits = target_logits(target, &candidate)?.narrow(0, start as i64, verify_size as i64);
        let (accepted, bonus) = decoding.verify(&proposal, &logits)?;
        let (produced, stop_token_seen) = commit_block(
            &mut token_ids,
            &block,
            accepted,
            bonus,
            start,
            max_length,
            stop_token_ids,
        );
        stopped = stop_token_seen;
        start += produced;
        token_ids.truncate(start + 1);
        acceptance_lengths.push(produced);
    }
    token_ids.truncate((start + 1).min(max_length));
    let target_forwards = 1 + acceptance_lengths.len();
    Ok(GenerationTrace {
        token_ids,
        acceptance_lengths,
        target_forwards,
        draft_context_positions,
    })
}

/// The target layers the drafter reads, as indices.
fn target_layer_ids(config: &DraftConfig) -> Vec<usize> {
    config
        .target_layer_ids
        .iter()
        .map(|&layer| layer as usize)
        .collect()
}

/// The next block: `anchor_token`, then mask tokens, `block_size` long or
/// shorter when fewer than that many positions are `left`.
fn masked_block(config: &DraftConfig, anchor_token: i64, left: usize) -> Vec<i64> {
    let mut block = vec![config.mask_token_id; (config.block_size as usize).min(left)];
    block[0] = anchor_token;
    block
}

/// Commits a verified block after position `start`: the `accepted`
/// proposals, then the target's own next token `bonus`, cut at
/// `max_length` and after the first stop token. Returns the tokens
/// produced after `start` and whether a stop token ended the sequence;
/// `token_ids` keeps the bonus token beyond them, which the caller drops.
fn commit_block(
    token_ids: &mut Vec<i64>,
    block: &[i64],
    accepted: usize,
    bonus: i64,
    start: usize,
    max_length: usize,
    stop_token_ids: &[i64],
) -> (usize, bool) {
    token_ids.truncate(start + 1);
    token_ids.extend_from_slice(&block[1..=accepted]);
    token_ids.push(bonus);
    let produced = (accepted + 1).min(max_length - start - 1);
    match token_ids[start + 1..start + 1 + produced]
        .iter()
        .position(|token| stop_token_ids.contains(token))
    {
        Some(offset) => (offset + 1, true),
        None => (produced, false),
    }
}

/// The draft hidden states `[block − 1, hidden]` of the positions after
/// the anchor of the block anchored at `anchor` (its first token
/// `block[0]`, masks after it), from the target states of every position
/// before the anchor, all projected anew (the reference).
fn draft_block(
    drafter: &DraftModel,
    context_hidden: &Tensor,
    block: &[i64],
    anchor: usize,
) -> Result<Tensor, EvalError> {
    let device = context_hidden.device();
    let block_tensor = Tensor::from_slice(block)
        .view([1, 1, block.len() as i64])
        .to_device(device);
    let anchor = Tensor::from_slice(&[anchor as i64])
        .view([1, 1])
        .to_device(device);
    let draft_hidden = drafter.forward_blocks(&BlockInputs {
        target_hidden: context_hidden,
        block_token_ids: &block_tensor,
        anchor_positions: &anchor,
    })?;
    Ok(draft_hidden
        .get(0)
        .get(0)
        .narrow(0, 1, block.len() as i64 - 1))
}

/// The draft hidden states `[block − 1, hidden]` of the positions after
/// the anchor of the block whose first token is `block[0]` (masks after
/// it), anchored right after the cached context.
fn draft_block_cached(
    drafter: &DraftModel,
    context: &DraftContextCache,
    block: &[i64],
) -> Result<Tensor, EvalError> {
    let block_tensor = Tensor::from_slice(block)
        .view([1, block.len() as i64])
        .to_device(drafter.device());
    let draft_hidden = drafter.forward_block_cached(context, &block_tensor)?;
    Ok(draft_hidden.get(0).narrow(0, 1, block.len() as i64 - 1))
}

/// Speculative decoding of one prompt (greedy verification) with the
/// target's KV cache and the drafter's context cache: one prefill, then per
/// verification one draft of the block's queries over the cached context and
/// one cached target forward of the block, whose captured states of the
/// committed positions extend the drafter's context.
pub fn speculative_generate(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
) -> Result<GenerationTrace, EvalError> {
    generate_cached(
        target,
        drafter,
        prompt,
        max_new_tokens,
        stop_token_ids,
        &mut Decoding::Greedy,
    )
}

/// [`speculative_generate`] sampled at `sampling` (greedy when its
/// temperature is 0), drawing from the generator of sequence
/// `sequence_id`, as [`evaluate`] does for its prompt of that index.
pub fn speculative_generate_sampled(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
    sampling: &SamplingOptions,
    sequence_id: u64,
) -> Result<GenerationTrace, EvalError> {
    sampling.validate().map_err(EvalError::Sampling)?;
    generate_cached(
        target,
        drafter,
        prompt,
        max_new_tokens,
        stop_token_ids,
        &mut Decoding::new(sampling, sequence_id),
    )
}

/// [`speculative_generate`] with greedy or sampled `decoding`.
fn generate_cached(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
    decoding: &mut Decoding,
) -> Result<GenerationTrace, EvalError> {
    let _no_grad = tch::no_grad_guard();
    let device = target.device();
    let config = drafter.config();
    let layer_ids = target_layer_ids(config);
    let max_length = prompt.len() + max_new_tokens;
    if max_new_tokens == 0 {
        return Ok(GenerationTrace::prompt_only(prompt));
    }
    let mut acceptance_lengths = Vec::new();
    let mut token_ids = prompt.to_vec();
    let capacity = (max_length + config.block_size as usize) as i64;
    let (mut cache, mut draft_context, first) =
        prefill(target, drafter, prompt, capacity, &layer_ids, decoding)?;
    let mut target_forwards = 1;
    token_ids.push(first);
    // `start` is the position of the newest token, the next block's anchor;
    // it is not in the cache yet.
    let mut start = prompt.len();
    let mut stopped = stop_token_ids.contains(&first);
    while start + 1 < max_length && !stopped {
        let mut block = masked_block(config, token_ids[start], max_length - start);
        let verify_size = block.len();
        let mut proposal = Proposal::empty();
        if verify_size > 1 {
            // The block is anchored right after the drafter's context.
            debug_assert_eq!(draft_context.len(), start as i64);
            let draft_hidden = draft_block_cached(drafter, &draft_context, &block)?;
            proposal = decoding.propose(drafter, &draft_hidden, block[0])?;
            block[1..].copy_from_slice(&proposal.tokens);
        }
        // Verify: the target's logits after each block position.
        let (block_ids, block_mask) = ids_tensor(&block, device);
        let verified = target.forward_cached(&block_ids, &block_mask, &mut cache, &layer_ids)?;
        target_forwards += 1;
        let logits = target.lm_head_logits(&verified.hidden.get(0));
        let (accepted, bonus) = decoding.verify(&proposal, &logits)?;
        let (produced, stop_token_seen) = commit_block(
            &mut token_ids,
            &block,
            accepted,
            bonus,
            start,
            max_length,
            stop_token_ids,
        );
        stopped = stop_token_seen;
        // Keep the committed block tokens (positions start..start+produced)
        // in the cache and the drafter's context; drop the rejected rest.
        cache.truncate((start + produced) as i64)?;
        if let Some(captured) = &verified.captured {
            drafter.extend_context(&mut draft_context, &captured.narrow(1, 0, produced as i64))?;
        }
        start += produced;
        token_ids.truncate(start + 1);
        acceptance_lengths.push(produced);
    }
    token_ids.truncate((start + 1).min(max_length));
    Ok(GenerationTrace {
        token_ids,
        acceptance_lengths,
        target_forwards,
        draft_context_positions: draft_context.len() as usize,
    })
}

/// The prefill of [`speculative_generate`]: the target's KV cache over the
/// prompt, the drafter's context (the target states of every prompt token,
/// projected once into each draft layer's keys and values) and the first
/// new token, which comes from the target alone.
fn prefill(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    capacity: i64,
    layer_ids: &[usize],
    decoding: &mut Decoding,
) -> Result<(KeyValueCache, DraftContextCache, i64), EvalError> {
    let mut cache = target.new_cache(1, capacity);
    let (ids, mask) = ids_tensor(prompt, target.device());
    let prefill = target.forward_cached(&ids, &mask, &mut cache, layer_ids)?;
    let prompt_hidden = prefill.captured.ok_or_else(|| {
        EvalError::Target(ModelError::InvalidInput(
            "the drafter names no target layers".into(),
        ))
    })?;
    let mut draft_context = drafter.new_context_cache(1, capacity);
    drafter.extend_context(&mut draft_context, &prompt_hidden)?;
    let first = decoding
        .next_token(&target.lm_head_logits(&prefill.hidden.get(0).get(prompt.len() as i64 - 1)))?;
    Ok((cache, draft_context, first))
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
