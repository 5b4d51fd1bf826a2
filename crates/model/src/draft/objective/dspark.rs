//! DSpark's objective (speculators 0.9.0's `DSparkDraftModel.forward` and
//! `dspark.metrics.compute_metrics`, `sample_from_anchor` true): block slot
//! `k = 0..B−1` of the block at anchor `p` predicts the token after
//! position `p + k`; its teacher is the target's own distribution there,
//! `softmax(lm_head(last_hidden[p + k]))`, made from the target's last
//! hidden state (after its final norm, before its LM head) through the
//! frozen LM head the drafter already holds. The drafter's logits at slot
//! `k` carry the Markov bias of the true token at `p + k` (teacher forcing).
//!
//! Per slot, with `w = loss_mask[p + k] · exp(−k/γ)` (speculators masks the
//! slot by its input position):
//! - the distillation term `KL(p ‖ q)` of the teacher `p` and the drafter `q`;
//! - the confidence term: BCE of the confidence logit against the
//!   analytical acceptance rate `a = Σ_v min(p_v, q_v) = 1 − TV(q, p)`
//!   (a constant: no gradient flows through it);
//! - loss `= (Σ w·KL + α·Σ w·BCE) / Σ w`. speculators divides both sums by
//!   the supervised count `N` instead of `Σ w` (see `docs/dspark.md`).
//!
//! The metrics are speculators': mean acceptance rate, the expected accept
//! length per block (cumulative product of `a` over the slots, plus the
//! bonus token), the greedy accept length (leading run of slots whose
//! argmax is the teacher's argmax, plus the bonus), per-slot greedy
//! accuracy, and the confidence head's calibration (absolute error, mean
//! prediction, bias of its cumulative product against `a`'s).

use tch::{Kind, Reduction, Tensor};

use super::packing::PackedBatch;
use crate::draft::error::DraftError;
use crate::draft::model::DraftModel;

/// DSpark's loss terms and metrics over a batch, as sums so that
/// micro-batches (and data-parallel members) add up exactly.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DsparkTotals {
    /// `α` of the loss.
    pub confidence_head_alpha: f64,
    /// `Σ w·KL(p ‖ q)`.
    pub weighted_distillation: f64,
    /// `Σ w·BCE(confidence, a)` (0 without a confidence head).
    pub weighted_confidence: f64,
    /// `Σ w`.
    pub weight_sum: f64,
    /// Supervised slots `N`.
    pub supervised: f64,
    /// `Σ a` over supervised slots.
    pub accept_rate_sum: f64,
    /// Blocks with at least one supervised slot.
    pub valid_blocks: f64,
    /// `Σ (1 + Σ_k Π_{j≤k} a_j·mask_j)` over valid blocks.
    pub accept_length_sum: f64,
    /// `Σ (1 + leading run of greedy hits)` over valid blocks.
    pub greedy_accept_length_sum: f64,
    /// `Σ |σ(confidence) − a|` over supervised slots.
    pub confidence_absolute_error_sum: f64,
    /// `Σ σ(confidence)` over supervised slots.
    pub confidence_prediction_sum: f64,
    /// `Σ (Π σ(confidence)·mask − Π a·mask)` over supervised slots.
    pub confidence_cumulative_bias_sum: f64,
    /// Whether the confidence head exists (its figures are 0 otherwise).
    pub has_confidence_head: bool,
}

impl DsparkTotals {
    /// Sums another batch's totals into these.
    pub fn add(&mut self, other: &DsparkTotals) {
        self.confidence_head_alpha = other.confidence_head_alpha;
        self.has_confidence_head = other.has_confidence_head;
        self.weighted_distillation += other.weighted_distillation;
        self.weighted_confidence += other.weighted_confidence;
        self.weight_sum += other.weight_sum;
        self.supervised += other.supervised;
        self.accept_rate_sum += other.accept_rate_sum;
        self.valid_blocks += other.valid_blocks;
        self.accept_length_sum += other.accept_length_sum;
        self.greedy_accept_length_sum += other.greedy_accept_length_sum;
        self.confidence_absolute_error_sum += other.confidence_absolute_error_sum;
        self.confidence_prediction_sum += other.confidence_prediction_sum;
        self.confidence_cumulative_bias_sum += other.confidence_cumulative_bias_sum;
    }

