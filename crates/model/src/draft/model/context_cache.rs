//! The drafter's context cache for speculative decoding.
//!
//! Every draft layer attends to the context (the target hidden states of
//! the tokens already committed) through keys and values it projects from
//! the one fused context stream (`fc`, `hidden_norm`). The stream does not
//! change from layer to layer, and a committed position never changes, so
//! each position's per-layer keys (after `k_norm` and RoPE at its absolute
//! position) and values are computed once, when the position is committed,
//! and reused by every later block. A block's forward then costs its own
//! `block_size` queries over the cached keys, instead of re-projecting the
//! whole context: speculative decoding's drafter cost becomes proportional
//! to the tokens generated.
//!
//! The function is the one of [`DraftModel::forward_blocks`] with one block
//! per row anchored right after the context (the split attention: one
//! softmax over `[context ‖ own block]`); only the order of some f32 sums
//! differs (the context is projected a few rows at a time).

use tch::{Kind, Tensor};

use super::network::DraftModel;
use super::parameters::DraftLayerParameters;
use crate::draft::error::DraftError;
use crate::layers::repeat_key_value_heads;
use crate::layers::{apply_rotary, rms_norm, rotary_cos_sin};

/// Per draft layer, the keys and values of the context positions seen so
/// far, for a batch of rows that all hold the same number of positions.
#[derive(Debug)]
pub struct DraftContextCache {
    /// Per draft layer, `[batch, key_value_heads, capacity, head_dim]`:
    /// keys after `k_norm` and RoPE at their absolute positions; positions
    /// at and past `length` are unspecified.
    keys: Vec<Tensor>,
    /// Per draft layer, the values, laid out like `keys`.
    values: Vec<Tensor>,
    /// Context positions cached: the anchor of the next block.
    length: i64,
    /// Positions the storage holds before it must grow.
    capacity: i64,
    batch: i64,
}

impl DraftContextCache {
    /// Context positions cached, which is also the absolute position of the
    /// next block's anchor.
    pub fn len(&self) -> i64 {
        self.length
    }

    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// Rows of the batch.
    pub fn batch_size(&self) -> i64 {
        self.batch
    }

    /// Makes room for `additional` more positions, doubling the capacity.
    fn reserve(&mut self, additional: i64) {
        let needed = self.length + additional;
        if needed <= self.capacity {
            return;
        }
        let new_capacity = needed.max(self.capacity * 2);
        let grow = |storage: &Tensor| {
            let mut size = storage.size();
            size[2] = new_capacity - self.capacity;
            let extra = Tensor::zeros(size.as_slice(), (storage.kind(), storage.device()));
            Tensor::cat(&[storage, &extra], 2)
        };
        self.keys = self.keys.iter().map(grow).collect();
        self.values = self.values.iter().map(grow).collect();
        self.capacity = new_capacity;
    }
}

impl DraftModel {
    /// An empty context cache for `batch` rows, with room for `capacity`
    /// positions before it grows.
    pub fn new_context_cache(&self, batch: i64, capacity: i64) -> DraftContextCache {
        let config = &self.config;
        let capacity = capacity.max(1);
        let storage = || {
            (0..self.layers.len())
                .map(|_| {
                    Tensor::zeros(
                        [batch, config.num_key_value_heads, capacity, config.head_dim],
                        (self.compute_kind, self.device()),
                    )
                })
                .collect()
        };
        DraftContextCache {
            keys: storage(),
            values: storage(),
            length: 0,
            capacity,
            batch,
        }
    }

    /// Appends the next context positions: `target_hidden` is
    /// `[batch, new positions, n·hidden]`, the tapped target states of the
    /// tokens at positions `cache.len()..cache.len() + new positions`.
    pub fn extend_context(
        &self,
        cache: &mut DraftContextCache,
        target_hidden: &Tensor,
    ) -> Result<(), DraftError> {
        let config = &self.config;
        let (batch, new_positions, width) = target_hidden.size3()?;
        if width != config.target_hidden_width() {
            return Err(DraftError::ShapeMismatch(format!(
                "target hidden width {width}, the model expects {} ({} layers × hidden {})",
                config.target_hidden_width(),
                config.target_layer_ids.len(),
                config.hidden_size
            )));
        }
        if batch != cache.batch {
            return Err(DraftError::ShapeMismatch(format!(
                "target hidden batch {batch}, the context cache holds {} rows",
                cache.batch
            )));
        }
        if new_positions == 0 {
            return Ok(());
        }
        let _no_grad = tch::no_grad_guard();
        let device = self.device();
        let kind = self.compute_kind;
        let (kv_heads, head_dim) = (config.num_key_value_heads, config.head_dim);
        let context = rms_norm(
            &target_hidden
                .to_device(device)
                .to_kind(kind)
                .linear::<Tensor>(&self.weight(&self.fc), None),
            &self.weight(&self.hidden_norm),
            config.rms_norm_eps,
        );
        let positions = Tensor::arange_start(
            cache.length,
            cache.length + new_positions,
            (Kind::Int64, device),
        );
        let (cos, sin) = rotary_cos_sin(&positions, head_dim, &config.rope, kind, device);
        cache.reserve(new_positions);
        for (index, layer) in self.layers.iter().enumerate() {
            let key = rms_norm(
                &context
                    .linear::<Tensor>(&self.weight(&layer.k_proj), None)
                    .view([batch, new_positions, kv_heads, head_dim]),
                &self.weight(&layer.k_norm),
                config.rms_norm_eps,
            )
            .transpose(1, 2);
            let key = apply_rotary(&key, &cos, &sin);
            let value = context
                .linear::<Tensor>(&self.weight(&layer.v_proj), None)
                .view([batch, new_positions, kv_heads, head_dim])
                .transpose(1, 2);
            cache.keys[index]
                .narrow(2, cache.length, new_positions)
                .copy_(&key);
            cache.values[index]
                .narrow(2, cache.length, new_positions)
                .copy_(&value);
        }
        cache.length += new_positions;
        Ok(())
    }

