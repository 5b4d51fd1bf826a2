//! The frozen Qwen3 / Llama-3 decoder forward, with capture of the hidden
//! states of chosen layers.
//!
//! The forward follows Hugging Face `Qwen3Model` / `LlamaModel` operation by
//! operation (pre-norm residual blocks, grouped-query attention with a causal
//! and padding mask, RoPE on positions `0..T`), so that the captured states
//! equal `output_hidden_states` of the reference within float tolerance.
//!
//! # Layout
//! This file holds [`TargetModel`] and its forwards: the full forward with
//! hidden-state capture and the cached, incremental one of decoding.
//! - `loading`: the Hugging Face tensor names and shapes a target must
//!   have, and [`TargetModel::load`], which builds the model from them.
//! - `decoder_layer`: one pre-norm decoder layer (projections, per-head
//!   norms, RoPE, grouped-query attention, SwiGLU MLP), shared by both
//!   forwards.

use super::cache::KeyValueCache;
use super::config::TargetConfig;
use super::ModelError;
use crate::layers::{rms_norm, rotary_cos_sin, swiglu_mlp};
use tch::{Device, Kind, Tensor};

mod decoder_layer;
mod loading;

use decoder_layer::DecoderLayer;

/// File name of the model configuration inside a model directory.
pub const CONFIG_FILE_NAME: &str = "config.json";

/// What [`TargetModel::forward_cached`] returns.
#[derive(Debug)]
pub struct CachedForward {
    /// Final-normed hidden states `[B, T, H]` of the new positions.
    pub hidden: Tensor,
    /// `[B, T, len(layer_ids) * H]` when layer ids were asked for.
    pub captured: Option<Tensor>,
}

/// A frozen target LLM loaded from a Hugging Face model directory.
///
/// Weights never require gradients and every forward runs under
/// `tch::no_grad`, so no autograd graph is ever kept alive.
pub struct TargetModel {
    config: TargetConfig,
    device: Device,
    kind: Kind,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    final_norm: Tensor,
    /// The LM head matrix `[V, H]`; a shallow clone of `embed_tokens` when
    /// the model ties embeddings (same storage).
    lm_head: Tensor,
}

