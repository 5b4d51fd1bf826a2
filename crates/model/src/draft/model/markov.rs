//! DSpark's two heads on the DFlash backbone (speculators 0.9.0's
//! `MarkovHead` and `ConfidenceHead`):
//! - the Markov head adds a low-rank logit bias to each block position,
//!   indexed by the token before it: `W2 · W1[prev]` (vanilla),
//!   `W2 · (σ(gate([h, W1[prev]])) ⊙ W1[prev])` (gated), or `W2 · tanh(o)`
//!   of a recurrent state carried across the block (rnn);
//! - the confidence head maps `[h, W1[prev]]` (or `h` alone) to one logit
//!   per position: the predicted probability that the position's drafted
//!   token is accepted.
//!
//! Training feeds the true previous tokens (teacher forcing, the anchor at
//! slot 0: `draft::objective`); decoding feeds the tokens it drafts, one
//! position at a time ([`DraftModel::dspark_position`]): the backbone runs
//! once per block, only these heads are sequential.
//!
//! The heads compute in f32 from the f32 master weights whatever the
//! compute kind, like the selector: they are small next to the logits.

use tch::{Kind, Tensor};

use super::network::DraftModel;
use super::parameters::{ConfidenceParameters, DsparkHeads, MarkovParameters};
use crate::draft::dspark_config::MarkovHeadType;
use crate::draft::error::DraftError;

/// The heads' outputs over whole blocks.
pub struct DsparkBlockHeads {
    /// `[.., B, vocab]` f32 logit bias; `None` without a Markov head.
    pub markov_bias: Option<Tensor>,
    /// `[.., B]` f32 confidence logits; `None` without a confidence head.
    pub confidence_logits: Option<Tensor>,
}

/// The Markov head's recurrent state while a block is drafted (rnn only:
/// the other variants keep none).
pub struct MarkovState {
    /// `[rows, rank]`, zero at the start of each block.
    state: Option<Tensor>,
}

/// One block position's head outputs in decoding.
pub struct DsparkPositionHeads {
    /// `[rows, vocab]` f32 logit bias; `None` without a Markov head.
    pub markov_bias: Option<Tensor>,
    /// `[rows]` f32 confidence logits; `None` without a confidence head.
    pub confidence_logits: Option<Tensor>,
}

impl DraftModel {
    /// Whether this is a DSpark model (Markov and/or confidence head,
    /// distillation objective).
    pub fn is_dspark(&self) -> bool {
        self.dspark_heads.is_some()
    }

    fn dspark_heads(&self) -> Result<&DsparkHeads, DraftError> {
        self.dspark_heads.as_ref().ok_or_else(|| {
            DraftError::InvalidConfig(
                "the Markov and confidence heads exist only in DSpark models".to_string(),
            )
        })
    }

    /// The heads over whole blocks: draft hidden states `[.., B, hidden]`
    /// and the token before each position `[.., B]` (teacher forcing).
    /// Differentiable in the heads' parameters and the hidden states.
    pub fn dspark_block_heads(
        &self,
        hidden: &Tensor,
        previous_tokens: &Tensor,
    ) -> Result<DsparkBlockHeads, DraftError> {
        let heads = self.dspark_heads()?;
        let hidden = hidden.to_kind(Kind::Float);
        let size = hidden.size();
        let token_size = previous_tokens.size();
        if size.len() < 2 || token_size.as_slice() != &size[..size.len() - 1] {
            return Err(DraftError::ShapeMismatch(format!(
                "DSpark heads: hidden states {size:?} with previous tokens {token_size:?}"
            )));
        }
        let previous_embedding = heads.markov.as_ref().map(|markov| {
            Tensor::embedding(
                &markov.w1,
                &previous_tokens.to_kind(Kind::Int64),
                -1,
                false,
                false,
            )
        });
        let markov_bias = match (&heads.markov, &previous_embedding) {
            (Some(markov), Some(embedding)) => Some(match markov.head_type {
                MarkovHeadType::Vanilla | MarkovHeadType::Gated => {
                    markov.positionwise_bias(embedding, &hidden)
                }
                MarkovHeadType::Rnn => {
                    // Sequential over the block (dimension -2).
                    let positions = size[size.len() - 2];
                    let mut state = MarkovState { state: None };
                    let biases = (0..positions)
                        .map(|position| {
                            let embedding_k = embedding.select(-2, position);
                            let hidden_k = hidden.select(-2, position);
                            markov.recurrent_bias(&mut state, &embedding_k, &hidden_k)
                        })
                        .collect::<Vec<_>>();
                    Tensor::stack(&biases, -2)
                }
            }),
            _ => None,
        };
        let confidence_logits = heads.confidence.as_ref().map(|confidence| {
            heads.confidence_logits(confidence, &hidden, previous_embedding.as_ref())
        });
        Ok(DsparkBlockHeads {
            markov_bias,
            confidence_logits,
        })
    }

