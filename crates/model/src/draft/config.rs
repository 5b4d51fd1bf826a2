//! The draft model's configuration and its `config.json` form.
//!
//! The checkpoint's `config.json` is a Hugging Face Qwen3 configuration plus
//! the DFlash keys the reference `dflash` package reads (`block_size`,
//! `num_target_layers`, `dflash_config.{target_layer_ids, mask_token_id}`),
//! so that `DFlashDraftModel.from_pretrained` rebuilds exactly the module
//! tree whose weights we save. Everything not specific to DFlash (widths,
//! heads, RoPE, vocabulary) defaults from the target model, because the
//! drafter shares the target's embedding and LM head and must agree with
//! them.

use serde_json::{json, Value};

use super::dspark_config::DsparkConfig;
use super::error::DraftError;
use crate::layers::{Llama3RopeScaling, RopeParams};
use crate::target_model::TargetConfig;

/// Default number of draft decoder layers (the DFlash Qwen3-8B recipe).
pub const DEFAULT_NUM_DRAFT_LAYERS: i64 = 5;
/// Default number of tokens per drafted block.
pub const DEFAULT_BLOCK_SIZE: i64 = 16;

/// Shape of the draft model: widths and heads follow the target, depth,
/// block size, mask token and the tapped target layers are DFlash's own.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftConfig {
    /// Width of the residual stream; equal to the target's so the target's
    /// embedding and LM head can be used unchanged.
    pub hidden_size: i64,
    /// Inner width of the SwiGLU MLP.
    pub intermediate_size: i64,
    /// Number of draft decoder layers (`num_hidden_layers` in `config.json`).
    pub num_draft_layers: i64,
    pub num_attention_heads: i64,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    /// Rotary embedding parameters, taken from the target.
    pub rope: RopeParams,
    pub vocab_size: i64,
    pub max_position_embeddings: i64,
    /// Tokens per drafted block: the anchor token plus `block_size - 1` masks.
    pub block_size: i64,
    /// Number of decoder layers of the target (`num_target_layers`).
    pub num_target_layers: i64,
    /// Target layers whose outputs are concatenated as the draft's context;
    /// their count fixes the input width of `fc`.
    pub target_layer_ids: Vec<i64>,
    /// Token id that fills the not-yet-drafted positions of a block.
    pub mask_token_id: i64,
    /// Standard deviation of the normal initialisation of linear weights
    /// (HF `initializer_range`).
    pub initializer_range: f64,
    /// DFlash2's additions (grouped dynamic convolutions in every layer and
    /// the candidate selector); `None` is plain DFlash.
    pub dflash2: Option<Dflash2Config>,
    /// DSpark's additions (Markov head, confidence head, distillation from
    /// the target's distribution); `None` is plain DFlash. Exclusive with
    /// `dflash2`. A DSpark checkpoint is written in speculators' format.
    pub dspark: Option<DsparkConfig>,
}

/// The keys `dflash`'s `DFlash2DraftModel` reads on top of DFlash's, plus
/// the weight of the selector loss in training.
#[derive(Debug, Clone, PartialEq)]
pub struct Dflash2Config {
    /// Causal taps of each grouped dynamic convolution (`conv_kernel_size`).
    pub conv_kernel_size: i64,
    /// Hidden channels sharing one dynamic kernel (`conv_group_size`); must
    /// divide the hidden size.
    pub conv_group_size: i64,
    /// Rank of the selector's bilinear factorisation (`selector_rank`).
    pub selector_rank: i64,
    /// Unary candidates the selector re-ranks per position (`selector_top_k`).
    pub selector_top_k: i64,
    /// Training loss = unary loss + `selector_loss_alpha` × selector loss
    /// (speculators' default 1.0). Not read by the reference; kept in
    /// `dflash_config` so a checkpoint says how it was trained.
    pub selector_loss_alpha: f64,
}

impl Default for Dflash2Config {
    /// speculators 0.9.0's defaults.
    fn default() -> Self {
        Dflash2Config {
            conv_kernel_size: 2,
            conv_group_size: 16,
            selector_rank: 256,
            selector_top_k: 16,
            selector_loss_alpha: 1.0,
        }
    }
}