impl std::fmt::Debug for TargetModel {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TargetModel")
            .field("config", &self.config)
            .field("device", &self.device)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl TargetModel {
    pub fn config(&self) -> &TargetConfig {
        &self.config
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The input embedding matrix `[V, H]` (the drafter embeds its blocks
    /// with it).
    pub fn embed_tokens_weight(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// The LM head matrix `[V, H]`; the same storage as the embeddings when
    /// they are tied.
    pub fn lm_head_weight(&self) -> &Tensor {
        &self.lm_head
    }

    /// Hidden states after the decoder layers in `layer_ids` (HF
    /// `hidden_states[id + 1]`; for the last layer that is, as in HF, the
    /// output after the final norm), concatenated on the last dimension:
    /// `[B, T, len(layer_ids) * hidden]` in the model dtype. Layers after the
    /// deepest requested one are not run. Padded positions (attention mask 0)
    /// hold unspecified values; valid positions do not depend on padding.
    pub fn capture_hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        layer_ids: &[usize],
    ) -> Result<Tensor, ModelError> {
        Ok(self.capture(input_ids, attention_mask, layer_ids, false)?.0)
    }

    /// [`TargetModel::capture_hidden_states`] and the last hidden state
    /// after the final norm (the LM head's input, HF's `last_hidden_state`)
    /// `[B, T, hidden]`: DSpark's teacher, from which a drafter makes the
    /// target's distribution with the LM head it already holds. Runs every
    /// layer.
    pub fn capture_hidden_states_and_last(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        layer_ids: &[usize],
    ) -> Result<(Tensor, Tensor), ModelError> {
        let (captured, last) = self.capture(input_ids, attention_mask, layer_ids, true)?;
        let last = last.ok_or_else(|| {
            ModelError::InvalidInput("the last hidden state was not captured".into())
        })?;
        Ok((captured, last))
    }

    fn capture(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        layer_ids: &[usize],
        with_last: bool,
    ) -> Result<(Tensor, Option<Tensor>), ModelError> {
        let deepest = layer_ids
            .iter()
            .copied()
            .max()
            .ok_or_else(|| ModelError::InvalidInput("layer_ids is empty".into()))?;
        if deepest >= self.config.num_hidden_layers {
            return Err(ModelError::InvalidInput(format!(
                "layer id {deepest} out of range: the model has {} layers (0..={})",
                self.config.num_hidden_layers,
                self.config.num_hidden_layers - 1
            )));
        }
        let layer_count = if with_last {
            self.layers.len()
        } else {
            deepest + 1
        };
        tch::no_grad(|| {
            let last_layer = self.layers.len() - 1;
            let mut captured: Vec<Option<Tensor>> = (0..self.layers.len()).map(|_| None).collect();
            let wanted: Vec<bool> = (0..self.layers.len())
                .map(|layer| layer_ids.contains(&layer))
                .collect();
            let output =
                self.run_layers(input_ids, attention_mask, layer_count, |layer, hidden| {
                    if wanted[layer] {
                        // HF replaces hidden_states[-1] by the final-normed
                        // last_hidden_state; reproduce that for the last layer.
                        let state = if layer == last_layer {
                            rms_norm(hidden, &self.final_norm, self.config.rms_norm_eps)
                        } else {
                            hidden.shallow_clone()
                        };
                        captured[layer] = Some(state);
                    }
                })?;
            let selected: Vec<&Tensor> = layer_ids
                .iter()
                .filter_map(|&layer| captured[layer].as_ref())
                .collect();
            let last =
                with_last.then(|| rms_norm(&output, &self.final_norm, self.config.rms_norm_eps));
            Ok((Tensor::f_cat(&selected, -1)?, last))
        })
    }

    /// Logits `[B, T, V]` of the full forward (all layers, final norm, LM
    /// head), in the model dtype.
    pub fn logits(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Tensor, ModelError> {
        tch::no_grad(|| {
            let hidden =
                self.run_layers(input_ids, attention_mask, self.layers.len(), |_, _| {})?;
            let normed = rms_norm(&hidden, &self.final_norm, self.config.rms_norm_eps);
            Ok(normed.f_linear::<Tensor>(&self.lm_head, None)?)
        })
    }

    /// An empty key/value cache for `batch` sequences, with room for
    /// `capacity` positions before it grows.
    pub fn new_cache(&self, batch: i64, capacity: i64) -> KeyValueCache {
        KeyValueCache::new(
            self.layers.len(),
            batch,
            self.config.num_key_value_heads,
            self.config.head_dim,
            capacity,
            self.kind,
            self.device,
        )
    }

    /// Runs the new positions `input_ids` `[B, T]` (mask `[B, T]`, 0 for
    /// padding) after those already in `cache`, appending their keys and
    /// values to it. A new position attends to the cached real tokens and to
    /// the new real tokens up to itself. Returns the final-normed hidden
    /// states `[B, T, H]` (feed them to [`TargetModel::lm_head_logits`]) and,
    /// when `layer_ids` is not empty, the states of those layers as
    /// [`TargetModel::capture_hidden_states`] gives them. Outputs at padded
    /// positions are unspecified.
    pub fn forward_cached(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        cache: &mut KeyValueCache,
        layer_ids: &[usize],
    ) -> Result<CachedForward, ModelError> {
        let (batch, length) = self.validate_inputs(input_ids, attention_mask)?;
        if batch != cache.batch {
            return Err(ModelError::InvalidInput(format!(
                "input batch {batch} differs from the cache's batch {}",
                cache.batch
            )));
        }
        if let Some(&layer) = layer_ids
            .iter()
            .find(|&&layer| layer >= self.config.num_hidden_layers)
        {
            return Err(ModelError::InvalidInput(format!(
                "layer id {layer} out of range: the model has {} layers",
                self.config.num_hidden_layers
            )));
        }
        let total = cache.length + length;
        if total > self.config.max_position_embeddings {
            return Err(ModelError::InvalidInput(format!(
                "cached {} + new {length} positions exceed max_position_embeddings {}",
                cache.length, self.config.max_position_embeddings
            )));
        }
        tch::no_grad(|| {
            let device = self.device;
            let input_ids = input_ids.to_device(device);
            let is_token = attention_mask.to_device(device).ne(0);
            // RoPE positions count each row's real tokens (HF:
            // cumsum(mask) - 1); padding gets a harmless clamped position.
            let positions = (cache.next_positions.unsqueeze(1)
                + is_token.to_kind(Kind::Int64).cumsum(1, Kind::Int64)
                - 1)
            .clamp_min(0);
            let (cos, sin) = rotary_cos_sin(
                &positions,
                self.config.head_dim,
                &self.config.rope,
                self.kind,
                device,
            );
            cache.reserve(length);
            let start = cache.length;
            cache.key_is_token.narrow(1, start, length).copy_(&is_token);
            // Query t (absolute start + t) sees key s when s <= start + t and
            // s is a real token; every query also sees itself, so that rows
            // of padding attend to something (no NaN) without touching the
            // real positions.
            let key_index = Tensor::arange(total, (Kind::Int64, device)).unsqueeze(0);
            let query_index =
                Tensor::arange_start(start, total, (Kind::Int64, device)).unsqueeze(1);
            let causal = key_index.le_tensor(&query_index);
            let itself = key_index.eq_tensor(&query_index);
            let attention_allowed = causal
                .unsqueeze(0)
                .logical_and(&cache.key_is_token.narrow(1, 0, total).unsqueeze(1))
                .logical_or(&itself.unsqueeze(0))
                .unsqueeze(1);
            let last_layer = self.layers.len() - 1;
            let mut captured = Vec::with_capacity(layer_ids.len());
            let mut hidden = Tensor::f_embedding(&self.embed_tokens, &input_ids, -1, false, false)?;
            let eps = self.config.rms_norm_eps;
            for (index, layer) in self.layers.iter().enumerate() {
                let normed = rms_norm(&hidden, &layer.input_layernorm, eps);
                let (query, key, value) = layer.query_key_value(&self.config, &normed, &cos, &sin);
                cache.keys[index].narrow(2, start, length).copy_(&key);
                cache.values[index].narrow(2, start, length).copy_(&value);
                let attention = layer.attend(
                    &self.config,
                    &query,
                    &cache.keys[index].narrow(2, 0, total),
                    &cache.values[index].narrow(2, 0, total),
                    Some(&attention_allowed),
                );
                hidden = &hidden + attention;
                let normed = rms_norm(&hidden, &layer.post_attention_layernorm, eps);
                hidden = &hidden
                    + swiglu_mlp(&normed, &layer.gate_proj, &layer.up_proj, &layer.down_proj);
                if layer_ids.contains(&index) && index != last_layer {
                    captured.push((index, hidden.shallow_clone()));
                }
            }
            cache.length = total;
            cache.next_positions = &cache.next_positions
                + is_token.to_kind(Kind::Int64).sum_dim_intlist(
                    [1i64].as_slice(),
                    false,
                    Kind::Int64,
                );
            let normed = rms_norm(&hidden, &self.final_norm, eps);
            let captured = if layer_ids.is_empty() {
                None
            } else {
                // HF's last hidden_states entry is the final-normed output.
                let selected: Vec<&Tensor> = layer_ids
                    .iter()
                    .map(|&layer| {
                        if layer == last_layer {
                            &normed
                        } else {
                            captured
                                .iter()
                                .find(|(index, _)| *index == layer)
                                .map(|(_, state)| state)
                                .unwrap_or(&normed)
                        }
                    })
                    .collect();
                Some(Tensor::f_cat(&selected, -1)?)
            };
            Ok(CachedForward {
                hidden: normed,
                captured,
            })
        })
    }

    /// Logits of final-normed hidden states (`[.., H]` to `[.., V]`).
    pub fn lm_head_logits(&self, normed_hidden: &Tensor) -> Tensor {
        tch::no_grad(|| normed_hidden.linear::<Tensor>(&self.lm_head, None))
    }

    fn validate_inputs(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<(i64, i64), ModelError> {
        let size = input_ids.size();
        let [batch, length] = size[..] else {
            return Err(ModelError::InvalidInput(format!(
                "input_ids must be [B, T], got {size:?}"
            )));
        };
        if batch == 0 || length == 0 {
            return Err(ModelError::InvalidInput(format!(
                "input_ids is empty: {size:?}"
            )));
        }
        if input_ids.kind() != Kind::Int64 {
            return Err(ModelError::InvalidInput(format!(
                "input_ids must be int64, got {:?}",
                input_ids.kind()
            )));
        }
        if attention_mask.size() != size {
            return Err(ModelError::InvalidInput(format!(
                "attention_mask shape {:?} differs from input_ids shape {size:?}",
                attention_mask.size()
            )));
        }
        let smallest = input_ids.f_min()?.f_int64_value(&[])?;
        let largest = input_ids.f_max()?.f_int64_value(&[])?;
        if smallest < 0 || largest >= self.config.vocab_size {
            return Err(ModelError::InvalidInput(format!(
                "token ids must lie in 0..{}, got range {smallest}..={largest}",
                self.config.vocab_size
            )));
        }
        if length > self.config.max_position_embeddings {
            return Err(ModelError::InvalidInput(format!(
                "sequence length {length} exceeds max_position_embeddings {}",
                self.config.max_position_embeddings
            )));
        }
        Ok((batch, length))
    }

    /// Embeds and runs layers `0..layer_count`, handing each layer's output
    /// to `observe`, and returns the last output.
    fn run_layers(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        layer_count: usize,
        mut observe: impl FnMut(usize, &Tensor),
    ) -> Result<Tensor, ModelError> {
        let (batch, length) = self.validate_inputs(input_ids, attention_mask)?;
        let input_ids = input_ids.to_device(self.device);
        let key_is_token = attention_mask.to_device(self.device).ne(0);
        // With right padding, causality alone already hides every padded key
        // from every real query (padding only follows the real tokens), so
        // the fused causal kernel gives the real positions exactly the
        // states of the fully masked reference, several times faster.
        // Padded query rows then see padded keys: their outputs are
        // unspecified either way. Any other mask gets the explicit
        // [B, 1, T, T] mask: query t sees key s when s <= t and s is a token.
        let right_padded = length < 2
            || !key_is_token
                .narrow(1, 1, length - 1)
                .logical_and(&key_is_token.narrow(1, 0, length - 1).logical_not())
                .any()
                .f_int64_value(&[])
                .map(|any| any != 0)?;
        let attention_allowed = if right_padded {
            None
        } else {
            let causal = Tensor::ones([length, length], (Kind::Bool, self.device)).tril(0);
            Some(
                causal
                    .unsqueeze(0)
                    .unsqueeze(0)
                    .logical_and(&key_is_token.view([batch, 1, 1, length])),
            )
        };
        // HF uses cache positions 0..T for every row; right padding keeps the
        // real tokens at the same positions.
        let positions = Tensor::arange(length, (Kind::Int64, self.device))
            .unsqueeze(0)
            .expand([batch, length], true);
        let (cos, sin) = rotary_cos_sin(
            &positions,
            self.config.head_dim,
            &self.config.rope,
            self.kind,
            self.device,
        );
        let mut hidden = Tensor::f_embedding(&self.embed_tokens, &input_ids, -1, false, false)?;
        for (index, layer) in self.layers.iter().take(layer_count).enumerate() {
            hidden = layer.forward(
                &self.config,
                &hidden,
                attention_allowed.as_ref(),
                &cos,
                &sin,
            );
            observe(index, &hidden);
        }
        Ok(hidden)
    }
}
