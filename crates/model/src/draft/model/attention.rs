//! The block-over-context attention of a draft layer: the projection of
//! the queries (from the blocks) and of the keys and values (from the
//! context and the blocks), and the three implementations of
//! [`AttentionImplementation`], which compute the same function with
//! different memory and kernel trade-offs. Apart from the rest of the
//! forward because this is where the numerics are subtle (one softmax
//! shared by two parts, the log-sum-exp merge and its gradient).

use tch::{Device, Kind, Tensor};

use super::attention_masks::{ContextAttentionChunk, FusedAttentionChunk};
use super::forward::PreparedBlocks;
use super::network::DraftModel;
use super::parameters::DraftLayerParameters;
use crate::layers::{apply_rotary, repeat_key_value_heads, rms_norm};

impl DraftModel {
    /// The layer's queries (from the blocks) and keys and values (from the
    /// context and the blocks, same weights), normed, rotated and with the
    /// key/value heads repeated to the query heads.
    pub(super) fn attention_heads(
        &self,
        layer: &DraftLayerParameters,
        hidden: &Tensor,
        context: &Tensor,
        prepared: &PreparedBlocks,
    ) -> AttentionHeads {
        let config = &self.config;
        let batch = prepared.batch;
        let heads = config.num_attention_heads;
        let kv_heads = config.num_key_value_heads;
        let head_dim = config.head_dim;
        let normed = rms_norm(
            hidden,
            &self.weight(&layer.input_layernorm),
            config.rms_norm_eps,
        );
        let (normed, attention_output_kernel) = match &layer.convolutions {
            None => (normed, None),
            Some(convolutions) => {
                let (convolved, kernel) = self.convolve_sublayer_input(
                    &convolutions.attention,
                    &normed,
                    prepared.block_size,
                );
                (convolved, Some(kernel))
            }
        };
        let q_norm = self.weight(&layer.q_norm);
        let k_norm = self.weight(&layer.k_norm);
        let k_proj = self.weight(&layer.k_proj);
        let v_proj = self.weight(&layer.v_proj);
        // [batch, length, heads, head_dim] → q/k norm → [batch, heads, length, head_dim]
        let split_heads = |projected: Tensor, head_count: i64, norm: Option<&Tensor>| {
            let length = projected.size()[1];
            let per_head = projected.view([batch, length, head_count, head_dim]);
            let per_head = match norm {
                Some(weight) => rms_norm(&per_head, weight, config.rms_norm_eps),
                None => per_head,
            };
            per_head.transpose(1, 2)
        };
        let query = split_heads(
            normed.linear::<Tensor>(&self.weight(&layer.q_proj), None),
            heads,
            Some(&q_norm),
        );
        let query = apply_rotary(&query, &prepared.block_cos, &prepared.block_sin);
        // The context and the blocks go through the same key and value
        // projections; keys are rotated to their own positions.
        let keys_values = |source: &Tensor, cos: &Tensor, sin: &Tensor| {
            let key = split_heads(
                source.linear::<Tensor>(&k_proj, None),
                kv_heads,
                Some(&k_norm),
            );
            let key = apply_rotary(&key, cos, sin);
            let value = split_heads(source.linear::<Tensor>(&v_proj, None), kv_heads, None);
            (
                repeat_key_value_heads(&key, heads / kv_heads),
                repeat_key_value_heads(&value, heads / kv_heads),
            )
        };
        let (context_key, context_value) =
            keys_values(context, &prepared.context_cos, &prepared.context_sin);
        let (block_key, block_value) =
            keys_values(&normed, &prepared.block_cos, &prepared.block_sin);
        AttentionHeads {
            query,
            context_key,
            context_value,
            block_key,
            block_value,
            heads,
            head_dim,
            scale: (head_dim as f64).powf(-0.5),
            kind: self.compute_kind,
            attention_output_kernel,
        }
    }
}

/// One layer's attention inputs, `[batch, heads, length, head_dim]` each
/// (key/value heads already repeated to the query heads).
pub(super) struct AttentionHeads {
    /// The blocks' queries.
    query: Tensor,
    context_key: Tensor,
    context_value: Tensor,
    block_key: Tensor,
    block_value: Tensor,
    heads: i64,
    head_dim: i64,
    scale: f64,
    /// The compute kind the probabilities go back to after the f32 softmax.
    kind: Kind,
    /// DFlash2: the dynamic kernel the attention output is convolved with.
    pub(super) attention_output_kernel: Option<Tensor>,
}

