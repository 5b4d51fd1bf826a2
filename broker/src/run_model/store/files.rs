//! The run's model's two files as the broker keeps them, never decoded:
//! `config.json` and `model.safetensors` (the reference dflash layout, as
//! the drafter's one checkpoint writer produced them), each the chunks it
//! arrived in. What the broker knows of the weights it reads from the
//! safetensors header alone ([`WeightsLayout`]: each tensor's name, dtype,
//! shape and byte range), and the one pass it makes over them reads the
//! f32 values in place ([`first_non_finite`]), across chunk boundaries.
//!
//! Apart from the upload and the model because both use them, and the
//! checkpoint on disk too.

use std::collections::HashMap;

use bytes::Bytes;
use safetensors::tensor::Metadata;

/// The model config's file name: the model's `config.json`.
pub const CONFIG_FILE_NAME: &str = "config.json";
/// The weights' file name: safetensors, f32.
pub const MODEL_FILE_NAME: &str = "model.safetensors";
/// The two files of a snapshot, in the order a sender sends them.
pub const MODEL_FILE_NAMES: [&str; 2] = [CONFIG_FILE_NAME, MODEL_FILE_NAME];

/// The most bytes `config.json` may have: it is joined into one string
/// (the header of a read, the pinned-config check).
pub const CONFIG_FILE_LIMIT: u64 = 1 << 20;

/// The largest safetensors header the broker reads (the `safetensors`
/// crate's own bound).
pub const HEADER_LIMIT: u64 = 100_000_000;

/// The length prefix of a safetensors file: its header's length.
pub const HEADER_LENGTH_BYTES: u64 = 8;

/// One file as it arrived: its chunks in order, together exactly `size`
/// bytes. Shared (`Bytes`): a clone copies handles, never the bytes.
#[derive(Debug, Clone, Default)]
pub struct ModelFile {
    pub chunks: Vec<Bytes>,
    pub size: u64,
}

impl ModelFile {
    /// A file read whole (from disk).
    pub fn whole(bytes: Bytes) -> Self {
        ModelFile {
            size: bytes.len() as u64,
            chunks: vec![bytes],
        }
    }

    /// The file's bytes joined (small files and tests only).
    pub fn joined(&self) -> Vec<u8> {
        self.chunks.concat()
    }
}

/// One tensor of the weights as its header places it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    pub name: String,
    pub shape: Vec<u64>,
    /// Its bytes in the file: `[start, end)`, absolute offsets.
    pub start: u64,
    pub end: u64,
}

/// The weights as the safetensors header describes them: every tensor
/// f32, its bytes inside the file, the tensors back to back up to its end.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightsLayout {
    /// Sorted by name.
    pub tensors: Vec<TensorLayout>,
    by_name: HashMap<String, usize>,
}

impl WeightsLayout {
    pub fn get(&self, name: &str) -> Option<&TensorLayout> {
        self.by_name.get(name).map(|&index| &self.tensors[index])
    }

    /// Parameters (f32 elements) of every tensor.
    pub fn parameters(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| tensor.shape.iter().product::<u64>())
            .sum()
    }
}

/// The header's length from a safetensors file's first 8 bytes, checked
/// against the bound and the file's size; the message names the value.
pub fn header_length(prefix: [u8; 8], file_size: u64) -> Result<u64, String> {
    let length = u64::from_le_bytes(prefix);
    if length > HEADER_LIMIT {
        return Err(format!(
            "header of {length} bytes, more than the {HEADER_LIMIT} read"
        ));
    }
    if HEADER_LENGTH_BYTES + length > file_size {
        return Err(format!(
            "header of {length} bytes does not fit the file's {file_size}"
        ));
    }
    Ok(length)
}

