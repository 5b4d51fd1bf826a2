//! Batched, KV-cached generation with the target: one prefill of a padded
//! batch of prompts, then one cached forward per new token for the whole
//! batch. Greedy, or temperature / top-p sampling with a seed per sequence
//! (so a sequence's sample does not depend on what it was batched with).
//!
//! [`generate`] splits any number of prompts into batches that fit a token
//! budget (prompt + new tokens, padding included) and reports each finished
//! batch, so callers can show progress and write results as they come.

use crate::sampling::{SamplingOptions, SequenceSampler};
use crate::target_model::{ModelError, TargetModel};
use tch::{Device, Kind, Tensor};

/// Which side of a batch the padding of shorter prompts goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Padding {
    /// Prompts end together; every row's next token is the last column.
    #[default]
    Left,
    /// Prompts start together (the layout of training batches); new tokens
    /// are appended after the padding, which the cache masks.
    Right,
}

/// How to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationOptions {
    /// New tokens per sequence at most.
    pub max_new_tokens: usize,
    /// A sequence ends after any of these tokens (EOS, end of turn); the
    /// stop token is part of its output.
    pub stop_token_ids: Vec<i64>,
    pub sampling: SamplingOptions,
    pub padding: Padding,
    /// Token id written into padded positions (masked, so any valid id).
    pub pad_token_id: i64,
}

impl Default for GenerationOptions {
    fn default() -> Self {
        GenerationOptions {
            max_new_tokens: 64,
            stop_token_ids: Vec::new(),
            sampling: SamplingOptions::greedy(),
            padding: Padding::Left,
            pad_token_id: 0,
        }
    }
}

/// One prompt to continue.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt: Vec<i64>,
    /// Seeds this sequence's sampler (mixed with the options' seed); use a
    /// stable id such as the line number so resumed or re-batched runs
    /// sample the same tokens.
    pub sequence_id: u64,
}

impl GenerationRequest {
    /// One request per prompt, each prompt's index as its sequence id.
    pub fn numbered(prompts: &[Vec<i64>]) -> Vec<GenerationRequest> {
        prompts
            .iter()
            .enumerate()
            .map(|(index, prompt)| GenerationRequest {
                prompt: prompt.clone(),
                sequence_id: index as u64,
            })
            .collect()
    }
}

/// The continuation of one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    /// New tokens only (the stop token included when one ended it).
    pub tokens: Vec<i64>,
    /// Ended by a stop token rather than by `max_new_tokens`.
    pub stopped: bool,
}

