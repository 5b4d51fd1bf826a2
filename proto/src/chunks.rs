//! The run's model's files sent as `ModelFileChunk`s (a `ReadModel`
//! stream), put back together: each file's chunks in order and contiguous,
//! one file after the other, each exactly its declared size, then a count
//! that must match. One reader for the drafter's sync link and the
//! evaluator.

use crate::v1::ModelFileChunk;

/// A file as received: its name and its bytes.
pub type ReceivedFile = (String, Vec<u8>);

/// Why chunks do not make the files they claim. Messages name the file,
/// the offset or the counts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssembleError {
    #[error("chunk of {file:?} at offset {offset} out of order (expected {expected_file:?} at {expected_offset}, or a new file at 0)")]
    OutOfOrder {
        file: String,
        offset: u64,
        expected_file: String,
        expected_offset: u64,
    },
    #[error("file {file:?}: {received} bytes received, its size is {size}")]
    WrongSize {
        file: String,
        received: u64,
        size: u64,
    },
    #[error("file {file:?} of {size} bytes cannot be held in memory")]
    TooLarge { file: String, size: u64 },
    #[error("{received} files received, the sender said {said}")]
    CountMismatch { received: usize, said: u32 },
}

/// One file being received.
#[derive(Debug)]
struct PartialFile {
    name: String,
    /// The size every chunk of it declares.
    size: u64,
    bytes: Vec<u8>,
}

impl PartialFile {
    fn check_whole(&self) -> Result<(), AssembleError> {
        if self.bytes.len() as u64 == self.size {
            return Ok(());
        }
        Err(AssembleError::WrongSize {
            file: self.name.clone(),
            received: self.bytes.len() as u64,
            size: self.size,
        })
    }
}

/// Collects chunks into files.
#[derive(Debug, Default)]
pub struct FileAssembler {
    files: Vec<PartialFile>,
}

impl FileAssembler {
    /// Adds a chunk: the next bytes of the file being received, or the
    /// first (offset 0) of the next file once the one before is whole.
    pub fn push(&mut self, chunk: ModelFileChunk) -> Result<(), AssembleError> {
        if let Some(last) = self.files.last_mut() {
            if last.name == chunk.file && last.bytes.len() as u64 == chunk.offset {
                let received = last.bytes.len() as u64 + chunk.data.len() as u64;
                if chunk.file_size != last.size || received > last.size {
                    return Err(AssembleError::WrongSize {
                        file: chunk.file,
                        received,
                        size: last.size,
                    });
                }
                last.bytes.extend_from_slice(&chunk.data);
                return Ok(());
            }
        }
        if chunk.offset != 0 {
            let (expected_file, expected_offset) =
                self.files.last().map_or((String::new(), 0), |last| {
                    (last.name.clone(), last.bytes.len() as u64)
                });
            return Err(AssembleError::OutOfOrder {
                file: chunk.file,
                offset: chunk.offset,
                expected_file,
                expected_offset,
            });
        }
        if let Some(last) = self.files.last() {
            last.check_whole()?;
        }
        if chunk.data.len() as u64 > chunk.file_size {
            return Err(AssembleError::WrongSize {
                file: chunk.file,
                received: chunk.data.len() as u64,
                size: chunk.file_size,
            });
        }
        // Reserved once, at the size the sender declares: a file of 4 GiB
        // is not grown (and copied) by doubling. A size no allocator gives
        // is an error, not an abort.
        let mut bytes = Vec::new();
        let capacity = usize::try_from(chunk.file_size).ok();
        if capacity.is_none_or(|capacity| bytes.try_reserve_exact(capacity).is_err()) {
            return Err(AssembleError::TooLarge {
                file: chunk.file,
                size: chunk.file_size,
            });
        }
        bytes.extend_from_slice(&chunk.data);
        self.files.push(PartialFile {
            name: chunk.file,
            size: chunk.file_size,
            bytes,
        });
        Ok(())
    }

    /// The files, each whole, when the sender's count (its DONE) matches.
    pub fn finish(self, said: u32) -> Result<Vec<ReceivedFile>, AssembleError> {
        if self.files.len() != said as usize {
            return Err(AssembleError::CountMismatch {
                received: self.files.len(),
                said,
            });
        }
        for file in &self.files {
            file.check_whole()?;
        }
        Ok(self
            .files
            .into_iter()
            .map(|file| (file.name, file.bytes))
            .collect())
    }
}

/// The bytes of file `name` among `files`, taken out of them.
pub fn take_file(files: &mut Vec<ReceivedFile>, name: &str) -> Option<Vec<u8>> {
    let index = files.iter().position(|(file, _)| file == name)?;
    Some(files.swap_remove(index).1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(file: &str, offset: u64, data: &[u8], file_size: u64) -> ModelFileChunk {
        ModelFileChunk {
            file: file.to_string(),
            offset,
            data: data.to_vec().into(),
            file_size,
        }
    }

    #[test]
    fn chunks_in_order_make_their_files() {
        let mut assembler = FileAssembler::default();
        assembler.push(chunk("a", 0, &[1, 2], 3)).unwrap();
        assembler.push(chunk("a", 2, &[3], 3)).unwrap();
        assembler.push(chunk("b", 0, &[9], 1)).unwrap();
        let mut files = assembler.finish(2).unwrap();
        assert_eq!(take_file(&mut files, "a"), Some(vec![1, 2, 3]));
        assert_eq!(take_file(&mut files, "b"), Some(vec![9]));
        assert_eq!(take_file(&mut files, "a"), None);
    }

    #[test]
    fn a_gap_a_late_start_a_short_file_or_a_wrong_count_is_refused_naming_it() {
        let mut assembler = FileAssembler::default();
        assembler.push(chunk("a", 0, &[1, 2], 4)).unwrap();
        let error = assembler.push(chunk("a", 3, &[4], 4)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "chunk of \"a\" at offset 3 out of order (expected \"a\" at 2, or a new file at 0)"
        );
        let error = assembler.push(chunk("b", 1, &[4], 1)).unwrap_err();
        assert!(error.to_string().contains("\"b\" at offset 1"), "{error}");
        let error = assembler.push(chunk("b", 0, &[4], 1)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "file \"a\": 2 bytes received, its size is 4"
        );
        let error = assembler.push(chunk("a", 2, &[4, 5, 6], 4)).unwrap_err();
        assert!(matches!(
            error,
            AssembleError::WrongSize { received: 5, .. }
        ));
        let error = assembler.finish(3).unwrap_err();
        assert_eq!(error.to_string(), "1 files received, the sender said 3");
        let mut huge = FileAssembler::default();
        assert!(matches!(
            huge.push(chunk("a", 0, &[1], u64::MAX)),
            Err(AssembleError::TooLarge { .. })
        ));
    }
}