/// Architecture names of the two draft models in `config.json`.
pub const DFLASH_ARCHITECTURE: &str = "DFlashDraftModel";
pub const DFLASH2_ARCHITECTURE: &str = "DFlash2DraftModel";
/// speculators' class of DSpark checkpoints (`speculators_model_type`
/// `dspark`).
pub const DSPARK_ARCHITECTURE: &str = "DSparkDraftModel";

/// The target-side facts a draft configuration is derived from.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetDimensions {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope: RopeParams,
    pub vocab_size: i64,
    pub max_position_embeddings: i64,
}

/// The DFlash-specific choices; `None` fields take the defaults.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraftOptions {
    pub num_draft_layers: Option<i64>,
    pub block_size: Option<i64>,
    pub mask_token_id: i64,
    /// Target layers to tap; defaults to [`build_target_layer_ids`] of the
    /// target depth and the number of draft layers.
    pub target_layer_ids: Option<Vec<i64>>,
}

/// [`crate::target_model::build_target_layer_ids`] in the draft config's integer type.
pub fn build_target_layer_ids(num_target_layers: i64, num_draft_layers: i64) -> Vec<i64> {
    crate::target_model::build_target_layer_ids(
        num_target_layers.max(0) as usize,
        num_draft_layers.max(0) as usize,
    )
    .into_iter()
    .map(|layer| layer as i64)
    .collect()
}

impl From<&TargetConfig> for TargetDimensions {
    fn from(target: &TargetConfig) -> Self {
        TargetDimensions {
            hidden_size: target.hidden_size,
            intermediate_size: target.intermediate_size,
            num_hidden_layers: target.num_hidden_layers as i64,
            num_attention_heads: target.num_attention_heads,
            num_key_value_heads: target.num_key_value_heads,
            head_dim: target.head_dim,
            rms_norm_eps: target.rms_norm_eps,
            rope: target.rope.clone(),
            vocab_size: target.vocab_size,
            // Targets without a limit (i64::MAX) get Qwen3's default, which
            // is only informational for the drafter.
            max_position_embeddings: target.max_position_embeddings.min(1 << 20),
        }
    }
}

impl DraftConfig {
    /// A draft configuration for a target: widths from the target, DFlash
    /// choices from `options` with the documented defaults.
    pub fn for_target(
        target: &TargetDimensions,
        options: &DraftOptions,
    ) -> Result<Self, DraftError> {
        let num_draft_layers = options.num_draft_layers.unwrap_or(DEFAULT_NUM_DRAFT_LAYERS);
        let target_layer_ids = options
            .target_layer_ids
            .clone()
            .unwrap_or_else(|| build_target_layer_ids(target.num_hidden_layers, num_draft_layers));
        let config = DraftConfig {
            hidden_size: target.hidden_size,
            intermediate_size: target.intermediate_size,
            num_draft_layers,
            num_attention_heads: target.num_attention_heads,
            num_key_value_heads: target.num_key_value_heads,
            head_dim: target.head_dim,
            rms_norm_eps: target.rms_norm_eps,
            rope: target.rope.clone(),
            vocab_size: target.vocab_size,
            max_position_embeddings: target.max_position_embeddings,
            block_size: options.block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
            num_target_layers: target.num_hidden_layers,
            target_layer_ids,
            mask_token_id: options.mask_token_id,
            initializer_range: 0.02,
            dflash2: None,
            dspark: None,
        };
        config.validate()?;
        Ok(config)
    }

    /// This configuration with DSpark's additions switched on (validated).
    pub fn with_dspark(self, dspark: DsparkConfig) -> Result<Self, DraftError> {
        let config = DraftConfig {
            dspark: Some(dspark),
            ..self
        };
        config.validate()?;
        Ok(config)
    }

    /// This configuration with DFlash2's additions switched on (validated).
    pub fn with_dflash2(self, dflash2: Dflash2Config) -> Result<Self, DraftError> {
        let config = DraftConfig {
            dflash2: Some(dflash2),
            ..self
        };
        config.validate()?;
        Ok(config)
    }

