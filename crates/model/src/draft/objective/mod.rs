//! The DFlash training objective: anchor sampling, block construction and
//! the decayed, loss-masked cross-entropy.
//!
//! Per sequence, anchors are drawn without replacement among positions `i`
//! with `loss_mask[i] && loss_mask[i + 1]` (so every block has at least one
//! supervised target), at most `num_anchors` of them, sorted. Each block is
//! `[token at anchor, MASK × (B − 1)]`; block position `k ≥ 1` predicts the
//! token at `anchor + k` with weight `exp(−(k − 1)/γ) · loss_mask[anchor + k]`
//! (zero past the end of the sequence), and the loss is `Σ w·CE / Σ w`.
//!
//! DFlash2 adds the selector loss of speculators 0.9.0: at each block
//! position the unary top-k candidates (sorted), with the gold token put in
//! at rank K when the top-k misses it, are scored by the candidate selector
//! with the true previous token as predecessor (teacher forcing: the anchor
//! at position 1), and the cross-entropy of the gold's rank gets the same
//! weights `w`. The loss is `(Σ w·CE + α·Σ w·CE_selector) / Σ w`.
//!
//! DSpark (`dspark`) replaces the cross-entropy by distillation from the
//! target's distribution plus the confidence BCE (see that module).
//!
//! Anchor sampling and block packing (`packing`) come first, then DSpark's
//! loss (`dspark`); this module computes the loss over a packed batch.

use tch::{Device, Kind, Tensor};

use super::error::DraftError;
use super::model::{BlockInputs, DraftModel};

mod dspark;
mod packing;

pub use dspark::DsparkTotals;
pub use packing::{
    anchor_candidates, default_loss_decay_gamma, pack_batch, sample_anchors, PackedBatch,
    TrainingSequence,
};

/// What one forward of the objective produced.
pub struct ObjectiveOutput {
    /// Scalar `Σ w·CE / Σ w`, differentiable.
    pub loss: Tensor,
    /// `[batch, blocks, block_size, hidden]` draft hidden states.
    pub draft_hidden: Tensor,
    /// `Σ w`, so accumulated micro-batches can be combined exactly
    /// (backpropagate `loss · weight_sum`, divide by the total at the step).
    pub weight_sum: f64,
    /// Per block position `k = 1..B−1`: supervised targets predicted right
    /// by the argmax.
    pub correct_per_position: Vec<f64>,
    /// Per block position `k = 1..B−1`: supervised targets.
    pub supervised_per_position: Vec<f64>,
    /// DFlash2's selector terms; `None` for DFlash.
    pub selector: Option<SelectorTotals>,
    /// DSpark's terms and metrics; `None` for DFlash and DFlash2. With
    /// DSpark the per-position counts cover slots `0..B−1` and count the
    /// drafter's argmax against the teacher's.
    pub dspark: Option<DsparkTotals>,
}

/// DFlash2's selector loss and metrics over a batch, as sums so that
/// micro-batches add up exactly.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SelectorTotals {
    /// Candidates per position (`selector_top_k`).
    pub top_k: i64,
    /// `α` of the loss.
    pub selector_loss_alpha: f64,
    /// `Σ w·CE` of the unary (DFlash) loss.
    pub unary_weighted_cross_entropy: f64,
    /// `Σ w·CE` of the selector loss.
    pub selector_weighted_cross_entropy: f64,
    /// Supervised positions.
    pub supervised: f64,
    /// Supervised positions whose gold token is in the unary top-k (recall@K).
    pub recall_hits: f64,
    /// Of those, positions where the selector's best candidate (teacher
    /// forced) is the gold token.
    pub selector_correct: f64,
}

impl SelectorTotals {
    /// Sums another batch's totals into these.
    pub fn add(&mut self, other: &SelectorTotals) {
        self.top_k = other.top_k;
        self.selector_loss_alpha = other.selector_loss_alpha;
        self.unary_weighted_cross_entropy += other.unary_weighted_cross_entropy;
        self.selector_weighted_cross_entropy += other.selector_weighted_cross_entropy;
        self.supervised += other.supervised;
        self.recall_hits += other.recall_hits;
        self.selector_correct += other.selector_correct;
    }

