//! The tiny model's weights: every tensor name and shape of a Qwen3 or
//! Llama checkpoint of the spec's sizes, each filled from its own seeded
//! SplitMix64 stream (so the bytes depend only on the seed and the tensor
//! name), written as bf16 `model.safetensors`. Apart from the tokenizer
//! because the two share nothing but the vocabulary size.

use safetensors::tensor::TensorView;
use safetensors::Dtype as SafeDtype;
use std::collections::HashMap;
use std::path::Path;

use super::spec::TinyModelSpec;
use crate::target_model::{Architecture, ModelError};

/// SplitMix64: tiny, portable, and good enough for test weights.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = self.0;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    }

    /// Uniform in (0, 1].
    fn next_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Standard normal by Box-Muller.
    fn next_normal(&mut self) -> f64 {
        let radius = (-2.0 * self.next_unit().ln()).sqrt();
        radius * (2.0 * std::f64::consts::PI * self.next_unit()).cos()
    }
}

/// FNV-1a, to give each tensor its own stream independent of write order.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// How a tensor is initialised.
enum Init {
    /// N(0, std²).
    Normal(f64),
    /// 1 + N(0, std²), for norm weights (not exactly one, so a norm weight
    /// applied in the wrong place changes the result).
    AroundOne(f64),
}

fn random_bf16_bytes(seed: u64, name: &str, count: usize, init: &Init) -> Vec<u8> {
    let mut generator = SplitMix64(seed ^ name_hash(name));
    let mut bytes = Vec::with_capacity(count * 2);
    for _ in 0..count {
        let value = match init {
            Init::Normal(std) => std * generator.next_normal(),
            Init::AroundOne(std) => 1.0 + std * generator.next_normal(),
        };
        bytes.extend_from_slice(&half::bf16::from_f64(value).to_le_bytes());
    }
    bytes
}

/// The bytes of every tensor of `plan`, in its order, filled by one
/// thread per core, largest tensors first: each tensor's stream depends
/// only on the seed and its name, so the bytes are those one thread would
/// write. A Qwen3-8B-shaped model (8.2 billion values) took 386 s on one
/// thread of an H200 machine's CPU (`scripts/check-gpu.sh`).
fn fill_in_parallel(seed: u64, plan: &[(String, Vec<i64>, Init)]) -> Vec<Vec<u8>> {
    use std::sync::atomic::{AtomicUsize, Ordering};

    let count = |shape: &[i64]| shape.iter().product::<i64>() as usize;
    let mut order: Vec<usize> = (0..plan.len()).collect();
    order.sort_by_key(|&index| std::cmp::Reverse(count(&plan[index].1)));
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |cores| cores.get())
        .min(plan.len().max(1));
    let mut filled = vec![Vec::new(); plan.len()];
    std::thread::scope(|scope| {
        // Each worker returns the tensors it filled, by index.
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    while let Some(&index) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let (name, shape, init) = &plan[index];
                        mine.push((index, random_bf16_bytes(seed, name, count(shape), init)));
                    }
                    mine
                })
            })
            .collect();
        for handle in handles {
            match handle.join() {
                Ok(mine) => {
                    for (index, bytes) in mine {
                        filled[index] = bytes;
                    }
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    filled
}

/// Every tensor of the tiny model with its shape and initialisation, in
/// the order of the file.
fn weight_plan(spec: &TinyModelSpec) -> Vec<(String, Vec<i64>, Init)> {
    let hidden = spec.hidden_size;
    let head_dim = spec.head_dim();
    let query_width = spec.heads * head_dim;
    let key_value_width = spec.kv_heads * head_dim;
    // Linear layers scaled by 1/sqrt(fan_in) keep activations O(1) through
    // the stack, so every layer visibly contributes to the hidden states.
    let linear = |fan_in: i64| Init::Normal(1.0 / (fan_in as f64).sqrt());
    let norm = || Init::AroundOne(0.1);
    // A `[outputs, inputs]` linear weight, scaled by its fan-in.
    let projection = |name: &'static str, outputs: i64, inputs: i64| {
        (name, vec![outputs, inputs], linear(inputs))
    };
    let mut plan: Vec<(String, Vec<i64>, Init)> = vec![(
        "model.embed_tokens.weight".into(),
        vec![spec.vocab, hidden],
        Init::Normal(1.0),
    )];
    for layer in 0..spec.layers {
        let mut layer_plan = vec![
            ("input_layernorm", vec![hidden], norm()),
            projection("self_attn.q_proj", query_width, hidden),
            projection("self_attn.k_proj", key_value_width, hidden),
            projection("self_attn.v_proj", key_value_width, hidden),
            projection("self_attn.o_proj", hidden, query_width),
        ];
        if spec.architecture == Architecture::Qwen3 {
            layer_plan.push(("self_attn.q_norm", vec![head_dim], norm()));
            layer_plan.push(("self_attn.k_norm", vec![head_dim], norm()));
        }
        layer_plan.extend([
            ("post_attention_layernorm", vec![hidden], norm()),
            projection("mlp.gate_proj", spec.intermediate, hidden),
            projection("mlp.up_proj", spec.intermediate, hidden),
            projection("mlp.down_proj", hidden, spec.intermediate),
        ]);
        plan.extend(layer_plan.into_iter().map(|(name, shape, init)| {
            (format!("model.layers.{layer}.{name}.weight"), shape, init)
        }));
    }
    plan.push(("model.norm.weight".into(), vec![hidden], norm()));
    if spec.architecture == Architecture::Llama {
        plan.push((
            "lm_head.weight".into(),
            vec![spec.vocab, hidden],
            linear(hidden),
        ));
    }
    plan
}

pub(super) fn write_weights(path: &Path, spec: &TinyModelSpec) -> Result<(), ModelError> {
    let plan = weight_plan(spec);
    let filled = fill_in_parallel(spec.seed, &plan);
    let buffers: Vec<(String, Vec<usize>, Vec<u8>)> = plan
        .into_iter()
        .zip(filled)
        .map(|((name, shape, _), bytes)| {
            (
                name,
                shape.into_iter().map(|dim| dim as usize).collect(),
                bytes,
            )
        })
        .collect();
    let mut views = Vec::with_capacity(buffers.len());
    for (name, shape, bytes) in &buffers {
        let view = TensorView::new(SafeDtype::BF16, shape.clone(), bytes).map_err(|error| {
            ModelError::Safetensors {
                path: path.to_path_buf(),
                message: format!("tensor {name:?}: {error}"),
            }
        })?;
        views.push((name.clone(), view));
    }
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|error| {
        ModelError::Safetensors {
            path: path.to_path_buf(),
            message: error.to_string(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_depend_on_seed_and_name_only() {
        let init = Init::Normal(1.0);
        let first = random_bf16_bytes(7, "a", 16, &init);
        assert_eq!(first, random_bf16_bytes(7, "a", 16, &init));
        assert_ne!(first, random_bf16_bytes(8, "a", 16, &init));
        assert_ne!(first, random_bf16_bytes(7, "b", 16, &init));
    }

    #[test]
    fn the_parallel_fill_writes_what_one_thread_writes() {
        let spec = TinyModelSpec::default();
        let plan = weight_plan(&spec);
        let filled = fill_in_parallel(spec.seed, &plan);
        assert_eq!(filled.len(), plan.len());
        for ((name, shape, init), bytes) in plan.iter().zip(&filled) {
            let count = shape.iter().product::<i64>() as usize;
            assert_eq!(
                bytes,
                &random_bf16_bytes(spec.seed, name, count, init),
                "{name}"
            );
        }
    }
}
