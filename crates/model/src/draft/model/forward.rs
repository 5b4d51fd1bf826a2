//! The training forward of the draft model over packed blocks:
//! [`DraftModel::forward_blocks`] and its activation-checkpointed twin
//! [`DraftModel::forward_backward_checkpointed`], the preparation every
//! layer shares (fused context stream, block embeddings, rotary tables,
//! masks), one decoder layer around the attention and the final norm.
//! Apart from the attention kernels (`attention`), which this only calls.

use tch::{Kind, Tensor};

use super::attention_masks::AttentionMasks;
use super::network::{BlockInputs, DraftModel};
use super::parameters::DraftLayerParameters;
use crate::draft::error::DraftError;
use crate::layers::{rms_norm, rotary_cos_sin, swiglu_mlp};

impl DraftModel {
    /// The draft hidden states `[batch, blocks, block_size, hidden]` for
    /// every block, before the LM head.
    pub fn forward_blocks(&self, inputs: &BlockInputs<'_>) -> Result<Tensor, DraftError> {
        let prepared = self.prepare(inputs)?;
        let mut hidden = prepared.initial_hidden.shallow_clone();
        for layer in &self.layers {
            hidden = self.layer_forward(layer, &hidden, &prepared.context, &prepared);
        }
        Ok(self.final_norm(&hidden, &prepared))
    }

    /// Forward and backward with activation checkpointing of the draft
    /// layers: only each layer's input `[batch, queries, hidden]` is kept
    /// during the forward, and each layer is recomputed during the backward.
    /// `head` gets the final draft hidden states (a leaf that requires grad),
    /// must call `backward` on whatever depends on them (the loss, possibly
    /// in chunks) and returns what the caller needs from it. Gradients
    /// accumulate in the parameters exactly as `forward_blocks` followed by
    /// a backward would.
    pub fn forward_backward_checkpointed<R>(
        &self,
        inputs: &BlockInputs<'_>,
        head: impl FnOnce(&Tensor) -> Result<R, DraftError>,
    ) -> Result<R, DraftError> {
        let prepared = self.prepare(inputs)?;
        let context_leaf = prepared.context.detach().set_requires_grad(true);
        let mut layer_inputs = Vec::with_capacity(self.layers.len());
        let last_hidden = tch::no_grad(|| {
            let mut hidden = prepared.initial_hidden.detach();
            for layer in &self.layers {
                let next = self.layer_forward(layer, &hidden, &context_leaf, &prepared);
                layer_inputs.push(hidden);
                hidden = next;
            }
            hidden
        });
        let last_leaf = last_hidden.set_requires_grad(true);
        let output = self.final_norm(&last_leaf, &prepared);
        let output_leaf = output.detach().set_requires_grad(true);
        let result = head(&output_leaf)?;
        let mut upstream = gradient_of(&output_leaf, "draft hidden states")?;
        backward_with_gradient(&output, &upstream);
        upstream = gradient_of(&last_leaf, "last layer output")?;
        for (layer, layer_input) in self.layers.iter().zip(layer_inputs).rev() {
            let input_leaf = layer_input.set_requires_grad(true);
            let layer_output = self.layer_forward(layer, &input_leaf, &context_leaf, &prepared);
            backward_with_gradient(&layer_output, &upstream);
            upstream = gradient_of(&input_leaf, "layer input")?;
        }
        if context_leaf.grad().defined() {
            backward_with_gradient(&prepared.context, &context_leaf.grad());
        }
        Ok(result)
    }

    /// Everything the layers share: the fused context stream, the block
    /// embeddings, rotary tables and the attention masks.
    fn prepare(&self, inputs: &BlockInputs<'_>) -> Result<PreparedBlocks, DraftError> {
        let config = &self.config;
        let (batch, context_len, width) = inputs.target_hidden.size3()?;
        let (token_batch, num_blocks, block_size) = inputs.block_token_ids.size3()?;
        let (anchor_batch, anchor_blocks) = inputs.anchor_positions.size2()?;
        if width != config.target_hidden_width() {
            return Err(DraftError::ShapeMismatch(format!(
                "target hidden width {width}, the model expects {} ({} layers × hidden {})",
                config.target_hidden_width(),
                config.target_layer_ids.len(),
                config.hidden_size
            )));
        }
        if token_batch != batch || anchor_batch != batch || anchor_blocks != num_blocks {
            return Err(DraftError::ShapeMismatch(format!(
                "target hidden batch {batch}, block tokens [{token_batch}, {num_blocks}, {block_size}], anchors [{anchor_batch}, {anchor_blocks}]"
            )));
        }
        let device = self.device();
        let kind = self.compute_kind;
        let head_dim = config.head_dim;
        let queries = num_blocks * block_size;

        let target_hidden = inputs.target_hidden.to_device(device).to_kind(kind);
        let context = rms_norm(
            &target_hidden.linear::<Tensor>(&self.weight(&self.fc), None),
            &self.weight(&self.hidden_norm),
            config.rms_norm_eps,
        );
        let anchors = inputs
            .anchor_positions
            .to_device(device)
            .to_kind(Kind::Int64);
        let block_offsets = Tensor::arange(block_size, (Kind::Int64, device));
        let block_positions = (anchors.unsqueeze(-1) + &block_offsets).view([batch, queries]);
        let context_positions = Tensor::arange(context_len, (Kind::Int64, device));
        let (context_cos, context_sin) =
            rotary_cos_sin(&context_positions, head_dim, &config.rope, kind, device);
        let (block_cos, block_sin) =
            rotary_cos_sin(&block_positions, head_dim, &config.rope, kind, device);
        let masks = self.attention_masks(&anchors, &context_positions, block_size)?;
        let initial_hidden = self
            .embed(&inputs.block_token_ids.to_device(device))
            .view([batch, queries, -1]);
        Ok(PreparedBlocks {
            batch,
            num_blocks,
            block_size,
            context_len,
            context,
            initial_hidden,
            context_cos,
            context_sin,
            block_cos,
            block_sin,
            masks,
        })
    }