/// The layout a safetensors header (its JSON, without the length prefix)
/// describes in a file of `file_size` bytes: the `safetensors` crate's
/// metadata reader (offsets back to back, each range the size of its dtype
/// and shape, without overflow), then every tensor f32 and the data
/// ending exactly at the file's end. Reads nothing but the header.
pub fn parse_header(header: &[u8], file_size: u64) -> Result<WeightsLayout, String> {
    let metadata: Metadata =
        serde_json::from_slice(header).map_err(|error| format!("header: {error}"))?;
    let data_start = HEADER_LENGTH_BYTES + header.len() as u64;
    let data_end = data_start + metadata.data_len() as u64;
    if data_end != file_size {
        return Err(format!(
            "header places the tensors' data in bytes [{data_start}, {data_end}), the file has {file_size}"
        ));
    }
    let mut tensors = Vec::new();
    for (name, info) in metadata.tensors() {
        if info.dtype != safetensors::Dtype::F32 {
            return Err(format!(
                "tensor {name:?} has dtype {:?}, expected F32 (the f32 master weights)",
                info.dtype
            ));
        }
        let (start, end) = info.data_offsets;
        tensors.push(TensorLayout {
            name,
            shape: info.shape.iter().map(|&dim| dim as u64).collect(),
            start: data_start + start as u64,
            end: data_start + end as u64,
        });
    }
    tensors.sort_by(|left, right| left.name.cmp(&right.name));
    let by_name = tensors
        .iter()
        .enumerate()
        .map(|(index, tensor)| (tensor.name.clone(), index))
        .collect();
    Ok(WeightsLayout { tensors, by_name })
}

/// The layout of a safetensors file held whole (read from disk).
pub fn parse_whole_file(bytes: &[u8]) -> Result<WeightsLayout, String> {
    let size = bytes.len() as u64;
    let prefix = bytes
        .get(..HEADER_LENGTH_BYTES as usize)
        .and_then(|prefix| <[u8; 8]>::try_from(prefix).ok())
        .ok_or_else(|| format!("{size} bytes: shorter than the header's length"))?;
    let length = header_length(prefix, size)?;
    let header = &bytes[HEADER_LENGTH_BYTES as usize..(HEADER_LENGTH_BYTES + length) as usize];
    parse_header(header, size)
}

/// The first value in bytes `[start, end)` of the chunked file `chunks`
/// (f32 little-endian) that is not finite, and its element index; read in
/// place, nothing copied (a value split between two chunks is put
/// together from its 4 bytes).
pub fn first_non_finite(chunks: &[Bytes], start: u64, end: u64) -> Option<(u64, f32)> {
    let mut index = 0u64;
    let mut carry = [0u8; 4];
    let mut carried = 0usize;
    let mut chunk_start = 0u64;
    let finite = |raw: [u8; 4]| f32::from_le_bytes(raw).is_finite();
    for chunk in chunks {
        let chunk_end = chunk_start + chunk.len() as u64;
        if chunk_end <= start {
            chunk_start = chunk_end;
            continue;
        }
        if chunk_start >= end {
            break;
        }
        let from = start.saturating_sub(chunk_start) as usize;
        let to = (end.min(chunk_end) - chunk_start) as usize;
        let mut piece = &chunk[from..to];
        if carried > 0 {
            let take = (4 - carried).min(piece.len());
            carry[carried..carried + take].copy_from_slice(&piece[..take]);
            carried += take;
            piece = &piece[take..];
            if carried == 4 {
                if !finite(carry) {
                    return Some((index, f32::from_le_bytes(carry)));
                }
                index += 1;
                carried = 0;
            }
        }
        let mut values = piece.chunks_exact(4);
        for raw in &mut values {
            let raw = [raw[0], raw[1], raw[2], raw[3]];
            if !finite(raw) {
                return Some((index, f32::from_le_bytes(raw)));
            }
            index += 1;
        }
        let rest = values.remainder();
        carry[..rest.len()].copy_from_slice(rest);
        carried += rest.len();
        chunk_start = chunk_end;
    }
    None
}

/// The first tensor of `layout` with a value that is not finite: its
/// name, the element and the value.
pub fn first_non_finite_tensor(
    file: &ModelFile,
    layout: &WeightsLayout,
) -> Option<(String, u64, f32)> {
    layout.tensors.iter().find_map(|tensor| {
        first_non_finite(&file.chunks, tensor.start, tensor.end)
            .map(|(index, value)| (tensor.name.clone(), index, value))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_split_between_chunks_is_read_whole() {
        let values = [1.0f32, f32::NAN, 3.0];
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect();
        // Chunks of 3 bytes: every value straddles a boundary.
        let chunks: Vec<Bytes> = bytes.chunks(3).map(Bytes::copy_from_slice).collect();
        let found = first_non_finite(&chunks, 0, 12).unwrap();
        assert_eq!(found.0, 1);
        assert!(found.1.is_nan());
        assert_eq!(first_non_finite(&chunks, 8, 12), None);
        assert_eq!(first_non_finite(&chunks, 0, 4), None);
    }
}
