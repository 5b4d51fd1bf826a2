//! [`TinyModelSpec`]: the sizes, architecture and seed of a tiny model.

use crate::target_model::{Architecture, ModelError};

/// What tiny model to write.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyModelSpec {
    /// Qwen3 (tied embeddings, q/k norm) or Llama (untied, llama3 RoPE).
    pub architecture: Architecture,
    /// Seed of every weight; the same spec always gives the same bytes.
    pub seed: u64,
    pub hidden_size: i64,
    pub layers: usize,
    pub heads: i64,
    pub kv_heads: i64,
    pub intermediate: i64,
    /// Model vocabulary (embedding rows); at least the tokenizer's size,
    /// padded like Qwen pads its vocabulary.
    pub vocab: i64,
}

impl Default for TinyModelSpec {
    /// A tiny Qwen3: 8 layers so that 5 DFlash draft layers read the
    /// distinct target layers [1, 2, 3, 4, 5].
    fn default() -> Self {
        TinyModelSpec {
            architecture: Architecture::Qwen3,
            seed: 0,
            hidden_size: 64,
            layers: 8,
            heads: 4,
            kv_heads: 2,
            intermediate: 128,
            vocab: 512,
        }
    }
}

impl TinyModelSpec {
    /// A tiny Llama-3 with llama3 RoPE scaling and untied embeddings.
    pub fn llama() -> Self {
        TinyModelSpec {
            architecture: Architecture::Llama,
            seed: 1,
            hidden_size: 48,
            layers: 6,
            heads: 6,
            kv_heads: 2,
            intermediate: 96,
            vocab: 512,
        }
    }

    pub(super) fn head_dim(&self) -> i64 {
        self.hidden_size / self.heads
    }

    pub(super) fn validate(&self) -> Result<(), ModelError> {
        let invalid =
            |message: String| ModelError::InvalidInput(format!("tiny model spec: {message}"));
        if self.hidden_size <= 0
            || self.heads <= 0
            || self.kv_heads <= 0
            || self.intermediate <= 0
            || self.layers == 0
        {
            return Err(invalid(format!("sizes must be positive: {self:?}")));
        }
        if self.hidden_size % self.heads != 0 || self.head_dim() % 2 != 0 {
            return Err(invalid(format!(
                "hidden_size {} must split into {} heads of even width",
                self.hidden_size, self.heads
            )));
        }
        if self.heads % self.kv_heads != 0 {
            return Err(invalid(format!(
                "heads {} not a multiple of kv_heads {}",
                self.heads, self.kv_heads
            )));
        }
        Ok(())
    }
}
