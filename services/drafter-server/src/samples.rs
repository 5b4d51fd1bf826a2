//! Decoding a broker `Sample` into a training sequence, with every check
//! that decides whether the item is usable by this drafter at all. A sample
//! that fails here fails on every drafter with the same model, so it is
//! dead-lettered rather than requeued.

use dflash_model::draft::TrainingSequence;
use dflash_proto::v1::{Dtype, Sample, Tensor as WireTensor};
use tch::{Kind, Tensor};

/// Tensor names of a DFlash sample on the wire.
pub const INPUT_IDS: &str = "input_ids";
pub const LOSS_MASK: &str = "loss_mask";
pub const HIDDEN_STATES: &str = "hidden_states";

/// What the model expects of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleExpectations {
    /// `n_layers × hidden` of the draft config.
    pub hidden_width: i64,
    pub vocab_size: i64,
}

/// Why a sample cannot be trained on; the message names the tensor and sizes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    #[error("invalid sample: {0}")]
    Invalid(#[from] dflash_proto::tensor::TensorError),
    #[error("tensor {name:?}: dtype {dtype}, expected one of {expected}")]
    Dtype {
        name: &'static str,
        dtype: &'static str,
        expected: &'static str,
    },
    #[error("tensor {name:?}: shape {shape:?}, expected {expected}")]
    Shape {
        name: &'static str,
        shape: Vec<u64>,
        expected: String,
    },
    #[error("tensor \"hidden_states\": width {actual}, the drafter expects {expected} (target layers × hidden size); is the target-server tapping the same layers of the same model?")]
    HiddenWidth { actual: u64, expected: i64 },
    #[error("sample has {0} tokens; at least 2 are needed to train")]
    TooShort(u64),
    #[error("tensor \"input_ids\": token id {token} outside the vocabulary of {vocab_size}")]
    TokenOutOfRange { token: i64, vocab_size: i64 },
}

/// Number of tokens a sample declares (0 when it has no `input_ids`); the
/// synthetic mode needs nothing more.
pub fn sample_token_count(sample: &Sample) -> u64 {
    sample
        .tensor(INPUT_IDS)
        .ok()
        .and_then(|tensor| tensor.shape.first().copied())
        .unwrap_or(0)
}

/// Checks and converts a sample; tensors are copied out of the wire bytes
/// into CPU tensors (hidden states keep their wire dtype).
pub fn decode_sample(
    sample: &Sample,
    expectations: SampleExpectations,
) -> Result<TrainingSequence, SampleError> {
    sample.validate()?;
    let input_ids = sample.tensor(INPUT_IDS)?;
    let loss_mask = sample.tensor(LOSS_MASK)?;
    let hidden_states = sample.tensor(HIDDEN_STATES)?;
    let length = match input_ids.shape.as_slice() {
        [length] => *length,
        other => {
            return Err(SampleError::Shape {
                name: INPUT_IDS,
                shape: other.to_vec(),
                expected: "[T]".into(),
            })
        }
    };
    if length < 2 {
        return Err(SampleError::TooShort(length));
    }
    if loss_mask.shape != [length] {
        return Err(SampleError::Shape {
            name: LOSS_MASK,
            shape: loss_mask.shape.clone(),
            expected: format!("[{length}] like input_ids"),
        });
    }
    match hidden_states.shape.as_slice() {
        [rows, width] if *rows == length => {
            if *width as i64 != expectations.hidden_width {
                return Err(SampleError::HiddenWidth {
                    actual: *width,
                    expected: expectations.hidden_width,
                });
            }
        }
        other => {
            return Err(SampleError::Shape {
                name: HIDDEN_STATES,
                shape: other.to_vec(),
                expected: format!("[{length}, {}]", expectations.hidden_width),
            })
        }
    }
    let token_ids = decode_token_ids(input_ids)?;
    if let Some(&token) = token_ids
        .iter()
        .find(|&&token| token < 0 || token >= expectations.vocab_size)
    {
        return Err(SampleError::TokenOutOfRange {
            token,
            vocab_size: expectations.vocab_size,
        });
    }
    let mask = match loss_mask.checked_dtype()? {
        Dtype::U8 | Dtype::Bool => loss_mask
            .data
            .iter()
            .map(|&value| u8::from(value != 0))
            .collect(),
        Dtype::I32 => loss_mask
            .data
            .chunks_exact(4)
            .map(|bytes| u8::from(bytes.iter().any(|&byte| byte != 0)))
            .collect(),
        other => {
            return Err(SampleError::Dtype {
                name: LOSS_MASK,
                dtype: other.short_name(),
                expected: "uint8, bool, int32",
            })
        }
    };
    let kind = match hidden_states.checked_dtype()? {
        Dtype::Bf16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F32 => Kind::Float,
        other => {
            return Err(SampleError::Dtype {
                name: HIDDEN_STATES,
                dtype: other.short_name(),
                expected: "bf16, f16, f32",
            })
        }
    };
    let shape = [length as i64, expectations.hidden_width];
    let target_hidden =
        Tensor::f_from_data_size(&hidden_states.data, &shape, kind).map_err(|error| {
            SampleError::Shape {
                name: HIDDEN_STATES,
                shape: hidden_states.shape.clone(),
                expected: format!("a tensor libtorch accepts: {error}"),
            }
        })?;
    Ok(TrainingSequence {
        input_ids: token_ids,
        loss_mask: mask,
        target_hidden,
    })
}

