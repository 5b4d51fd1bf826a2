//! Checked helpers on the generated `Tensor` and `Sample` messages: element
//! sizes, shape/byte-length validation and lookup by name. Pure functions, no
//! I/O, so the broker and both services validate payloads the same way.

use crate::v1::{Dtype, Sample, Tensor};
use bytes::Bytes;

/// A tensor whose declared dtype and shape do not match its bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    #[error("tensor {name:?}: dtype {dtype} is not a known element type")]
    UnknownDtype { name: String, dtype: i32 },
    #[error("tensor {name:?}: shape {shape:?} overflows the element count")]
    ShapeOverflow { name: String, shape: Vec<u64> },
    #[error("tensor {name:?}: {actual} bytes, expected {expected} for {dtype} {shape:?}")]
    ByteLength {
        name: String,
        actual: u64,
        expected: u64,
        dtype: &'static str,
        shape: Vec<u64>,
    },
    #[error("tensor name is empty")]
    EmptyName,
    #[error("sample has two tensors named {name:?}")]
    DuplicateName { name: String },
    #[error("sample has no tensors")]
    EmptySample,
    #[error("sample has {count} tensors, at most {limit} are accepted")]
    TooManyTensors { count: usize, limit: usize },
    #[error("sample has no tensor named {name:?}")]
    Missing { name: String },
    #[error("tensor {name:?}: dtype {actual}, expected {expected}")]
    WrongDtype {
        name: String,
        actual: &'static str,
        expected: &'static str,
    },
}

impl Dtype {
    /// Bytes per element; `None` for `DTYPE_UNSPECIFIED`.
    pub fn element_size(self) -> Option<u64> {
        match self {
            Dtype::Unspecified => None,
            Dtype::Bf16 | Dtype::F16 => Some(2),
            Dtype::F32 | Dtype::I32 => Some(4),
            Dtype::I64 => Some(8),
            Dtype::U8 | Dtype::Bool => Some(1),
        }
    }

    /// Short lowercase name used in messages (`bf16`, `int32`, ...).
    pub fn short_name(self) -> &'static str {
        match self {
            Dtype::Unspecified => "unspecified",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
            Dtype::I32 => "int32",
            Dtype::I64 => "int64",
            Dtype::U8 => "uint8",
            Dtype::Bool => "bool",
        }
    }
}

impl Tensor {
    /// A tensor from its parts; call [`Tensor::validate`] before trusting it.
    pub fn from_parts(name: impl Into<String>, dtype: Dtype, shape: Vec<u64>, data: Bytes) -> Self {
        Tensor {
            name: name.into(),
            dtype: dtype as i32,
            shape,
            data,
        }
    }

    /// The dtype, or an error naming the tensor when the number is unknown.
    pub fn checked_dtype(&self) -> Result<Dtype, TensorError> {
        match Dtype::try_from(self.dtype) {
            Ok(dtype) if dtype != Dtype::Unspecified => Ok(dtype),
            _ => Err(TensorError::UnknownDtype {
                name: self.name.clone(),
                dtype: self.dtype,
            }),
        }
    }

    /// Number of elements the shape declares.
    pub fn element_count(&self) -> Result<u64, TensorError> {
        self.shape
            .iter()
            .try_fold(1u64, |count, &dim| count.checked_mul(dim))
            .ok_or_else(|| TensorError::ShapeOverflow {
                name: self.name.clone(),
                shape: self.shape.clone(),
            })
    }

    /// Checks that the name is set, the dtype known, and the byte length is
    /// exactly elements × element size.
    pub fn validate(&self) -> Result<(), TensorError> {
        self.validate_length(self.data.len() as u64)
    }

    /// [`Tensor::validate`] for a tensor whose `actual` data bytes are held
    /// elsewhere (the broker keeps a large payload as the slices of the
    /// frames it arrived in).
    pub fn validate_length(&self, actual: u64) -> Result<(), TensorError> {
        if self.name.is_empty() {
            return Err(TensorError::EmptyName);
        }
        let dtype = self.checked_dtype()?;
        let element_size = dtype.element_size().unwrap_or(0);
        let expected = self
            .element_count()?
            .checked_mul(element_size)
            .ok_or_else(|| TensorError::ShapeOverflow {
                name: self.name.clone(),
                shape: self.shape.clone(),
            })?;
        if actual != expected {
            return Err(TensorError::ByteLength {
                name: self.name.clone(),
                actual,
                expected,
                dtype: dtype.short_name(),
                shape: self.shape.clone(),
            });
        }
        Ok(())
    }

    /// Checks the tensor has the expected dtype.
    pub fn expect_dtype(&self, expected: Dtype) -> Result<(), TensorError> {
        let actual = self.checked_dtype()?;
        if actual != expected {
            return Err(TensorError::WrongDtype {
                name: self.name.clone(),
                actual: actual.short_name(),
                expected: expected.short_name(),
            });
        }
        Ok(())
    }
}

impl Sample {
    /// Validates every tensor and that names are unique and non-empty.
    pub fn validate(&self) -> Result<(), TensorError> {
        if self.tensors.is_empty() {
            return Err(TensorError::EmptySample);
        }
        for (index, tensor) in self.tensors.iter().enumerate() {
            tensor.validate()?;
            if self.tensors[..index]
                .iter()
                .any(|earlier| earlier.name == tensor.name)
            {
                return Err(TensorError::DuplicateName {
                    name: tensor.name.clone(),
                });
            }
        }
        Ok(())
    }

    /// The tensor with this name.
    pub fn tensor(&self, name: &str) -> Result<&Tensor, TensorError> {
        self.tensors
            .iter()
            .find(|tensor| tensor.name == name)
            .ok_or_else(|| TensorError::Missing {
                name: name.to_string(),
            })
    }

    /// Payload bytes of all tensors (what the broker's byte limits count).
    pub fn payload_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|tensor| tensor.data.len() as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(dtype: Dtype, shape: Vec<u64>, bytes: usize) -> Tensor {
        Tensor::from_parts("hidden_states", dtype, shape, Bytes::from(vec![0u8; bytes]))
    }

    #[test]
    fn valid_tensor_passes() {
        assert_eq!(tensor(Dtype::Bf16, vec![3, 4], 24).validate(), Ok(()));
        assert_eq!(tensor(Dtype::I32, vec![], 4).validate(), Ok(()));
    }

    #[test]
    fn wrong_length_names_the_tensor_and_sizes() {
        let error = tensor(Dtype::Bf16, vec![256, 4096], 1_048_576)
            .validate()
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "tensor \"hidden_states\": 1048576 bytes, expected 2097152 for bf16 [256, 4096]"
        );
    }

    #[test]
    fn unknown_dtype_and_overflow_are_errors() {
        let mut bad = tensor(Dtype::Bf16, vec![1], 2);
        bad.dtype = 99;
        assert!(matches!(
            bad.validate(),
            Err(TensorError::UnknownDtype { dtype: 99, .. })
        ));
        assert!(matches!(
            tensor(Dtype::F32, vec![u64::MAX, 2], 0).validate(),
            Err(TensorError::ShapeOverflow { .. })
        ));
    }

    #[test]
    fn sample_rejects_duplicates_and_empty() {
        assert_eq!(
            Sample { tensors: vec![] }.validate(),
            Err(TensorError::EmptySample)
        );
        let one = tensor(Dtype::U8, vec![2], 2);
        let sample = Sample {
            tensors: vec![one.clone(), one],
        };
        assert!(matches!(
            sample.validate(),
            Err(TensorError::DuplicateName { .. })
        ));
    }
}
