//! One snapshot as a session receives it: the [`Upload`] staged chunk by
//! chunk (each chunk checked to continue its tensor exactly), and the wire
//! enums it is declared with, and the finite check on f32 bytes in place
//! ([`check_finite`]). The chunks are kept as they arrived: they become
//! the model's bytes as they are.
//!
//! Apart from [`super::ModelSyncState`] because an upload belongs to the
//! session, not to the model: it is built without the model's lock, and
//! a drafter that dies mid-upload drops it without the model noticing.

use bytes::Bytes;
use dflash_proto::v1 as proto;

use crate::rpc_error::SyncError;

/// What kind of snapshot a drafter began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotKind {
    /// The trained model's weights, replacing the run's model.
    Snapshot,
    /// A snapshot that is also the drafter's last (it stops).
    FinalSnapshot,
}

impl SnapshotKind {
    /// The kind `value` names; the kinds of asynchronous local SGD (JOIN 1,
    /// UPDATE 2, FINAL 3, numbers kept reserved on the wire) are refused by
    /// name.
    pub fn from_proto(value: i32) -> Result<Self, SyncError> {
        match value {
            1 => return Err(SyncError::RemovedKind("SYNC_KIND_JOIN")),
            2 => return Err(SyncError::RemovedKind("SYNC_KIND_UPDATE")),
            3 => return Err(SyncError::RemovedKind("SYNC_KIND_FINAL")),
            _ => {}
        }
        match proto::SyncKind::try_from(value) {
            Ok(proto::SyncKind::Snapshot) => Ok(SnapshotKind::Snapshot),
            Ok(proto::SyncKind::FinalSnapshot) => Ok(SnapshotKind::FinalSnapshot),
            _ => Err(SyncError::Kind(value)),
        }
    }
}

/// Bytes of one element: a snapshot is the f32 master weights.
const ELEMENT_BYTES: u64 = 4;

/// A chunk's dtype, checked: DTYPE_F32 alone.
fn check_dtype(value: i32) -> Result<(), SyncError> {
    match proto::Dtype::try_from(value) {
        Ok(proto::Dtype::F32) => Ok(()),
        _ => Err(SyncError::Dtype(value)),
    }
}

/// One tensor of a snapshot being received: its chunks, unchanged.
#[derive(Debug)]
pub struct UploadedTensor {
    pub name: String,
    pub shape: Vec<u64>,
    /// Chunks in offset order; together exactly the tensor's bytes at commit.
    pub chunks: Vec<Bytes>,
    pub received_bytes: u64,
}

impl UploadedTensor {
    fn expected_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * ELEMENT_BYTES
    }

    /// Checks that `chunk` continues this tensor exactly: the same shape as
    /// its first chunk, at the next offset, whole elements, and not past the
    /// tensor's end.
    fn check_continued_by(&self, chunk: &proto::TensorChunk) -> Result<(), SyncError> {
        if self.shape != chunk.shape {
            return Err(bad_chunk(
                chunk,
                format!(
                    "chunk says {:?}, the tensor's first chunk said {:?}",
                    chunk.shape, self.shape
                ),
            ));
        }
        if chunk.offset != self.received_bytes {
            return Err(bad_chunk(
                chunk,
                format!(
                    "chunk at offset {}, expected {}",
                    chunk.offset, self.received_bytes
                ),
            ));
        }
        let length = chunk.data.len() as u64;
        if !length.is_multiple_of(ELEMENT_BYTES) {
            return Err(bad_chunk(
                chunk,
                format!("chunk of {length} bytes is not a whole number of f32 elements"),
            ));
        }
        if self.received_bytes + length > self.expected_bytes() {
            return Err(bad_chunk(
                chunk,
                format!(
                    "{} bytes received, more than the {} of f32 {:?}",
                    self.received_bytes + length,
                    self.expected_bytes(),
                    self.shape
                ),
            ));
        }
        Ok(())
    }
}

/// A [`SyncError::BadTensor`] naming `chunk`'s tensor.
fn bad_chunk(chunk: &proto::TensorChunk, detail: String) -> SyncError {
    SyncError::BadTensor {
        name: chunk.name.clone(),
        detail,
    }
}

/// A snapshot being received on one session.
#[derive(Debug)]
pub struct Upload {
    pub kind: SnapshotKind,
    /// Committed optimizer steps the weights are trained for.
    pub steps: u64,
    /// Samples those steps trained on (every member's).
    pub samples: u64,
    pub tensors: Vec<UploadedTensor>,
}

impl Upload {
    /// The snapshot `begin` opens, checked (a retired kind is refused by
    /// name).
    pub fn new(begin: &proto::SyncBegin) -> Result<Self, SyncError> {
        let kind = SnapshotKind::from_proto(begin.kind)?;
        Ok(Upload {
            kind,
            steps: begin.steps,
            samples: begin.samples,
            tensors: Vec::new(),
        })
    }