impl AttentionHeads {
    /// Each query's scores over the keys of its own block,
    /// `[batch, heads, queries, block_size]` in f32.
    fn within_block_scores(&self, query: &Tensor, prepared: &PreparedBlocks) -> Tensor {
        let (batch, num_blocks, block_size) =
            (prepared.batch, prepared.num_blocks, prepared.block_size);
        let shape = [batch, self.heads, num_blocks, block_size, self.head_dim];
        (query.matmul(&self.block_key.view(shape).transpose(-2, -1)) * self.scale)
            .to_kind(Kind::Float)
            .view([batch, self.heads, num_blocks * block_size, block_size])
    }

    /// `probabilities` `[.., queries, block_size]` over the own block's
    /// values, `[batch, heads, queries, head_dim]`.
    fn within_block_output(&self, probabilities: &Tensor, prepared: &PreparedBlocks) -> Tensor {
        let (batch, num_blocks, block_size) =
            (prepared.batch, prepared.num_blocks, prepared.block_size);
        probabilities
            .view([batch, self.heads, num_blocks, block_size, block_size])
            .matmul(&self.block_value.view([
                batch,
                self.heads,
                num_blocks,
                block_size,
                self.head_dim,
            ]))
            .view([batch, self.heads, num_blocks * block_size, self.head_dim])
    }

    /// [`AttentionImplementation::Split`]: the scores over the context
    /// materialised, one softmax over `[context ‖ own block]`.
    pub(super) fn split_attention(
        &self,
        context_visible: &Tensor,
        prepared: &PreparedBlocks,
    ) -> Tensor {
        let (batch, num_blocks, block_size, context_len) = (
            prepared.batch,
            prepared.num_blocks,
            prepared.block_size,
            prepared.context_len,
        );
        let context_scores = (self.query.matmul(&self.context_key.transpose(-2, -1)) * self.scale)
            .to_kind(Kind::Float)
            .masked_fill(&context_visible.logical_not(), f64::NEG_INFINITY);
        let block_query =
            self.query
                .view([batch, self.heads, num_blocks, block_size, self.head_dim]);
        let block_scores = self.within_block_scores(&block_query, prepared);
        let probabilities = Tensor::cat(&[&context_scores, &block_scores], -1)
            .softmax(-1, Kind::Float)
            .to_kind(self.kind);
        let context_probabilities = probabilities.narrow(-1, 0, context_len);
        let block_probabilities = probabilities.narrow(-1, context_len, block_size);
        context_probabilities.matmul(&self.context_value)
            + self.within_block_output(&block_probabilities, prepared)
    }

    /// [`AttentionImplementation::Fused`]: the context part chunk by chunk
    /// through the fused kernel, merged with the within-block scores through
    /// its log-sum-exp as one more softmax column.
    pub(super) fn fused_attention(
        &self,
        chunks: &[ContextAttentionChunk],
        prepared: &PreparedBlocks,
    ) -> Tensor {
        let (batch, num_blocks, block_size) =
            (prepared.batch, prepared.num_blocks, prepared.block_size);
        let block_scores = self.within_block_scores(
            &self
                .query
                .view([batch, self.heads, num_blocks, block_size, self.head_dim]),
            prepared,
        );
        let (context_outputs, context_log_sum_exps): (Vec<Tensor>, Vec<Tensor>) = chunks
            .iter()
            .map(|chunk| self.context_chunk_attention(chunk, batch))
            .unzip();
        let context_output = Tensor::cat(&context_outputs, 2);
        let context_log_sum_exp = Tensor::cat(&context_log_sum_exps, 2);
        // The context as one more column of the within-block softmax.
        let probabilities = Tensor::cat(&[block_scores, context_log_sum_exp.unsqueeze(-1)], -1)
            .softmax(-1, Kind::Float)
            .to_kind(self.kind);
        self.within_block_output(&probabilities.narrow(-1, 0, block_size), prepared)
            + probabilities.narrow(-1, block_size, 1) * context_output
    }

