//! One snapshot as a session receives it: the [`Upload`] staged chunk by
//! chunk (each chunk checked to continue its tensor exactly), and the wire
//! enums it is declared with.
//!
//! Apart from [`super::ModelSyncState`] because an upload belongs to the
//! session, not to the center: it is built without the center's lock, and
//! a drafter that dies mid-upload drops it without the center noticing.

use bytes::Bytes;
use dflash_proto::v1 as proto;

use super::error::SyncError;
use crate::run_model::arith::{self, WireDtype};

/// What kind of snapshot a drafter began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotKind {
    /// The trained model's weights, replacing the center.
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

pub fn dtype_from_proto(value: i32) -> Result<WireDtype, SyncError> {
    match proto::Dtype::try_from(value) {
        Ok(proto::Dtype::F32) => Ok(WireDtype::F32),
        Ok(proto::Dtype::Bf16) => Ok(WireDtype::Bf16),
        _ => Err(SyncError::Dtype(value)),
    }
}

pub fn dtype_to_proto(dtype: WireDtype) -> proto::Dtype {
    match dtype {
        WireDtype::F32 => proto::Dtype::F32,
        WireDtype::Bf16 => proto::Dtype::Bf16,
    }
}

/// One tensor of a snapshot being received: its chunks, unchanged.
#[derive(Debug)]
pub struct UploadedTensor {
    pub name: String,
    pub dtype: WireDtype,
    pub shape: Vec<u64>,
    /// Chunks in offset order; together exactly the tensor's bytes at commit.
    pub chunks: Vec<Bytes>,
    pub received_bytes: u64,
}

impl UploadedTensor {
    fn expected_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.element_bytes() as u64
    }

    /// Calls `apply` on each chunk, in order, with the range of the
    /// tensor's elements it holds; an error `apply` returns names this
    /// tensor.
    pub(super) fn for_each_chunk(
        &self,
        mut apply: impl FnMut(std::ops::Range<usize>, &Bytes) -> Result<(), arith::LengthMismatch>,
    ) -> Result<(), SyncError> {
        let mut element_offset = 0usize;
        for chunk in &self.chunks {
            let elements = chunk.len() / self.dtype.element_bytes();
            apply(element_offset..element_offset + elements, chunk).map_err(|error| {
                SyncError::BadTensor {
                    name: self.name.clone(),
                    detail: error.to_string(),
                }
            })?;
            element_offset += elements;
        }
        Ok(())
    }

    /// Checks that `chunk` continues this tensor exactly: the same dtype and
    /// shape as its first chunk, at the next offset, whole elements, and not
    /// past the tensor's end.
    fn check_continued_by(
        &self,
        chunk: &proto::TensorChunk,
        dtype: WireDtype,
    ) -> Result<(), SyncError> {
        if self.dtype != dtype || self.shape != chunk.shape {
            return Err(bad_chunk(
                chunk,
                format!(
                    "chunk says {} {:?}, the tensor's first chunk said {} {:?}",
                    dtype.name(),
                    chunk.shape,
                    self.dtype.name(),
                    self.shape
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
        let element_bytes = dtype.element_bytes() as u64;
        let length = chunk.data.len() as u64;
        if !length.is_multiple_of(element_bytes) {
            return Err(bad_chunk(
                chunk,
                format!(
                    "chunk of {length} bytes is not a whole number of {} elements",
                    dtype.name()
                ),
            ));
        }
        if self.received_bytes + length > self.expected_bytes() {
            return Err(bad_chunk(
                chunk,
                format!(
                    "{} bytes received, more than the {} of {} {:?}",
                    self.received_bytes + length,
                    self.expected_bytes(),
                    dtype.name(),
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
    /// The snapshot `begin` opens, checked; a begin that sets the removed
    /// `gradient_step` (a drafter of the broker's AdamW) is refused.
    pub fn new(begin: &proto::SyncBegin) -> Result<Self, SyncError> {
        if begin.gradient_step.is_some() {
            return Err(SyncError::GradientStepRemoved);
        }
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
        let dtype = dtype_from_proto(chunk.dtype)?;
        let continues_last = self
            .tensors
            .last()
            .is_some_and(|last| last.name == chunk.name);
        if !continues_last {
            self.begin_tensor(&chunk, dtype)?;
        }
        let Some(tensor) = self.tensors.last_mut() else {
            return Err(bad_chunk(&chunk, "no tensor".to_string()));
        };
        tensor.check_continued_by(&chunk, dtype)?;
        tensor.received_bytes += chunk.data.len() as u64;
        tensor.chunks.push(chunk.data);
        Ok(())
    }

    /// Starts a new tensor with `chunk`, its first: the chunk is at offset 0,
    /// the name is new, the tensor before it is complete, and the shape is
    /// valid.
    fn begin_tensor(
        &mut self,
        chunk: &proto::TensorChunk,
        dtype: WireDtype,
    ) -> Result<(), SyncError> {
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
            .try_fold(dtype.element_bytes() as u64, |product, &dim| {
                product.checked_mul(dim)
            });
        if chunk.shape.is_empty() {
            return Err(bad_chunk(chunk, "invalid shape []".to_string()));
        }
        if bytes.is_none() {
            return Err(bad_chunk(
                chunk,
                format!(
                    "invalid shape {:?}: its bytes as {} overflow a u64",
                    chunk.shape,
                    dtype.name()
                ),
            ));
        }
        self.tensors.push(UploadedTensor {
            name: chunk.name.clone(),
            dtype,
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

/// Decodes a tensor of a snapshot (the center-to-be) into `values`, in f32.
pub(super) fn decode_chunks(
    values: &mut [f32],
    uploaded: &UploadedTensor,
) -> Result<(), SyncError> {
    uploaded.for_each_chunk(|range, chunk| {
        arith::decode_into(&mut values[range], chunk, uploaded.dtype)
    })
}