    /// Fraction of supervised positions whose gold is in the unary top-k.
    pub fn recall_at_k(&self) -> f64 {
        ratio(self.recall_hits, self.supervised)
    }

    /// Teacher-forced selector accuracy over the positions the top-k
    /// recalled (speculators' `teacher_forced_selector_acc`).
    pub fn teacher_forced_selector_accuracy(&self) -> f64 {
        ratio(self.selector_correct, self.recall_hits)
    }
}

/// `numerator / denominator`, 0 when there is nothing to count.
fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 {
        numerator / denominator
    } else {
        0.0
    }
}

impl ObjectiveOutput {
    /// Accuracy at each block position `k = 1..B−1` (NaN where nothing was supervised).
    pub fn accuracy_per_position(&self) -> Vec<f64> {
        accuracy_ratios(&self.correct_per_position, &self.supervised_per_position)
    }

    /// Accuracy over every supervised target.
    pub fn accuracy(&self) -> f64 {
        overall_accuracy(&self.correct_per_position, &self.supervised_per_position)
    }
}

/// `correct / supervised` element-wise.
pub fn accuracy_ratios(correct: &[f64], supervised: &[f64]) -> Vec<f64> {
    correct
        .iter()
        .zip(supervised)
        .map(|(correct, supervised)| correct / supervised)
        .collect()
}

/// `Σ correct / Σ supervised`, 0 when nothing was supervised.
pub fn overall_accuracy(correct: &[f64], supervised: &[f64]) -> f64 {
    let supervised_total: f64 = supervised.iter().sum();
    if supervised_total == 0.0 {
        return 0.0;
    }
    correct.iter().sum::<f64>() / supervised_total
}

/// Labels and weights of block positions `1..B−1`, and the block tokens.
struct BlockTargets {
    /// `[batch, blocks, B]`: the anchor token, then mask tokens.
    block_token_ids: Tensor,
    /// `[batch, blocks, B−1]` token ids to predict (clamped past the end).
    labels: Tensor,
    /// `[batch, blocks, B−1]` 1 where the label is supervised.
    supervised: Tensor,
    /// `[batch, blocks, B−1]` supervised · exp(−(k − 1)/γ).
    weights: Tensor,
    anchors: Tensor,
    /// `[batch, blocks, B−1]` the true token before each label (the anchor
    /// token for `k = 1`): the selector's teacher-forced predecessors.
    predecessors: Tensor,
}

fn block_targets(
    model: &DraftModel,
    batch: &PackedBatch,
    gamma: f64,
) -> Result<BlockTargets, DraftError> {
    let config = model.config();
    let device = model.device();
    let block_size = config.block_size;
    let input_ids = batch.input_ids.to_device(device);
    let loss_mask = batch.loss_mask.to_device(device);
    let anchors = batch.anchors.to_device(device);
    let anchor_valid = batch.anchor_valid.to_device(device);
    let (batch_size, max_len) = input_ids.size2()?;
    let num_blocks = anchors.size()[1];

    let anchor_tokens = input_ids.gather(1, &anchors, false);
    let mask_tokens = Tensor::full(
        [batch_size, num_blocks, block_size - 1],
        config.mask_token_id,
        (Kind::Int64, device),
    );
    let block_token_ids = Tensor::cat(&[&anchor_tokens.unsqueeze(-1), &mask_tokens], -1);

    // Targets of block positions 1..B−1.
    let offsets = Tensor::arange_start(1, block_size, (Kind::Int64, device));
    let label_positions = anchors.unsqueeze(-1) + &offsets;
    let in_range = label_positions.lt(max_len);
    let clamped_positions = label_positions.clamp_max(max_len - 1);
    let flat_positions = clamped_positions.view([batch_size, -1]);
    let labels = input_ids
        .gather(1, &flat_positions, false)
        .view_as(&clamped_positions);
    let label_mask = loss_mask
        .gather(1, &flat_positions, false)
        .view_as(&clamped_positions);
    let supervised = label_mask
        * in_range.to_kind(Kind::Float)
        * anchor_valid.unsqueeze(-1).to_kind(Kind::Float);
    let decay = ((offsets.to_kind(Kind::Float) - 1.0) * (-1.0 / gamma)).exp();
    let weights = &supervised * decay;
    let predecessors = Tensor::cat(
        &[
            &anchor_tokens.unsqueeze(-1),
            &labels.narrow(2, 0, block_size - 2),
        ],
        -1,
    );
    Ok(BlockTargets {
        block_token_ids,
        labels,
        supervised,
        weights,
        anchors,
        predecessors,
    })
}

