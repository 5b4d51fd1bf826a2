//! A tiny, seeded Hugging Face model directory for tests, the golden parity
//! fixtures and `dflash init-tiny`, so nothing is ever downloaded.
//!
//! The directory looks like a real checkpoint: `config.json`,
//! `model.safetensors` (bf16, like released checkpoints), a byte-level BPE
//! `tokenizer.json` the `tokenizers` crate and Python `transformers` both
//! load, `tokenizer_config.json` with a ChatML `chat_template` (also written
//! as `chat_template.jinja`, the transformers 5 layout) and
//! `generation_config.json`. Everything is a pure function of the
//! [`TinyModelSpec`]: the weights come from a self-contained SplitMix64
//! generator rather than `rand`, whose `StdRng` stream may change between
//! releases and would silently invalidate committed fixtures.
//!
//! Special tokens follow Qwen: `<|endoftext|>` (padding), `<|im_start|>`,
//! `<|im_end|>` (end of turn, eos) and, for the drafter, a mask token
//! `<|MASK|>` named by `mask_token` in `tokenizer_config.json`; see
//! [`crate::tokens::mask_token_id`].
//!
//! # Layout
//! This file holds the directory writer with its JSON files
//! (`config.json`, `generation_config.json`).
//! - `spec`: [`TinyModelSpec`], what tiny model to write, and its checks.
//! - `tokenizer`: the special tokens and chat template, the byte-level BPE
//!   tokenizer, its merges learned from
//!   [`TOKENIZER_CORPUS`], and its `tokenizer.json` /
//!   `tokenizer_config.json`.
//! - `weights`: the seeded bf16 weights of every tensor, written as
//!   `model.safetensors`.

use crate::target_model::{Architecture, ModelError};
use serde_json::{json, Value};
use std::path::Path;

mod spec;
mod tokenizer;
mod weights;

pub use spec::TinyModelSpec;
use tokenizer::TinyTokenizer;
pub use tokenizer::{
    CHAT_TEMPLATE, END_OF_TEXT_TOKEN, IM_END_TOKEN, IM_START_TOKEN, MASK_TOKEN, TOKENIZER_CORPUS,
};
use weights::write_weights;

/// The token ids [`random_token_sequences`] draws from: ordinary tokens of
/// the tiny vocabulary (byte and merge tokens, no special token).
pub const ORDINARY_TOKEN_IDS: std::ops::Range<i64> = 3..300;

/// `count` token sequences of `length` drawn from `generator` over
/// [`ORDINARY_TOKEN_IDS`]: the demo's prompts and the tests' sequences.
pub fn random_token_sequences(
    count: usize,
    length: usize,
    generator: &mut impl rand::Rng,
) -> Vec<Vec<i64>> {
    (0..count)
        .map(|_| {
            (0..length)
                .map(|_| generator.random_range(ORDINARY_TOKEN_IDS))
                .collect()
        })
        .collect()
}

/// Writes the tiny model directory `dir` (created if missing).
pub fn write_tiny_model(dir: &Path, spec: &TinyModelSpec) -> Result<(), ModelError> {
    spec.validate()?;
    let tokenizer = TinyTokenizer::build();
    let tokenizer_size = tokenizer.size() as i64;
    if spec.vocab < tokenizer_size {
        return Err(ModelError::InvalidInput(format!(
            "tiny model spec: vocab {} is smaller than the tokenizer's {tokenizer_size} tokens",
            spec.vocab
        )));
    }
    std::fs::create_dir_all(dir).map_err(|source| io_error(dir, source))?;
    write_json(&dir.join("config.json"), &model_config(spec, &tokenizer))?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({
            "eos_token_id": tokenizer.special_id(IM_END_TOKEN),
            "pad_token_id": tokenizer.special_id(END_OF_TEXT_TOKEN),
            "do_sample": false,
        }),
    )?;
    write_json(&dir.join("tokenizer.json"), &tokenizer.tokenizer_json())?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer.tokenizer_config_json(),
    )?;
    write_text(&dir.join("chat_template.jinja"), CHAT_TEMPLATE)?;
    write_weights(&dir.join("model.safetensors"), spec)
}

fn io_error(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write_text(path: &Path, text: &str) -> Result<(), ModelError> {
    std::fs::write(path, text).map_err(|source| io_error(path, source))
}

fn write_json(path: &Path, value: &Value) -> Result<(), ModelError> {
    let text = serde_json::to_string_pretty(value).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    write_text(path, &(text + "\n"))
}

fn model_config(spec: &TinyModelSpec, tokenizer: &TinyTokenizer) -> Value {
    let common = json!({
        "architectures": [spec.architecture.hf_class_name()],
        "model_type": spec.architecture.model_type(),
        "attention_bias": false,
        "attention_dropout": 0.0,
        "eos_token_id": tokenizer.special_id(IM_END_TOKEN),
        "pad_token_id": tokenizer.special_id(END_OF_TEXT_TOKEN),
        "head_dim": spec.head_dim(),
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 4096,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "use_cache": true,
        "vocab_size": spec.vocab,
    });
    let specific = match spec.architecture {
        Architecture::Qwen3 => json!({
            "rope_theta": 1_000_000.0,
            "rope_scaling": null,
            "tie_word_embeddings": true,
            "max_window_layers": spec.layers,
            "sliding_window": null,
            "use_sliding_window": false,
        }),
        // Llama 3.1's values; with the tiny head_dim of 8 the four
        // wavelengths (6, 167, 4443, 118k) fall in all three llama3 bands
        // (kept, interpolated, divided by the factor).
        Architecture::Llama => json!({
            "rope_theta": 500_000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": false,
            "max_position_embeddings": 131072,
            "mlp_bias": false,
            "pretraining_tp": 1,
        }),
    };
    let mut merged = common;
    if let (Some(target), Value::Object(extra)) = (merged.as_object_mut(), specific) {
        target.extend(extra);
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_specs_are_rejected() {
        let odd_heads = TinyModelSpec {
            heads: 5,
            ..TinyModelSpec::default()
        };
        assert!(odd_heads.validate().is_err());
        let small_vocab = TinyModelSpec {
            vocab: 100,
            ..TinyModelSpec::default()
        };
        let directory = std::env::temp_dir().join("dflash-tiny-never-written");
        assert!(write_tiny_model(&directory, &small_vocab).is_err());
        assert!(!directory.exists());
    }
}
