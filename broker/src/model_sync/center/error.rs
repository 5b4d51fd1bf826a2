//! [`SyncError`]: why an exchange or a chunk was refused.

/// Why an exchange or a chunk was refused. Messages name the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    #[error("no center yet: the first JOIN must carry the drafter's weights")]
    NoCenter,
    #[error("tensor {name:?}: {detail}")]
    BadTensor { name: String, detail: String },
    #[error("the center has no tensor {0:?}")]
    UnknownTensor(String),
    #[error("tensor {name:?} has shape {got:?}, the center has {center:?}")]
    ShapeMismatch {
        name: String,
        got: Vec<u64>,
        center: Vec<u64>,
    },
    #[error("the exchange sent {sent} tensors, the commit says {declared}")]
    CountMismatch { sent: usize, declared: u32 },
    #[error("the exchange lacks tensor {0:?}")]
    MissingTensor(String),
    #[error("tensor {0:?} was sent twice in one exchange")]
    DuplicateTensor(String),
    #[error("base version {base} is newer than the center's version {center}")]
    FutureBase { base: u64, center: u64 },
    #[error("unsupported dtype {0} (expected DTYPE_BF16 or DTYPE_F32)")]
    Dtype(i32),
    #[error("sync kind {0} is not JOIN, UPDATE, FINAL, SNAPSHOT or FINAL_SNAPSHOT")]
    Kind(i32),
    #[error("model config is not valid JSON: {0}")]
    Config(String),
    #[error("model config {got} is not the run's {expected} (--model-config)")]
    ConfigMismatch { expected: String, got: String },
    /// A SyncBegin that sets `gradient_step` (field 7, kept on the wire so
    /// its number is never reused): the mode that sent it is gone.
    #[error("gradient_step: the broker's AdamW (--sync-gradients) was removed; drafters are data-parallel by default")]
    GradientStepRemoved,
    #[error("{0}")]
    MixedMethods(String),
}
