//! What the draft model's tests share: one tiny configuration, seeded
//! uniform tensors and frozen target heads made from them.

#![allow(dead_code)]

use dflash_model::draft::{DraftConfig, FrozenTargetHeads};
use dflash_model::layers::RopeParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::Tensor;

pub const VOCAB: i64 = 64;
pub const HIDDEN: i64 = 32;

/// Two draft layers over two of six target layers, blocks of 4; weights
/// drawn from N(0, `initializer_range`).
pub fn tiny_draft_config(initializer_range: f64) -> DraftConfig {
    DraftConfig {
        hidden_size: HIDDEN,
        intermediate_size: 64,
        num_draft_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope: RopeParams::plain(10_000.0),
        vocab_size: VOCAB,
        max_position_embeddings: 256,
        block_size: 4,
        num_target_layers: 6,
        target_layer_ids: vec![1, 3],
        mask_token_id: VOCAB - 1,
        initializer_range,
        dflash2: None,
    }
}

/// f32 values uniform in `[-scale, scale)`, in `shape`.
pub fn uniform_tensor(shape: &[i64], scale: f32, generator: &mut StdRng) -> Tensor {
    let count: i64 = shape.iter().product();
    let values: Vec<f32> = (0..count)
        .map(|_| generator.random_range(-scale..scale))
        .collect();
    Tensor::from_slice(&values).view(shape)
}

/// The target's embedding and LM head, uniform in `[-1, 1)` from `seed`.
pub fn frozen_heads(seed: u64) -> FrozenTargetHeads {
    let mut generator = StdRng::seed_from_u64(seed);
    FrozenTargetHeads {
        embed_tokens: uniform_tensor(&[VOCAB, HIDDEN], 1.0, &mut generator),
        lm_head: uniform_tensor(&[VOCAB, HIDDEN], 1.0, &mut generator),
    }
}