/// Runs the draft model over a packed batch and computes the DFlash loss.
pub fn compute_objective(
    model: &DraftModel,
    batch: &PackedBatch,
    gamma: f64,
) -> Result<ObjectiveOutput, DraftError> {
    if model.is_dspark() {
        return dspark_objective(model, batch, gamma);
    }
    let block_size = model.config().block_size;
    let targets = block_targets(model, batch, gamma)?;
    let draft_hidden = model.forward_blocks(&BlockInputs {
        target_hidden: &batch.target_hidden,
        block_token_ids: &targets.block_token_ids,
        anchor_positions: &targets.anchors,
    })?;
    let labels = &targets.labels;
    let weights = &targets.weights;
    let supervised = &targets.supervised;

    let logits = model.logits(&draft_hidden.narrow(2, 1, block_size - 1));
    let log_probabilities = logits.log_softmax(-1, Kind::Float);
    let cross_entropy = -log_probabilities
        .gather(-1, &labels.unsqueeze(-1), false)
        .squeeze_dim(-1);
    let weight_sum = weights.sum(Kind::Float);
    let mut weighted_cross_entropy = (&cross_entropy * weights).sum(Kind::Float);
    let selector = match model.config().dflash2.as_ref() {
        None => None,
        Some(dflash2) => {
            let terms = selector_terms(
                model,
                &draft_hidden.narrow(2, 1, block_size - 1),
                &logits,
                labels,
                &targets.predecessors,
                weights,
                supervised,
            )?;
            let mut totals = terms.totals(weighted_cross_entropy.double_value(&[]), dflash2)?;
            weighted_cross_entropy = weighted_cross_entropy
                .g_add(&(&terms.weighted_cross_entropy * dflash2.selector_loss_alpha));
            totals.selector_weighted_cross_entropy = terms.weighted_cross_entropy.double_value(&[]);
            Some(totals)
        }
    };
    let loss = weighted_cross_entropy / weight_sum.clamp_min(1e-12);

    let correct = logits
        .argmax(-1, false)
        .eq_tensor(labels)
        .to_kind(Kind::Float)
        * supervised;
    let correct_per_position = correct.sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float);
    let supervised_per_position =
        supervised.sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float);
    Ok(ObjectiveOutput {
        loss,
        draft_hidden,
        weight_sum: weight_sum.double_value(&[]),
        correct_per_position: tensor_to_f64_vec(&correct_per_position)?,
        supervised_per_position: tensor_to_f64_vec(&supervised_per_position)?,
        selector,
        dspark: None,
    })
}

