//! The attention masks of the training forward: which context positions
//! each block's queries see (those strictly before its anchor), in the form
//! each [`AttentionImplementation`] wants: one boolean mask for the split
//! attention, or additive masks per chunk of blocks for the fused kernels
//! (with each chunk's context cut at its largest anchor). Built once per
//! forward and shared by every layer.

use tch::{Device, Kind, Tensor};

use super::attention_implementation::AttentionImplementation;
use super::network::DraftModel;
use crate::draft::error::DraftError;

impl DraftModel {
    /// The masks of the block-over-context attention: which context
    /// positions each query sees (those before its block's anchor).
    pub(super) fn attention_masks(
        &self,
        anchors: &Tensor,
        context_positions: &Tensor,
        block_size: i64,
    ) -> Result<AttentionMasks, DraftError> {
        let (batch, num_blocks) = anchors.size2()?;
        let context_len = context_positions.size()[0];
        let queries = num_blocks * block_size;
        let kind = self.compute_kind;
        Ok(match self.attention {
            AttentionImplementation::Split => {
                // Query (block, k) may read context position p only when p < anchor.
                AttentionMasks::Split {
                    context_visible: context_positions
                        .view([1, 1, context_len])
                        .lt_tensor(&anchors.unsqueeze(-1))
                        .unsqueeze(2)
                        .expand([batch, num_blocks, block_size, context_len], false)
                        .reshape([batch, 1, queries, context_len]),
                }
            }
            AttentionImplementation::Fused { blocks_per_chunk } => AttentionMasks::Fused(
                chunk_spans(anchors, context_len, blocks_per_chunk)?
                    .into_iter()
                    .map(|span| ContextAttentionChunk::new(anchors, span, block_size, kind))
                    .collect(),
            ),
            AttentionImplementation::FusedConcatenated { blocks_per_chunk } => {
                AttentionMasks::FusedConcatenated(
                    chunk_spans(anchors, context_len, blocks_per_chunk)?
                        .into_iter()
                        .map(|span| FusedAttentionChunk::new(anchors, span, block_size, kind))
                        .collect(),
                )
            }
        })
    }
}

/// The masks of one forward, in the form the model's
/// [`AttentionImplementation`] consumes; built once, read by every layer.
pub(super) enum AttentionMasks {
    /// `[batch, 1, queries, context_len]` true where a query sees a context position.
    Split {
        context_visible: Tensor,
    },
    Fused(Vec<ContextAttentionChunk>),
    FusedConcatenated(Vec<FusedAttentionChunk>),
}

/// One fused context-attention call of [`AttentionImplementation::Fused`].
pub(super) struct ContextAttentionChunk {
    pub(super) first_query: i64,
    pub(super) num_queries: i64,
    /// Context positions any block of the chunk may see (its largest anchor).
    pub(super) context_len: i64,
    /// `[batch, 1, chunk queries, context_len]`: 0 where visible, −∞
    /// elsewhere; rows of blocks without any context (anchor 0) see
    /// position 0 so the kernel never meets an empty row, and are dropped
    /// through `without_context`.
    pub(super) additive_mask: Tensor,
    /// `[batch, 1, chunk queries]` true for queries whose block has no context.
    pub(super) without_context: Tensor,
}

/// A chunk of blocks of one fused-attention call: blocks
/// `first_block..first_block + num_blocks`.
#[derive(Debug, Clone, Copy)]
pub(super) struct ChunkSpan {
    pub(super) first_block: i64,
    pub(super) num_blocks: i64,
    /// Context positions any block of the chunk may see (its largest anchor).
    pub(super) context_len: i64,
}

