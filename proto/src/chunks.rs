//! Named tensors sent as `TensorChunk`s (the run's model in a ModelSync reply
//! or a `ReadModel` stream), put back together: each tensor's chunks in
//! order and contiguous, one tensor after the other, then a count that
//! must match. One reader for the drafter's sync link and the evaluator.

use crate::v1::TensorChunk;

/// A tensor as received: name, shape, and its bytes as sent.
pub type ReceivedTensor = (String, Vec<u64>, Vec<u8>);

/// Why chunks do not make the tensors they claim. Messages name the
/// tensor, the offset or the counts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssembleError {
    #[error("chunk of {name:?} at offset {offset} out of order (expected {expected_name:?} at {expected_offset}, or a new tensor at 0)")]
    OutOfOrder {
        name: String,
        offset: u64,
        expected_name: String,
        expected_offset: u64,
    },
    #[error("{received} tensors received, the sender said {said}")]
    CountMismatch { received: usize, said: u32 },
}

/// Collects chunks into tensors.
#[derive(Debug, Default)]
pub struct TensorAssembler {
    tensors: Vec<ReceivedTensor>,
}

impl TensorAssembler {
    /// Adds a chunk: the next bytes of the tensor being received, or the
    /// first (offset 0) of the next tensor.
    pub fn push(&mut self, chunk: TensorChunk) -> Result<(), AssembleError> {
        if let Some((name, _, bytes)) = self.tensors.last_mut() {
            if *name == chunk.name && bytes.len() as u64 == chunk.offset {
                bytes.extend_from_slice(&chunk.data);
                return Ok(());
            }
        }
        if chunk.offset != 0 {
            let (expected_name, expected_offset) = self
                .tensors
                .last()
                .map_or((String::new(), 0), |(name, _, bytes)| {
                    (name.clone(), bytes.len() as u64)
                });
            return Err(AssembleError::OutOfOrder {
                name: chunk.name,
                offset: chunk.offset,
                expected_name,
                expected_offset,
            });
        }
        self.tensors
            .push((chunk.name, chunk.shape, chunk.data.to_vec()));
        Ok(())
    }

    /// The tensors, when the sender's count (its DONE) matches.
    pub fn finish(self, said: u32) -> Result<Vec<ReceivedTensor>, AssembleError> {
        if self.tensors.len() != said as usize {
            return Err(AssembleError::CountMismatch {
                received: self.tensors.len(),
                said,
            });
        }
        Ok(self.tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(name: &str, offset: u64, data: &[u8]) -> TensorChunk {
        TensorChunk {
            name: name.to_string(),
            shape: vec![data.len() as u64],
            offset,
            data: data.to_vec().into(),
            ..Default::default()
        }
    }

    #[test]
    fn chunks_in_order_make_their_tensors() {
        let mut assembler = TensorAssembler::default();
        assembler.push(chunk("a", 0, &[1, 2])).unwrap();
        assembler.push(chunk("a", 2, &[3])).unwrap();
        assembler.push(chunk("b", 0, &[9])).unwrap();
        let tensors = assembler.finish(2).unwrap();
        assert_eq!(tensors[0].0, "a");
        assert_eq!(tensors[0].2, vec![1, 2, 3]);
        assert_eq!(tensors[1].2, vec![9]);
    }

    #[test]
    fn a_gap_a_late_start_or_a_wrong_count_is_refused_naming_it() {
        let mut assembler = TensorAssembler::default();
        assembler.push(chunk("a", 0, &[1, 2])).unwrap();
        let error = assembler.push(chunk("a", 3, &[4])).unwrap_err();
        assert_eq!(
            error.to_string(),
            "chunk of \"a\" at offset 3 out of order (expected \"a\" at 2, or a new tensor at 0)"
        );
        let error = assembler.push(chunk("b", 1, &[4])).unwrap_err();
        assert!(error.to_string().contains("\"b\" at offset 1"), "{error}");
        let error = assembler.finish(3).unwrap_err();
        assert_eq!(error.to_string(), "1 tensors received, the sender said 3");
        let mut first = TensorAssembler::default();
        assert!(matches!(
            first.push(chunk("a", 5, &[1])),
            Err(AssembleError::OutOfOrder { .. })
        ));
    }
}
