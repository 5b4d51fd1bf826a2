//! How one verification step chooses tokens, as the reference's
//! `dflash_generate` does: the drafter's proposals for a block (the unary
//! argmax or a draw for DFlash; the candidate selector's walk, greedy or
//! sampled, for DFlash2, as `DFlash2DraftModel.propose`) and the target's
//! verdict on them (the longest prefix equal to its greedy choices, or
//! speculative rejection sampling, which keeps the output distributed as
//! the target's own sampling), plus its bonus token.
//!
//! A DSpark drafter (speculators' `DSparkDraftModel`, `sample_from_anchor`)
//! drafts every slot of its block, the anchor's included: slot `k`
//! proposes the token after position `anchor + k`, semi-autoregressively:
//! the backbone ran once for the block, then slot by slot the Markov bias of
//! the token drafted before it (the anchor for slot 0) is added to the
//! slot's logits before its token is chosen (argmax or a draw). With a
//! confidence threshold the block is cut where the cumulative product of
//! the confidence head's acceptance probabilities falls below it (at least
//! one token is proposed).

use tch::{Device, Kind, Tensor};

use super::error::EvalError;
use crate::draft::DraftModel;
use crate::sampling::{sampling_probabilities, SamplingOptions, SequenceSampler};

/// Greedy decoding, or sampling with one prompt's own generator.
pub(super) enum Decoding {
    Greedy,
    Sampled {
        options: SamplingOptions,
        sampler: SequenceSampler,
    },
}

impl Decoding {
    /// The decoding of prompt `sequence_id` at `options`; each prompt draws
    /// from its own seeded generator, so a prompt's output does not depend
    /// on the prompts evaluated before it.
    pub(super) fn new(options: &SamplingOptions, sequence_id: u64) -> Self {
        if options.is_greedy() {
            Decoding::Greedy
        } else {
            // The nucleus is cut in the probabilities themselves (the draft
            // and target distributions the rejection test compares), so the
            // generator draws from them as they are.
            let exact = SamplingOptions {
                top_p: 1.0,
                ..options.clone()
            };
            Decoding::Sampled {
                options: options.clone(),
                sampler: SequenceSampler::new(&exact, sequence_id),
            }
        }
    }

    /// The next token from the target's logits `[vocab]` at one position.
    pub(super) fn next_token(&mut self, logits: &Tensor) -> Result<i64, EvalError> {
        match self {
            Decoding::Greedy => Ok(logits.argmax(-1, false).int64_value(&[])),
            Decoding::Sampled { options, sampler } => {
                let probabilities =
                    probability_rows(&sampling_probabilities(&logits.unsqueeze(0), options))?;
                Ok(sampler.sample(&probabilities[0]))
            }
        }
    }

    /// The drafter's proposals for the block positions after the anchor,
    /// from their draft hidden states `[positions, hidden]` (DSpark: every
    /// slot's, the anchor's first; at most `max_proposals` are drafted, cut
    /// further by `confidence_threshold`).
    pub(super) fn propose(
        &mut self,
        drafter: &DraftModel,
        draft_hidden: &Tensor,
        anchor_token: i64,
        max_proposals: usize,
        confidence_threshold: Option<f64>,
    ) -> Result<Proposal, EvalError> {
        if drafter.is_dspark() {
            self.propose_dspark(
                drafter,
                draft_hidden,
                anchor_token,
                max_proposals,
                confidence_threshold,
            )
        } else if drafter.is_dflash2() {
            self.propose_with_selector(drafter, draft_hidden, anchor_token)
        } else {
            let logits = drafter.logits(draft_hidden);
            match self {
                Decoding::Greedy => Ok(Proposal {
                    tokens: token_list(&logits.argmax(-1, false))?,
                    distributions: Vec::new(),
                }),
                Decoding::Sampled { options, sampler } => {
                    let rows = probability_rows(&sampling_probabilities(&logits, options))?;
                    let tokens = rows.iter().map(|row| sampler.sample(row)).collect();
                    let distributions = rows
                        .into_iter()
                        .map(|probabilities| DraftDistribution {
                            candidates: None,
                            probabilities,
                        })
                        .collect();
                    Ok(Proposal {
                        tokens,
                        distributions,
                    })
                }
            }
        }
    }