/// The blocks in chunks of `blocks_per_chunk` (the last one shorter), each
/// with the context its largest anchor (over the batch) lets it see.
fn chunk_spans(
    anchors: &Tensor,
    context_len: i64,
    blocks_per_chunk: i64,
) -> Result<Vec<ChunkSpan>, DraftError> {
    let (batch, num_blocks) = anchors.size2()?;
    let anchor_values = Vec::<i64>::try_from(&anchors.to_device(Device::Cpu).flatten(0, -1))?;
    let mut spans = Vec::new();
    let mut first_block = 0;
    while first_block < num_blocks {
        let chunk_blocks = blocks_per_chunk.min(num_blocks - first_block);
        let chunk_context =
            largest_anchor(&anchor_values, batch, num_blocks, first_block, chunk_blocks)
                .clamp(0, context_len);
        spans.push(ChunkSpan {
            first_block,
            num_blocks: chunk_blocks,
            context_len: chunk_context,
        });
        first_block += chunk_blocks;
    }
    Ok(spans)
}

/// Off the CPU, the row stride (in elements) of an additive mask: the
/// memory-efficient attention kernel rejects a bias whose rows do not start
/// at multiples of 8 elements ("attn_bias is not correctly aligned
/// (strideM)", seen on an H200 with a 17-position context). PyTorch's public
/// `scaled_dot_product_attention` pads the bias for it; the kernel called
/// directly, as [`AttentionImplementation::Fused`] does for its
/// log-sum-exp, does not.
const CUDA_MASK_ROW_ALIGNMENT: i64 = 8;

/// 0 where `visible`, −∞ elsewhere; off the CPU with its rows aligned for
/// the memory-efficient kernel (see [`aligned_additive_mask`]).
fn additive_mask(visible: &Tensor, kind: Kind, device: Device) -> Tensor {
    let alignment = if device == Device::Cpu {
        1
    } else {
        CUDA_MASK_ROW_ALIGNMENT
    };
    aligned_additive_mask(visible, kind, device, alignment)
}

/// 0 where `visible`, −∞ elsewhere, as a view of the first columns of a
/// tensor whose last dimension is padded to a multiple of `alignment`: the
/// same values, a unit column stride and a row stride that is a multiple
/// of `alignment`. Filled in place, since an out-of-place fill would copy
/// the view into a contiguous (unaligned) tensor.
fn aligned_additive_mask(visible: &Tensor, kind: Kind, device: Device, alignment: i64) -> Tensor {
    let mut size = visible.size();
    let last = size.len() - 1;
    let columns = size[last];
    size[last] = (columns + alignment - 1) / alignment * alignment;
    let mut mask = Tensor::zeros(size, (kind, device)).narrow(last as i64, 0, columns);
    let _ = mask.masked_fill_(&visible.logical_not(), f64::NEG_INFINITY);
    mask
}

impl ContextAttentionChunk {
    /// The chunk `span` of [`AttentionImplementation::Fused`] and its masks.
    fn new(anchors: &Tensor, span: ChunkSpan, block_size: i64, kind: Kind) -> Self {
        let batch = anchors.size()[0];
        let device = anchors.device();
        let chunk_queries = span.num_blocks * block_size;
        let per_query_anchor = anchors
            .narrow(1, span.first_block, span.num_blocks)
            .unsqueeze(-1)
            .expand([batch, span.num_blocks, block_size], false)
            .reshape([batch, 1, chunk_queries]);
        let without_context = per_query_anchor.le(0);
        let positions = Tensor::arange(span.context_len, (Kind::Int64, device)).view([
            1,
            1,
            1,
            span.context_len,
        ]);
        let visible = positions
            .lt_tensor(&per_query_anchor.unsqueeze(-1))
            .logical_or(&positions.eq(0).logical_and(&without_context.unsqueeze(-1)));
        ContextAttentionChunk {
            first_query: span.first_block * block_size,
            num_queries: chunk_queries,
            context_len: span.context_len,
            additive_mask: additive_mask(&visible, kind, device),
            without_context,
        }
    }
}