    /// One chunk's attention over its context: the output and the
    /// differentiable log-sum-exp of its scores.
    fn context_chunk_attention(
        &self,
        chunk: &ContextAttentionChunk,
        batch: i64,
    ) -> (Tensor, Tensor) {
        let chunk_query = self.query.narrow(2, chunk.first_query, chunk.num_queries);
        if chunk.context_len == 0 {
            let no_context = Tensor::full(
                [batch, self.heads, chunk.num_queries],
                f64::NEG_INFINITY,
                (Kind::Float, self.query.device()),
            );
            return (chunk_query.zeros_like(), no_context);
        }
        let key = self.context_key.narrow(2, 0, chunk.context_len);
        let value = self.context_value.narrow(2, 0, chunk.context_len);
        let (output, log_sum_exp) = fused_attention_with_log_sum_exp(
            &chunk_query,
            &key,
            &value,
            &chunk.additive_mask,
            self.scale,
        );
        // d lse/dq = scale·Σ P·k and d lse/dk_j = scale·P_j·q: the
        // attention of the detached query over the detached keys
        // with the (attached) keys as values has the value Σ P·k
        // and gives the keys exactly that second gradient.
        let detached_query = chunk_query.detach();
        let (key_average, _) = fused_attention_with_log_sum_exp(
            &detached_query,
            &key.detach(),
            &key,
            &chunk.additive_mask,
            self.scale,
        );
        let key_average_value = key_average.detach();
        let log_sum_exp_gradient_carrier = ((&chunk_query - &detached_query) * &key_average_value
            + &detached_query * (&key_average - &key_average_value))
            .sum_dim_intlist(-1, false, Kind::Float)
            * self.scale;
        let log_sum_exp = (log_sum_exp.detach().to_kind(Kind::Float)
            + log_sum_exp_gradient_carrier)
            .masked_fill(&chunk.without_context, f64::NEG_INFINITY);
        (output, log_sum_exp)
    }

    /// [`AttentionImplementation::FusedConcatenated`]: one fused call per
    /// chunk over `[its context ‖ its blocks' keys]`.
    pub(super) fn fused_concatenated_attention(
        &self,
        chunks: &[FusedAttentionChunk],
        prepared: &PreparedBlocks,
    ) -> Tensor {
        let block_size = prepared.block_size;
        let outputs: Vec<Tensor> = chunks
            .iter()
            .map(|chunk| {
                let first_query = chunk.span.first_block * block_size;
                let chunk_queries = chunk.span.num_blocks * block_size;
                let context_len = chunk.span.context_len;
                let keys = Tensor::cat(
                    &[
                        self.context_key.narrow(2, 0, context_len),
                        self.block_key.narrow(2, first_query, chunk_queries),
                    ],
                    2,
                );
                let values = Tensor::cat(
                    &[
                        self.context_value.narrow(2, 0, context_len),
                        self.block_value.narrow(2, first_query, chunk_queries),
                    ],
                    2,
                );
                fused_attention(
                    &self.query.narrow(2, first_query, chunk_queries),
                    &keys,
                    &values,
                    &chunk.additive_mask,
                    self.scale,
                )
            })
            .collect();
        Tensor::cat(&outputs, 2)
    }
}

/// Fused attention `softmax(q·kᵀ·scale + mask)·v` with libtorch's kernels:
/// on the CPU the flash kernel is called directly, so it can never fall back
/// to the materialising math path; elsewhere `scaled_dot_product_attention`
/// picks flash or memory-efficient attention.
fn fused_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    additive_mask: &Tensor,
    scale: f64,
) -> Tensor {
    if query.device() == Device::Cpu {
        // The same flash kernel call; its log-sum-exp is dropped.
        fused_attention_with_log_sum_exp(query, key, value, additive_mask, scale).0
    } else {
        Tensor::scaled_dot_product_attention(
            query,
            key,
            value,
            Some(additive_mask),
            0.0,
            false,
            scale,
            false,
        )
    }
}

/// Fused attention that also returns the log-sum-exp of each query's
/// scores, `[batch, heads, queries]` in f32 (not differentiable: the caller
/// supplies its gradient). Flash kernel on the CPU, memory-efficient
/// attention elsewhere (whose log-sum-exp is padded to a multiple of 32).
fn fused_attention_with_log_sum_exp(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    additive_mask: &Tensor,
    scale: f64,
) -> (Tensor, Tensor) {
    let queries = query.size()[2];
    if query.device() == Device::Cpu {
        Tensor::internal_scaled_dot_product_flash_attention_for_cpu(
            query,
            key,
            value,
            0.0,
            false,
            Some(additive_mask),
            scale,
        )
    } else {
        let heads = query.size()[1];
        let (output, log_sum_exp, _, _) = Tensor::internal_scaled_dot_product_efficient_attention(
            query,
            key,
            value,
            Some(additive_mask.expand([-1, heads, -1, -1], false)),
            true,
            0.0,
            false,
            scale,
        );
        (output, log_sum_exp.narrow(2, 0, queries))
    }
}
