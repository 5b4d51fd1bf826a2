//! Decoding a broker `Sample` into a training sequence, with every check
//! that decides whether the item is usable by this drafter at all. The wire
//! schema itself is `dflash_proto::sample`; this adds what the model needs
//! (width, vocabulary, length). A sample that fails here fails on every
//! drafter with the same model, so it is dead-lettered rather than requeued.

use dflash_model::draft::TrainingSequence;
use dflash_proto::sample as schema;
use dflash_proto::v1::{Dtype, Sample};
use tch::{Kind, Tensor};

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
    #[error(transparent)]
    Schema(#[from] schema::SampleError),
    #[error("tensor \"hidden_states\": width {actual}, the drafter expects {expected} (target layers × hidden size); is the target-server tapping the same layers of the same model?")]
    HiddenWidth { actual: u64, expected: i64 },
    #[error("sample has {0} tokens; at least 2 are needed to train")]
    TooShort(u64),
    #[error("tensor \"input_ids\": token id {token} outside the vocabulary of {vocab_size}")]
    TokenOutOfRange { token: i64, vocab_size: i64 },
    #[error("tensor \"hidden_states\": libtorch refused the bytes: {0}")]
    Tensor(String),
    #[error("tensor \"hidden_states\": {count} non-finite values (NaN or infinity), the first at token {token}, column {column}: never trained on (a bf16 overflow or a fault in the target that made it)")]
    NonFinite { count: u64, token: u64, column: u64 },
    #[error("tensor \"last_hidden_states\": {count} non-finite values (NaN or infinity), the first at token {token}, column {column}: never trained on")]
    LastHiddenNonFinite { count: u64, token: u64, column: u64 },
    #[error("sample has no tensor \"last_hidden_states\": a DSpark drafter trains on the target's last hidden state (run the broker with --target-capture last-hidden-states: it tells its targets to send it)")]
    MissingLastHidden,
    #[error("tensor \"last_hidden_states\": width {actual}, the drafter expects the target's hidden size {expected}")]
    LastHiddenWidth { actual: i64, expected: i64 },
}

/// Checks and converts a sample; tensors are copied out of the wire bytes
/// into CPU tensors (hidden states keep their wire dtype).
pub fn decode_sample(
    sample: &Sample,
    expectations: SampleExpectations,
) -> Result<TrainingSequence, SampleError> {
    let decoded = schema::decode(sample)?;
    if decoded.tokens < 2 {
        return Err(SampleError::TooShort(decoded.tokens));
    }
    if decoded.width as i64 != expectations.hidden_width {
        return Err(SampleError::HiddenWidth {
            actual: decoded.width,
            expected: expectations.hidden_width,
        });
    }
    if let Some(&token) = decoded
        .input_ids
        .iter()
        .find(|&&token| token < 0 || token >= expectations.vocab_size)
    {
        return Err(SampleError::TokenOutOfRange {
            token,
            vocab_size: expectations.vocab_size,
        });
    }
    let kind = kind_of(decoded.hidden_dtype);
    let shape = [decoded.tokens as i64, expectations.hidden_width];
    let target_hidden = Tensor::f_from_data_size(&decoded.hidden_states.data, &shape, kind)
        .map_err(|error| SampleError::Tensor(error.to_string()))?;
    let target_last_hidden = match &decoded.last_hidden_states {
        None => None,
        Some(last) => {
            let shape = [decoded.tokens as i64, last.width as i64];
            Some(
                Tensor::f_from_data_size(&last.tensor.data, &shape, kind_of(last.dtype))
                    .map_err(|error| SampleError::Tensor(error.to_string()))?,
            )
        }
    };
    Ok(TrainingSequence {
        target_last_hidden,
        input_ids: decoded.input_ids,
        loss_mask: decoded.loss_mask,
        target_hidden,
    })
}

/// The libtorch kind of a float wire dtype (bf16 for anything else, which
/// the schema has refused already).
fn kind_of(dtype: Dtype) -> Kind {
    match dtype {
        Dtype::F16 => Kind::Half,
        Dtype::F32 => Kind::Float,
        _ => Kind::BFloat16,
    }
}

/// What a DSpark drafter requires of a decoded sequence beyond
/// [`decode_sample`]'s checks: the target's last hidden state, `hidden_size`
/// wide.
pub fn require_last_hidden(
    sequence: &TrainingSequence,
    hidden_size: i64,
) -> Result<(), SampleError> {
    let last = sequence
        .target_last_hidden
        .as_ref()
        .ok_or(SampleError::MissingLastHidden)?;
    let width = last.size().get(1).copied().unwrap_or(0);
    if width != hidden_size {
        return Err(SampleError::LastHiddenWidth {
            actual: width,
            expected: hidden_size,
        });
    }
    Ok(())
}

