//! [`AttentionImplementation`]: the setting that picks how the
//! block-over-context attention is computed (`attention` runs it).

/// How the block-over-context attention is computed. All give the same
/// function (the reference's dense `[context ‖ blocks]` mask).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionImplementation {
    /// Scores materialised and one softmax over `[context ‖ own block]`:
    /// `[batch, heads, queries, context]` floats per layer. The default: on
    /// this project's 2-core CPU at the tiny sizes it measured faster than
    /// the fused kernels; `Fused` is the choice when the scores do not fit.
    #[default]
    Split,
    /// The context part through libtorch's fused attention kernel (the
    /// flash kernel on the CPU, memory-efficient attention on a GPU), one
    /// call per chunk of `blocks_per_chunk` blocks over the context before
    /// the chunk's largest anchor (views, no copies); the within-block part
    /// (`[queries, block]` scores) computed directly; the two merged through
    /// the context part's log-sum-exp as one more softmax column. The
    /// kernels do not differentiate their log-sum-exp, so a second fused
    /// call (values = keys) supplies its gradient. Nothing of size queries ×
    /// context is materialised: not the scores, not the mask, not the keys.
    Fused { blocks_per_chunk: i64 },
    /// One fused call per chunk of blocks over `[context before the chunk's
    /// largest anchor ‖ the chunk's block keys]` with a block-diagonal mask:
    /// one kernel call instead of two, but every chunk copies its context
    /// keys and values (chunks × context × heads × head_dim per layer) and
    /// each query also scores the chunk's other blocks' keys.
    FusedConcatenated { blocks_per_chunk: i64 },
}

impl AttentionImplementation {
    pub(super) fn blocks_per_chunk(self) -> Option<i64> {
        match self {
            AttentionImplementation::Split => None,
            AttentionImplementation::Fused { blocks_per_chunk }
            | AttentionImplementation::FusedConcatenated { blocks_per_chunk } => {
                Some(blocks_per_chunk)
            }
        }
    }
}

/// Blocks per fused-attention call: each chunk sees the context up to its
/// largest anchor, so smaller chunks skip more keys (sorted anchors) at the
/// price of more kernel calls.
pub const DEFAULT_BLOCKS_PER_ATTENTION_CHUNK: i64 = 8;
