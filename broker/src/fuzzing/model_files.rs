//! A snapshot's files and session messages made from f32 values, for the
//! seeds, the tests and the snapshot bench (the broker never writes a
//! safetensors file itself: a drafter's checkpoint writer does, with the
//! same `safetensors` serializer and `{"format": "pt"}` metadata used
//! here).

use std::collections::HashMap;

use bytes::Bytes;
use dflash_proto::v1 as proto;
use safetensors::tensor::TensorView;

use crate::run_model::store::files::{CONFIG_FILE_NAME, MODEL_FILE_NAME};

/// One f32 tensor: name, shape, values.
pub type F32Tensor = (String, Vec<u64>, Vec<f32>);

/// `model.safetensors` of f32 `tensors`, as a drafter's checkpoint writer
/// lays it out.
pub fn weights_file(tensors: &[F32Tensor]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, values)| {
            values
                .iter()
                .flat_map(|value| value.to_le_bytes())
                .collect()
        })
        .collect();
    weights_file_of_bytes(
        tensors
            .iter()
            .zip(&bytes)
            .map(|((name, shape, _), bytes)| (name.as_str(), shape.as_slice(), bytes.as_slice())),
    )
}

/// `model.safetensors` of f32 tensors given as their little-endian bytes
/// (any bytes: a test may send a value that is not finite).
pub fn weights_file_of_bytes<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [u64], &'a [u8])>,
) -> Vec<u8> {
    let views: Vec<(String, TensorView<'a>)> = tensors
        .into_iter()
        .filter_map(|(name, shape, bytes)| {
            let shape = shape.iter().map(|&dim| dim as usize).collect();
            TensorView::new(safetensors::Dtype::F32, shape, bytes)
                .ok()
                .map(|view| (name.to_string(), view))
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(metadata)).unwrap_or_default()
}

/// One file's chunks of at most `chunk_bytes` (one empty chunk for an
/// empty file).
pub fn file_chunks(file: &str, bytes: &Bytes, chunk_bytes: usize) -> Vec<proto::ModelFileChunk> {
    let chunk_bytes = chunk_bytes.max(1);
    let mut chunks: Vec<proto::ModelFileChunk> = (0..bytes.len())
        .step_by(chunk_bytes)
        .map(|start| proto::ModelFileChunk {
            file: file.to_string(),
            offset: start as u64,
            data: bytes.slice(start..(start + chunk_bytes).min(bytes.len())),
            file_size: bytes.len() as u64,
        })
        .collect();
    if chunks.is_empty() {
        chunks.push(proto::ModelFileChunk {
            file: file.to_string(),
            ..proto::ModelFileChunk::default()
        });
    }
    chunks
}

fn request(kind: proto::sync_request::Kind) -> proto::SyncRequest {
    proto::SyncRequest { kind: Some(kind) }
}

/// A snapshot's messages: begin, `config.json` and `model.safetensors` in
/// chunks of at most `chunk_bytes`, commit.
pub fn snapshot_requests(
    begin: proto::SyncBegin,
    config_json: &str,
    weights: Bytes,
    chunk_bytes: usize,
) -> Vec<proto::SyncRequest> {
    let config = Bytes::from(config_json.as_bytes().to_vec());
    let mut requests = vec![request(proto::sync_request::Kind::Begin(begin))];
    for (name, bytes) in [(CONFIG_FILE_NAME, &config), (MODEL_FILE_NAME, &weights)] {
        requests.extend(
            file_chunks(name, bytes, chunk_bytes)
                .into_iter()
                .map(|chunk| request(proto::sync_request::Kind::FileChunk(chunk))),
        );
    }
    requests.push(request(proto::sync_request::Kind::Commit(
        proto::SyncCommit { files: 2 },
    )));
    requests
}

/// The model `tensors` make at `version`, as a resumed broker keeps it
/// (through the checkpoint's reader: nothing but the files).
pub fn stored_model(
    config_json: &str,
    tensors: &[F32Tensor],
    version: u64,
    samples: u64,
) -> Result<crate::run_model::store::StoredModel, crate::run_model::checkpoint::CheckpointError> {
    let weights = Bytes::from(weights_file(tensors));
    let state = format!(r#"{{"version": {version}, "samples": {samples}}}"#);
    crate::run_model::checkpoint::decode_model(
        std::path::Path::new("model"),
        crate::run_model::checkpoint::ModelFiles {
            config_json,
            model: &weights,
            state_json: Some(&state),
        },
    )
}
