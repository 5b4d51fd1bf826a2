//! One snapshot as a session receives it: the [`Upload`] staged chunk by
//! chunk (each chunk checked to continue its file exactly, the weights'
//! header parsed from their first bytes as they arrive), the wire enums it
//! is declared with, and the finite check on the weights in place
//! ([`Upload::into_finite`]). The chunks are kept as they arrived: they
//! become the model's files as they are.
//!
//! Apart from [`super::ModelSyncState`] because an upload belongs to the
//! session, not to the model: it is built without the model's lock, and
//! a drafter that dies mid-upload drops it without the model noticing.

use bytes::Bytes;
use dflash_proto::v1 as proto;

use super::files::{
    first_non_finite_tensor, header_length, parse_header, ModelFile, WeightsLayout,
    CONFIG_FILE_LIMIT, CONFIG_FILE_NAME, HEADER_LENGTH_BYTES, MODEL_FILE_NAME, MODEL_FILE_NAMES,
};
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

/// One file of a snapshot being received: its chunks, unchanged.
#[derive(Debug)]
struct UploadedFile {
    name: &'static str,
    /// The size its first chunk declared.
    size: u64,
    chunks: Vec<Bytes>,
    received: u64,
}

impl UploadedFile {
    fn error(&self, detail: String) -> SyncError {
        SyncError::BadFile {
            file: self.name.to_string(),
            detail,
        }
    }

    fn check_whole(&self) -> Result<(), SyncError> {
        if self.received == self.size {
            return Ok(());
        }
        Err(self.error(format!("{} of {} bytes received", self.received, self.size)))
    }
}

/// The weights' header as its bytes arrive: the 8-byte length, then the
/// JSON, parsed as soon as it is whole (a copy of the header only).
#[derive(Debug, Default)]
struct HeaderReader {
    bytes: Vec<u8>,
    /// The header's length once its prefix arrived.
    length: Option<u64>,
    layout: Option<WeightsLayout>,
}

