//! The DFlash sample schema: the tensors one training sample carries on the
//! wire, with one encoder (the target, the tests, the synthetic tools) and
//! one validating decoder (the drafter). The Python client mirrors it.
//!
//! | tensor | dtype | shape |
//! |---|---|---|
//! | `input_ids` | int32 (int64 accepted) | `[T]` |
//! | `loss_mask` | uint8 (bool, int32 accepted) | `[T]` |
//! | `hidden_states` | bf16 (f16, f32 accepted) | `[T, n_layers · hidden]` |
//! | `last_hidden_states` (optional) | bf16 (f16, f32 accepted) | `[T, hidden]` |
//!
//! `last_hidden_states` is the target's last hidden state after its final
//! norm (its LM head's input), sent only when the run asks for it
//! (`ProducerWelcome.capture`, the broker's `--target-capture
//! last-hidden-states`): a DSpark drafter makes the target's distribution
//! from it with the LM head it holds.
//!
//! Pure functions on bytes; no libtorch.

use bytes::Bytes;

use crate::tensor::TensorError;
use crate::v1::{Dtype, Sample, Tensor};

/// Token ids of the sequence.
pub const INPUT_IDS: &str = "input_ids";
/// 1 where the token is trained on (assistant tokens), else 0.
pub const LOSS_MASK: &str = "loss_mask";
/// The target's hidden states at the DFlash layers, concatenated per token.
pub const HIDDEN_STATES: &str = "hidden_states";
/// The target's last hidden state after its final norm, per token (optional).
pub const LAST_HIDDEN_STATES: &str = "last_hidden_states";

/// Why a sample does not follow the schema; the message names the tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    #[error("invalid sample: {0}")]
    Invalid(#[from] TensorError),
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
}

/// A schema-checked sample: tokens and mask decoded, hidden states still the
/// wire bytes (`hidden_states.data`, `[tokens, width]` of `hidden_dtype`).
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedSample<'a> {
    pub input_ids: Vec<i64>,
    /// 0 or 1 per token.
    pub loss_mask: Vec<u8>,
    pub hidden_states: &'a Tensor,
    pub hidden_dtype: Dtype,
    pub tokens: u64,
    pub width: u64,
    /// `last_hidden_states` (`[tokens, last_width]` of its dtype) when the
    /// sample carries it.
    pub last_hidden_states: Option<LastHiddenStates<'a>>,
}

/// A sample's `last_hidden_states`, schema-checked, bytes still the wire's.
#[derive(Debug, Clone, PartialEq)]
pub struct LastHiddenStates<'a> {
    pub tensor: &'a Tensor,
    pub dtype: Dtype,
    pub width: u64,
}

/// Adds `last_hidden_states` (`[T, width]` of `dtype`, the bytes shared) to
/// an encoded sample.
pub fn push_last_hidden_states(sample: &mut Sample, data: Bytes, dtype: Dtype, width: u64) {
    let tokens = token_count(sample);
    sample.tensors.push(Tensor::from_parts(
        LAST_HIDDEN_STATES,
        dtype,
        vec![tokens, width],
        data,
    ));
}

/// Encodes a sample: `input_ids` as int32, `loss_mask` as uint8 and the
/// hidden states' bytes (`[input_ids.len(), width]` of `hidden_dtype`) shared,
/// not copied. Token ids must fit int32 (every tokenizer's do).
pub fn encode(
    input_ids: &[i64],
    loss_mask: &[u8],
    hidden_states: Bytes,
    hidden_dtype: Dtype,
    width: u64,
) -> Sample {
    let tokens = input_ids.len() as u64;
    let id_bytes: Vec<u8> = input_ids
        .iter()
        .flat_map(|&id| (id as i32).to_le_bytes())
        .collect();
    Sample {
        tensors: vec![
            Tensor::from_parts(INPUT_IDS, Dtype::I32, vec![tokens], Bytes::from(id_bytes)),
            Tensor::from_parts(
                LOSS_MASK,
                Dtype::U8,
                vec![tokens],
                Bytes::copy_from_slice(loss_mask),
            ),
            Tensor::from_parts(
                HIDDEN_STATES,
                hidden_dtype,
                vec![tokens, width],
                hidden_states,
            ),
        ],
    }
}

