//! [`SyncError`]: why a snapshot or a chunk was refused.

/// Why a snapshot or a chunk was refused. Messages name the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    #[error("no center yet: the first snapshot must carry the model's weights")]
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
    #[error("the snapshot sent {sent} tensors, the commit says {declared}")]
    CountMismatch { sent: usize, declared: u32 },
    #[error("the snapshot lacks tensor {0:?}")]
    MissingTensor(String),
    #[error("tensor {0:?} was sent twice in one snapshot")]
    DuplicateTensor(String),
    #[error("unsupported dtype {0} (expected DTYPE_F32: a snapshot is the f32 master weights)")]
    Dtype(i32),
    #[error("sync kind {0} is not SNAPSHOT or FINAL_SNAPSHOT")]
    Kind(i32),
    /// A kind of asynchronous local SGD: the method was retired.
    #[error("{0}: asynchronous local SGD was removed; drafters are data-parallel and send SNAPSHOT or FINAL_SNAPSHOT")]
    RemovedKind(&'static str),
    #[error("model config is not valid JSON: {0}")]
    Config(String),
    #[error("model config {got} is not the run's {expected} (--model-config)")]
    ConfigMismatch { expected: String, got: String },
    /// A SyncBegin that sets `gradient_step` (field 7, kept on the wire so
    /// its number is never reused): the mode that sent it is gone.
    #[error("gradient_step: the broker's AdamW (--sync-gradients) was removed; drafters are data-parallel by default")]
    GradientStepRemoved,
}