/// Continues every prompt of one batch (all rows run together).
pub fn generate_batch(
    target: &TargetModel,
    requests: &[GenerationRequest],
    options: &GenerationOptions,
) -> Result<Vec<Generated>, ModelError> {
    if requests.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(index) = requests
        .iter()
        .position(|request| request.prompt.is_empty())
    {
        return Err(ModelError::InvalidInput(format!(
            "prompt {index} of the batch is empty"
        )));
    }
    options.sampling.validate()?;
    let _no_grad = tch::no_grad_guard();
    let device = target.device();
    let batch = requests.len();
    let (ids, mask, longest) = padded_prompts(requests, options, device);
    let mut cache = target.new_cache(
        batch as i64,
        (longest + options.max_new_tokens.max(1)) as i64,
    );
    let mut samplers: Vec<SequenceSampler> = requests
        .iter()
        .map(|request| SequenceSampler::new(&options.sampling, request.sequence_id))
        .collect();
    let mut outputs: Vec<Generated> = (0..batch)
        .map(|_| Generated {
            tokens: Vec::with_capacity(options.max_new_tokens),
            stopped: false,
        })
        .collect();
    if options.max_new_tokens == 0 {
        return Ok(outputs);
    }
    let prefill = target.forward_cached(&ids, &mask, &mut cache, &[])?;
    let mut last_hidden = last_prompt_states(target, requests, options, longest, &prefill.hidden);
    let mut finished = vec![false; batch];
    for step in 0..options.max_new_tokens {
        let logits = target.lm_head_logits(&last_hidden).to_kind(Kind::Float);
        let next = choose_tokens(&logits, &mut samplers, &options.sampling)?;
        for (row, &token) in next.iter().enumerate() {
            if finished[row] {
                continue;
            }
            outputs[row].tokens.push(token);
            if options.stop_token_ids.contains(&token) {
                outputs[row].stopped = true;
                finished[row] = true;
            }
        }
        if step + 1 == options.max_new_tokens || finished.iter().all(|&done| done) {
            break;
        }
        // Finished rows keep stepping (the batch moves together) with a
        // masked pad token that nothing attends to.
        let fed: Vec<i64> = next
            .iter()
            .zip(&finished)
            .map(|(&token, &done)| if done { options.pad_token_id } else { token })
            .collect();
        let fed_mask: Vec<i64> = finished.iter().map(|&done| i64::from(!done)).collect();
        let fed = Tensor::from_slice(&fed)
            .view([batch as i64, 1])
            .to_device(device);
        let fed_mask = Tensor::from_slice(&fed_mask)
            .view([batch as i64, 1])
            .to_device(device);
        let step_output = target.forward_cached(&fed, &fed_mask, &mut cache, &[])?;
        last_hidden = step_output.hidden.squeeze_dim(1);
    }
    Ok(outputs)
}

/// The prompts padded to the longest (`options.padding` says on which
/// side) as `[batch, longest]` ids and attention mask, and that length.
fn padded_prompts(
    requests: &[GenerationRequest],
    options: &GenerationOptions,
    device: Device,
) -> (Tensor, Tensor, usize) {
    let batch = requests.len();
    let longest = requests.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let mut ids = vec![options.pad_token_id; batch * longest];
    let mut mask = vec![0i64; batch * longest];
    for (row, request) in requests.iter().enumerate() {
        let offset = match options.padding {
            Padding::Left => longest - request.prompt.len(),
            Padding::Right => 0,
        };
        let start = row * longest + offset;
        ids[start..start + request.prompt.len()].copy_from_slice(&request.prompt);
        mask[start..start + request.prompt.len()].fill(1);
    }
    let shape = [batch as i64, longest as i64];
    let ids = Tensor::from_slice(&ids).view(shape).to_device(device);
    let mask = Tensor::from_slice(&mask).view(shape).to_device(device);
    (ids, mask, longest)
}

/// The prefill's hidden state at each row's last real prompt position,
/// `[batch, hidden]`.
fn last_prompt_states(
    target: &TargetModel,
    requests: &[GenerationRequest],
    options: &GenerationOptions,
    longest: usize,
    prefill_hidden: &Tensor,
) -> Tensor {
    let batch = requests.len() as i64;
    let last_positions: Vec<i64> = requests
        .iter()
        .map(|request| match options.padding {
            Padding::Left => longest as i64 - 1,
            Padding::Right => request.prompt.len() as i64 - 1,
        })
        .collect();
    let index = Tensor::from_slice(&last_positions)
        .view([batch, 1, 1])
        .to_device(target.device())
        .expand([batch, 1, target.config().hidden_size], false);
    prefill_hidden.gather(1, &index, false).squeeze_dim(1)
}

/// Next token per row from `[B, V]` f32 logits.
fn choose_tokens(
    logits: &Tensor,
    samplers: &mut [SequenceSampler],
    sampling: &SamplingOptions,
) -> Result<Vec<i64>, ModelError> {
    if sampling.is_greedy() {
        return Ok(Vec::<i64>::try_from(
            &logits.argmax(-1, false).to_device(Device::Cpu),
        )?);
    }
    let probabilities = (logits / sampling.temperature)
        .softmax(-1, Kind::Float)
        .to_device(Device::Cpu);
    let rows = Vec::<Vec<f32>>::try_from(&probabilities)?;
    Ok(rows
        .iter()
        .zip(samplers.iter_mut())
        .map(|(row, sampler)| sampler.sample(row))
        .collect())
}