    /// `(Σ w·KL + α·Σ w·BCE) / Σ w`.
    pub fn loss(&self) -> f64 {
        ratio(
            self.weighted_distillation + self.confidence_head_alpha * self.weighted_confidence,
            self.weight_sum,
        )
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

/// DSpark's per-block targets: what the slots read and are weighed by.
pub(super) struct DsparkTargets {
    /// `[batch, blocks, B]`: the anchor token, then mask tokens.
    pub(super) block_token_ids: Tensor,
    /// `[batch, blocks]`.
    pub(super) anchors: Tensor,
    /// `[batch, blocks, B]` the true token at `p + k`: the Markov head's
    /// previous token of slot `k`.
    pub(super) previous_tokens: Tensor,
    /// `[batch, blocks, B]` 1 where slot `k` is supervised.
    pub(super) supervised: Tensor,
    /// `[batch, blocks, B]` `supervised · exp(−k/γ)`.
    pub(super) weights: Tensor,
    /// `[batch, blocks, B, hidden]` the target's last hidden state at `p + k`.
    pub(super) teacher_hidden: Tensor,
}

pub(super) fn dspark_targets(
    model: &DraftModel,
    batch: &PackedBatch,
    gamma: f64,
) -> Result<DsparkTargets, DraftError> {
    let config = model.config();
    let device = model.device();
    let block_size = config.block_size;
    let last_hidden = batch.target_last_hidden.as_ref().ok_or_else(|| {
        DraftError::ShapeMismatch(
            "a DSpark drafter trains on the target's last hidden state, and the batch has none"
                .to_string(),
        )
    })?;
    let input_ids = batch.input_ids.to_device(device);
    let loss_mask = batch.loss_mask.to_device(device);
    let anchors = batch.anchors.to_device(device);
    let anchor_valid = batch.anchor_valid.to_device(device);
    let (batch_size, max_len) = input_ids.size2()?;
    let (hidden_batch, hidden_len, hidden_width) = last_hidden.size3()?;
    if hidden_batch != batch_size || hidden_len != max_len || hidden_width != config.hidden_size {
        return Err(DraftError::ShapeMismatch(format!(
            "target last hidden states {:?}, expected [{batch_size}, {max_len}, {}]",
            last_hidden.size(),
            config.hidden_size
        )));
    }
    let num_blocks = anchors.size()[1];

    let anchor_tokens = input_ids.gather(1, &anchors, false);
    let mask_tokens = Tensor::full(
        [batch_size, num_blocks, block_size - 1],
        config.mask_token_id,
        (Kind::Int64, device),
    );
    let block_token_ids = Tensor::cat(&[&anchor_tokens.unsqueeze(-1), &mask_tokens], -1);

    let offsets = Tensor::arange(block_size, (Kind::Int64, device));
    let slot_positions = anchors.unsqueeze(-1) + &offsets;
    let in_range = slot_positions.lt(max_len);
    let clamped = slot_positions.clamp_max(max_len - 1);
    let flat = clamped.view([batch_size, -1]);
    let previous_tokens = input_ids.gather(1, &flat, false).view_as(&clamped);
    let slot_mask = loss_mask.gather(1, &flat, false).view_as(&clamped);
    let supervised =
        slot_mask * in_range.to_kind(Kind::Float) * anchor_valid.unsqueeze(-1).to_kind(Kind::Float);
    let decay = (offsets.to_kind(Kind::Float) * (-1.0 / gamma)).exp();
    let weights = &supervised * decay;
    // The wire's bf16 (or any float kind) in the kind the LM head computes in.
    let last_hidden = last_hidden.to_device(device).to_kind(model.compute_kind());
    let teacher_hidden = last_hidden
        .gather(
            1,
            &flat
                .unsqueeze(-1)
                .expand([batch_size, num_blocks * block_size, hidden_width], false),
            false,
        )
        .view([batch_size, num_blocks, block_size, hidden_width]);
    Ok(DsparkTargets {
        block_token_ids,
        anchors,
        previous_tokens,
        supervised,
        weights,
        teacher_hidden,
    })
}

/// What the DSpark heads and loss made of some blocks' draft hidden states.
pub(super) struct DsparkChunk {
    /// `Σ w·KL + α·Σ w·BCE`, differentiable.
    pub(super) weighted_loss: Tensor,
    pub(super) totals: DsparkTotals,
    /// `[batch, blocks, B]` f32: 1 where the drafter's argmax is the teacher's.
    pub(super) greedy_correct: Tensor,
}

/// The loss and metrics of draft hidden states `hidden`
/// `[batch, blocks, B, hidden]` against the targets of the same blocks.
pub(super) fn dspark_chunk(
    model: &DraftModel,
    hidden: &Tensor,
    targets: &DsparkTargets,
    first_block: i64,
    blocks: i64,
) -> Result<DsparkChunk, DraftError> {
    let dspark = model.config().dspark.as_ref().ok_or_else(|| {
        DraftError::InvalidConfig("the DSpark objective needs a DSpark model".to_string())
    })?;
    let alpha = dspark.confidence_head_alpha;
    let narrow = |tensor: &Tensor| tensor.narrow(1, first_block, blocks);
    let previous_tokens = narrow(&targets.previous_tokens);
    let supervised = narrow(&targets.supervised);
    let weights = narrow(&targets.weights);
    let heads = model.dspark_block_heads(hidden, &previous_tokens)?;
    let unbiased_logits = model.logits(hidden);
    let logits = match &heads.markov_bias {
        Some(bias) => unbiased_logits + bias,
        None => unbiased_logits,
    };
    let teacher_logits = tch::no_grad(|| model.logits(&narrow(&targets.teacher_hidden)));
    let teacher_log_probabilities = teacher_logits.log_softmax(-1, Kind::Float);
    let teacher_probabilities = teacher_log_probabilities.exp();
    let log_probabilities = logits.log_softmax(-1, Kind::Float);
    let distillation = (&teacher_probabilities * (&teacher_log_probabilities - &log_probabilities))
        .sum_dim_intlist([-1i64].as_slice(), false, Kind::Float);
    let mut weighted_loss = (&distillation * &weights).sum(Kind::Float);
    let weighted_distillation = weighted_loss.double_value(&[]);

    let accept_rate = tch::no_grad(|| {
        log_probabilities
            .exp()
            .minimum(&teacher_probabilities)
            .sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)
    });
    let mut totals = tch::no_grad(|| -> Result<DsparkTotals, DraftError> {
        let accepted_prefix = (&accept_rate * &supervised).cumprod(-1, Kind::Float);
        let block_valid = supervised
            .sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)
            .gt(0.0)
            .to_kind(Kind::Float);
        let greedy_correct = logits
            .argmax(-1, false)
            .eq_tensor(&teacher_logits.argmax(-1, false))
            .to_kind(Kind::Float);
        let greedy_prefix = (&greedy_correct * &supervised).cumprod(-1, Kind::Float);
        let per_block = |prefix: &Tensor| -> f64 {
            ((prefix.sum_dim_intlist([-1i64].as_slice(), false, Kind::Float) + 1.0) * &block_valid)
                .sum(Kind::Float)
                .double_value(&[])
        };
        Ok(DsparkTotals {
            confidence_head_alpha: alpha,
            weighted_distillation,
            weight_sum: weights.sum(Kind::Float).double_value(&[]),
            supervised: supervised.sum(Kind::Float).double_value(&[]),
            accept_rate_sum: (&accept_rate * &supervised)
                .sum(Kind::Float)
                .double_value(&[]),
            valid_blocks: block_valid.sum(Kind::Float).double_value(&[]),
            accept_length_sum: per_block(&accepted_prefix),
            greedy_accept_length_sum: per_block(&greedy_prefix),
            ..DsparkTotals::default()
        })
    })?;
    if let Some(confidence_logits) = &heads.confidence_logits {
        let binary_cross_entropy = confidence_logits.binary_cross_entropy_with_logits::<Tensor>(
            &accept_rate,
            None,
            None,
            Reduction::None,
        );
        let weighted_confidence = (&binary_cross_entropy * &weights).sum(Kind::Float);
        totals.has_confidence_head = true;
        totals.weighted_confidence = weighted_confidence.double_value(&[]);
        weighted_loss = weighted_loss.g_add(&(weighted_confidence * alpha));
        tch::no_grad(|| {
            let predicted = confidence_logits.sigmoid();
            totals.confidence_absolute_error_sum = ((&predicted - &accept_rate).abs()
                * &supervised)
                .sum(Kind::Float)
                .double_value(&[]);
            totals.confidence_prediction_sum = (&predicted * &supervised)
                .sum(Kind::Float)
                .double_value(&[]);
            let predicted_prefix = (&predicted * &supervised).cumprod(-1, Kind::Float);
            let accepted_prefix = (&accept_rate * &supervised).cumprod(-1, Kind::Float);
            totals.confidence_cumulative_bias_sum = ((predicted_prefix - accepted_prefix)
                * &supervised)
                .sum(Kind::Float)
                .double_value(&[]);
        });
    }
    let greedy_correct = tch::no_grad(|| {
        logits
            .argmax(-1, false)
            .eq_tensor(&teacher_logits.argmax(-1, false))
            .to_kind(Kind::Float)
    });
    Ok(DsparkChunk {
        weighted_loss,
        totals,
        greedy_correct,
    })
}