    /// DSpark: slot by slot, the backbone's logits plus the Markov bias of
    /// the token drafted before (the anchor first), then argmax or a draw
    /// from the sampling distribution of those biased logits.
    fn propose_dspark(
        &mut self,
        drafter: &DraftModel,
        draft_hidden: &Tensor,
        anchor_token: i64,
        max_proposals: usize,
        confidence_threshold: Option<f64>,
    ) -> Result<Proposal, EvalError> {
        let device = drafter.device();
        let slots = (draft_hidden.size()[0].max(0) as usize).min(max_proposals);
        let mut state = drafter.markov_start();
        let mut previous = anchor_token;
        let mut cumulative_confidence = 1.0f64;
        let mut tokens = Vec::with_capacity(slots);
        let mut distributions = Vec::new();
        for slot in 0..slots {
            let hidden = draft_hidden.narrow(0, slot as i64, 1);
            let previous_token = Tensor::from_slice(&[previous]).to_device(device);
            let heads = drafter.dspark_position(&mut state, &hidden, &previous_token)?;
            if let Some(confidence_logit) = &heads.confidence_logits {
                let confidence = confidence_logit.sigmoid().double_value(&[0]);
                cumulative_confidence *= confidence;
                if let Some(threshold) = confidence_threshold {
                    if slot > 0 && cumulative_confidence < threshold {
                        break;
                    }
                }
            }
            let unbiased = drafter.logits(&hidden);
            let logits = match &heads.markov_bias {
                Some(bias) => unbiased + bias,
                None => unbiased,
            };
            let token = match self {
                Decoding::Greedy => logits.argmax(-1, false).int64_value(&[0]),
                Decoding::Sampled { options, sampler } => {
                    let row =
                        probability_rows(&sampling_probabilities(&logits, options))?.remove(0);
                    let token = sampler.sample(&row);
                    distributions.push(DraftDistribution {
                        candidates: None,
                        probabilities: row,
                    });
                    token
                }
            };
            tokens.push(token);
            previous = token;
        }
        Ok(Proposal {
            tokens,
            distributions,
        })
    }

    /// DFlash2: the candidate selector's walk from the anchor, each
    /// position's token the best-scoring candidate (greedy) or drawn from
    /// `softmax(scores / temperature)` over the candidates (the reference
    /// applies no nucleus there).
    fn propose_with_selector(
        &mut self,
        drafter: &DraftModel,
        draft_hidden: &Tensor,
        anchor_token: i64,
    ) -> Result<Proposal, EvalError> {
        let anchor = Tensor::from_slice(&[anchor_token]).to_device(drafter.device());
        let hidden = draft_hidden.unsqueeze(0);
        match self {
            Decoding::Greedy => {
                let path = drafter.select_greedy(&hidden, &anchor)?;
                Ok(Proposal {
                    tokens: token_list(&path.tokens.get(0))?,
                    distributions: Vec::new(),
                })
            }
            Decoding::Sampled { options, sampler } => {
                let temperature = options.temperature;
                let mut distributions = Vec::new();
                let path = drafter.select_with(&hidden, &anchor, |scores| {
                    let probabilities = (scores / temperature).softmax(-1, Kind::Float);
                    let row = probability_rows(&probabilities)?.remove(0);
                    let index = sampler.sample(&row);
                    distributions.push(row);
                    Ok(Tensor::from_slice(&[index])
                        .view([1, 1])
                        .to_device(scores.device()))
                })?;
                let candidates = path.candidates.get(0).to_device(Device::Cpu);
                let distributions = distributions
                    .into_iter()
                    .enumerate()
                    .map(|(position, probabilities)| {
                        Ok(DraftDistribution {
                            candidates: Some(token_list(&candidates.get(position as i64))?),
                            probabilities,
                        })
                    })
                    .collect::<Result<_, EvalError>>()?;
                Ok(Proposal {
                    tokens: token_list(&path.tokens.get(0))?,
                    distributions,
                })
            }
        }
    }