/// The largest anchor of blocks `first_block..first_block + chunk_blocks`
/// over every sequence of the batch (`anchor_values` is `[batch, blocks]`).
fn largest_anchor(
    anchor_values: &[i64],
    batch: i64,
    num_blocks: i64,
    first_block: i64,
    chunk_blocks: i64,
) -> i64 {
    (0..batch)
        .flat_map(|row| {
            let start = (row * num_blocks + first_block) as usize;
            anchor_values[start..start + chunk_blocks as usize]
                .iter()
                .copied()
        })
        .max()
        .unwrap_or(0)
}

/// One fused-attention call of [`AttentionImplementation::FusedConcatenated`].
pub(super) struct FusedAttentionChunk {
    pub(super) span: ChunkSpan,
    /// `[batch, 1, chunk queries, context_len + chunk queries]`: 0 where
    /// visible, −∞ elsewhere (context before the anchor, the own block).
    pub(super) additive_mask: Tensor,
}

impl FusedAttentionChunk {
    /// The chunk `span` of [`AttentionImplementation::FusedConcatenated`]
    /// and its additive mask.
    fn new(anchors: &Tensor, span: ChunkSpan, block_size: i64, kind: Kind) -> Self {
        let batch = anchors.size()[0];
        let device = anchors.device();
        let chunk_anchors = anchors.narrow(1, span.first_block, span.num_blocks);
        let chunk_queries = span.num_blocks * block_size;
        // [batch, blocks, context]: position p visible when p < anchor.
        let context_visible = Tensor::arange(span.context_len, (Kind::Int64, device))
            .view([1, 1, span.context_len])
            .lt_tensor(&chunk_anchors.unsqueeze(-1));
        let context_visible = context_visible
            .unsqueeze(2)
            .expand(
                [batch, span.num_blocks, block_size, span.context_len],
                false,
            )
            .reshape([batch, 1, chunk_queries, span.context_len]);
        // Block-diagonal: a query sees the keys of its own block only.
        let block_of_position = Tensor::arange(chunk_queries, (Kind::Int64, device))
            .divide_scalar_mode(block_size, "floor");
        let block_visible = block_of_position
            .unsqueeze(-1)
            .eq_tensor(&block_of_position.unsqueeze(0))
            .view([1, 1, chunk_queries, chunk_queries])
            .expand([batch, 1, chunk_queries, chunk_queries], false);
        let visible = Tensor::cat(&[context_visible, block_visible], -1);
        FusedAttentionChunk {
            span,
            additive_mask: additive_mask(&visible, kind, device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aligned_mask_has_the_values_of_the_plain_one_and_aligned_rows() {
        // 17 context positions, as the H200 run that found the kernel's
        // alignment rule had.
        let visible = Tensor::arange(17, (Kind::Int64, Device::Cpu))
            .view([1, 1, 1, 17])
            .lt_tensor(&Tensor::from_slice(&[3i64, 9, 17]).view([1, 1, 3, 1]));
        let plain = aligned_additive_mask(&visible, Kind::Float, Device::Cpu, 1);
        let aligned = aligned_additive_mask(&visible, Kind::Float, Device::Cpu, 8);
        assert_eq!(aligned.size(), vec![1, 1, 3, 17]);
        assert_eq!(plain.stride(), vec![51, 51, 17, 1]);
        assert_eq!(aligned.stride(), vec![72, 72, 24, 1]);
        assert!(aligned.equal(&plain));
        // 0 where visible, -inf elsewhere: row 0 sees positions 0..3.
        let row: Vec<f32> = Vec::try_from(aligned.get(0).get(0).get(0)).unwrap();
        assert_eq!(&row[..3], &[0.0; 3]);
        assert!(row[3..].iter().all(|value| *value == f32::NEG_INFINITY));
        // Expanded over the heads (as the kernel gets it) the rows stay aligned.
        let expanded = aligned.expand([-1, 4, -1, -1], false);
        assert_eq!(expanded.stride()[2] % CUDA_MASK_ROW_ALIGNMENT, 0);
    }
}