    /// The reference class that loads this configuration's checkpoints.
    pub fn architecture(&self) -> &'static str {
        if self.dflash2.is_some() {
            DFLASH2_ARCHITECTURE
        } else if self.dspark.is_some() {
            DSPARK_ARCHITECTURE
        } else {
            DFLASH_ARCHITECTURE
        }
    }

    /// Width of the concatenated target hidden states a sample carries.
    pub fn target_hidden_width(&self) -> i64 {
        self.target_layer_ids.len() as i64 * self.hidden_size
    }

    /// Checks the invariants the forward relies on.
    pub fn validate(&self) -> Result<(), DraftError> {
        let invalid = |reason: String| Err(DraftError::InvalidConfig(reason));
        if self.hidden_size <= 0 || self.intermediate_size <= 0 || self.head_dim <= 0 {
            return invalid(format!(
                "hidden_size {}, intermediate_size {} and head_dim {} must be positive",
                self.hidden_size, self.intermediate_size, self.head_dim
            ));
        }
        if self.num_draft_layers <= 0 {
            return invalid(format!(
                "num_hidden_layers {} must be positive",
                self.num_draft_layers
            ));
        }
        if self.num_attention_heads <= 0
            || self.num_key_value_heads <= 0
            || self.num_attention_heads % self.num_key_value_heads != 0
        {
            return invalid(format!(
                "num_attention_heads {} must be a positive multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim % 2 != 0 {
            return invalid(format!(
                "head_dim {} must be even for rotary embeddings",
                self.head_dim
            ));
        }
        if self.block_size < 2 {
            return invalid(format!("block_size {} must be at least 2", self.block_size));
        }
        if self.target_layer_ids.is_empty() {
            return invalid("target_layer_ids is empty".to_string());
        }
        if let Some(bad) = self
            .target_layer_ids
            .iter()
            .find(|&&layer| layer < 0 || layer >= self.num_target_layers)
        {
            return invalid(format!(
                "target layer id {bad} is outside the target's {} layers",
                self.num_target_layers
            ));
        }
        if self.mask_token_id < 0 || self.mask_token_id >= self.vocab_size {
            return invalid(format!(
                "mask_token_id {} is outside the vocabulary of {} tokens",
                self.mask_token_id, self.vocab_size
            ));
        }
        if let Some(dflash2) = &self.dflash2 {
            dflash2.validate(self)?;
        }
        if let Some(dspark) = &self.dspark {
            if self.dflash2.is_some() {
                return invalid("a draft config cannot be both DFlash2 and DSpark".to_string());
            }
            dspark.validate()?;
        }
        Ok(())
    }

    /// The checkpoint's `config.json`: a Qwen3 configuration the reference
    /// `DFlashDraftModel` (`config_class = Qwen3Config`) accepts, with the
    /// DFlash keys both at the top level (older readers) and in
    /// `dflash_config` (read first by `dflash` 0.1.0).
    pub fn to_hf_json(&self, torch_dtype: &str) -> Value {
        if let Some(dspark) = &self.dspark {
            return self.to_speculators_json(dspark, torch_dtype);
        }
        let mut rope_parameters = json!({ "rope_type": "default", "rope_theta": self.rope.theta });
        let mut rope_scaling = Value::Null;
        if let Some(scaling) = &self.rope.scaling {
            let llama3 = json!({
                "rope_type": "llama3",
                "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
            });
            rope_scaling = llama3.clone();
            rope_parameters = llama3;
            rope_parameters["rope_theta"] = json!(self.rope.theta);
        }
        let mut config = json!({
            "architectures": [self.architecture()],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_draft_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "use_sliding_window": false,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "initializer_range": self.initializer_range,
            "use_cache": true,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
            "dflash_config": {
                "target_layer_ids": self.target_layer_ids,
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
            },
        });
        if let Some(dflash2) = &self.dflash2 {
            let keys = [
                ("conv_kernel_size", json!(dflash2.conv_kernel_size)),
                ("conv_group_size", json!(dflash2.conv_group_size)),
                ("selector_rank", json!(dflash2.selector_rank)),
                ("selector_top_k", json!(dflash2.selector_top_k)),
            ];
            for (name, value) in keys {
                config[name] = value.clone();
                config["dflash_config"][name] = value;
            }
            config["dflash_config"]["selector_loss_alpha"] = json!(dflash2.selector_loss_alpha);
        }
        config
    }

    /// Reads a checkpoint's `config.json`, looking up the DFlash keys in
    /// `dflash_config` first and at the top level second, like the reference.
    pub fn from_hf_json(value: &Value) -> Result<Self, DraftError> {
        if let Some(model_type) = value.get("speculators_model_type") {
            return match model_type.as_str() {
                Some("dspark") => Self::from_speculators_json(value),
                _ => Err(DraftError::InvalidConfig(format!(
                    "config.json: speculators_model_type {model_type} is not supported (only \"dspark\" is read in speculators' format)"
                ))),
            };
        }
        let integer = |name: &str| -> Result<i64, DraftError> {
            dflash_value(value, name)
                .and_then(Value::as_i64)
                .ok_or_else(|| {
                    DraftError::InvalidConfig(format!(
                        "config.json: missing or non-integer {name:?}"
                    ))
                })
        };
        let float = |name: &str| -> Result<f64, DraftError> {
            value.get(name).and_then(Value::as_f64).ok_or_else(|| {
                DraftError::InvalidConfig(format!("config.json: missing or non-numeric {name:?}"))
            })
        };
        let hidden_size = integer("hidden_size")?;
        let num_attention_heads = integer("num_attention_heads")?;
        let head_dim = match value.get("head_dim").and_then(Value::as_i64) {
            Some(head_dim) => head_dim,
            None if num_attention_heads > 0 => hidden_size / num_attention_heads,
            None => 0,
        };
        let num_draft_layers = integer("num_hidden_layers")?;
        let num_target_layers = integer("num_target_layers")?;
        let target_layer_ids = match dflash_value(value, "target_layer_ids") {
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|id| {
                    id.as_i64().ok_or_else(|| {
                        DraftError::InvalidConfig(format!(
                            "config.json: target layer id {id} is not an integer"
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => {
                return Err(DraftError::InvalidConfig(format!(
                    "config.json: target_layer_ids {other} is not a list"
                )))
            }
            None => build_target_layer_ids(num_target_layers, num_draft_layers),
        };
        let config = DraftConfig {
            hidden_size,
            intermediate_size: integer("intermediate_size")?,
            num_draft_layers,
            num_attention_heads,
            num_key_value_heads: dflash_value(value, "num_key_value_heads")
                .and_then(Value::as_i64)
                .unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: float("rms_norm_eps")?,
            rope: rope_from_json(value)?,
            vocab_size: integer("vocab_size")?,
            max_position_embeddings: integer("max_position_embeddings")?,
            block_size: dflash_value(value, "block_size")
                .and_then(Value::as_i64)
                .unwrap_or(DEFAULT_BLOCK_SIZE),
            num_target_layers,
            target_layer_ids,
            mask_token_id: integer("mask_token_id")?,
            initializer_range: value
                .get("initializer_range")
                .and_then(Value::as_f64)
                .unwrap_or(0.02),
            dflash2: dflash2_from_json(value)?,
            dspark: None,
        };
        reject_unimplemented_transforms(value)?;
        config.validate()?;
        Ok(config)
    }
}

/// Keys of the DFlash `config.json` that speculators keeps outside its
/// `transformer_layer_config` (or names otherwise).
const DFLASH_ONLY_KEYS: [&str; 6] = [
    "architectures",
    "block_size",
    "num_target_layers",
    "mask_token_id",
    "target_layer_ids",
    "dflash_config",
];

impl DraftConfig {
    /// speculators 0.9.0's `config.json` of a DSpark drafter
    /// (`DSparkSpeculatorConfig`): the Qwen3 layer configuration under
    /// `transformer_layer_config`, the DFlash keys under speculators' names
    /// (`aux_hidden_state_layer_ids`, `draft_vocab_size`), DSpark's keys at
    /// the top level, and `speculators_config` (greedy proposals of
    /// `block_size` tokens: with `sample_from_anchor` every slot drafts).
    /// The target's depth is kept as `num_target_layers` (speculators' config
    /// allows extra keys), so the file reads back into this configuration.
    fn to_speculators_json(&self, dspark: &DsparkConfig, torch_dtype: &str) -> Value {
        let dflash = DraftConfig {
            dspark: None,
            ..self.clone()
        };
        let mut layer = dflash.to_hf_json(torch_dtype);
        if let Some(keys) = layer.as_object_mut() {
            for key in DFLASH_ONLY_KEYS {
                keys.remove(key);
            }
        }
        let mut config = json!({
            "architectures": [DSPARK_ARCHITECTURE],
            "speculators_model_type": "dspark",
            "speculators_version": "0.9.0",
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [{
                    "proposal_type": "greedy",
                    "speculative_tokens": self.block_size,
                }],
                "default_proposal_method": "greedy",
                "verifier": { "name_or_path": null, "architectures": [] },
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "target_hidden_size": null,
            "aux_hidden_state_layer_ids": self.target_layer_ids,
            "mask_token_id": self.mask_token_id,
            "sliding_window_non_causal": false,
            "num_target_layers": self.num_target_layers,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
        });
        for (name, value) in dspark.json_keys() {
            config[name] = value;
        }
        config
    }

    /// Reads speculators' DSpark `config.json` (see
    /// [`DraftConfig::to_speculators_json`]). A reduced draft vocabulary
    /// (`draft_vocab_size` other than the target's) is refused by value.
    fn from_speculators_json(value: &Value) -> Result<Self, DraftError> {
        let missing = |name: &str| {
            DraftError::InvalidConfig(format!(
                "config.json (speculators dspark): missing or invalid {name:?}"
            ))
        };
        let mut layer = value
            .get("transformer_layer_config")
            .filter(|layer| layer.is_object())
            .cloned()
            .ok_or_else(|| missing("transformer_layer_config"))?;
        let vocab_size = layer
            .get("vocab_size")
            .and_then(Value::as_i64)
            .ok_or_else(|| missing("transformer_layer_config.vocab_size"))?;
        if let Some(draft_vocab) = value
            .get("draft_vocab_size")
            .filter(|found| !found.is_null())
        {
            if draft_vocab.as_i64() != Some(vocab_size) {
                return Err(DraftError::InvalidConfig(format!(
                    "config.json: draft_vocab_size {draft_vocab} differs from the vocabulary of {vocab_size} tokens (a reduced draft vocabulary is not implemented)"
                )));
            }
        }
        let target_layer_ids = value
            .get("aux_hidden_state_layer_ids")
            .filter(|ids| ids.is_array())
            .ok_or_else(|| missing("aux_hidden_state_layer_ids"))?;
        let ids = target_layer_ids.as_array().map(Vec::len).unwrap_or(0) as i64;
        let max_id = target_layer_ids
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_i64)
            .max()
            .unwrap_or(0);
        let num_target_layers = match value.get("num_target_layers").filter(|n| !n.is_null()) {
            Some(found) => found.clone(),
            // Written by speculators itself: the target's depth is not
            // stored; the largest tapped layer bounds it from below.
            None => json!((max_id + 1).max(ids)),
        };
        for (name, found) in [
            ("block_size", value.get("block_size").cloned()),
            ("mask_token_id", value.get("mask_token_id").cloned()),
        ] {
            layer[name] = found
                .filter(|found| !found.is_null())
                .ok_or_else(|| missing(name))?;
        }
        layer["target_layer_ids"] = target_layer_ids.clone();
        layer["num_target_layers"] = num_target_layers;
        let dflash = DraftConfig::from_hf_json(&layer)?;
        dflash.with_dspark(DsparkConfig::from_json(value)?)
    }
}

impl Dflash2Config {
    /// The bounds `DFlash2DraftModel` and speculators' training assume.
    fn validate(&self, draft: &DraftConfig) -> Result<(), DraftError> {
        let invalid = |reason: String| Err(DraftError::InvalidConfig(reason));
        if self.conv_kernel_size < 1 || self.conv_kernel_size > draft.block_size {
            return invalid(format!(
                "conv_kernel_size {} must be between 1 and block_size {}",
                self.conv_kernel_size, draft.block_size
            ));
        }
        if self.conv_group_size < 1 || draft.hidden_size % self.conv_group_size != 0 {
            return invalid(format!(
                "conv_group_size {} must be positive and divide hidden_size {}",
                self.conv_group_size, draft.hidden_size
            ));
        }
        if self.selector_rank < 1 {
            return invalid(format!(
                "selector_rank {} must be positive",
                self.selector_rank
            ));
        }
        if self.selector_top_k < 1 || self.selector_top_k > draft.vocab_size {
            return invalid(format!(
                "selector_top_k {} must be between 1 and the vocabulary of {} tokens",
                self.selector_top_k, draft.vocab_size
            ));
        }
        if !self.selector_loss_alpha.is_finite() || self.selector_loss_alpha < 0.0 {
            return invalid(format!(
                "selector_loss_alpha {} must be finite and non-negative",
                self.selector_loss_alpha
            ));
        }
        Ok(())
    }

    /// Groups of channels sharing one dynamic kernel.
    pub fn conv_groups(&self, hidden_size: i64) -> i64 {
        hidden_size / self.conv_group_size
    }
}

/// DFlash2's keys when `architectures` names `DFlash2DraftModel` (the
/// reference requires them then), else `None`.
fn dflash2_from_json(value: &Value) -> Result<Option<Dflash2Config>, DraftError> {
    let architectures = value.get("architectures").and_then(Value::as_array);
    let is_dflash2 = architectures.is_some_and(|names| {
        names
            .iter()
            .any(|name| name.as_str() == Some(DFLASH2_ARCHITECTURE))
    });
    if !is_dflash2 {
        return Ok(None);
    }
    let integer = |name: &str| -> Result<i64, DraftError> {
        dflash_value(value, name)
            .and_then(Value::as_i64)
            .ok_or_else(|| {
                DraftError::InvalidConfig(format!(
                    "config.json: {DFLASH2_ARCHITECTURE} without an integer {name:?}"
                ))
            })
    };
    let selector_loss_alpha = match dflash_value(value, "selector_loss_alpha") {
        None => Dflash2Config::default().selector_loss_alpha,
        Some(alpha) => alpha.as_f64().ok_or_else(|| {
            DraftError::InvalidConfig(format!(
                "config.json: selector_loss_alpha {alpha} is not a number"
            ))
        })?,
    };
    Ok(Some(Dflash2Config {
        conv_kernel_size: integer("conv_kernel_size")?,
        conv_group_size: integer("conv_group_size")?,
        selector_rank: integer("selector_rank")?,
        selector_top_k: integer("selector_top_k")?,
        selector_loss_alpha,
    }))
}

/// The reference applies `input_embedding_scale` to the block embeddings,
/// and `output_multiplier` then `final_logit_softcapping` to the logits.
/// Only their identity values are implemented here: anything else is
/// refused by name rather than trained or evaluated as a different model.
fn reject_unimplemented_transforms(value: &Value) -> Result<(), DraftError> {
    let number = |name: &str| -> Result<Option<f64>, DraftError> {
        match dflash_value(value, name) {
            None => Ok(None),
            Some(found) => found.as_f64().map(Some).ok_or_else(|| {
                DraftError::InvalidConfig(format!("config.json: {name} {found} is not a number"))
            }),
        }
    };
    for name in ["input_embedding_scale", "output_multiplier"] {
        if let Some(found) = number(name)? {
            if found != 1.0 {
                return Err(DraftError::InvalidConfig(format!(
                    "config.json: {name} {found} is not supported (only 1.0 is implemented)"
                )));
            }
        }
    }
    if let Some(softcap) = number("final_logit_softcapping")? {
        // The reference caps only when the value is positive.
        if softcap > 0.0 {
            return Err(DraftError::InvalidConfig(format!(
                "config.json: final_logit_softcapping {softcap} is not supported (only none or 0 is implemented)"
            )));
        }
    }
    Ok(())
}

/// `dflash_config[name]`, else the top-level `name` (the reference's lookup order).
fn dflash_value<'a>(value: &'a Value, name: &str) -> Option<&'a Value> {
    value
        .get("dflash_config")
        .and_then(|dflash| dflash.get(name))
        .or_else(|| value.get(name))
        .filter(|found| !found.is_null())
}

/// RoPE parameters from `rope_parameters` (transformers 5) or the legacy
/// `rope_theta` / `rope_scaling` keys.
fn rope_from_json(value: &Value) -> Result<RopeParams, DraftError> {
    let parameters = value
        .get("rope_parameters")
        .filter(|found| found.is_object());
    let theta = parameters
        .and_then(|parameters| parameters.get("rope_theta"))
        .or_else(|| value.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(10_000.0);
    let scaling_source =
        parameters.or_else(|| value.get("rope_scaling").filter(|found| found.is_object()));
    let rope_type = scaling_source
        .and_then(|scaling| scaling.get("rope_type").or_else(|| scaling.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match (rope_type, scaling_source) {
        ("default", _) | (_, None) => None,
        ("llama3", Some(scaling)) => {
            let field = |name: &str| {
                scaling.get(name).and_then(Value::as_f64).ok_or_else(|| {
                    DraftError::InvalidConfig(format!(
                        "config.json: llama3 rope scaling lacks {name:?}"
                    ))
                })
            };
            Some(Llama3RopeScaling {
                factor: field("factor")?,
                low_freq_factor: field("low_freq_factor")?,
                high_freq_factor: field("high_freq_factor")?,
                original_max_position_embeddings: field("original_max_position_embeddings")?,
            })
        }
        (other, _) => {
            return Err(DraftError::InvalidConfig(format!(
                "config.json: rope type {other:?} is not supported (default and llama3 are)"
            )))
        }
    };
    Ok(RopeParams { theta, scaling })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_target() -> TargetDimensions {
        TargetDimensions {
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 8,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-6,
            rope: RopeParams::plain(1_000_000.0),
            vocab_size: 100,
            max_position_embeddings: 512,
        }
    }

    #[test]
    fn config_json_round_trips() {
        let options = DraftOptions {
            num_draft_layers: Some(2),
            block_size: Some(4),
            mask_token_id: 99,
            target_layer_ids: None,
        };
        let config = DraftConfig::for_target(&tiny_target(), &options).unwrap();
        assert_eq!(config.target_layer_ids, vec![1, 5]);
        let json = config.to_hf_json("float32");
        assert_eq!(json["dflash_config"]["mask_token_id"], 99);
        assert_eq!(json["architectures"][0], "DFlashDraftModel");
        assert_eq!(DraftConfig::from_hf_json(&json).unwrap(), config);
    }

    #[test]
    fn dspark_config_json_is_speculators_format_and_round_trips() {
        use crate::draft::dspark_config::{DsparkConfig, MarkovHeadType};
        let options = DraftOptions {
            num_draft_layers: Some(2),
            block_size: Some(4),
            mask_token_id: 99,
            target_layer_ids: None,
        };
        let dspark = DsparkConfig {
            markov_rank: 16,
            markov_head_type: MarkovHeadType::Gated,
            confidence_head_alpha: 0.5,
            ..DsparkConfig::default()
        };
        let config = DraftConfig::for_target(&tiny_target(), &options)
            .unwrap()
            .with_dspark(dspark)
            .unwrap();
        let json = config.to_hf_json("float32");
        assert_eq!(json["speculators_model_type"], "dspark");
        assert_eq!(json["architectures"][0], DSPARK_ARCHITECTURE);
        assert_eq!(json["aux_hidden_state_layer_ids"], json!([1, 5]));
        assert_eq!(json["markov_head_type"], "gated");
        assert_eq!(json["transformer_layer_config"]["num_hidden_layers"], 2);
        assert!(json["transformer_layer_config"]
            .get("dflash_config")
            .is_none());
        assert_eq!(
            json["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
            4
        );
        assert_eq!(DraftConfig::from_hf_json(&json).unwrap(), config);

        let mut reduced = json.clone();
        reduced["draft_vocab_size"] = json!(50);
        let error = DraftConfig::from_hf_json(&reduced).unwrap_err().to_string();
        assert!(error.contains("draft_vocab_size 50"), "{error}");
        let mut other = json;
        other["speculators_model_type"] = json!("eagle3");
        let error = DraftConfig::from_hf_json(&other).unwrap_err().to_string();
        assert!(error.contains("\"eagle3\""), "{error}");
        let both = DraftConfig {
            dflash2: Some(Dflash2Config::default()),
            ..config
        };
        let error = both.validate().unwrap_err().to_string();
        assert!(error.contains("both DFlash2 and DSpark"), "{error}");
    }

    #[test]
    fn invalid_configs_are_rejected_with_the_value() {
        let options = DraftOptions {
            mask_token_id: 100,
            ..DraftOptions::default()
        };
        let error = DraftConfig::for_target(&tiny_target(), &options).unwrap_err();
        assert!(error.to_string().contains("mask_token_id 100"), "{error}");
        let options = DraftOptions {
            target_layer_ids: Some(vec![8]),
            mask_token_id: 1,
            ..DraftOptions::default()
        };
        let error = DraftConfig::for_target(&tiny_target(), &options).unwrap_err();
        assert!(error.to_string().contains("target layer id 8"), "{error}");
    }
}