    /// The target's verdict on `proposal` from its logits `[block, vocab]`
    /// after each block position: how many proposals are accepted and the
    /// token after them (the target's own choice at the first rejection,
    /// or after the whole block).
    pub(super) fn verify(
        &mut self,
        proposal: &Proposal,
        target_logits: &Tensor,
    ) -> Result<(usize, i64), EvalError> {
        match self {
            Decoding::Greedy => {
                let posterior = token_list(&target_logits.argmax(-1, false))?;
                let accepted = proposal
                    .tokens
                    .iter()
                    .zip(&posterior)
                    .take_while(|(proposed, verified)| proposed == verified)
                    .count();
                Ok((accepted, posterior[accepted]))
            }
            Decoding::Sampled { options, sampler } => {
                let target = probability_rows(&sampling_probabilities(target_logits, options))?;
                Ok(rejection_sample(proposal, &target, sampler))
            }
        }
    }
}

/// What the drafter proposed for one block.
pub(super) struct Proposal {
    /// The proposed tokens after the anchor.
    pub(super) tokens: Vec<i64>,
    /// Sampled decoding only: the distribution each token was drawn from.
    distributions: Vec<DraftDistribution>,
}

impl Proposal {
    /// No proposal: a block of the anchor alone (the last position).
    pub(super) fn empty() -> Self {
        Proposal {
            tokens: Vec::new(),
            distributions: Vec::new(),
        }
    }
}

/// The draft distribution at one position: over the whole vocabulary
/// (DFlash), or over the selector's candidates (DFlash2).
struct DraftDistribution {
    /// The token of each probability; `None` when the index is the token.
    candidates: Option<Vec<i64>>,
    probabilities: Vec<f32>,
}

impl DraftDistribution {
    fn probability(&self, token: i64) -> f32 {
        match &self.candidates {
            None => self.probabilities[token as usize],
            Some(candidates) => candidates
                .iter()
                .zip(&self.probabilities)
                .filter(|(candidate, _)| **candidate == token)
                .map(|(_, probability)| probability)
                .sum(),
        }
    }
}

/// Speculative rejection sampling (Leviathan et al. 2023; the reference's
/// `_rejection_sample`): proposal `k` (drawn from `q`) is accepted when
/// `u·q(x) < p(x)` for a fresh uniform `u`, while every earlier one was; at
/// the first rejection the next token is drawn from `max(p − q, 0)`
/// renormalised (from `p` itself when that is all zero), after a fully
/// accepted block from the target's distribution after it. The tokens kept
/// are then distributed as the target's own sampling. `target[k]` is the
/// target's distribution after block position `k` (one more row than
/// proposals).
fn rejection_sample(
    proposal: &Proposal,
    target: &[Vec<f32>],
    sampler: &mut SequenceSampler,
) -> (usize, i64) {
    let mut accepted = 0;
    for (token, draft) in proposal.tokens.iter().zip(&proposal.distributions) {
        let target_probability = f64::from(target[accepted][*token as usize]);
        let draft_probability = f64::from(draft.probability(*token));
        if sampler.uniform() * draft_probability < target_probability {
            accepted += 1;
        } else {
            break;
        }
    }
    if accepted == proposal.tokens.len() {
        return (accepted, sampler.sample(&target[accepted]));
    }
    let draft = &proposal.distributions[accepted];
    let mut residual = target[accepted].clone();
    match &draft.candidates {
        None => residual
            .iter_mut()
            .zip(&draft.probabilities)
            .for_each(|(probability, draft_probability)| *probability -= draft_probability),
        Some(candidates) => candidates.iter().zip(&draft.probabilities).for_each(
            |(candidate, draft_probability)| residual[*candidate as usize] -= draft_probability,
        ),
    }
    residual
        .iter_mut()
        .for_each(|probability| *probability = probability.max(0.0));
    let total: f32 = residual.iter().sum();
    let bonus = if total > 0.0 {
        residual
            .iter_mut()
            .for_each(|probability| *probability /= total);
        sampler.sample(&residual)
    } else {
        sampler.sample(&target[accepted])
    };
    (accepted, bonus)
}

