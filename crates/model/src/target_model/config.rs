//! `config.json` of a Hugging Face causal LM, reduced to what the Qwen3 and
//! Llama-3 forward needs.
//!
//! Both the legacy keys (`rope_theta`, `rope_scaling`, written by
//! transformers 4.x) and the transformers 5 `rope_parameters` object are
//! read, because users have checkpoints saved by either.

use super::ModelError;
use crate::layers::{Llama3RopeScaling, RopeParams};
use serde_json::Value;
use std::path::Path;

/// The decoder families the target forward implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen3: RMSNorm on per-head queries and keys, plain RoPE.
    Qwen3,
    /// Llama (3.x): no q/k norm, optionally llama3-scaled RoPE.
    Llama,
}

impl Architecture {
    /// The `architectures[0]` value transformers writes for it.
    pub fn hf_class_name(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Llama => "LlamaForCausalLM",
        }
    }

    /// The `model_type` value transformers writes for it.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "qwen3",
            Architecture::Llama => "llama",
        }
    }
}

/// The hyper-parameters of a target model.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetConfig {
    pub architecture: Architecture,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    /// Per-head width; `hidden_size / num_attention_heads` when the file
    /// omits it (Llama), explicit for Qwen3 where it may differ.
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope: RopeParams,
    pub vocab_size: i64,
    /// When true no `lm_head.weight` is stored and the LM head reuses the
    /// input embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v/o projections carry biases (`attention_bias`).
    pub attention_bias: bool,
    pub max_position_embeddings: i64,
}

impl TargetConfig {
    /// Reads and validates `config.json` at `path`.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Parses the JSON text of a `config.json`; `path` is only used in
    /// error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self, ModelError> {
        let json: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let reader = ConfigReader { json: &json, path };
        let architecture = reader.architecture()?;
        let hidden_size = reader.positive_integer("hidden_size")?;
        let num_attention_heads = reader.positive_integer("num_attention_heads")?;
        let num_key_value_heads = match json.get("num_key_value_heads") {
            None | Some(Value::Null) => num_attention_heads,
            Some(_) => reader.positive_integer("num_key_value_heads")?,
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(reader.invalid(format!(
                "num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"
            )));
        }
        let head_dim = match json.get("head_dim") {
            None | Some(Value::Null) => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(reader.invalid(format!(
                        "hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads} and head_dim is not given"
                    )));
                }
                hidden_size / num_attention_heads
            }
            Some(_) => reader.positive_integer("head_dim")?,
        };
        if head_dim % 2 != 0 {
            return Err(reader.invalid(format!(
                "head_dim {head_dim} must be even for rotary embeddings"
            )));
        }
        if let Some(activation) = json.get("hidden_act").and_then(Value::as_str) {
            if activation != "silu" {
                return Err(reader.invalid(format!(
                    "hidden_act {activation:?} is not supported (only silu)"
                )));
            }
        }
        let num_hidden_layers = reader.positive_integer("num_hidden_layers")? as usize;
        Ok(TargetConfig {
            architecture,
            hidden_size,
            intermediate_size: reader.positive_integer("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: reader.optional_float("rms_norm_eps")?.unwrap_or(1e-6),
            rope: reader.rope()?,
            vocab_size: reader.positive_integer("vocab_size")?,
            tie_word_embeddings: reader
                .optional_bool("tie_word_embeddings")?
                .unwrap_or(false),
            attention_bias: reader.optional_bool("attention_bias")?.unwrap_or(false),
            max_position_embeddings: match json.get("max_position_embeddings") {
                None | Some(Value::Null) => i64::MAX,
                Some(_) => reader.positive_integer("max_position_embeddings")?,
            },
        })
    }
}

/// Typed access to the JSON object with errors that name the file and key.
struct ConfigReader<'a> {
    json: &'a Value,
    path: &'a Path,
}