/// [`compute_objective`] of a DSpark model: one differentiable loss over
/// every block.
fn dspark_objective(
    model: &DraftModel,
    batch: &PackedBatch,
    gamma: f64,
) -> Result<ObjectiveOutput, DraftError> {
    let targets = dspark::dspark_targets(model, batch, gamma)?;
    let draft_hidden = model.forward_blocks(&BlockInputs {
        target_hidden: &batch.target_hidden,
        block_token_ids: &targets.block_token_ids,
        anchor_positions: &targets.anchors,
    })?;
    let num_blocks = draft_hidden.size()[1];
    let chunk = dspark::dspark_chunk(model, &draft_hidden, &targets, 0, num_blocks)?;
    let weight_sum = chunk.totals.weight_sum;
    let correct = chunk.greedy_correct * &targets.supervised;
    Ok(ObjectiveOutput {
        loss: chunk.weighted_loss / weight_sum.max(1e-12),
        draft_hidden,
        weight_sum,
        correct_per_position: per_position(&correct)?,
        supervised_per_position: per_position(&targets.supervised)?,
        selector: None,
        dspark: Some(chunk.totals),
    })
}

/// `[batch, blocks, positions]` summed to `[positions]`.
fn per_position(values: &Tensor) -> Result<Vec<f64>, DraftError> {
    tensor_to_f64_vec(&values.sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float))
}

/// The unary top-k `candidate_ids` `[.., K]` (sorted, best first) made into
/// the selector's training candidates for `target_ids` `[..]`: where the
/// gold token is missing, it replaces the K-th (weakest) candidate. Returns
/// the training candidates, the gold's rank among them `[..]` and whether
/// the unary top-k held the gold `[..]` (speculators'
/// `selector_training_candidates`).
pub fn selector_training_candidates(
    candidate_ids: &Tensor,
    target_ids: &Tensor,
) -> Result<(Tensor, Tensor, Tensor), DraftError> {
    let top_k = candidate_ids.size().last().copied().unwrap_or(0);
    if top_k < 1 {
        return Err(DraftError::ShapeMismatch(format!(
            "selector candidates {:?} have no candidate dimension",
            candidate_ids.size()
        )));
    }
    let matches = candidate_ids.eq_tensor(&target_ids.unsqueeze(-1));
    let contains_target = matches.any_dim(-1, false);
    let found_rank = matches.to_kind(Kind::Int64).argmax(-1, false);
    let last_rank = found_rank.full_like(top_k - 1);
    let target_positions = found_rank.where_self(&contains_target, &last_rank);
    let last_candidate = candidate_ids.narrow(-1, top_k - 1, 1).squeeze_dim(-1);
    let replaced_last = last_candidate.where_self(&contains_target, target_ids);
    let training_candidate_ids = Tensor::cat(
        &[
            &candidate_ids.narrow(-1, 0, top_k - 1),
            &replaced_last.unsqueeze(-1),
        ],
        -1,
    );
    Ok((training_candidate_ids, target_positions, contains_target))
}

/// The selector's terms over some blocks: `Σ w·CE` (differentiable) and
/// the counts of recall@K and teacher-forced accuracy.
struct SelectorTerms {
    weighted_cross_entropy: Tensor,
    supervised: Tensor,
    recall_hits: Tensor,
    selector_correct: Tensor,
}

impl SelectorTerms {
    /// The totals with the unary `Σ w·CE`; the selector's own is filled by
    /// the caller, which may have back-propagated it chunk by chunk.
    fn totals(
        &self,
        unary_weighted_cross_entropy: f64,
        dflash2: &super::Dflash2Config,
    ) -> Result<SelectorTotals, DraftError> {
        Ok(SelectorTotals {
            top_k: dflash2.selector_top_k,
            selector_loss_alpha: dflash2.selector_loss_alpha,
            unary_weighted_cross_entropy,
            selector_weighted_cross_entropy: 0.0,
            supervised: self.supervised.double_value(&[]),
            recall_hits: self.recall_hits.double_value(&[]),
            selector_correct: self.selector_correct.double_value(&[]),
        })
    }
}