/// The DSpark loss over draft hidden states `draft_hidden` (a leaf that
/// requires grad when `train`), `chunk_blocks` blocks at a time: each
/// chunk back-propagates into the leaf's grad before the next chunk's
/// logits (drafter's and teacher's) are made. Returns `Σ w·KL + α·Σ w·BCE`,
/// the greedy hits `[batch, blocks, B]` and the totals.
pub(super) fn dspark_chunked_loss(
    model: &DraftModel,
    targets: &DsparkTargets,
    draft_hidden: &Tensor,
    chunk_blocks: Option<i64>,
    train: bool,
) -> Result<(f64, Tensor, DsparkTotals), DraftError> {
    let num_blocks = draft_hidden.size()[1];
    let chunk_blocks = chunk_blocks
        .unwrap_or(num_blocks)
        .clamp(1, num_blocks.max(1));
    let mut weighted_loss = 0.0;
    let mut totals = DsparkTotals::default();
    let mut correct_chunks = Vec::new();
    let mut first_block = 0;
    while first_block < num_blocks {
        let blocks = chunk_blocks.min(num_blocks - first_block);
        let hidden = draft_hidden.narrow(1, first_block, blocks);
        let chunk = dspark_chunk(model, &hidden, targets, first_block, blocks)?;
        weighted_loss += chunk.weighted_loss.double_value(&[]);
        if train {
            chunk.weighted_loss.backward();
        }
        totals.add(&chunk.totals);
        correct_chunks.push(chunk.greedy_correct);
        first_block += blocks;
    }
    Ok((weighted_loss, Tensor::cat(&correct_chunks, 1), totals))
}
