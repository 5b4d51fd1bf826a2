//! DFlash2's candidate selector (`CandidateSelector` of `dflash` 0.1.0):
//! at each block position the unary top-k candidates are re-ranked by
//! `score(a → b) = unary logit of b + ⟨pred(a) ⊙ proj(h), succ(b)⟩`, where
//! `a` is the token before the position (the anchor at the first), `h` the
//! position's draft hidden state, `pred`/`succ` the two codebooks and
//! `proj` the hidden projection. Training scores teacher-forced predecessors
//! (`draft::objective`); decoding walks the block left to right
//! ([`DraftModel::select_greedy`]).
//!
//! The selector computes in f32 from the f32 master weights whatever the
//! compute kind: its tensors are `[.., top_k, rank]`, small next to the
//! logits.

use tch::{Kind, Tensor};

use super::network::DraftModel;
use crate::draft::error::DraftError;

/// A greedy walk of the selector over one block per row.
pub struct SelectorPath {
    /// `[batch, positions]` the chosen token at each position.
    pub tokens: Tensor,
    /// `[batch, positions, top_k]` the unary top-k (sorted by unary logit).
    pub candidates: Tensor,
    /// `[batch, positions, top_k]` f32 selector scores of the candidates,
    /// given the path's predecessors.
    pub scores: Tensor,
}

impl DraftModel {
    /// Whether this is a DFlash2 model (convolutions and selector).
    pub fn is_dflash2(&self) -> bool {
        self.selector.is_some()
    }

    /// Candidates the selector re-ranks (`selector_top_k`); `None` for DFlash.
    pub fn selector_top_k(&self) -> Option<i64> {
        self.config
            .dflash2
            .as_ref()
            .map(|dflash2| dflash2.selector_top_k)
    }

    /// Selector scores `[.., top_k]` (f32) of `candidate_ids` `[.., top_k]`
    /// after `predecessor_ids` `[..]`, from the draft hidden states
    /// `[.., hidden]` and their unary logits `[.., vocab]`. Differentiable in
    /// the selector's parameters, the hidden states and the logits.
    pub fn selector_scores(
        &self,
        hidden: &Tensor,
        unary_logits: &Tensor,
        predecessor_ids: &Tensor,
        candidate_ids: &Tensor,
    ) -> Result<Tensor, DraftError> {
        let selector = self.selector.as_ref().ok_or_else(|| {
            DraftError::InvalidConfig(
                "the candidate selector exists only in DFlash2 models".to_string(),
            )
        })?;
        let projected = hidden
            .to_kind(Kind::Float)
            .linear::<Tensor>(&selector.hidden_projection, None);
        let predecessor = Tensor::embedding(
            &selector.predecessor_codebook,
            predecessor_ids,
            -1,
            false,
            false,
        );
        let context = predecessor * projected;
        let successors = Tensor::embedding(
            &selector.successor_codebook,
            candidate_ids,
            -1,
            false,
            false,
        );
        let transition =
            (context.unsqueeze(-2) * successors).sum_dim_intlist(-1, false, Kind::Float);
        Ok(unary_logits
            .to_kind(Kind::Float)
            .gather(-1, candidate_ids, false)
            + transition)
    }

    /// The reference's greedy `select` over draft hidden states
    /// `[batch, positions, hidden]` (block positions 1.. of one block per
    /// row) after `anchor_ids` `[batch]`: at each position the best-scoring
    /// candidate given the token chosen before it.
    pub fn select_greedy(
        &self,
        hidden: &Tensor,
        anchor_ids: &Tensor,
    ) -> Result<SelectorPath, DraftError> {
        self.select_with(hidden, anchor_ids, |scores| Ok(scores.argmax(-1, true)))
    }

    /// The reference's `select` with the choice at each position left to
    /// `choose`: given the `[batch, top_k]` f32 scores of the position's
    /// candidates (after the token chosen before it), it returns the
    /// `[batch, 1]` index of the candidate to take (the argmax when greedy,
    /// a draw from `softmax(scores / temperature)` when sampling). The
    /// path's `scores` are the ones `choose` saw.
    pub fn select_with(
        &self,
        hidden: &Tensor,
        anchor_ids: &Tensor,
        mut choose: impl FnMut(&Tensor) -> Result<Tensor, DraftError>,
    ) -> Result<SelectorPath, DraftError> {
        let top_k = self.selector_top_k().ok_or_else(|| {
            DraftError::InvalidConfig(
                "the candidate selector exists only in DFlash2 models".to_string(),
            )
        })?;
        let (_, positions, _) = hidden.size3()?;
        let logits = self.logits(hidden);
        let (_, candidates) = logits.topk(top_k, -1, true, true);
        let mut predecessor = anchor_ids.to_device(self.device()).to_kind(Kind::Int64);
        let mut tokens = Vec::with_capacity(positions as usize);
        let mut scores = Vec::with_capacity(positions as usize);
        for position in 0..positions {
            let position_candidates = candidates.select(1, position);
            let position_scores = self.selector_scores(
                &hidden.select(1, position),
                &logits.select(1, position),
                &predecessor,
                &position_candidates,
            )?;
            let chosen = choose(&position_scores)?;
            predecessor = position_candidates
                .gather(-1, &chosen.to_kind(Kind::Int64), false)
                .squeeze_dim(-1);
            tokens.push(predecessor.shallow_clone());
            scores.push(position_scores);
        }
        Ok(SelectorPath {
            tokens: Tensor::stack(&tokens, 1),
            candidates,
            scores: Tensor::stack(&scores, 1),
        })
    }
}
