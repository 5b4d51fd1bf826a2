//! What an evaluation is asked ([`EvalOptions`]) and what it found
//! ([`EvalReport`], one [`GenerationTrace`] per prompt).

use crate::sampling::SamplingOptions;
use tch::Device;

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
    /// DSpark drafters: propose each block only as far as the cumulative
    /// product of the confidence head's acceptance probabilities stays at
    /// or above this (at least one token); `None` proposes the whole block.
    /// Other drafters ignore it.
    pub confidence_threshold: Option<f64>,
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
    /// Tokens proposed for verification in all (what the verify forwards
    /// checked beyond their anchors).
    pub proposed_tokens: usize,
    /// Each prompt followed by its generated tokens.
    pub outputs: Vec<Vec<i64>>,
    /// Per prompt, each verification's proposed tokens (after the anchor)
    /// in order: what the drafter proposed and the target verified, so a
    /// reference decoder can be compared step by step, not only by its
    /// output (`scripts/check_spec_generate.py`). Moved from each prompt's
    /// [`GenerationTrace`], not copied; no caller serialises the report.
    pub proposals: Vec<Vec<Vec<i64>>>,
}

/// One prompt's speculative generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationTrace {
    /// Prompt plus generated tokens.
    pub token_ids: Vec<i64>,
    pub acceptance_lengths: Vec<usize>,
    /// Each verification's proposed tokens (after the anchor), in order.
    pub proposed_tokens: Vec<Vec<i64>>,
    /// Target forwards run (prefill and verifications).
    pub target_forwards: usize,
    /// Context positions the drafter projected into its layers' keys and
    /// values: each committed position once with the cache, the whole
    /// context again for every block without it.
    pub draft_context_positions: usize,
}

impl GenerationTrace {
    /// Nothing generated: the prompt alone, no target forward.
    pub(super) fn prompt_only(prompt: &[i64]) -> Self {
        GenerationTrace {
            token_ids: prompt.to_vec(),
            acceptance_lengths: Vec::new(),
            proposed_tokens: Vec::new(),
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