    /// The draft hidden states `[batch, block length, hidden]` of one block
    /// per row (`block_token_ids` `[batch, block length]`: the anchor token,
    /// then mask tokens) anchored right after the cached context, at
    /// position `cache.len()`: [`DraftModel::forward_blocks`] of that block
    /// over the same context, without recomputing the context.
    pub fn forward_block_cached(
        &self,
        cache: &DraftContextCache,
        block_token_ids: &Tensor,
    ) -> Result<Tensor, DraftError> {
        let (batch, block_length) = block_token_ids.size2()?;
        if batch != cache.batch {
            return Err(DraftError::ShapeMismatch(format!(
                "block batch {batch}, the context cache holds {} rows",
                cache.batch
            )));
        }
        if block_length < 1 {
            return Err(DraftError::ShapeMismatch(
                "an empty block has nothing to draft".to_string(),
            ));
        }
        let _no_grad = tch::no_grad_guard();
        let config = &self.config;
        let device = self.device();
        let positions = Tensor::arange_start(
            cache.length,
            cache.length + block_length,
            (Kind::Int64, device),
        );
        let (block_cos, block_sin) = rotary_cos_sin(
            &positions,
            config.head_dim,
            &config.rope,
            self.compute_kind,
            device,
        );
        let mut hidden = self.embed(&block_token_ids.to_device(device));
        for (index, layer) in self.layers.iter().enumerate() {
            hidden = self.cached_layer_forward(
                layer,
                &hidden,
                &cache.keys[index].narrow(2, 0, cache.length),
                &cache.values[index].narrow(2, 0, cache.length),
                (&block_cos, &block_sin),
            );
        }
        Ok(rms_norm(
            &hidden,
            &self.weight(&self.norm),
            config.rms_norm_eps,
        ))
    }

    /// One decoder layer over a block `[batch, block length, hidden]` whose
    /// queries see every cached context key and their own block's keys
    /// (the split attention of [`DraftModel::forward_blocks`] with nothing
    /// masked: the whole context lies before the anchor).
    fn cached_layer_forward(
        &self,
        layer: &DraftLayerParameters,
        hidden: &Tensor,
        context_key: &Tensor,
        context_value: &Tensor,
        (block_cos, block_sin): (&Tensor, &Tensor),
    ) -> Tensor {
        let config = &self.config;
        let kind = self.compute_kind;
        let (batch, block_length) = (hidden.size()[0], hidden.size()[1]);
        let context_length = context_key.size()[2];
        let heads = config.num_attention_heads;
        let kv_heads = config.num_key_value_heads;
        let head_dim = config.head_dim;
        let scale = (head_dim as f64).powf(-0.5);
        let split_heads = |projected: Tensor, head_count: i64, norm: Option<&Tensor>| {
            let per_head = projected.view([batch, block_length, head_count, head_dim]);
            let per_head = match norm {
                Some(weight) => rms_norm(&per_head, weight, config.rms_norm_eps),
                None => per_head,
            };
            per_head.transpose(1, 2)
        };

        let residual = hidden.shallow_clone();
        let normed = rms_norm(
            hidden,
            &self.weight(&layer.input_layernorm),
            config.rms_norm_eps,
        );
        // DFlash2: the block is one convolution block.
        let (normed, attention_output_kernel) = match &layer.convolutions {
            None => (normed, None),
            Some(convolutions) => {
                let (convolved, kernel) =
                    self.convolve_sublayer_input(&convolutions.attention, &normed, block_length);
                (convolved, Some(kernel))
            }
        };
        let k_norm = self.weight(&layer.k_norm);
        let query = split_heads(
            normed.linear::<Tensor>(&self.weight(&layer.q_proj), None),
            heads,
            Some(&self.weight(&layer.q_norm)),
        );
        let query = apply_rotary(&query, block_cos, block_sin);
        let block_key = split_heads(
            normed.linear::<Tensor>(&self.weight(&layer.k_proj), None),
            kv_heads,
            Some(&k_norm),
        );
        let block_key = apply_rotary(&block_key, block_cos, block_sin);
        let block_value = split_heads(
            normed.linear::<Tensor>(&self.weight(&layer.v_proj), None),
            kv_heads,
            None,
        );
        let repeats = heads / kv_heads;
        let (context_key, context_value, block_key, block_value) = (
            repeat_key_value_heads(context_key, repeats),
            repeat_key_value_heads(context_value, repeats),
            repeat_key_value_heads(&block_key, repeats),
            repeat_key_value_heads(&block_value, repeats),
        );
        let context_scores =
            (query.matmul(&context_key.transpose(-2, -1)) * scale).to_kind(Kind::Float);
        let block_scores =
            (query.matmul(&block_key.transpose(-2, -1)) * scale).to_kind(Kind::Float);
        let probabilities = Tensor::cat(&[&context_scores, &block_scores], -1)
            .softmax(-1, Kind::Float)
            .to_kind(kind);
        let attended = probabilities
            .narrow(-1, 0, context_length)
            .matmul(&context_value)
            + probabilities
                .narrow(-1, context_length, block_length)
                .matmul(&block_value);
        self.finish_layer(
            layer,
            residual,
            &attended,
            attention_output_kernel.as_ref(),
            block_length,
        )
    }
}
