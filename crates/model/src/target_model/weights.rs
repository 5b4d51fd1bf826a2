//! Reading named tensors out of a Hugging Face directory's safetensors
//! file(s), single or sharded, with shape checks.
//!
//! Shards are read one at a time and every tensor is converted to the
//! requested dtype and device before the next shard is read, so peak host
//! memory is about one shard, not the whole model.

use super::ModelError;
use safetensors::{Dtype as SafeDtype, SafeTensors};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE_NAME: &str = "model.safetensors";
/// File name of the shard index of a sharded checkpoint.
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";

/// One tensor the caller needs, with the shape it must have.
#[derive(Debug, Clone)]
pub struct TensorRequest {
    pub name: String,
    pub shape: Vec<i64>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

/// Where each tensor of a checkpoint lives.
enum Layout {
    Single(PathBuf),
    /// Tensor name to shard path, from the index's `weight_map`.
    Sharded {
        index_path: PathBuf,
        tensor_to_file: HashMap<String, PathBuf>,
    },
}

fn detect_layout(dir: &Path) -> Result<Layout, ModelError> {
    let single = dir.join(SINGLE_FILE_NAME);
    if single.is_file() {
        return Ok(Layout::Single(single));
    }
    let index_path = dir.join(INDEX_FILE_NAME);
    if !index_path.is_file() {
        return Err(ModelError::NoWeights {
            dir: dir.to_path_buf(),
        });
    }
    let text = std::fs::read_to_string(&index_path).map_err(|source| ModelError::Io {
        path: index_path.clone(),
        source,
    })?;
    let index: ShardIndex = serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: index_path.clone(),
        source,
    })?;
    let tensor_to_file = index
        .weight_map
        .into_iter()
        .map(|(tensor, file)| (tensor, dir.join(file)))
        .collect();
    Ok(Layout::Sharded {
        index_path,
        tensor_to_file,
    })
}

/// Loads every requested tensor from the checkpoint in `dir`, converted to
/// `kind` on `device`. Fails on the first missing tensor, shape mismatch or
/// unsupported stored dtype, naming the file and the tensor.
pub fn load_tensors(
    dir: &Path,
    requests: &[TensorRequest],
    device: Device,
    kind: Kind,
) -> Result<HashMap<String, Tensor>, ModelError> {
    let layout = detect_layout(dir)?;
    // Group the requests by the file that holds them, in a stable order.
    let mut requests_by_file: BTreeMap<PathBuf, Vec<&TensorRequest>> = BTreeMap::new();
    for request in requests {
        let file = match &layout {
            Layout::Single(path) => path.clone(),
            Layout::Sharded {
                index_path,
                tensor_to_file,
            } => tensor_to_file.get(&request.name).cloned().ok_or_else(|| {
                ModelError::MissingTensor {
                    path: index_path.clone(),
                    tensor: request.name.clone(),
                }
            })?,
        };
        requests_by_file.entry(file).or_default().push(request);
    }
    let mut loaded = HashMap::with_capacity(requests.len());
    for (file, file_requests) in requests_by_file {
        let bytes = std::fs::read(&file).map_err(|source| ModelError::Io {
            path: file.clone(),
            source,
        })?;
        let safetensors =
            SafeTensors::deserialize(&bytes).map_err(|error| ModelError::Safetensors {
                path: file.clone(),
                message: error.to_string(),
            })?;
        for request in file_requests {
            let tensor = read_one(&safetensors, &file, request)?;
            loaded.insert(request.name.clone(), tensor.to_device(device).to_kind(kind));
        }
    }
    Ok(loaded)
}

fn read_one(
    safetensors: &SafeTensors<'_>,
    file: &Path,
    request: &TensorRequest,
) -> Result<Tensor, ModelError> {
    let view = safetensors
        .tensor(&request.name)
        .map_err(|_| ModelError::MissingTensor {
            path: file.to_path_buf(),
            tensor: request.name.clone(),
        })?;
    let actual_shape = view.shape().to_vec();
    let shape_matches = actual_shape.len() == request.shape.len()
        && actual_shape
            .iter()
            .zip(&request.shape)
            .all(|(&actual, &expected)| actual as i64 == expected);
    if !shape_matches {
        return Err(ModelError::ShapeMismatch {
            path: file.to_path_buf(),
            tensor: request.name.clone(),
            actual: actual_shape,
            expected: request.shape.clone(),
        });
    }
    let stored_kind = match view.dtype() {
        SafeDtype::BF16 => Kind::BFloat16,
        SafeDtype::F16 => Kind::Half,
        SafeDtype::F32 => Kind::Float,
        other => {
            return Err(ModelError::UnsupportedTensorDtype {
                path: file.to_path_buf(),
                tensor: request.name.clone(),
                dtype: format!("{other:?}"),
            })
        }
    };
    Ok(Tensor::f_from_data_size(
        view.data(),
        &request.shape,
        stored_kind,
    )?)
}