/// The selector loss and metrics of draft hidden states `hidden`
/// `[batch, blocks, B−1, hidden]` with unary `logits` `[.., vocab]`.
fn selector_terms(
    model: &DraftModel,
    hidden: &Tensor,
    logits: &Tensor,
    labels: &Tensor,
    predecessors: &Tensor,
    weights: &Tensor,
    supervised: &Tensor,
) -> Result<SelectorTerms, DraftError> {
    let top_k = model.selector_top_k().ok_or_else(|| {
        DraftError::InvalidConfig("the selector loss needs a DFlash2 model".to_string())
    })?;
    let (_, candidate_ids) = tch::no_grad(|| logits.topk(top_k, -1, true, true));
    let (training_candidate_ids, target_positions, contains_target) =
        selector_training_candidates(&candidate_ids, labels)?;
    let scores = model.selector_scores(hidden, logits, predecessors, &training_candidate_ids)?;
    let cross_entropy = -scores
        .log_softmax(-1, Kind::Float)
        .gather(-1, &target_positions.unsqueeze(-1), false)
        .squeeze_dim(-1);
    let weighted_cross_entropy = (&cross_entropy * weights).sum(Kind::Float);
    let (recall_hits, selector_correct) = tch::no_grad(|| {
        let recalled = contains_target.to_kind(Kind::Float) * supervised;
        let chosen = training_candidate_ids
            .gather(-1, &scores.argmax(-1, true), false)
            .squeeze_dim(-1);
        let correct = chosen.eq_tensor(labels).to_kind(Kind::Float) * &recalled;
        (recalled.sum(Kind::Float), correct.sum(Kind::Float))
    });
    Ok(SelectorTerms {
        weighted_cross_entropy,
        supervised: supervised.sum(Kind::Float),
        recall_hits,
        selector_correct,
    })
}

/// How a training step trades memory for recomputation. The gradients are
/// the same whatever the choice (up to float summation order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ObjectiveMemory {
    /// Blocks (per sequence) whose logits `[batch, blocks, B−1, vocab]` exist
    /// at once; `None` for all of them. Each chunk's cross-entropy is
    /// back-propagated into the draft hidden states before the next chunk's
    /// logits are made.
    pub logits_chunk_blocks: Option<i64>,
    /// Keep only each draft layer's input during the forward and recompute
    /// the layer in the backward.
    pub checkpoint_layers: bool,
}

/// What [`compute_objective_backward`] produced: the loss as a number, the
/// gradients being already in the parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct BackwardOutput {
    /// `Σ w·CE / Σ w` (NaN-free: 0 when `Σ w = 0`).
    pub loss: f64,
    /// `Σ w`.
    pub weight_sum: f64,
    /// Per block position `k = 1..B−1`: supervised targets predicted right.
    pub correct_per_position: Vec<f64>,
    /// Per block position `k = 1..B−1`: supervised targets.
    pub supervised_per_position: Vec<f64>,
    /// DFlash2's selector terms; `None` for DFlash.
    pub selector: Option<SelectorTotals>,
    /// DSpark's terms and metrics; `None` for DFlash and DFlash2.
    pub dspark: Option<DsparkTotals>,
}