    /// Adds one chunk after checking it continues its tensor exactly.
    pub fn add_chunk(&mut self, chunk: proto::TensorChunk) -> Result<(), SyncError> {
        check_dtype(chunk.dtype)?;
        let continues_last = self
            .tensors
            .last()
            .is_some_and(|last| last.name == chunk.name);
        if !continues_last {
            self.begin_tensor(&chunk)?;
        }
        let Some(tensor) = self.tensors.last_mut() else {
            return Err(bad_chunk(&chunk, "no tensor".to_string()));
        };
        tensor.check_continued_by(&chunk)?;
        tensor.received_bytes += chunk.data.len() as u64;
        tensor.chunks.push(chunk.data);
        Ok(())
    }

    /// Starts a new tensor with `chunk`, its first: the chunk is at offset 0,
    /// the name is new, the tensor before it is complete, and the shape is
    /// valid.
    fn begin_tensor(&mut self, chunk: &proto::TensorChunk) -> Result<(), SyncError> {
        if chunk.offset != 0 {
            return Err(bad_chunk(
                chunk,
                format!("first chunk at offset {}, expected 0", chunk.offset),
            ));
        }
        if self.tensors.iter().any(|tensor| tensor.name == chunk.name) {
            return Err(SyncError::DuplicateTensor(chunk.name.clone()));
        }
        if let Some(last) = self.tensors.last() {
            if last.received_bytes != last.expected_bytes() {
                return Err(SyncError::BadTensor {
                    name: last.name.clone(),
                    detail: format!(
                        "{} of {} bytes before the next tensor began",
                        last.received_bytes,
                        last.expected_bytes()
                    ),
                });
            }
        }
        // The byte count must fit a u64, not only the element count:
        // `expected_bytes` multiplies by the element size unchecked (a
        // shape of 2^62 f32 elements overflowed it: fuzz target
        // `model_sync`, tests/fuzz/corpus/model_sync/crash-*).
        let bytes = chunk
            .shape
            .iter()
            .try_fold(ELEMENT_BYTES, |product, &dim| product.checked_mul(dim));
        if chunk.shape.is_empty() {
            return Err(bad_chunk(chunk, "invalid shape []".to_string()));
        }
        if bytes.is_none() {
            return Err(bad_chunk(
                chunk,
                format!(
                    "invalid shape {:?}: its bytes as f32 overflow a u64",
                    chunk.shape
                ),
            ));
        }
        self.tensors.push(UploadedTensor {
            name: chunk.name.clone(),
            shape: chunk.shape.clone(),
            chunks: Vec::new(),
            received_bytes: 0,
        });
        Ok(())
    }

    /// Every tensor is complete and their number is the declared one.
    pub(super) fn check_complete(&self, declared: u32) -> Result<(), SyncError> {
        if self.tensors.len() != declared as usize {
            return Err(SyncError::CountMismatch {
                sent: self.tensors.len(),
                declared,
            });
        }
        for tensor in &self.tensors {
            if tensor.received_bytes != tensor.expected_bytes() {
                return Err(SyncError::BadTensor {
                    name: tensor.name.clone(),
                    detail: format!(
                        "{} of {} bytes received",
                        tensor.received_bytes,
                        tensor.expected_bytes()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// An [`Upload`] whose every value is finite: the only kind the model
/// takes, so the check (a pass over 4 bytes a parameter) runs before the
/// model's lock, never under it.
#[derive(Debug)]
pub struct FiniteUpload(Upload);

impl FiniteUpload {
    pub(super) fn into_inner(self) -> Upload {
        self.0
    }
}

impl Upload {
    /// Refuses a snapshot with a value that is not finite, naming the
    /// tensor and the value: one read-only pass over its bytes.
    pub fn into_finite(self) -> Result<FiniteUpload, SyncError> {
        for tensor in &self.tensors {
            check_finite(&tensor.name, &tensor.chunks)?;
        }
        Ok(FiniteUpload(self))
    }
}

/// The first value of `data` (f32 little-endian, in chunks) that is not
/// finite, and its element index; read in place, nothing copied.
pub fn first_non_finite(data: &[Bytes]) -> Option<(usize, f32)> {
    let mut index = 0usize;
    for chunk in data {
        for raw in chunk.chunks_exact(4) {
            let value = f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
            if !value.is_finite() {
                return Some((index, value));
            }
            index += 1;
        }
    }
    None
}

/// Refuses a tensor with a value that is not finite as the run's model.
pub fn check_finite(name: &str, data: &[Bytes]) -> Result<(), SyncError> {
    match first_non_finite(data) {
        None => Ok(()),
        Some((index, value)) => Err(SyncError::BadTensor {
            name: name.to_string(),
            detail: format!(
                "weights are not finite ({value} at element {index}): refused as the run's model"
            ),
        }),
    }
}
