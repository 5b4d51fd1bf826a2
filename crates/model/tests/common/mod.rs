//! What the draft model's tests share: one tiny configuration, seeded
//! uniform tensors and frozen target heads made from them.

#![allow(dead_code)]

use dflash_model::draft::{BlockInputs, DraftConfig, DraftModel, FrozenTargetHeads};
use dflash_model::layers::RopeParams;
use dflash_model::target_model::TargetModel;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::PathBuf;

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
        dspark: None,
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

/// Unit roundoff of f32.
pub const UNIT_ROUNDOFF: f64 = f32::EPSILON as f64 / 2.0;

/// γ_n = n·u / (1 − n·u): the relative error bound of an n-term f32 sum
/// (Higham, Accuracy and Stability of Numerical Algorithms, §3.1).
pub fn gamma(terms: i64) -> f64 {
    let n_u = terms as f64 * UNIT_ROUNDOFF;
    n_u / (1.0 - n_u)
}

/// The DFlash2 golden fixtures (`scripts/golden/draft2_golden.py` and
/// `draft2_gradient_golden.py`).
pub fn dflash2_fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/draft/golden_dflash2")
}

/// Takes `name` out of a fixture's tensors, naming it when it is missing.
pub fn take(tensors: &mut HashMap<String, Tensor>, name: &str) -> anyhow::Result<Tensor> {
    tensors
        .remove(name)
        .ok_or_else(|| anyhow::anyhow!("the fixture lacks {name:?}"))
}

/// The drafter's hidden states `[block_size, hidden]` of the first block
/// after `prompt`: the anchor `anchor_token` in slot 0, mask tokens after
/// it, the target's hidden states of the prompt as context (what decoding
/// computes for its first proposal).
pub fn first_block_hidden(
    target: &TargetModel,
    drafter: &DraftModel,
    prompt: &[i64],
    anchor_token: i64,
) -> anyhow::Result<Tensor> {
    tch::no_grad(|| {
        let config = drafter.config();
        let layer_ids: Vec<usize> = config
            .target_layer_ids
            .iter()
            .map(|&id| id as usize)
            .collect();
        let ids = Tensor::from_slice(prompt).view([1, -1]);
        let context = target.capture_hidden_states(&ids, &ids.ones_like(), &layer_ids)?;
        let mut block = vec![config.mask_token_id; config.block_size as usize];
        block[0] = anchor_token;
        Ok(drafter
            .forward_blocks(&BlockInputs {
                target_hidden: &context,
                block_token_ids: &Tensor::from_slice(&block).view([1, 1, config.block_size]),
                anchor_positions: &Tensor::from_slice(&[prompt.len() as i64]).view([1, 1]),
            })?
            .get(0)
            .get(0))
    })
}