/// Forward and backward of the objective in one go: back-propagates the
/// unnormalised `Σ w·CE` (what the trainer accumulates across micro-batches)
/// into the parameters' gradients, with the logits made a chunk of blocks at
/// a time and optionally the draft layers checkpointed.
pub fn compute_objective_backward(
    model: &DraftModel,
    batch: &PackedBatch,
    gamma: f64,
    memory: ObjectiveMemory,
) -> Result<BackwardOutput, DraftError> {
    if let Some(chunk) = memory.logits_chunk_blocks.filter(|&chunk| chunk < 1) {
        return Err(DraftError::InvalidConfig(format!(
            "logits chunk of {chunk} blocks, expected at least 1"
        )));
    }
    if model.is_dspark() {
        return dspark_objective_backward(model, batch, gamma, memory);
    }
    let targets = block_targets(model, batch, gamma)?;
    let weight_sum = targets.weights.sum(Kind::Float).double_value(&[]);
    let train = weight_sum > 0.0;
    let inputs = BlockInputs {
        target_hidden: &batch.target_hidden,
        block_token_ids: &targets.block_token_ids,
        anchor_positions: &targets.anchors,
    };
    let head = |draft_hidden: &Tensor| {
        chunked_cross_entropy(
            model,
            &targets,
            draft_hidden,
            memory.logits_chunk_blocks,
            train,
        )
    };
    let (weighted_cross_entropy, correct, selector) = if memory.checkpoint_layers && train {
        model.forward_backward_checkpointed(&inputs, head)?
    } else {
        let draft_hidden = model.forward_blocks(&inputs)?;
        let leaf = draft_hidden.detach().set_requires_grad(train);
        let result = head(&leaf)?;
        if train {
            super::model::backward_with_gradient(&draft_hidden, &leaf.grad());
        }
        result
    };
    let correct = correct * &targets.supervised;
    let correct_per_position = correct.sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float);
    let supervised_per_position =
        targets
            .supervised
            .sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float);
    Ok(BackwardOutput {
        loss: if train {
            weighted_cross_entropy / weight_sum
        } else {
            0.0
        },
        weight_sum,
        correct_per_position: tensor_to_f64_vec(&correct_per_position)?,
        supervised_per_position: tensor_to_f64_vec(&supervised_per_position)?,
        selector,
        dspark: None,
    })
}

/// [`compute_objective_backward`] of a DSpark model.
fn dspark_objective_backward(
    model: &DraftModel,
    batch: &PackedBatch,
    gamma: f64,
    memory: ObjectiveMemory,
) -> Result<BackwardOutput, DraftError> {
    let targets = dspark::dspark_targets(model, batch, gamma)?;
    let weight_sum = targets.weights.sum(Kind::Float).double_value(&[]);
    let train = weight_sum > 0.0;
    let inputs = BlockInputs {
        target_hidden: &batch.target_hidden,
        block_token_ids: &targets.block_token_ids,
        anchor_positions: &targets.anchors,
    };
    let head = |draft_hidden: &Tensor| {
        dspark::dspark_chunked_loss(
            model,
            &targets,
            draft_hidden,
            memory.logits_chunk_blocks,
            train,
        )
    };
    let (weighted_loss, correct, totals) = if memory.checkpoint_layers && train {
        model.forward_backward_checkpointed(&inputs, head)?
    } else {
        let draft_hidden = model.forward_blocks(&inputs)?;
        let leaf = draft_hidden.detach().set_requires_grad(train);
        let result = head(&leaf)?;
        if train {
            super::model::backward_with_gradient(&draft_hidden, &leaf.grad());
        }
        result
    };
    let correct = correct * &targets.supervised;
    Ok(BackwardOutput {
        loss: if train {
            weighted_loss / weight_sum
        } else {
            0.0
        },
        weight_sum,
        correct_per_position: per_position(&correct)?,
        supervised_per_position: per_position(&targets.supervised)?,
        selector: None,
        dspark: Some(totals),
    })
}