impl ConfigReader<'_> {
    fn invalid(&self, message: String) -> ModelError {
        ModelError::InvalidConfig {
            path: self.path.to_path_buf(),
            message,
        }
    }

    fn architecture(&self) -> Result<Architecture, ModelError> {
        let from_model_type = self.json.get("model_type").and_then(Value::as_str);
        let from_architectures = self
            .json
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|list| list.first())
            .and_then(Value::as_str);
        let named = from_model_type.or(from_architectures).ok_or_else(|| {
            self.invalid("neither \"model_type\" nor \"architectures\" is set".to_string())
        })?;
        match named {
            "qwen3" | "Qwen3ForCausalLM" | "Qwen3Model" => Ok(Architecture::Qwen3),
            "llama" | "LlamaForCausalLM" | "LlamaModel" => Ok(Architecture::Llama),
            other => Err(ModelError::UnsupportedArchitecture {
                path: self.path.to_path_buf(),
                value: other.to_string(),
            }),
        }
    }

    fn positive_integer(&self, key: &str) -> Result<i64, ModelError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Err(self.invalid(format!("missing {key:?}"))),
            Some(value) => match value.as_i64() {
                Some(number) if number > 0 => Ok(number),
                _ => Err(self.invalid(format!("{key:?} must be a positive integer, got {value}"))),
            },
        }
    }

    fn optional_float(&self, key: &str) -> Result<Option<f64>, ModelError> {
        float_at(self.json, key).map_err(|message| self.invalid(message))
    }

    fn optional_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(flag)) => Ok(Some(*flag)),
            Some(other) => Err(self.invalid(format!("{key:?} must be a boolean, got {other}"))),
        }
    }

    /// RoPE from `rope_parameters` (transformers 5) or `rope_theta` +
    /// `rope_scaling` (transformers 4).
    fn rope(&self) -> Result<RopeParams, ModelError> {
        let parameters = self
            .json
            .get("rope_parameters")
            .filter(|value| value.is_object());
        let legacy_scaling = self
            .json
            .get("rope_scaling")
            .filter(|value| value.is_object());
        let theta = parameters
            .map(|object| float_at(object, "rope_theta"))
            .transpose()
            .map_err(|message| self.invalid(message))?
            .flatten()
            .or(self.optional_float("rope_theta")?)
            .unwrap_or(10_000.0);
        let scaling_object = legacy_scaling.or(parameters);
        let Some(scaling_object) = scaling_object else {
            return Ok(RopeParams::plain(theta));
        };
        let rope_type = scaling_object
            .get("rope_type")
            .or_else(|| scaling_object.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        match rope_type {
            "default" => Ok(RopeParams::plain(theta)),
            "llama3" => {
                let required = |key: &str| -> Result<f64, ModelError> {
                    float_at(scaling_object, key)
                        .map_err(|message| self.invalid(message))?
                        .ok_or_else(|| {
                            self.invalid(format!("llama3 rope scaling is missing {key:?}"))
                        })
                };
                Ok(RopeParams {
                    theta,
                    scaling: Some(Llama3RopeScaling {
                        factor: required("factor")?,
                        low_freq_factor: required("low_freq_factor")?,
                        high_freq_factor: required("high_freq_factor")?,
                        original_max_position_embeddings: required(
                            "original_max_position_embeddings",
                        )?,
                    }),
                })
            }
            other => Err(self.invalid(format!(
                "rope type {other:?} is not supported (supported: default, llama3)"
            ))),
        }
    }
}

fn float_at(object: &Value, key: &str) -> Result<Option<f64>, String> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("{key:?} must be a number, got {value}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TargetConfig, ModelError> {
        TargetConfig::from_json_str(text, Path::new("config.json"))
    }

    const QWEN3: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":4096,
        "intermediate_size":12288,"num_hidden_layers":36,"num_attention_heads":32,"num_key_value_heads":8,
        "head_dim":128,"rms_norm_eps":1e-6,"rope_theta":1000000,"rope_scaling":null,"vocab_size":151936,
        "tie_word_embeddings":false,"max_position_embeddings":40960,"hidden_act":"silu"}"#;

    #[test]
    fn parses_a_qwen3_config() -> Result<(), ModelError> {
        let config = parse(QWEN3)?;
        assert_eq!(config.architecture, Architecture::Qwen3);
        assert_eq!(config.head_dim, 128);
        assert_eq!(config.num_key_value_heads, 8);
        assert_eq!(config.rope, RopeParams::plain(1_000_000.0));
        assert!(!config.tie_word_embeddings);
        Ok(())
    }

    #[test]
    fn parses_llama3_rope_scaling_in_both_spellings() -> Result<(), ModelError> {
        let legacy = parse(
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"vocab_size":10,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192}}"#,
        )?;
        let modern = parse(
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"vocab_size":10,
            "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,
            "high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        )?;
        assert_eq!(legacy.rope, modern.rope);
        assert_eq!(legacy.head_dim, 16, "head_dim defaults to hidden / heads");
        assert_eq!(legacy.num_key_value_heads, 4, "kv heads default to heads");
        let scaling = legacy.rope.scaling.as_ref().map(|scaling| scaling.factor);
        assert_eq!(scaling, Some(8.0));
        assert_eq!(legacy.rope.theta, 500_000.0);
        Ok(())
    }

    #[test]
    fn unknown_architecture_names_file_and_value() {
        let error = parse(r#"{"model_type":"mamba","hidden_size":4}"#)
            .err()
            .map(|error| error.to_string());
        let message = error.unwrap_or_default();
        assert!(message.contains("config.json"), "{message}");
        assert!(message.contains("\"mamba\""), "{message}");
    }

    #[test]
    fn unsupported_rope_type_and_missing_keys_are_errors() {
        let yarn = QWEN3.replace(
            "\"rope_scaling\":null",
            "\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4.0}",
        );
        let message = parse(&yarn)
            .err()
            .map(|error| error.to_string())
            .unwrap_or_default();
        assert!(message.contains("yarn"), "{message}");
        let missing = QWEN3.replace("\"hidden_size\":4096,", "");
        let message = parse(&missing)
            .err()
            .map(|error| error.to_string())
            .unwrap_or_default();
        assert!(message.contains("hidden_size"), "{message}");
    }
}