impl HeaderReader {
    /// Takes what of `data` (the next bytes of a file of `file_size`) is
    /// the header's, and parses the header once it is whole.
    fn feed(&mut self, mut data: &[u8], file_size: u64) -> Result<(), String> {
        while self.layout.is_none() && !data.is_empty() {
            let wanted = match self.length {
                None => HEADER_LENGTH_BYTES,
                Some(length) => HEADER_LENGTH_BYTES + length,
            };
            let missing = (wanted - self.bytes.len() as u64) as usize;
            let take = missing.min(data.len());
            self.bytes.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.bytes.len() as u64 != wanted {
                continue;
            }
            match self.length {
                None => {
                    let mut prefix = [0u8; 8];
                    prefix.copy_from_slice(&self.bytes);
                    self.length = Some(header_length(prefix, file_size)?);
                    if self.length == Some(0) {
                        self.layout = Some(parse_header(&[], file_size)?);
                    }
                }
                Some(_) => {
                    let header = &self.bytes[HEADER_LENGTH_BYTES as usize..];
                    self.layout = Some(parse_header(header, file_size)?);
                    self.bytes = Vec::new();
                }
            }
        }
        Ok(())
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
    files: Vec<UploadedFile>,
    header: HeaderReader,
}

/// The file name `name` if it is one of a snapshot's two.
fn allowed_name(name: &str) -> Result<&'static str, SyncError> {
    MODEL_FILE_NAMES
        .into_iter()
        .find(|allowed| *allowed == name)
        .ok_or_else(|| SyncError::FileName(name.to_string()))
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
            files: Vec::new(),
            header: HeaderReader::default(),
        })
    }

    /// Adds one chunk after checking it continues its file exactly (or
    /// begins the next one at offset 0, the one before it whole), within
    /// the size its file declared; the weights' header is parsed as soon
    /// as its bytes are in.
    pub fn add_file_chunk(&mut self, chunk: proto::ModelFileChunk) -> Result<(), SyncError> {
        let name = allowed_name(&chunk.file)?;
        let continues_last = self.files.last().is_some_and(|last| last.name == name);
        if !continues_last {
            self.begin_file(name, &chunk)?;
        }
        let Some(file) = self.files.last_mut() else {
            return Err(SyncError::FileName(chunk.file));
        };
        if chunk.file_size != file.size {
            return Err(file.error(format!(
                "chunk says size {}, the file's first chunk said {}",
                chunk.file_size, file.size
            )));
        }
        if chunk.offset != file.received {
            return Err(file.error(format!(
                "chunk at offset {}, expected {}",
                chunk.offset, file.received
            )));
        }
        let received = file.received + chunk.data.len() as u64;
        if received > file.size {
            return Err(file.error(format!(
                "{received} bytes received, more than its size {}",
                file.size
            )));
        }
        if name == MODEL_FILE_NAME {
            self.header
                .feed(&chunk.data, file.size)
                .map_err(|detail| file.error(detail))?;
            if received == file.size && self.header.layout.is_none() {
                return Err(file.error(format!(
                    "{received} bytes end before the safetensors header does"
                )));
            }
        }
        file.received = received;
        file.chunks.push(chunk.data);
        Ok(())
    }

    /// Starts file `name` with `chunk`, its first: at offset 0, not sent
    /// before, the file before it whole, a size within the file's bound.
    fn begin_file(
        &mut self,
        name: &'static str,
        chunk: &proto::ModelFileChunk,
    ) -> Result<(), SyncError> {
        let file = UploadedFile {
            name,
            size: chunk.file_size,
            chunks: Vec::new(),
            received: 0,
        };
        if chunk.offset != 0 {
            return Err(file.error(format!(
                "first chunk at offset {}, expected 0",
                chunk.offset
            )));
        }
        if self.files.iter().any(|sent| sent.name == name) {
            return Err(SyncError::DuplicateFile(name.to_string()));
        }
        if let Some(last) = self.files.last() {
            last.check_whole()?;
        }
        if name == CONFIG_FILE_NAME && chunk.file_size > CONFIG_FILE_LIMIT {
            return Err(file.error(format!(
                "{} bytes, more than the {CONFIG_FILE_LIMIT} a config may have",
                chunk.file_size
            )));
        }
        self.files.push(file);
        Ok(())
    }

    /// Every file whole, both present, and their number the declared one.
    fn check_complete(&self, declared_files: u32) -> Result<(), SyncError> {
        if self.files.len() != declared_files as usize {
            return Err(SyncError::FileCountMismatch {
                sent: self.files.len(),
                declared: declared_files,
            });
        }
        for name in MODEL_FILE_NAMES {
            if !self.files.iter().any(|file| file.name == name) {
                return Err(SyncError::MissingFile(name));
            }
        }
        for file in &self.files {
            file.check_whole()?;
        }
        Ok(())
    }

    fn take_file(&mut self, name: &str) -> ModelFile {
        let index = self.files.iter().position(|file| file.name == name);
        index.map_or_else(ModelFile::default, |index| {
            let file = self.files.swap_remove(index);
            ModelFile {
                chunks: file.chunks,
                size: file.size,
            }
        })
    }

    /// Checks the snapshot whole (`declared_files` as its commit says),
    /// its config UTF-8 JSON, and every weight finite (one read-only pass
    /// over the chunks, naming the tensor and the value), then hands its
    /// files over as they arrived. Runs before the model's lock.
    pub fn into_finite(mut self, declared_files: u32) -> Result<FiniteUpload, SyncError> {
        self.check_complete(declared_files)?;
        let layout = self.header.layout.take().unwrap_or_default();
        let weights = self.take_file(MODEL_FILE_NAME);
        let config = self.take_file(CONFIG_FILE_NAME);
        let config_json = String::from_utf8(config.joined())
            .map_err(|error| SyncError::Config(format!("{CONFIG_FILE_NAME}: {error}")))?;
        serde_json::from_str::<serde_json::Value>(&config_json)
            .map_err(|error| SyncError::Config(format!("{CONFIG_FILE_NAME}: {error}")))?;
        if let Some((name, index, value)) = first_non_finite_tensor(&weights, &layout) {
            return Err(SyncError::BadTensor {
                name,
                detail: format!(
                    "weights are not finite ({value} at element {index}): refused as the run's model"
                ),
            });
        }
        Ok(FiniteUpload {
            kind: self.kind,
            steps: self.steps,
            samples: self.samples,
            config_json,
            weights,
            layout,
        })
    }
}

/// A whole [`Upload`] whose every weight is finite: the only kind the
/// model takes, so the check (a pass over 4 bytes a parameter) runs before
/// the model's lock, never under it.
#[derive(Debug)]
pub struct FiniteUpload {
    pub kind: SnapshotKind,
    pub steps: u64,
    pub samples: u64,
    /// `config.json`, as it arrived.
    pub config_json: String,
    /// `model.safetensors`, its chunks as they arrived.
    pub weights: ModelFile,
    /// What its header says of the tensors.
    pub layout: WeightsLayout,
}
