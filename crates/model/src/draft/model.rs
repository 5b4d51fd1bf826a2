//! The DFlash draft network: `fc` + `hidden_norm` fuse the tapped target
//! hidden states into one context stream, then `layers.{i}` Qwen3 decoder
//! layers with the DFlash attention, then the final `norm`.
//!
//! Parameters live in a `tch::nn::VarStore` under exactly the names of the
//! reference `DFlashDraftModel.state_dict()` (`fc.weight`,
//! `layers.0.self_attn.q_proj.weight`, ...), so the store is the checkpoint.
//! The target's `embed_tokens` and `lm_head` are held outside the store:
//! they are frozen and never saved.
//!
//! Training packs many blocks per sequence. Attention is computed in two
//! parts that share one softmax: each block's queries against the context
//! positions before its anchor, and against the block's own keys. This is
//! the same function as the reference's dense mask over
//! `[context ‖ all blocks]`, at O(blocks·B·(T + B)) instead of
//! O(blocks·B·(T + blocks·B)) memory. With `AttentionImplementation::Fused`
//! the context part goes through libtorch's fused attention kernel, a chunk
//! of blocks per call, so not even the O(blocks·B·T) scores are materialised.
//!
//! Speculative decoding drafts one block at a time after a growing context:
//! [`DraftContextCache`] (in `context_cache`) keeps each layer's projected
//! context keys and values, so each committed position is projected once.

use std::path::Path;

use rand::{Rng, SeedableRng};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::{DraftConfig, DraftError};

mod context_cache;
use crate::layers::{apply_rotary, rms_norm, rotary_cos_sin, swiglu_mlp};
use crate::target_model::weights::{load_tensors, TensorRequest};
use crate::target_model::TargetConfig;
pub use context_cache::DraftContextCache;

/// Handles on one decoder layer's parameters (shallow clones of the
/// `VarStore` variables, so optimizer updates are seen here).
struct DraftLayerParameters {
    input_layernorm: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    post_attention_layernorm: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
}

/// The frozen pieces of the target the drafter reads tokens through.
pub struct FrozenTargetHeads {
    /// `[vocab, hidden]`: embeds the block's tokens (anchor and masks).
    pub embed_tokens: Tensor,
    /// `[vocab, hidden]`: turns draft hidden states into logits.
    pub lm_head: Tensor,
}

impl FrozenTargetHeads {
    /// Reads only the embedding and LM head of a Hugging Face target
    /// directory (the LM head is the embedding when they are tied), so a
    /// drafter does not hold the whole target in memory.
    pub fn load(
        target_dir: &Path,
        device: Device,
        kind: Kind,
    ) -> Result<(TargetConfig, Self), DraftError> {
        let config =
            TargetConfig::from_file(&target_dir.join(crate::target_model::CONFIG_FILE_NAME))?;
        let shape = vec![config.vocab_size, config.hidden_size];
        let mut requests = vec![TensorRequest {
            name: EMBED_TOKENS_NAME.to_string(),
            shape: shape.clone(),
        }];
        if !config.tie_word_embeddings {
            requests.push(TensorRequest {
                name: LM_HEAD_NAME.to_string(),
                shape,
            });
        }
        let mut tensors = tch::no_grad(|| load_tensors(target_dir, &requests, device, kind))?;
        let missing =
            |name: &str| DraftError::MissingParameter(format!("{}: {name}", target_dir.display()));
        let embed_tokens = tensors
            .remove(EMBED_TOKENS_NAME)
            .ok_or_else(|| missing(EMBED_TOKENS_NAME))?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            tensors
                .remove(LM_HEAD_NAME)
                .ok_or_else(|| missing(LM_HEAD_NAME))?
        };
        Ok((
            config,
            FrozenTargetHeads {
                embed_tokens,
                lm_head,
            },
        ))
    }
}

/// Tensor names of the target's embedding and LM head in HF checkpoints.
const EMBED_TOKENS_NAME: &str = "model.embed_tokens.weight";
const LM_HEAD_NAME: &str = "lm_head.weight";

