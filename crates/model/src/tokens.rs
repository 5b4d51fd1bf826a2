//! Token ids a run needs from a model directory: the drafter's mask token
//! (the tokenizer's `mask_token`, else the DFlash convention of the first id
//! past the vocabulary) and the target's end-of-sequence ids. Read from the
//! Hugging Face files as they are on disk; used by the drafter-server, τ
//! evaluation, `dflash local` and `dflash regenerate`.

use crate::target_model::ModelError;
use serde_json::Value;
use std::path::Path;

/// The id of the mask token of a model directory: the `mask_token` of its
/// `tokenizer_config.json` (a string or an `{"content": ..}` object),
/// looked up among `tokenizer.json`'s added tokens and vocabulary.
pub fn mask_token_id(dir: &Path) -> Result<i64, ModelError> {
    let config_path = dir.join("tokenizer_config.json");
    let config = read_json(&config_path)?;
    let mask_token = match config.get("mask_token") {
        Some(Value::String(content)) => content.clone(),
        Some(Value::Object(object)) => object
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| invalid_config(&config_path, "mask_token object has no \"content\""))?,
        _ => return Err(invalid_config(&config_path, "no \"mask_token\"")),
    };
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = read_json(&tokenizer_path)?;
    let added = tokenizer
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|token| token.get("content").and_then(Value::as_str) == Some(mask_token.as_str()))
        .and_then(|token| token.get("id"))
        .and_then(Value::as_i64);
    let in_vocabulary = || {
        tokenizer
            .get("model")
            .and_then(|model| model.get("vocab"))
            .and_then(|vocab| vocab.get(&mask_token))
            .and_then(Value::as_i64)
    };
    added.or_else(in_vocabulary).ok_or_else(|| {
        invalid_config(
            &tokenizer_path,
            &format!("mask token {mask_token:?} is not in the vocabulary"),
        )
    })
}

/// Where a model's mask token id came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskTokenSource {
    /// The `mask_token` of `tokenizer_config.json`.
    Tokenizer,
    /// No `mask_token`: the reference convention of the published DFlash
    /// drafters, the first id past the tokenizer's vocabulary (an unused
    /// embedding row of the model; 151669 for Qwen3-8B).
    ReservedPastVocabulary,
}

impl std::fmt::Display for MaskTokenSource {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            MaskTokenSource::Tokenizer => "the tokenizer's mask_token",
            MaskTokenSource::ReservedPastVocabulary => {
                "no mask_token: the reserved id past the tokenizer's vocabulary (DFlash convention)"
            }
        })
    }
}

/// The mask token id a drafter of the model in `dir` uses by default: the
/// tokenizer's `mask_token` when it has one, else the first id past the
/// tokenizer's vocabulary (largest id of `tokenizer.json`'s vocabulary and
/// added tokens, plus one), which must be a row of the model's embedding
/// (`vocab_size` in `config.json`). Checked before any run starts.
pub fn default_mask_token_id(dir: &Path) -> Result<(i64, MaskTokenSource), ModelError> {
    let config_path = dir.join("tokenizer_config.json");
    let has_mask_token = config_path.is_file()
        && read_json(&config_path)?
            .get("mask_token")
            .is_some_and(|value| !value.is_null());
    if has_mask_token {
        return Ok((mask_token_id(dir)?, MaskTokenSource::Tokenizer));
    }
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = read_json(&tokenizer_path)?;
    let vocabulary_ids = tokenizer
        .get("model")
        .and_then(|model| model.get("vocab"))
        .and_then(Value::as_object)
        .into_iter()
        .flat_map(|vocab| vocab.values().filter_map(Value::as_i64));
    let added_ids = tokenizer
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|token| token.get("id").and_then(Value::as_i64));
    let reserved = vocabulary_ids
        .chain(added_ids)
        .max()
        .map_or(0, |largest| largest + 1);
    let model_config_path = dir.join("config.json");
    let vocab_size = read_json(&model_config_path)?
        .get("vocab_size")
        .and_then(Value::as_i64)
        .ok_or_else(|| invalid_config(&model_config_path, "no integer \"vocab_size\""))?;
    if reserved >= vocab_size {
        return Err(invalid_config(
            &tokenizer_path,
            &format!(
                "no mask_token, and no reserved id past the tokenizer's vocabulary: id {reserved} \
                 is not below the model's vocab_size {vocab_size} (pass --mask-token-id)"
            ),
        ));
    }
    Ok((reserved, MaskTokenSource::ReservedPastVocabulary))
}

fn invalid_config(path: &Path, message: &str) -> ModelError {
    ModelError::InvalidConfig {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

fn io_error(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|source| io_error(path, source))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// `eos_token_id` (a number or a list) from `generation_config.json`, else
/// `config.json`; empty when neither declares one.
pub fn eos_token_ids(target_dir: &Path) -> Vec<i64> {
    for file in ["generation_config.json", "config.json"] {
        let Ok(text) = std::fs::read_to_string(target_dir.join(file)) else {
            continue;
        };
        let Ok(value) = serde_json::from_str::<serde_json::Value>(&text) else {
            continue;
        };
        match value.get("eos_token_id") {
            Some(serde_json::Value::Number(number)) => {
                return number.as_i64().into_iter().collect()
            }
            Some(serde_json::Value::Array(ids)) => {
                return ids.iter().filter_map(serde_json::Value::as_i64).collect()
            }
            _ => {}
        }
    }
    Vec::new()
}