/// Refuses a sample whose hidden states hold a NaN or an infinity: one such
/// sample would make every later loss NaN and, through model sync, the
/// shared model's weights. A scan of the wire bytes (no tensor), run by the
/// async side as each delivery arrives, off the training thread, so the
/// device never waits on it. A sample without hidden states passes here;
/// [`decode_sample`] names what it lacks.
pub fn check_finite(sample: &Sample) -> Result<(), SampleError> {
    let Ok(hidden) = sample.tensor(schema::HIDDEN_STATES) else {
        return Ok(());
    };
    let Ok(dtype) = hidden.checked_dtype() else {
        return Ok(());
    };
    let width = hidden.shape.get(1).copied().unwrap_or(1).max(1);
    if let Some(non_finite) = schema::non_finite_values(&hidden.data, dtype) {
        return Err(SampleError::NonFinite {
            count: non_finite.count,
            token: non_finite.first_index / width,
            column: non_finite.first_index % width,
        });
    }
    let Ok(last) = sample.tensor(schema::LAST_HIDDEN_STATES) else {
        return Ok(());
    };
    let Ok(dtype) = last.checked_dtype() else {
        return Ok(());
    };
    let width = last.shape.get(1).copied().unwrap_or(1).max(1);
    match schema::non_finite_values(&last.data, dtype) {
        None => Ok(()),
        Some(non_finite) => Err(SampleError::LastHiddenNonFinite {
            count: non_finite.count,
            token: non_finite.first_index / width,
            column: non_finite.first_index % width,
        }),
    }
}

/// Builds a wire sample from parts (tests, the synthetic tools and the
/// evaluation data generator use it): [`schema::encode`] with bf16 states.
pub fn encode_sample(
    input_ids: &[i32],
    loss_mask: &[u8],
    hidden_states_bf16: &[u8],
    hidden_width: u64,
) -> Sample {
    let ids: Vec<i64> = input_ids.iter().map(|&id| i64::from(id)).collect();
    schema::encode(
        &ids,
        loss_mask,
        hidden_states_bf16.to_vec().into(),
        Dtype::Bf16,
        hidden_width,
    )
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
    fn a_sample_with_a_nan_or_an_infinity_is_refused_naming_where() {
        let mut hidden = vec![0u8; 3 * 4 * 2];
        // bf16 NaN (0x7FC0) at token 2, column 1; -inf (0xFF80) later.
        hidden[(2 * 4 + 1) * 2..(2 * 4 + 1) * 2 + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
        hidden[(2 * 4 + 3) * 2..(2 * 4 + 3) * 2 + 2].copy_from_slice(&0xFF80u16.to_le_bytes());
        let sample = encode_sample(&[1, 2, 3], &[1, 1, 1], &hidden, 4);
        let error = check_finite(&sample).expect_err("refused");
        assert_eq!(
            error,
            SampleError::NonFinite {
                count: 2,
                token: 2,
                column: 1
            }
        );
        assert!(error.to_string().contains("2 non-finite values"), "{error}");
    }

    #[test]
    fn the_last_hidden_state_decodes_and_a_dspark_drafter_requires_it() {
        let plain = decode_sample(&sample(&[1, 2, 3], 4), EXPECT).unwrap();
        let missing = require_last_hidden(&plain, 2).unwrap_err();
        assert_eq!(missing, SampleError::MissingLastHidden);
        // The error names the tensor and the broker flag that turns it on.
        let message = missing.to_string();
        assert!(
            message.contains("\"last_hidden_states\"")
                && message.contains("--target-capture last-hidden-states"),
            "{message}"
        );
        let mut with_last = sample(&[1, 2, 3], 4);
        let mut last = vec![0u8; 3 * 2 * 2];
        // bf16 +inf (0x7F80) at token 1, column 0.
        last[4..6].copy_from_slice(&0x7F80u16.to_le_bytes());
        schema::push_last_hidden_states(&mut with_last, last.into(), Dtype::Bf16, 2);
        assert_eq!(
            check_finite(&with_last).unwrap_err(),
            SampleError::LastHiddenNonFinite {
                count: 1,
                token: 1,
                column: 0
            }
        );
        let sequence = decode_sample(&with_last, EXPECT).unwrap();
        let decoded = sequence.target_last_hidden.as_ref().unwrap();
        assert_eq!(decoded.size(), vec![3, 2]);
        assert_eq!(decoded.kind(), Kind::BFloat16);
        require_last_hidden(&sequence, 2).unwrap();
        let error = require_last_hidden(&sequence, 8).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("width 2, the drafter expects the target's hidden size 8"),
            "{error}"
        );
    }

    #[test]
    fn a_well_formed_sample_decodes() {
        let sequence = decode_sample(&sample(&[1, 2, 3], 4), EXPECT).unwrap();
        assert_eq!(sequence.input_ids, vec![1, 2, 3]);
        assert_eq!(sequence.loss_mask, vec![1, 1, 1]);
        assert_eq!(sequence.target_hidden.size(), vec![3, 4]);
        assert_eq!(sequence.target_hidden.kind(), Kind::BFloat16);
        assert_eq!(schema::token_count(&sample(&[1, 2, 3], 4)), 3);
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
            Err(SampleError::Schema(schema::SampleError::Invalid(_)))
        ));
    }
}
