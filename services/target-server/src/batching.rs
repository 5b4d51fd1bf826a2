//! Ordering samples and grouping them into padded batches under a token
//! budget.
//!
//! Samples are read in windows of `--sort-window` consecutive shard records;
//! each window is sorted by length (longest first, ties by line number) and
//! cut into batches whose padded size `batch_size × longest` stays within
//! `--max-batch-tokens`. Sorting inside a window, not over the whole shard,
//! keeps memory bounded and streaming possible while still putting samples
//! of similar length together, so little compute is spent on padding.
//!
//! The processing order is a pure function of the data, the shard, the
//! tokenizer, `--max-length` and `--sort-window` (not of the batch budget),
//! and `seq` numbers follow it. That is what makes `resume_after_seq` exact:
//! a restarted target recomputes the same order and skips the prefix the
//! broker already has. Changing `--sort-window` or `--max-length` between
//! restarts of one run breaks that and is refused by nothing: don't.

use dflash_model::chat::TokenizedSequence;

/// A tokenized sequence with its place in the data and in the stream (its
/// seq becomes the item's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumberedSequence {
    /// Position in this target's processing order; the broker's per-target
    /// item sequence number.
    pub seq: u64,
    /// 1-based line of the data file it came from (0 for generated data).
    pub line_number: u64,
    pub sequence: TokenizedSequence,
}

/// Samples that go through the model together, right-padded to the longest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedBatch {
    pub samples: Vec<NumberedSequence>,
}

impl PlannedBatch {
    /// Length every row is padded to.
    pub fn padded_length(&self) -> usize {
        self.samples
            .iter()
            .map(|sample| sample.sequence.input_ids.len())
            .max()
            .unwrap_or(0)
    }

    /// Tokens that are not padding.
    pub fn real_tokens(&self) -> usize {
        self.samples
            .iter()
            .map(|sample| sample.sequence.input_ids.len())
            .sum()
    }
}

/// Sorts one window longest first; equal lengths keep file order.
pub fn sort_window(window: &mut [(u64, TokenizedSequence)]) {
    window.sort_by(|(line_a, sample_a), (line_b, sample_b)| {
        sample_b
            .input_ids
            .len()
            .cmp(&sample_a.input_ids.len())
            .then(line_a.cmp(line_b))
    });
}

/// Cuts consecutive samples into batches with `batch_size × longest <=
/// max_batch_tokens`. A sample longer than the budget gets a batch of its
/// own rather than being dropped.
pub fn split_into_batches(
    samples: Vec<NumberedSequence>,
    max_batch_tokens: usize,
) -> Vec<PlannedBatch> {
    let mut batches = Vec::new();
    let mut current: Vec<NumberedSequence> = Vec::new();
    let mut current_longest = 0usize;
    for sample in samples {
        let length = sample.sequence.input_ids.len();
        let longest_if_added = current_longest.max(length);
        if !current.is_empty() && (current.len() + 1) * longest_if_added > max_batch_tokens {
            batches.push(PlannedBatch {
                samples: std::mem::take(&mut current),
            });
            current_longest = 0;
        }
        current_longest = current_longest.max(length);
        current.push(sample);
    }
    if !current.is_empty() {
        batches.push(PlannedBatch { samples: current });
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(seq: u64, length: usize) -> NumberedSequence {
        NumberedSequence {
            seq,
            line_number: seq + 1,
            sequence: TokenizedSequence {
                input_ids: vec![7; length],
                loss_mask: vec![1; length],
                truncated: false,
            },
        }
    }

    #[test]
    fn batches_respect_the_padded_token_budget() {
        let lengths = [100usize, 90, 90, 60, 50, 10, 10, 10, 5];
        let samples = lengths
            .iter()
            .enumerate()
            .map(|(seq, &length)| sample(seq as u64, length))
            .collect();
        let batches = split_into_batches(samples, 256);
        for batch in &batches {
            assert!(batch.samples.len() == 1 || batch.samples.len() * batch.padded_length() <= 256);
        }
        let sizes: Vec<usize> = batches.iter().map(|batch| batch.samples.len()).collect();
        assert_eq!(sizes, vec![2, 2, 5]);
        // Order and membership are preserved.
        let seqs: Vec<u64> = batches
            .iter()
            .flat_map(|batch| batch.samples.iter().map(|sample| sample.seq))
            .collect();
        assert_eq!(seqs, (0..9).collect::<Vec<u64>>());
    }

    #[test]
    fn an_oversized_sample_travels_alone() {
        let batches = split_into_batches(vec![sample(0, 10), sample(1, 500), sample(2, 10)], 100);
        let sizes: Vec<usize> = batches.iter().map(|batch| batch.samples.len()).collect();
        assert_eq!(sizes, vec![1, 1, 1]);
        assert_eq!(batches[1].padded_length(), 500);
        assert_eq!(batches[1].real_tokens(), 500);
    }

    #[test]
    fn windows_sort_longest_first_with_stable_ties() {
        let mut window: Vec<(u64, TokenizedSequence)> = [(1u64, 3usize), (2, 7), (3, 3), (4, 9)]
            .iter()
            .map(|&(line, length)| (line, sample(0, length).sequence))
            .collect();
        sort_window(&mut window);
        let lines: Vec<u64> = window.iter().map(|(line, _)| *line).collect();
        assert_eq!(lines, vec![4, 2, 1, 3]);
    }
}