fn token_list(tokens: &Tensor) -> Result<Vec<i64>, EvalError> {
    Ok(Vec::<i64>::try_from(
        &tokens.to_kind(Kind::Int64).to_device(Device::Cpu),
    )?)
}

/// The rows of `[rows, vocab]` probabilities, on the CPU.
fn probability_rows(probabilities: &Tensor) -> Result<Vec<Vec<f32>>, tch::TchError> {
    let probabilities = probabilities.to_kind(Kind::Float).to_device(Device::Cpu);
    Vec::<Vec<f32>>::try_from(&probabilities)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(seed: u64) -> SequenceSampler {
        SequenceSampler::new(
            &SamplingOptions {
                temperature: 1.0,
                top_p: 1.0,
                seed,
            },
            0,
        )
    }

    /// The first token after the anchor over many draws: rejection sampling
    /// must leave it distributed as the target's `p`, whatever the draft's
    /// `q`, for a vocabulary draft (DFlash) and a candidate one (DFlash2).
    fn first_token_shares(candidates: Option<Vec<i64>>, draft: Vec<f32>) -> Vec<f64> {
        let target = vec![vec![0.5f32, 0.3, 0.15, 0.05], vec![0.25f32; 4]];
        let mut draws = sampler(3);
        let mut counts = [0usize; 4];
        let trials = 20_000;
        for _ in 0..trials {
            let distribution = DraftDistribution {
                candidates: candidates.clone(),
                probabilities: draft.clone(),
            };
            let index = draws.sample(&distribution.probabilities) as usize;
            let token = candidates.as_ref().map_or(index as i64, |ids| ids[index]);
            let proposal = Proposal {
                tokens: vec![token],
                distributions: vec![distribution],
            };
            let (accepted, bonus) = rejection_sample(&proposal, &target, &mut draws);
            let first = if accepted == 1 { token } else { bonus };
            counts[first as usize] += 1;
        }
        counts
            .iter()
            .map(|&count| count as f64 / trials as f64)
            .collect()
    }

    #[test]
    fn rejection_sampling_keeps_the_target_distribution() {
        // Binomial shares of 20,000 draws: standard deviation at most
        // sqrt(0.25 / 20000) = 0.0035; 0.015 is over 4 of them.
        let target = [0.5, 0.3, 0.15, 0.05];
        let vocabulary = first_token_shares(None, vec![0.1, 0.2, 0.3, 0.4]);
        let candidates = first_token_shares(Some(vec![3, 1]), vec![0.7, 0.3]);
        for shares in [vocabulary, candidates] {
            for (share, want) in shares.iter().zip(target) {
                assert!(
                    (share - want).abs() < 0.015,
                    "{shares:?} against {target:?}"
                );
            }
        }
    }

    #[test]
    fn a_draft_equal_to_the_target_is_always_accepted() {
        let target = vec![vec![0.0f32, 1.0, 0.0], vec![0.0f32, 0.0, 1.0]];
        let proposal = Proposal {
            tokens: vec![1],
            distributions: vec![DraftDistribution {
                candidates: None,
                probabilities: vec![0.0, 1.0, 0.0],
            }],
        };
        let mut draws = sampler(9);
        for _ in 0..100 {
            assert_eq!(rejection_sample(&proposal, &target, &mut draws), (1, 2));
        }
    }
}
