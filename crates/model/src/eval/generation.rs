//! Speculative generation, cached and uncached, and the target's own
//! greedy generation: the loops `evaluate` runs per prompt.

use crate::draft::{BlockInputs, DraftConfig, DraftContextCache, DraftModel};
use crate::sampling::SamplingOptions;
use crate::target_model::{KeyValueCache, ModelError, TargetModel};
use tch::{Device, Tensor};

use super::decoding::{Decoding, Proposal};
use super::error::EvalError;
use super::report::GenerationTrace;

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
        None,
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
    confidence_threshold: Option<f64>,
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
    let mut proposed_tokens = Vec::new();
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
        let (draft, max_proposals) =
            draft_block_and_proposals(drafter, token_ids[start], max_length - start);
        let mut proposal = Proposal::empty();
        if max_proposals > 0 {
            let (context_ids, context_mask) = ids_tensor(&token_ids[..start], device);
            let context_hidden =
                target.capture_hidden_states(&context_ids, &context_mask, &layer_ids)?;
            let draft_hidden = draft_block(drafter, &context_hidden, &draft, start)?;
            proposal = decoding.propose(
                drafter,
                &draft_hidden,
                draft[0],
                max_proposals,
                confidence_threshold,
            )?;
            draft_context_positions += start;
        }
        // Verify: the target's logits after the anchor and each proposal.
        let block = [&draft[..1], proposal.tokens.as_slice()].concat();
        let verify_size = block.len();
        proposed_tokens.push(proposal.tokens.clone());
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
        proposed_tokens,
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
    let first = first_drafting_slot(drafter);
    Ok(draft_hidden
        .get(0)
        .get(0)
        .narrow(0, first, block.len() as i64 - first))
}

/// The first block slot that drafts a token: 1 for DFlash and DFlash2 (the
/// anchor slot predicts nothing), 0 for DSpark (`sample_from_anchor`: slot
/// `k` predicts the token after `anchor + k`).
fn first_drafting_slot(drafter: &DraftModel) -> i64 {
    if drafter.is_dspark() {
        0
    } else {
        1
    }
}

/// The block the drafter reads at `start` (`anchor_token`, then masks) and
/// how many tokens it may propose there, `left` positions remaining. DFlash
/// and DFlash2 draft a block cut to what is left (its slots after the
/// anchor propose); DSpark always drafts its whole block (its training
/// shape) and proposes from its first slots, one per position left after
/// the anchor.
fn draft_block_and_proposals(
    drafter: &DraftModel,
    anchor_token: i64,
    left: usize,
) -> (Vec<i64>, usize) {
    let config = drafter.config();
    if drafter.is_dspark() {
        let block = masked_block(config, anchor_token, config.block_size as usize);
        let proposals = (config.block_size as usize).min(left.saturating_sub(1));
        (block, proposals)
    } else {
        let block = masked_block(config, anchor_token, left);
        let proposals = block.len() - 1;
        (block, proposals)
    }
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
    let first = first_drafting_slot(drafter);
    Ok(draft_hidden
        .get(0)
        .narrow(0, first, block.len() as i64 - first))
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
        None,
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
        None,
    )
}

/// [`speculative_generate_sampled`] of a DSpark drafter whose verify length
/// is scheduled by its confidence head: each block's proposals stop where
/// the cumulative product of the predicted acceptance probabilities falls
/// below `confidence_threshold` (at least one is proposed). Other drafters
/// ignore the threshold.
#[allow(clippy::too_many_arguments)]
pub fn speculative_generate_scheduled(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
    sampling: &SamplingOptions,
    sequence_id: u64,
    confidence_threshold: f64,
) -> Result<GenerationTrace, EvalError> {
    sampling.validate().map_err(EvalError::Sampling)?;
    validate_confidence_threshold(Some(confidence_threshold))?;
    generate_cached(
        target,
        drafter,
        prompt,
        max_new_tokens,
        stop_token_ids,
        &mut Decoding::new(sampling, sequence_id),
        Some(confidence_threshold),
    )
}

/// A confidence threshold is a probability: in `[0, 1]`.
pub(super) fn validate_confidence_threshold(threshold: Option<f64>) -> Result<(), EvalError> {
    match threshold {
        Some(value) if !(0.0..=1.0).contains(&value) => {
            Err(EvalError::Sampling(ModelError::InvalidInput(format!(
                "confidence threshold must lie in [0, 1], got {value}"
            ))))
        }
        _ => Ok(()),
    }
}

/// [`speculative_generate`] with greedy or sampled `decoding`, and for a
/// DSpark drafter the confidence-scheduled verify length.
pub(super) fn generate_cached(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
    decoding: &mut Decoding,
    confidence_threshold: Option<f64>,
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
    let mut proposed_tokens = Vec::new();
    let mut token_ids = prompt.to_vec();
    // A DSpark verification holds the anchor and a whole block of proposals.
    let capacity = (max_length + config.block_size as usize + 1) as i64;
    let (mut cache, mut draft_context, first) =
        prefill(target, drafter, prompt, capacity, &layer_ids, decoding)?;
    let mut target_forwards = 1;
    token_ids.push(first);
    // `start` is the position of the newest token, the next block's anchor;
    // it is not in the cache yet.
    let mut start = prompt.len();
    let mut stopped = stop_token_ids.contains(&first);
    while start + 1 < max_length && !stopped {
        let (draft, max_proposals) =
            draft_block_and_proposals(drafter, token_ids[start], max_length - start);
        let mut proposal = Proposal::empty();
        if max_proposals > 0 {
            // The block is anchored right after the drafter's context.
            debug_assert_eq!(draft_context.len(), start as i64);
            let draft_hidden = draft_block_cached(drafter, &draft_context, &draft)?;
            proposal = decoding.propose(
                drafter,
                &draft_hidden,
                draft[0],
                max_proposals,
                confidence_threshold,
            )?;
        }
        // Verify: the target's logits after the anchor and each proposal.
        let block = [&draft[..1], proposal.tokens.as_slice()].concat();
        proposed_tokens.push(proposal.tokens.clone());
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
        proposed_tokens,
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