/// Groups prompt indices into batches whose padded size (rows × (longest
/// prompt + `max_new_tokens`)) stays within `token_budget`, longest prompts
/// first so rows of a batch have similar lengths. A prompt larger than the
/// budget alone gets a batch of its own.
pub fn plan_batches(
    prompt_lengths: &[usize],
    max_new_tokens: usize,
    token_budget: usize,
) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..prompt_lengths.len()).collect();
    order.sort_by_key(|&index| std::cmp::Reverse(prompt_lengths[index]));
    let mut batches: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_width = 0;
    for index in order {
        let width = current_width.max(prompt_lengths[index] + max_new_tokens);
        if !current.is_empty() && (current.len() + 1) * width > token_budget {
            batches.push(std::mem::take(&mut current));
            current_width = prompt_lengths[index] + max_new_tokens;
        } else {
            current_width = width;
        }
        current.push(index);
    }
    if !current.is_empty() {
        batches.push(current);
    }
    batches
}

/// Continues every request, batched by `token_budget`; `on_batch` sees each
/// finished batch (the request indices and their outputs) as it completes.
/// Returns the outputs in request order.
pub fn generate(
    target: &TargetModel,
    requests: &[GenerationRequest],
    options: &GenerationOptions,
    token_budget: usize,
    mut on_batch: impl FnMut(&[usize], &[Generated]),
) -> Result<Vec<Generated>, ModelError> {
    let lengths: Vec<usize> = requests.iter().map(|r| r.prompt.len()).collect();
    let mut outputs: Vec<Option<Generated>> = vec![None; requests.len()];
    for batch in plan_batches(&lengths, options.max_new_tokens, token_budget) {
        let batch_requests: Vec<GenerationRequest> =
            batch.iter().map(|&index| requests[index].clone()).collect();
        let generated = generate_batch(target, &batch_requests, options)?;
        on_batch(&batch, &generated);
        for (index, output) in batch.into_iter().zip(generated) {
            outputs[index] = Some(output);
        }
    }
    Ok(outputs.into_iter().flatten().collect())
}

/// Today's reference: greedy decoding of one prompt with no cache, the
/// whole prefix recomputed for every new token. Quadratic; kept as the
/// baseline that cached decoding must reproduce token for token.
pub fn greedy_generate_uncached(
    target: &TargetModel,
    prompt: &[i64],
    max_new_tokens: usize,
    stop_token_ids: &[i64],
) -> Result<Vec<i64>, ModelError> {
    let mut tokens = prompt.to_vec();
    for _ in 0..max_new_tokens {
        let ids = Tensor::from_slice(&tokens)
            .view([1, -1])
            .to_device(target.device());
        let logits = target.logits(&ids, &ids.ones_like())?;
        let next = logits
            .get(0)
            .get(tokens.len() as i64 - 1)
            .argmax(-1, false)
            .int64_value(&[]);
        tokens.push(next);
        if stop_token_ids.contains(&next) {
            break;
        }
    }
    Ok(tokens[prompt.len()..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_respect_the_budget_and_cover_every_prompt_once() {
        let lengths = [10, 3, 7, 7, 1, 20];
        let batches = plan_batches(&lengths, 10, 60);
        let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2, 3, 4, 5]);
        for batch in &batches {
            let width = batch.iter().map(|&i| lengths[i] + 10).max().unwrap();
            assert!(batch.len() == 1 || batch.len() * width <= 60, "{batches:?}");
        }
        // Longest first: 2 rows of width 30 fill the budget exactly.
        assert_eq!(batches[0], vec![5, 0]);
        // A budget below one request still makes progress.
        assert_eq!(plan_batches(&[50, 50], 10, 5).len(), 2);
    }
}