/// One forward's inputs, already batched and padded.
pub struct BlockInputs<'a> {
    /// `[batch, context_len, n·hidden]` tapped target states (any float kind).
    pub target_hidden: &'a Tensor,
    /// `[batch, blocks, block_size]` token ids of every block: the anchor
    /// token followed by mask tokens.
    pub block_token_ids: &'a Tensor,
    /// `[batch, blocks]` absolute position of each block's first token; a
    /// block sees the context positions strictly before it.
    pub anchor_positions: &'a Tensor,
}

/// The trainable draft model plus the frozen target embedding and head.
pub struct DraftModel {
    config: DraftConfig,
    var_store: VarStore,
    fc: Tensor,
    hidden_norm: Tensor,
    layers: Vec<DraftLayerParameters>,
    norm: Tensor,
    frozen: FrozenTargetHeads,
    /// Kind the forward computes in: f32 on the CPU, bf16 on a GPU. The
    /// master weights in the `VarStore` stay f32 either way.
    compute_kind: Kind,
    /// How the block-over-context attention is computed.
    attention: AttentionImplementation,
}

impl DraftModel {
    /// A freshly initialised model (linear weights ~ N(0, initializer_range),
    /// norms at one, like HF `_init_weights`) drawn from a seeded generator
    /// so that two runs with the same seed are identical.
    pub fn new(
        config: DraftConfig,
        frozen: FrozenTargetHeads,
        device: Device,
        compute_kind: Kind,
        seed: u64,
    ) -> Result<Self, DraftError> {
        config.validate()?;
        check_frozen_shapes(&config, &frozen)?;
        let var_store = VarStore::new(device);
        let mut generator = rand::rngs::StdRng::seed_from_u64(seed);
        let standard_deviation = config.initializer_range;
        for (name, shape) in parameter_shapes(&config) {
            let is_norm = name.ends_with("norm.weight") || name.ends_with("layernorm.weight");
            let initial = if is_norm {
                Tensor::ones(shape.as_slice(), (Kind::Float, Device::Cpu))
            } else {
                seeded_normal(&shape, standard_deviation, &mut generator)
            };
            add_named_variable(&var_store, &name, &initial)?;
        }
        Self::from_var_store(config, var_store, frozen, compute_kind)
    }

    /// Wraps a `VarStore` that already holds every parameter (for example
    /// loaded from a checkpoint).
    pub fn from_var_store(
        config: DraftConfig,
        var_store: VarStore,
        frozen: FrozenTargetHeads,
        compute_kind: Kind,
    ) -> Result<Self, DraftError> {
        config.validate()?;
        check_frozen_shapes(&config, &frozen)?;
        let variables = var_store.variables();
        let fetch = |name: String| -> Result<Tensor, DraftError> {
            variables
                .get(&name)
                .map(Tensor::shallow_clone)
                .ok_or(DraftError::MissingParameter(name))
        };
        let layers = (0..config.num_draft_layers)
            .map(|index| {
                let prefix = format!("layers.{index}");
                Ok(DraftLayerParameters {
                    input_layernorm: fetch(format!("{prefix}.input_layernorm.weight"))?,
                    q_proj: fetch(format!("{prefix}.self_attn.q_proj.weight"))?,
                    k_proj: fetch(format!("{prefix}.self_attn.k_proj.weight"))?,
                    v_proj: fetch(format!("{prefix}.self_attn.v_proj.weight"))?,
                    o_proj: fetch(format!("{prefix}.self_attn.o_proj.weight"))?,
                    q_norm: fetch(format!("{prefix}.self_attn.q_norm.weight"))?,
                    k_norm: fetch(format!("{prefix}.self_attn.k_norm.weight"))?,
                    post_attention_layernorm: fetch(format!(
                        "{prefix}.post_attention_layernorm.weight"
                    ))?,
                    gate_proj: fetch(format!("{prefix}.mlp.gate_proj.weight"))?,
                    up_proj: fetch(format!("{prefix}.mlp.up_proj.weight"))?,
                    down_proj: fetch(format!("{prefix}.mlp.down_proj.weight"))?,
                })
            })
            .collect::<Result<Vec<_>, DraftError>>()?;
        let frozen = FrozenTargetHeads {
            embed_tokens: frozen
                .embed_tokens
                .to_device(var_store.device())
                .to_kind(compute_kind)
                .detach(),
            lm_head: frozen
                .lm_head
                .to_device(var_store.device())
                .to_kind(compute_kind)
                .detach(),
        };
        Ok(DraftModel {
            fc: fetch("fc.weight".to_string())?,
            hidden_norm: fetch("hidden_norm.weight".to_string())?,
            norm: fetch("norm.weight".to_string())?,
            layers,
            config,
            var_store,
            frozen,
            compute_kind,
            attention: AttentionImplementation::default(),
        })
    }