    /// A fresh Markov state for drafting a block (`rows` blocks at once).
    pub fn markov_start(&self) -> MarkovState {
        MarkovState { state: None }
    }

    /// The heads at one block position in decoding: the position's draft
    /// hidden states `[rows, hidden]` and the token before it `[rows]` (the
    /// anchor at slot 0, then the token drafted at the slot before).
    pub fn dspark_position(
        &self,
        state: &mut MarkovState,
        hidden: &Tensor,
        previous_tokens: &Tensor,
    ) -> Result<DsparkPositionHeads, DraftError> {
        let heads = self.dspark_heads()?;
        let hidden = hidden.to_kind(Kind::Float);
        let previous_embedding = heads.markov.as_ref().map(|markov| {
            Tensor::embedding(
                &markov.w1,
                &previous_tokens.to_kind(Kind::Int64),
                -1,
                false,
                false,
            )
        });
        let markov_bias = match (&heads.markov, &previous_embedding) {
            (Some(markov), Some(embedding)) => Some(match markov.head_type {
                MarkovHeadType::Vanilla | MarkovHeadType::Gated => {
                    markov.positionwise_bias(embedding, &hidden)
                }
                MarkovHeadType::Rnn => markov.recurrent_bias(state, embedding, &hidden),
            }),
            _ => None,
        };
        let confidence_logits = heads.confidence.as_ref().map(|confidence| {
            heads.confidence_logits(confidence, &hidden, previous_embedding.as_ref())
        });
        Ok(DsparkPositionHeads {
            markov_bias,
            confidence_logits,
        })
    }
}

impl MarkovParameters {
    /// Vanilla and gated: each position on its own.
    fn positionwise_bias(&self, previous_embedding: &Tensor, hidden: &Tensor) -> Tensor {
        let input = match &self.gate {
            Some((weight, bias)) if self.head_type == MarkovHeadType::Gated => {
                let gate = Tensor::cat(&[hidden, previous_embedding], -1)
                    .linear(weight, Some(bias))
                    .sigmoid();
                gate * previous_embedding
            }
            _ => previous_embedding.shallow_clone(),
        };
        input.linear::<Tensor>(&self.w2, None)
    }

    /// Rnn: one position, advancing the state.
    fn recurrent_bias(
        &self,
        state: &mut MarkovState,
        previous_embedding: &Tensor,
        hidden: &Tensor,
    ) -> Tensor {
        let current = state.state.take().unwrap_or_else(|| {
            let mut shape = previous_embedding.size();
            if let Some(last) = shape.last_mut() {
                *last = self.rank;
            }
            previous_embedding.zeros_like().view(shape.as_slice())
        });
        let output = match &self.joint {
            Some((weight, bias)) => {
                let projected = Tensor::cat(&[&current, previous_embedding, hidden], -1)
                    .linear(weight, Some(bias));
                let parts = projected.chunk(3, -1);
                let gate = parts[0].sigmoid();
                let candidate = parts[1].tanh();
                let next = &gate * &current + (1.0 - &gate) * candidate;
                state.state = Some(next);
                parts[2].tanh()
            }
            None => previous_embedding.shallow_clone(),
        };
        output.linear::<Tensor>(&self.w2, None)
    }
}

impl DsparkHeads {
    fn confidence_logits(
        &self,
        confidence: &ConfidenceParameters,
        hidden: &Tensor,
        previous_embedding: Option<&Tensor>,
    ) -> Tensor {
        let features = match previous_embedding {
            Some(embedding) if self.confidence_with_markov => Tensor::cat(&[hidden, embedding], -1),
            _ => hidden.shallow_clone(),
        };
        features
            .linear(&confidence.weight, Some(&confidence.bias))
            .squeeze_dim(-1)
    }
}
