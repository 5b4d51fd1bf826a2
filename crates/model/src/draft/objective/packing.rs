//! Anchor sampling and block packing: sequences to the padded tensors of
//! one forward ([`PackedBatch`]).

use rand::rngs::StdRng;
use tch::Tensor;

use crate::draft::error::DraftError;

/// Default decay γ of the per-position weights for a block size: 7 for 16,
/// 4 for 8 (the published recipes), proportional in between.
pub fn default_loss_decay_gamma(block_size: i64) -> f64 {
    match block_size {
        16 => 7.0,
        8 => 4.0,
        other => (other as f64 * 7.0 / 16.0).max(1.0),
    }
}

/// One training sequence as it comes off the wire.
#[derive(Debug)]
pub struct TrainingSequence {
    /// `[T]` token ids.
    pub input_ids: Vec<i64>,
    /// `[T]` 1 where the token is supervised (assistant tokens).
    pub loss_mask: Vec<u8>,
    /// `[T, n·hidden]` tapped target hidden states (any float kind, CPU).
    pub target_hidden: Tensor,
    /// `[T, hidden]` the target's last hidden state (after its final norm,
    /// the LM head's input): DSpark's teacher. `None` where the run does not
    /// capture it (DFlash, DFlash2).
    pub target_last_hidden: Option<Tensor>,
}

impl TrainingSequence {
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}

/// Positions that may start a block: supervised and followed by a supervised token.
pub fn anchor_candidates(loss_mask: &[u8]) -> Vec<i64> {
    loss_mask
        .windows(2)
        .enumerate()
        .filter(|(_, pair)| pair[0] != 0 && pair[1] != 0)
        .map(|(position, _)| position as i64)
        .collect()
}

/// Up to `num_anchors` candidates drawn without replacement, sorted.
pub fn sample_anchors(loss_mask: &[u8], num_anchors: usize, generator: &mut StdRng) -> Vec<i64> {
    let candidates = anchor_candidates(loss_mask);
    if candidates.len() <= num_anchors {
        return candidates;
    }
    let mut chosen: Vec<i64> = rand::seq::index::sample(generator, candidates.len(), num_anchors)
        .into_iter()
        .map(|index| candidates[index])
        .collect();
    chosen.sort_unstable();
    chosen
}

/// A padded batch ready for the forward.
pub struct PackedBatch {
    /// `[batch, max_len, n·hidden]`, zero beyond each sequence's end.
    pub target_hidden: Tensor,
    /// `[batch, max_len, hidden]` the target's last hidden states, zero
    /// beyond each sequence's end; `None` unless every sequence has them.
    pub target_last_hidden: Option<Tensor>,
    /// `[batch, max_len]` token ids, zero-padded.
    pub input_ids: Tensor,
    /// `[batch, max_len]` f32 loss mask, zero-padded.
    pub loss_mask: Tensor,
    /// `[batch, max_anchors]` anchors, padding anchors at 0.
    pub anchors: Tensor,
    /// `[batch, max_anchors]` false for padding anchors.
    pub anchor_valid: Tensor,
    /// Real (unpadded) tokens in the batch, for throughput figures.
    pub num_tokens: usize,
}

/// Pads sequences and their anchors into one batch. Sequences without any
/// anchor contribute nothing to the loss but are still accepted.
pub fn pack_batch(
    sequences: &[TrainingSequence],
    anchors: &[Vec<i64>],
) -> Result<PackedBatch, DraftError> {
    if sequences.is_empty() || sequences.len() != anchors.len() {
        return Err(DraftError::ShapeMismatch(format!(
            "{} sequences with {} anchor lists",
            sequences.len(),
            anchors.len()
        )));
    }
    let max_len = sequences
        .iter()
        .map(TrainingSequence::len)
        .max()
        .unwrap_or(0) as i64;
    let max_anchors = anchors.iter().map(Vec::len).max().unwrap_or(0).max(1) as i64;
    let mut hidden_rows = Vec::with_capacity(sequences.len());
    let mut last_hidden_rows = Vec::with_capacity(sequences.len());
    let mut ids = Vec::with_capacity(sequences.len() * max_len as usize);
    let mut mask = Vec::with_capacity(sequences.len() * max_len as usize);
    let mut anchor_values = Vec::with_capacity(sequences.len() * max_anchors as usize);
    let mut anchor_valid = Vec::with_capacity(sequences.len() * max_anchors as usize);
    for (sequence, sequence_anchors) in sequences.iter().zip(anchors) {
        let length = sequence.len() as i64;
        let hidden_size = sequence.target_hidden.size();
        if hidden_size.len() != 2
            || hidden_size[0] != length
            || sequence.loss_mask.len() as i64 != length
        {
            return Err(DraftError::ShapeMismatch(format!(
                "sequence of {length} tokens with loss mask of {} and hidden states {hidden_size:?}",
                sequence.loss_mask.len()
            )));
        }
        if let Some(bad) = sequence_anchors
            .iter()
            .find(|&&anchor| anchor < 0 || anchor >= length)
        {
            return Err(DraftError::ShapeMismatch(format!(
                "anchor {bad} outside a sequence of {length} tokens"
            )));
        }
        let padding = max_len - length;
        hidden_rows.push(sequence.target_hidden.constant_pad_nd([0, 0, 0, padding]));
        if let Some(last_hidden) = &sequence.target_last_hidden {
            let last_size = last_hidden.size();
            if last_size.len() != 2 || last_size[0] != length {
                return Err(DraftError::ShapeMismatch(format!(
                    "sequence of {length} tokens with target last hidden states {last_size:?}"
                )));
            }
            last_hidden_rows.push(last_hidden.constant_pad_nd([0, 0, 0, padding]));
        }
        ids.extend(sequence.input_ids.iter().copied());
        ids.extend(std::iter::repeat_n(0, padding as usize));
        mask.extend(
            sequence
                .loss_mask
                .iter()
                .map(|&value| f32::from(value != 0)),
        );
        mask.extend(std::iter::repeat_n(0.0, padding as usize));
        anchor_values.extend(sequence_anchors.iter().copied());
        anchor_valid.extend(std::iter::repeat_n(true, sequence_anchors.len()));
        let anchor_padding = max_anchors as usize - sequence_anchors.len();
        anchor_values.extend(std::iter::repeat_n(0, anchor_padding));
        anchor_valid.extend(std::iter::repeat_n(false, anchor_padding));
    }
    let batch = sequences.len() as i64;
    Ok(PackedBatch {
        target_hidden: Tensor::stack(&hidden_rows, 0),
        target_last_hidden: if last_hidden_rows.len() == sequences.len() {
            Some(Tensor::stack(&last_hidden_rows, 0))
        } else {
            None
        },
        input_ids: Tensor::from_slice(&ids).view([batch, max_len]),
        loss_mask: Tensor::from_slice(&mask).view([batch, max_len]),
        anchors: Tensor::from_slice(&anchor_values).view([batch, max_anchors]),
        anchor_valid: Tensor::from_slice(&anchor_valid).view([batch, max_anchors]),
        num_tokens: sequences.iter().map(TrainingSequence::len).sum(),
    })
}