    pub fn config(&self) -> &DraftConfig {
        &self.config
    }

    /// The trainable parameters, under their checkpoint names.
    pub fn var_store(&self) -> &VarStore {
        &self.var_store
    }

    pub fn device(&self) -> Device {
        self.var_store.device()
    }

    pub fn compute_kind(&self) -> Kind {
        self.compute_kind
    }

    /// Number of trainable parameters (embedding and LM head excluded).
    pub fn num_parameters(&self) -> i64 {
        self.var_store
            .trainable_variables()
            .iter()
            .map(Tensor::numel)
            .map(|n| n as i64)
            .sum()
    }

    /// A master weight in the compute kind; the cast is differentiable, so
    /// gradients reach the f32 master weight.
    fn weight(&self, master: &Tensor) -> Tensor {
        if master.kind() == self.compute_kind {
            master.shallow_clone()
        } else {
            master.to_kind(self.compute_kind)
        }
    }

    /// Embeds block tokens with the target's (frozen) embedding.
    pub fn embed(&self, token_ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.frozen.embed_tokens, token_ids, -1, false, false)
    }

    /// Logits of draft hidden states through the target's (frozen) LM head,
    /// in f32 so the softmax and cross-entropy do not lose precision.
    pub fn logits(&self, draft_hidden: &Tensor) -> Tensor {
        draft_hidden
            .linear::<Tensor>(&self.frozen.lm_head, None)
            .to_kind(Kind::Float)
    }

    /// How the block-over-context attention is computed (split by default).
    pub fn attention(&self) -> AttentionImplementation {
        self.attention
    }

    /// Chooses the attention implementation; both compute the same function.
    pub fn set_attention(&mut self, attention: AttentionImplementation) -> Result<(), DraftError> {
        if let Some(blocks_per_chunk) = attention.blocks_per_chunk() {
            if blocks_per_chunk < 1 {
                return Err(DraftError::InvalidConfig(format!(
                    "fused attention with {blocks_per_chunk} blocks per chunk, expected at least 1"
                )));
            }
        }
        self.attention = attention;
        Ok(())
    }

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

    /// The masks of the block-over-context attention: which context
    /// positions each query sees (those before its block's anchor).
    fn attention_masks(
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
        self.finish_layer(layer, residual, &attended)
    }

    /// The layer's queries (from the blocks) and keys and values (from the
    /// context and the blocks, same weights), normed, rotated and with the
    /// key/value heads repeated to the query heads.
    fn attention_heads(
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
        }
    }

    /// The rest of a draft layer after attention, shared by the training
    /// forward and the cached one: heads `[batch, heads, queries, head_dim]`
    /// merged, `o_proj` plus the residual, then the post-attention norm and
    /// the SwiGLU MLP with their residual.
    fn finish_layer(
        &self,
        layer: &DraftLayerParameters,
        residual: Tensor,
        attended: &Tensor,
    ) -> Tensor {
        let attended = attended.transpose(1, 2).flatten(2, 3);
        let hidden = residual + attended.linear::<Tensor>(&self.weight(&layer.o_proj), None);

        let residual = hidden.shallow_clone();
        let normed = rms_norm(
            &hidden,
            &self.weight(&layer.post_attention_layernorm),
            self.config.rms_norm_eps,
        );
        residual
            + swiglu_mlp(
                &normed,
                &self.weight(&layer.gate_proj),
                &self.weight(&layer.up_proj),
                &self.weight(&layer.down_proj),
            )
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

/// One layer's attention inputs, `[batch, heads, length, head_dim]` each
/// (key/value heads already repeated to the query heads).
struct AttentionHeads {
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
    fn split_attention(&self, context_visible: &Tensor, prepared: &PreparedBlocks) -> Tensor {
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
    fn fused_attention(
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
    fn fused_concatenated_attention(
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
    fn blocks_per_chunk(self) -> Option<i64> {
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

/// What [`DraftModel::prepare`] computes once for all layers.
struct PreparedBlocks {
    batch: i64,
    num_blocks: i64,
    block_size: i64,
    context_len: i64,
    /// `[batch, context_len, hidden]` fused target states (`fc`, `hidden_norm`).
    context: Tensor,
    /// `[batch, queries, hidden]` embedded block tokens.
    initial_hidden: Tensor,
    context_cos: Tensor,
    context_sin: Tensor,
    block_cos: Tensor,
    block_sin: Tensor,
    masks: AttentionMasks,
}

enum AttentionMasks {
    /// `[batch, 1, queries, context_len]` true where a query sees a context position.
    Split {
        context_visible: Tensor,
    },
    Fused(Vec<ContextAttentionChunk>),
    FusedConcatenated(Vec<FusedAttentionChunk>),
}

/// One fused context-attention call of [`AttentionImplementation::Fused`].
struct ContextAttentionChunk {
    first_query: i64,
    num_queries: i64,
    /// Context positions any block of the chunk may see (its largest anchor).
    context_len: i64,
    /// `[batch, 1, chunk queries, context_len]`: 0 where visible, −∞
    /// elsewhere; rows of blocks without any context (anchor 0) see
    /// position 0 so the kernel never meets an empty row, and are dropped
    /// through `without_context`.
    additive_mask: Tensor,
    /// `[batch, 1, chunk queries]` true for queries whose block has no context.
    without_context: Tensor,
}

/// A chunk of blocks of one fused-attention call: blocks
/// `first_block..first_block + num_blocks`.
#[derive(Debug, Clone, Copy)]
struct ChunkSpan {
    first_block: i64,
    num_blocks: i64,
    /// Context positions any block of the chunk may see (its largest anchor).
    context_len: i64,
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

/// 0 where `visible`, −∞ elsewhere.
fn additive_mask(visible: &Tensor, kind: Kind, device: Device) -> Tensor {
    Tensor::zeros(visible.size(), (kind, device))
        .masked_fill(&visible.logical_not(), f64::NEG_INFINITY)
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
struct FusedAttentionChunk {
    span: ChunkSpan,
    /// `[batch, 1, chunk queries, context_len + chunk queries]`: 0 where
    /// visible, −∞ elsewhere (context before the anchor, the own block).
    additive_mask: Tensor,
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

/// Every parameter name of the reference `DFlashDraftModel.state_dict()`
/// with its shape, in a stable order.
pub fn parameter_shapes(config: &DraftConfig) -> Vec<(String, Vec<i64>)> {
    let hidden = config.hidden_size;
    let query_width = config.num_attention_heads * config.head_dim;
    let key_value_width = config.num_key_value_heads * config.head_dim;
    let mut shapes = vec![
        (
            "fc.weight".to_string(),
            vec![hidden, config.target_hidden_width()],
        ),
        ("hidden_norm.weight".to_string(), vec![hidden]),
        ("norm.weight".to_string(), vec![hidden]),
    ];
    for index in 0..config.num_draft_layers {
        let prefix = format!("layers.{index}");
        shapes.extend([
            (format!("{prefix}.input_layernorm.weight"), vec![hidden]),
            (
                format!("{prefix}.self_attn.q_proj.weight"),
                vec![query_width, hidden],
            ),
            (
                format!("{prefix}.self_attn.k_proj.weight"),
                vec![key_value_width, hidden],
            ),
            (
                format!("{prefix}.self_attn.v_proj.weight"),
                vec![key_value_width, hidden],
            ),
            (
                format!("{prefix}.self_attn.o_proj.weight"),
                vec![hidden, query_width],
            ),
            (
                format!("{prefix}.self_attn.q_norm.weight"),
                vec![config.head_dim],
            ),
            (
                format!("{prefix}.self_attn.k_norm.weight"),
                vec![config.head_dim],
            ),
            (
                format!("{prefix}.post_attention_layernorm.weight"),
                vec![hidden],
            ),
            (
                format!("{prefix}.mlp.gate_proj.weight"),
                vec![config.intermediate_size, hidden],
            ),
            (
                format!("{prefix}.mlp.up_proj.weight"),
                vec![config.intermediate_size, hidden],
            ),
            (
                format!("{prefix}.mlp.down_proj.weight"),
                vec![hidden, config.intermediate_size],
            ),
        ]);
    }
    shapes
}

/// Adds a trainable variable under a dotted name (`layers.0.mlp.up_proj.weight`):
/// tch wants the dots as path components, not inside a variable name.
pub(crate) fn add_named_variable(
    var_store: &VarStore,
    dotted_name: &str,
    value: &Tensor,
) -> Result<(), DraftError> {
    let mut components: Vec<&str> = dotted_name.split('.').collect();
    let variable_name = components.pop().unwrap_or_default();
    let path = components
        .iter()
        .fold(var_store.root(), |path, component| path / *component);
    let _ = path.f_var_copy(variable_name, value)?;
    Ok(())
}

/// HF `repeat_kv`: key/value head `h` serves query heads `h·n_rep .. (h+1)·n_rep`.
fn repeat_key_value_heads(states: &Tensor, repeats: i64) -> Tensor {
    if repeats == 1 {
        return states.shallow_clone();
    }
    let size = states.size();
    let (batch, kv_heads, length, head_dim) = (size[0], size[1], size[2], size[3]);
    states
        .unsqueeze(2)
        .expand([batch, kv_heads, repeats, length, head_dim], false)
        .reshape([batch, kv_heads * repeats, length, head_dim])
}

/// Normal samples from a seeded generator (Box–Muller), so initialisation
/// does not depend on libtorch's global RNG, which concurrent tests share.
fn seeded_normal(
    shape: &[i64],
    standard_deviation: f64,
    generator: &mut rand::rngs::StdRng,
) -> Tensor {
    let count: i64 = shape.iter().product();
    let mut values = Vec::with_capacity(count as usize);
    while values.len() < count as usize {
        let uniform_a: f64 = generator.random::<f64>().max(f64::MIN_POSITIVE);
        let uniform_b: f64 = generator.random::<f64>();
        let radius = (-2.0 * uniform_a.ln()).sqrt() * standard_deviation;
        let angle = std::f64::consts::TAU * uniform_b;
        values.push((radius * angle.cos()) as f32);
        values.push((radius * angle.sin()) as f32);
    }
    values.truncate(count as usize);
    Tensor::from_slice(&values).view(shape)
}

fn check_frozen_shapes(config: &DraftConfig, frozen: &FrozenTargetHeads) -> Result<(), DraftError> {
    let expected = vec![config.vocab_size, config.hidden_size];
    for (name, tensor) in [
        ("embed_tokens", &frozen.embed_tokens),
        ("lm_head", &frozen.lm_head),
    ] {
        if tensor.size() != expected {
            return Err(DraftError::ShapeMismatch(format!(
                "target {name} has shape {:?}, the draft config expects {expected:?}",
                tensor.size()
            )));
        }
    }
    Ok(())
}