fn decode_token_ids(tensor: &WireTensor) -> Result<Vec<i64>, SampleError> {
    match tensor.checked_dtype()? {
        Dtype::I32 => Ok(tensor
            .data
            .chunks_exact(4)
            .map(|bytes| i64::from(i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])))
            .collect()),
        Dtype::I64 => Ok(tensor
            .data
            .chunks_exact(8)
            .map(|bytes| {
                let mut array = [0u8; 8];
                array.copy_from_slice(bytes);
                i64::from_le_bytes(array)
            })
            .collect()),
        other => Err(SampleError::Dtype {
            name: INPUT_IDS,
            dtype: other.short_name(),
            expected: "int32, int64",
        }),
    }
}

/// Builds a wire sample from parts (tests, the synthetic tools and the
/// evaluation data generator use it).
pub fn encode_sample(
    input_ids: &[i32],
    loss_mask: &[u8],
    hidden_states_bf16: &[u8],
    hidden_width: u64,
) -> Sample {
    let length = input_ids.len() as u64;
    let id_bytes: Vec<u8> = input_ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    Sample {
        tensors: vec![
            WireTensor::from_parts(INPUT_IDS, Dtype::I32, vec![length], id_bytes.into()),
            WireTensor::from_parts(
                LOSS_MASK,
                Dtype::U8,
                vec![length],
                loss_mask.to_vec().into(),
            ),
            WireTensor::from_parts(
                HIDDEN_STATES,
                Dtype::Bf16,
                vec![length, hidden_width],
                hidden_states_bf16.to_vec().into(),
            ),
        ],
    }
}

/// The raw little-endian bytes of a bf16 tensor (for [`encode_sample`]).
pub fn bf16_bytes(tensor: &Tensor) -> Result<Vec<u8>, tch::TchError> {
    let contiguous = tensor
        .to_device(tch::Device::Cpu)
        .to_kind(Kind::BFloat16)
        .contiguous();
    let mut bytes = vec![0u8; contiguous.numel() * 2];
    contiguous.f_copy_data_u8(&mut bytes, contiguous.numel())?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPECT: SampleExpectations = SampleExpectations {
        hidden_width: 4,
        vocab_size: 10,
    };

    fn sample(tokens: &[i32], width: u64) -> Sample {
        let hidden = vec![0u8; tokens.len() * width as usize * 2];
        encode_sample(tokens, &vec![1; tokens.len()], &hidden, width)
    }

    #[test]
    fn a_well_formed_sample_decodes() {
        let sequence = decode_sample(&sample(&[1, 2, 3], 4), EXPECT).unwrap();
        assert_eq!(sequence.input_ids, vec![1, 2, 3]);
        assert_eq!(sequence.loss_mask, vec![1, 1, 1]);
        assert_eq!(sequence.target_hidden.size(), vec![3, 4]);
        assert_eq!(sequence.target_hidden.kind(), Kind::BFloat16);
        assert_eq!(sample_token_count(&sample(&[1, 2, 3], 4)), 3);
    }

    #[test]
    fn a_wrong_hidden_width_is_named() {
        let error = decode_sample(&sample(&[1, 2, 3], 6), EXPECT).unwrap_err();
        assert_eq!(
            error,
            SampleError::HiddenWidth {
                actual: 6,
                expected: 4
            }
        );
        assert!(error.to_string().contains("width 6, the drafter expects 4"));
    }

    #[test]
    fn bad_tokens_lengths_and_missing_tensors_are_errors() {
        assert_eq!(
            decode_sample(&sample(&[1, 12], 4), EXPECT).unwrap_err(),
            SampleError::TokenOutOfRange {
                token: 12,
                vocab_size: 10
            }
        );
        assert_eq!(
            decode_sample(&sample(&[1], 4), EXPECT).unwrap_err(),
            SampleError::TooShort(1)
        );
        let mut missing = sample(&[1, 2], 4);
        missing.tensors.remove(1);
        assert!(decode_sample(&missing, EXPECT)
            .unwrap_err()
            .to_string()
            .contains("loss_mask"));
        let mut truncated = sample(&[1, 2], 4);
        truncated.tensors[2].data = truncated.tensors[2].data.slice(1..);
        assert!(matches!(
            decode_sample(&truncated, EXPECT),
            Err(SampleError::Invalid(_))
        ));
    }
}