/// Tokens a sample declares (0 without `input_ids`): what synthetic
/// consumers need, without decoding anything.
pub fn token_count(sample: &Sample) -> u64 {
    sample
        .tensor(INPUT_IDS)
        .ok()
        .and_then(|tensor| tensor.shape.first().copied())
        .unwrap_or(0)
}

/// Validates every tensor's bytes against its dtype and shape, then the
/// schema: names, dtypes and the shapes' agreement on T.
pub fn decode(sample: &Sample) -> Result<DecodedSample<'_>, SampleError> {
    sample.validate()?;
    let input_ids = sample.tensor(INPUT_IDS)?;
    let loss_mask = sample.tensor(LOSS_MASK)?;
    let hidden_states = sample.tensor(HIDDEN_STATES)?;
    let tokens = match input_ids.shape.as_slice() {
        [tokens] => *tokens,
        other => {
            return Err(SampleError::Shape {
                name: INPUT_IDS,
                shape: other.to_vec(),
                expected: "[T]".into(),
            })
        }
    };
    if loss_mask.shape != [tokens] {
        return Err(SampleError::Shape {
            name: LOSS_MASK,
            shape: loss_mask.shape.clone(),
            expected: format!("[{tokens}] like input_ids"),
        });
    }
    let width = match hidden_states.shape.as_slice() {
        [rows, width] if *rows == tokens => *width,
        other => {
            return Err(SampleError::Shape {
                name: HIDDEN_STATES,
                shape: other.to_vec(),
                expected: format!("[{tokens}, width]"),
            })
        }
    };
    let hidden_dtype = float_dtype(hidden_states, HIDDEN_STATES)?;
    let last_hidden_states = match sample.tensor(LAST_HIDDEN_STATES) {
        Err(_) => None,
        Ok(last) => {
            let width = match last.shape.as_slice() {
                [rows, width] if *rows == tokens => *width,
                other => {
                    return Err(SampleError::Shape {
                        name: LAST_HIDDEN_STATES,
                        shape: other.to_vec(),
                        expected: format!("[{tokens}, hidden]"),
                    })
                }
            };
            Some(LastHiddenStates {
                tensor: last,
                dtype: float_dtype(last, LAST_HIDDEN_STATES)?,
                width,
            })
        }
    };
    Ok(DecodedSample {
        last_hidden_states,
        input_ids: decode_token_ids(input_ids)?,
        loss_mask: decode_loss_mask(loss_mask)?,
        hidden_states,
        hidden_dtype,
        tokens,
        width,
    })
}

/// A hidden-state tensor's dtype, one of the float ones.
fn float_dtype(tensor: &Tensor, name: &'static str) -> Result<Dtype, SampleError> {
    match tensor.checked_dtype()? {
        dtype @ (Dtype::Bf16 | Dtype::F16 | Dtype::F32) => Ok(dtype),
        other => Err(SampleError::Dtype {
            name,
            dtype: other.short_name(),
            expected: "bf16, f16, f32",
        }),
    }
}

/// The non-finite values (NaN, +inf, -inf) of a floating-point tensor's
/// little-endian bytes: how many, and the element index of the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NonFiniteValues {
    pub count: u64,
    pub first_index: u64,
}

