//! [`EvalError`]: what stops an evaluation, naming the file or input at fault.

use crate::draft::DraftError;
use crate::target_model::ModelError;

/// Errors of evaluation, naming the file or input at fault.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("target model: {0}")]
    Target(#[from] ModelError),
    #[error("drafter checkpoint: {0}")]
    Drafter(#[from] DraftError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("prompt {index} is empty")]
    EmptyPrompt { index: usize },
    #[error("the drafter's vocabulary ({drafter}) differs from the target's ({target})")]
    VocabularyMismatch { drafter: i64, target: i64 },
    #[error("sampling: {0}")]
    Sampling(ModelError),
}