/// The weighted cross-entropy `Σ w·CE` over the draft hidden states (a
/// leaf that requires grad when `train`), `chunk_blocks` blocks of logits at
/// a time: each chunk back-propagates into the leaf's grad. Also which
/// predictions were right, `[batch, blocks, block_size − 1]`. For DFlash2
/// the sum includes `α·Σ w·CE_selector` and the selector's totals come too.
fn chunked_cross_entropy(
    model: &DraftModel,
    targets: &BlockTargets,
    draft_hidden: &Tensor,
    chunk_blocks: Option<i64>,
    train: bool,
) -> Result<(f64, Tensor, Option<SelectorTotals>), DraftError> {
    let block_size = model.config().block_size;
    let num_blocks = draft_hidden.size()[1];
    let chunk_blocks = chunk_blocks
        .unwrap_or(num_blocks)
        .clamp(1, num_blocks.max(1));
    let mut weighted_cross_entropy = 0.0;
    let mut selector = model
        .config()
        .dflash2
        .as_ref()
        .map(|dflash2| SelectorTotals {
            top_k: dflash2.selector_top_k,
            selector_loss_alpha: dflash2.selector_loss_alpha,
            ..SelectorTotals::default()
        });
    let mut correct_chunks = Vec::new();
    let mut first_block = 0;
    while first_block < num_blocks {
        let blocks = chunk_blocks.min(num_blocks - first_block);
        let hidden = draft_hidden
            .narrow(1, first_block, blocks)
            .narrow(2, 1, block_size - 1);
        let labels = targets.labels.narrow(1, first_block, blocks);
        let weights = targets.weights.narrow(1, first_block, blocks);
        let logits = model.logits(&hidden);
        let cross_entropy = -logits
            .log_softmax(-1, Kind::Float)
            .gather(-1, &labels.unsqueeze(-1), false)
            .squeeze_dim(-1);
        let mut chunk_sum = (&cross_entropy * &weights).sum(Kind::Float);
        weighted_cross_entropy += chunk_sum.double_value(&[]);
        if let (Some(totals), Some(dflash2)) = (selector.as_mut(), model.config().dflash2.as_ref())
        {
            let terms = selector_terms(
                model,
                &hidden,
                &logits,
                &labels,
                &targets.predecessors.narrow(1, first_block, blocks),
                &weights,
                &targets.supervised.narrow(1, first_block, blocks),
            )?;
            let mut chunk_totals = terms.totals(chunk_sum.double_value(&[]), dflash2)?;
            let selector_sum = terms.weighted_cross_entropy.double_value(&[]);
            chunk_totals.selector_weighted_cross_entropy = selector_sum;
            totals.add(&chunk_totals);
            weighted_cross_entropy += dflash2.selector_loss_alpha * selector_sum;
            chunk_sum =
                chunk_sum.g_add(&(terms.weighted_cross_entropy * dflash2.selector_loss_alpha));
        }
        if train {
            chunk_sum.backward();
        }
        correct_chunks.push(tch::no_grad(|| {
            logits
                .argmax(-1, false)
                .eq_tensor(&labels)
                .to_kind(Kind::Float)
        }));
        first_block += blocks;
    }
    Ok((
        weighted_cross_entropy,
        Tensor::cat(&correct_chunks, 1),
        selector,
    ))
}

/// A 1-D tensor's values as f64.
pub(crate) fn tensor_to_f64_vec(tensor: &Tensor) -> Result<Vec<f64>, DraftError> {
    let flat = tensor
        .to_device(Device::Cpu)
        .to_kind(Kind::Double)
        .flatten(0, -1);
    Ok(Vec::<f64>::try_from(&flat)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn candidates_need_two_supervised_tokens_in_a_row() {
        assert_eq!(
            anchor_candidates(&[0, 1, 1, 1, 0, 1, 0, 1, 1]),
            vec![1, 2, 7]
        );
        assert!(anchor_candidates(&[1]).is_empty());
    }

    #[test]
    fn sampled_anchors_are_sorted_distinct_candidates_and_seeded() {
        let mask = vec![1u8; 100];
        let mut first = StdRng::seed_from_u64(7);
        let mut second = StdRng::seed_from_u64(7);
        let anchors = sample_anchors(&mask, 10, &mut first);
        assert_eq!(anchors.len(), 10);
        assert!(anchors.windows(2).all(|pair| pair[0] < pair[1]));
        assert!(anchors.iter().all(|&anchor| (0..99).contains(&anchor)));
        assert_eq!(anchors, sample_anchors(&mask, 10, &mut second));
        assert_eq!(sample_anchors(&[1, 1, 0], 10, &mut first), vec![0]);
    }

    #[test]
    fn gamma_defaults_follow_the_recipes() {
        assert_eq!(default_loss_decay_gamma(16), 7.0);
        assert_eq!(default_loss_decay_gamma(8), 4.0);
    }
}