/// Scans `data` (elements of `dtype`: bf16, f16 or f32; other dtypes have
/// no non-finite values) for NaN and infinities by their bit patterns (all
/// exponent bits set), without libtorch: the drafter checks every sample
/// with it before training on it, the target before sending one. Counts
/// eight bytes at a time (four bf16/f16 or two f32 lanes per u64, no
/// branch); the first index is searched only when the count is not zero.
/// `None` when every value is finite.
pub fn non_finite_values(data: &[u8], dtype: Dtype) -> Option<NonFiniteValues> {
    // Per lane of a little-endian u64: the exponent mask, and the bit that
    // `(lane & mask) + carry` sets exactly when every exponent bit is set
    // (`mask + carry` is the lane's top bit; a smaller masked value, whose
    // low bits below the exponent are zero, stays below it; no lane carries
    // into the next).
    let (element_bytes, mask, carry, top): (usize, u64, u64, u64) = match dtype {
        Dtype::Bf16 => (
            2,
            0x7F80_7F80_7F80_7F80,
            0x0080_0080_0080_0080,
            0x8000_8000_8000_8000,
        ),
        Dtype::F16 => (
            2,
            0x7C00_7C00_7C00_7C00,
            0x0400_0400_0400_0400,
            0x8000_8000_8000_8000,
        ),
        Dtype::F32 => (
            4,
            0x7F80_0000_7F80_0000,
            0x0080_0000_0080_0000,
            0x8000_0000_8000_0000,
        ),
        _ => return None,
    };
    let lane_is_non_finite = |lane: u64| ((lane & mask) + carry) & top;
    let words = data.chunks_exact(8);
    let tail = words.remainder();
    let mut count: u64 = words
        .map(|word| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(word);
            u64::from(lane_is_non_finite(u64::from_le_bytes(bytes)).count_ones())
        })
        .sum();
    for element in tail.chunks_exact(element_bytes) {
        let mut bytes = [0u8; 8];
        bytes[..element_bytes].copy_from_slice(element);
        count += u64::from(lane_is_non_finite(u64::from_le_bytes(bytes)).count_ones());
    }
    if count == 0 {
        return None;
    }
    let first_index = data
        .chunks_exact(element_bytes)
        .position(|element| {
            let mut bytes = [0u8; 8];
            bytes[..element_bytes].copy_from_slice(element);
            lane_is_non_finite(u64::from_le_bytes(bytes)) != 0
        })
        .unwrap_or_default() as u64;
    Some(NonFiniteValues { count, first_index })
}