    /// One decoder layer over `[batch, queries, hidden]`.
    fn layer_forward(
        &self,
        layer: &DraftLayerParameters,
        hidden: &Tensor,
        context: &Tensor,
        prepared: &PreparedBlocks,
    ) -> Tensor {
        let residual = hidden.shallow_clone();
        let heads = self.attention_heads(layer, hidden, context, prepared);
        let attended = match &prepared.masks {
            AttentionMasks::Split { context_visible } => {
                heads.split_attention(context_visible, prepared)
            }
            AttentionMasks::Fused(chunks) => heads.fused_attention(chunks, prepared),
            AttentionMasks::FusedConcatenated(chunks) => {
                heads.fused_concatenated_attention(chunks, prepared)
            }
        };
        self.finish_layer(
            layer,
            residual,
            &attended,
            heads.attention_output_kernel.as_ref(),
            prepared.block_size,
        )
    }

    /// The rest of a draft layer after attention, shared by the training
    /// forward and the cached one: heads `[batch, heads, queries, head_dim]`
    /// merged, `o_proj` (DFlash2: convolved with `attention_output_kernel`)
    /// plus the residual, then the post-attention norm and the SwiGLU MLP
    /// (DFlash2: inside the MLP convolution) with their residual. Blocks are
    /// `block_length` consecutive queries.
    pub(super) fn finish_layer(
        &self,
        layer: &DraftLayerParameters,
        residual: Tensor,
        attended: &Tensor,
        attention_output_kernel: Option<&Tensor>,
        block_length: i64,
    ) -> Tensor {
        let attended = attended.transpose(1, 2).flatten(2, 3);
        let mut attention_output = attended.linear::<Tensor>(&self.weight(&layer.o_proj), None);
        if let (Some(convolutions), Some(kernel)) = (&layer.convolutions, attention_output_kernel) {
            attention_output = self.convolve_sublayer_output(
                &convolutions.attention,
                &attention_output,
                kernel,
                block_length,
            );
        }
        let hidden = residual + attention_output;

        let residual = hidden.shallow_clone();
        let normed = rms_norm(
            &hidden,
            &self.weight(&layer.post_attention_layernorm),
            self.config.rms_norm_eps,
        );
        let mlp = |input: &Tensor| {
            swiglu_mlp(
                input,
                &self.weight(&layer.gate_proj),
                &self.weight(&layer.up_proj),
                &self.weight(&layer.down_proj),
            )
        };
        match &layer.convolutions {
            None => residual + mlp(&normed),
            Some(convolutions) => {
                let (convolved, kernel) =
                    self.convolve_sublayer_input(&convolutions.mlp, &normed, block_length);
                residual
                    + self.convolve_sublayer_output(
                        &convolutions.mlp,
                        &mlp(&convolved),
                        &kernel,
                        block_length,
                    )
            }
        }
    }

    /// The final `norm`, reshaped to `[batch, blocks, block_size, hidden]`.
    fn final_norm(&self, hidden: &Tensor, prepared: &PreparedBlocks) -> Tensor {
        let output = rms_norm(hidden, &self.weight(&self.norm), self.config.rms_norm_eps);
        output.view([
            prepared.batch,
            prepared.num_blocks,
            prepared.block_size,
            self.config.hidden_size,
        ])
    }
}

/// What [`DraftModel::prepare`] computes once for all layers.
pub(super) struct PreparedBlocks {
    pub(super) batch: i64,
    pub(super) num_blocks: i64,
    pub(super) block_size: i64,
    pub(super) context_len: i64,
    /// `[batch, context_len, hidden]` fused target states (`fc`, `hidden_norm`).
    pub(super) context: Tensor,
    /// `[batch, queries, hidden]` embedded block tokens.
    pub(super) initial_hidden: Tensor,
    pub(super) context_cos: Tensor,
    pub(super) context_sin: Tensor,
    pub(super) block_cos: Tensor,
    pub(super) block_sin: Tensor,
    pub(super) masks: AttentionMasks,
}

/// The gradient accumulated in a leaf by a backward.
fn gradient_of(leaf: &Tensor, what: &str) -> Result<Tensor, DraftError> {
    let gradient = leaf.grad();
    if gradient.defined() {
        Ok(gradient)
    } else {
        Err(DraftError::ShapeMismatch(format!(
            "checkpointed backward: no gradient reached the {what} {:?}",
            leaf.size()
        )))
    }
}

/// Backpropagates `gradient` (same shape as `output`) from a non-scalar output.
pub(crate) fn backward_with_gradient(output: &Tensor, gradient: &Tensor) {
    (output * gradient.detach()).sum(Kind::Float).backward();
}
