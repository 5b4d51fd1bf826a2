//! [`DraftError`], the errors of the draft model code, and [`SkippedStep`],
//! why the trainer's guard skipped an optimizer step.

use std::path::PathBuf;

/// Errors of the draft model code. Messages carry the offending value.
#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("invalid draft config: {0}")]
    InvalidConfig(String),
    #[error("shape mismatch: {0}")]
    ShapeMismatch(String),
    #[error("draft parameter {0:?} is missing")]
    MissingParameter(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(transparent)]
    Model(#[from] crate::target_model::ModelError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("optimizer step skipped: {0}")]
    StepSkipped(SkippedStep),
}

/// Why [`DraftTrainer::step`] skipped a step: weights, optimizer moments and
/// the step count are unchanged, and the step's gradients are dropped.
#[derive(Debug, Clone, PartialEq)]
pub enum SkippedStep {
    NonFiniteLoss {
        loss: f64,
    },
    NonFiniteGradient {
        grad_norm: f64,
    },
    GradientSpike {
        grad_norm: f64,
        median: f64,
        ratio: f64,
    },
    /// A data-parallel step's reduced sums that no group of members gives
    /// (the wrong length, or rank 0's hyper-parameters summed twice or
    /// missing): the members do not agree on the model or on who is rank 0.
    InconsistentReduction {
        what: String,
    },
}

impl std::fmt::Display for SkippedStep {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SkippedStep::NonFiniteLoss { loss } => write!(formatter, "loss {loss} is not finite"),
            SkippedStep::NonFiniteGradient { grad_norm } => {
                write!(formatter, "gradient norm {grad_norm} is not finite")
            }
            SkippedStep::GradientSpike {
                grad_norm,
                median,
                ratio,
            } => write!(
                formatter,
                "gradient norm {grad_norm:.4e} is over {ratio} x the median {median:.4e} of the last taken steps"
            ),
            SkippedStep::InconsistentReduction { what } => {
                write!(formatter, "the reduced step is inconsistent: {what}")
            }
        }
    }
}