fn decode_token_ids(tensor: &Tensor) -> Result<Vec<i64>, SampleError> {
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

fn decode_loss_mask(tensor: &Tensor) -> Result<Vec<u8>, SampleError> {
    match tensor.checked_dtype()? {
        Dtype::U8 | Dtype::Bool => Ok(tensor
            .data
            .iter()
            .map(|&value| u8::from(value != 0))
            .collect()),
        Dtype::I32 => Ok(tensor
            .data
            .chunks_exact(4)
            .map(|bytes| u8::from(bytes.iter().any(|&byte| byte != 0)))
            .collect()),
        other => Err(SampleError::Dtype {
            name: LOSS_MASK,
            dtype: other.short_name(),
            expected: "uint8, bool, int32",
        }),
    }
}

#[cfg(test)]
mod tests {
    proptest::proptest! {
        /// The eight-bytes-at-a-time count agrees with a plain per-element
        /// check on any bytes, any length (tails included), every dtype.
        #[test]
        fn the_word_scan_agrees_with_a_per_element_check(
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            dtype_index in 0usize..3,
        ) {
            use super::non_finite_values;
            use crate::v1::Dtype;
            let (dtype, size) = [(Dtype::Bf16, 2), (Dtype::F16, 2), (Dtype::F32, 4)][dtype_index];
            let flags: Vec<bool> = data
                .chunks_exact(size)
                .map(|element| match dtype {
                    Dtype::Bf16 => u16::from_le_bytes([element[0], element[1]]) & 0x7F80 == 0x7F80,
                    Dtype::F16 => u16::from_le_bytes([element[0], element[1]]) & 0x7C00 == 0x7C00,
                    _ => !f32::from_le_bytes([element[0], element[1], element[2], element[3]]).is_finite(),
                })
                .collect();
            let count = flags.iter().filter(|&&flag| flag).count() as u64;
            let expected = flags.iter().position(|&flag| flag).map(|first| super::NonFiniteValues {
                count,
                first_index: first as u64,
            });
            proptest::prop_assert_eq!(non_finite_values(&data, dtype), expected);
        }
    }

    #[test]
    fn non_finite_values_are_found_by_bit_pattern_in_every_float_dtype() {
        use super::{non_finite_values, NonFiniteValues};
        use crate::v1::Dtype;
        let bf16 = |value: f32| ((value.to_bits() >> 16) as u16).to_le_bytes();
        let mut data: Vec<u8> = [1.0f32, -2.5, 3.0e38, 0.0, -0.0, f32::MIN_POSITIVE]
            .iter()
            .flat_map(|&value| bf16(value))
            .collect();
        assert_eq!(non_finite_values(&data, Dtype::Bf16), None);
        data.extend(bf16(f32::NAN));
        data.extend(bf16(1.0));
        data.extend(bf16(f32::NEG_INFINITY));
        assert_eq!(
            non_finite_values(&data, Dtype::Bf16),
            Some(NonFiniteValues {
                count: 2,
                first_index: 6
            })
        );
        let f32_data: Vec<u8> = [0.5f32, f32::MAX, f32::INFINITY]
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect();
        assert_eq!(
            non_finite_values(&f32_data, Dtype::F32),
            Some(NonFiniteValues {
                count: 1,
                first_index: 2
            })
        );
        // f16: 0x7BFF is the largest finite value, 0x7C00 infinity, 0xFE00 a NaN.
        let f16_data: Vec<u8> = [0x3C00u16, 0x7BFF, 0xFE00]
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect();
        assert_eq!(
            non_finite_values(&f16_data, Dtype::F16),
            Some(NonFiniteValues {
                count: 1,
                first_index: 2
            })
        );
        assert_eq!(non_finite_values(&[0xFF; 8], Dtype::U8), None);
    }

    use super::*;

    fn hidden(tokens: usize, width: usize) -> Bytes {
        Bytes::from(vec![0u8; tokens * width * 2])
    }

    #[test]
    fn the_last_hidden_states_are_optional_and_checked_by_name() {
        let mut sample = encode(&[5, 6, 7], &[0, 1, 1], hidden(3, 4), Dtype::Bf16, 4);
        assert_eq!(decode(&sample).unwrap().last_hidden_states, None);
        push_last_hidden_states(&mut sample, hidden(3, 2), Dtype::Bf16, 2);
        let decoded = decode(&sample).unwrap();
        let last = decoded.last_hidden_states.unwrap();
        assert_eq!((last.width, last.dtype), (2, Dtype::Bf16));
        assert_eq!(last.tensor.data.len(), 12);
        let mut short = encode(&[5, 6, 7], &[0, 1, 1], hidden(3, 4), Dtype::Bf16, 4);
        short.tensors.push(Tensor::from_parts(
            LAST_HIDDEN_STATES,
            Dtype::Bf16,
            vec![2, 2],
            hidden(2, 2),
        ));
        let error = decode(&short).unwrap_err().to_string();
        assert!(
            error.contains("\"last_hidden_states\": shape [2, 2], expected [3, hidden]"),
            "{error}"
        );
        let mut integer = encode(&[5, 6, 7], &[0, 1, 1], hidden(3, 4), Dtype::Bf16, 4);
        integer.tensors.push(Tensor::from_parts(
            LAST_HIDDEN_STATES,
            Dtype::I32,
            vec![3, 1],
            Bytes::from(vec![0u8; 12]),
        ));
        let error = decode(&integer).unwrap_err().to_string();
        assert!(
            error.contains("\"last_hidden_states\": dtype int32"),
            "{error}"
        );
    }

    #[test]
    fn encode_then_decode_gives_the_parts_back() {
        let sample = encode(&[5, 6, 7], &[0, 1, 1], hidden(3, 4), Dtype::Bf16, 4);
        let decoded = decode(&sample).unwrap();
        assert_eq!(decoded.input_ids, vec![5, 6, 7]);
        assert_eq!(decoded.loss_mask, vec![0, 1, 1]);
        assert_eq!((decoded.tokens, decoded.width), (3, 4));
        assert_eq!(decoded.hidden_dtype, Dtype::Bf16);
        assert_eq!(decoded.hidden_states.data.len(), 24);
        assert_eq!(token_count(&sample), 3);
        let names: Vec<&str> = sample.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, vec![INPUT_IDS, LOSS_MASK, HIDDEN_STATES]);
        let large = encode(&[1, 70_000], &[1, 1], hidden(2, 1), Dtype::Bf16, 1);
        assert_eq!(&large.tensors[0].data[4..8], &70_000i32.to_le_bytes());
        assert_eq!(large.tensors[0].checked_dtype(), Ok(Dtype::I32));
        assert_eq!(large.tensors[1].checked_dtype(), Ok(Dtype::U8));
    }

    #[test]
    fn the_hidden_bytes_are_shared_not_copied() {
        let bytes = hidden(2, 8);
        let sample = encode(&[1, 2], &[1, 1], bytes.clone(), Dtype::Bf16, 8);
        let decoded = decode(&sample).unwrap();
        assert_eq!(decoded.hidden_states.data.as_ptr(), bytes.as_ptr());
    }

    #[test]
    fn wider_masks_and_ids_are_accepted() {
        let mut sample = encode(&[1, 2], &[1, 0], hidden(2, 2), Dtype::Bf16, 2);
        sample.tensors[0] = Tensor::from_parts(
            INPUT_IDS,
            Dtype::I64,
            vec![2],
            Bytes::from(
                [1i64, 300_000]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<_>>(),
            ),
        );
        sample.tensors[1] = Tensor::from_parts(
            LOSS_MASK,
            Dtype::I32,
            vec![2],
            Bytes::from(
                [0i32, 7]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<_>>(),
            ),
        );
        let decoded = decode(&sample).unwrap();
        assert_eq!(decoded.input_ids, vec![1, 300_000]);
        assert_eq!(decoded.loss_mask, vec![0, 1]);
    }

    #[test]
    fn schema_violations_name_the_tensor() {
        let mut short_mask = encode(&[1, 2, 3], &[1, 1, 1], hidden(3, 2), Dtype::Bf16, 2);
        short_mask.tensors[1] =
            Tensor::from_parts(LOSS_MASK, Dtype::U8, vec![2], Bytes::from(vec![1, 1]));
        let error = decode(&short_mask).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("\"loss_mask\": shape [2], expected [3]"),
            "{error}"
        );

        let rows = encode(&[1, 2, 3], &[1, 1, 1], hidden(3, 2), Dtype::Bf16, 2);
        let mut wrong_rows = rows.clone();
        wrong_rows.tensors[2] =
            Tensor::from_parts(HIDDEN_STATES, Dtype::Bf16, vec![2, 3], hidden(2, 3));
        assert!(matches!(
            decode(&wrong_rows),
            Err(SampleError::Shape {
                name: HIDDEN_STATES,
                ..
            })
        ));

        let mut integer_hidden = rows.clone();
        integer_hidden.tensors[2] = Tensor::from_parts(
            HIDDEN_STATES,
            Dtype::I32,
            vec![3, 2],
            Bytes::from(vec![0u8; 24]),
        );
        assert_eq!(
            decode(&integer_hidden).unwrap_err().to_string(),
            "tensor \"hidden_states\": dtype int32, expected one of bf16, f16, f32"
        );

        let mut missing = rows.clone();
        missing.tensors.remove(1);
        assert!(decode(&missing)
            .unwrap_err()
            .to_string()
            .contains("loss_mask"));

        let mut truncated = rows;
        truncated.tensors[2].data = truncated.tensors[2].data.slice(1..);
        assert!(matches!(decode(&truncated), Err(SampleError::Invalid(_))));
    }
}
