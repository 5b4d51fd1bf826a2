//! Loading a target from a Hugging Face model directory: the tensor names
//! and shapes `Qwen3ForCausalLM` / `LlamaForCausalLM` checkpoints hold
//! (biases and per-head norms depending on the config), and
//! [`TargetModel::load`], which reads exactly those. Apart from the forward
//! because it is about checkpoint naming, not computation.

use std::collections::HashMap;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use super::{DecoderLayer, TargetModel, CONFIG_FILE_NAME};
use crate::target_model::config::{Architecture, TargetConfig};
use crate::target_model::weights::{load_tensors, TensorRequest};
use crate::target_model::ModelError;

fn tensor_requests(config: &TargetConfig) -> Vec<TensorRequest> {
    let hidden = config.hidden_size;
    let query_width = config.num_attention_heads * config.head_dim;
    let key_value_width = config.num_key_value_heads * config.head_dim;
    let mut requests = Vec::new();
    let mut request = |name: String, shape: Vec<i64>| requests.push(TensorRequest { name, shape });
    request(
        "model.embed_tokens.weight".into(),
        vec![config.vocab_size, hidden],
    );
    for layer in 0..config.num_hidden_layers {
        let prefix = format!("model.layers.{layer}");
        request(format!("{prefix}.input_layernorm.weight"), vec![hidden]);
        request(
            format!("{prefix}.self_attn.q_proj.weight"),
            vec![query_width, hidden],
        );
        request(
            format!("{prefix}.self_attn.k_proj.weight"),
            vec![key_value_width, hidden],
        );
        request(
            format!("{prefix}.self_attn.v_proj.weight"),
            vec![key_value_width, hidden],
        );
        request(
            format!("{prefix}.self_attn.o_proj.weight"),
            vec![hidden, query_width],
        );
        if config.attention_bias {
            request(format!("{prefix}.self_attn.q_proj.bias"), vec![query_width]);
            request(
                format!("{prefix}.self_attn.k_proj.bias"),
                vec![key_value_width],
            );
            request(
                format!("{prefix}.self_attn.v_proj.bias"),
                vec![key_value_width],
            );
            request(format!("{prefix}.self_attn.o_proj.bias"), vec![hidden]);
        }
        if config.architecture == Architecture::Qwen3 {
            request(
                format!("{prefix}.self_attn.q_norm.weight"),
                vec![config.head_dim],
            );
            request(
                format!("{prefix}.self_attn.k_norm.weight"),
                vec![config.head_dim],
            );
        }
        request(
            format!("{prefix}.post_attention_layernorm.weight"),
            vec![hidden],
        );
        request(
            format!("{prefix}.mlp.gate_proj.weight"),
            vec![config.intermediate_size, hidden],
        );
        request(
            format!("{prefix}.mlp.up_proj.weight"),
            vec![config.intermediate_size, hidden],
        );
        request(
            format!("{prefix}.mlp.down_proj.weight"),
            vec![hidden, config.intermediate_size],
        );
    }
    request("model.norm.weight".into(), vec![hidden]);
    if !config.tie_word_embeddings {
        request("lm_head.weight".into(), vec![config.vocab_size, hidden]);
    }
    requests
}

/// Removes a tensor that `load_tensors` guaranteed to be present.
fn take(
    tensors: &mut HashMap<String, Tensor>,
    name: &str,
    dir: &Path,
) -> Result<Tensor, ModelError> {
    tensors
        .remove(name)
        .ok_or_else(|| ModelError::MissingTensor {
            path: dir.to_path_buf(),
            tensor: name.to_string(),
        })
}

impl TargetModel {
    /// Loads `config.json` and the safetensors weights (single file or
    /// sharded with an index) from `dir`, converted to `kind` on `device`.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<TargetModel, ModelError> {
        let config = TargetConfig::from_file(&dir.join(CONFIG_FILE_NAME))?;
        let requests = tensor_requests(&config);
        let mut tensors = tch::no_grad(|| load_tensors(dir, &requests, device, kind))?;
        let embed_tokens = take(&mut tensors, "model.embed_tokens.weight", dir)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for layer in 0..config.num_hidden_layers {
            let prefix = format!("model.layers.{layer}");
            let mut named = |suffix: &str| take(&mut tensors, &format!("{prefix}.{suffix}"), dir);
            let (q_bias, k_bias, v_bias, o_bias) = if config.attention_bias {
                (
                    Some(named("self_attn.q_proj.bias")?),
                    Some(named("self_attn.k_proj.bias")?),
                    Some(named("self_attn.v_proj.bias")?),
                    Some(named("self_attn.o_proj.bias")?),
                )
            } else {
                (None, None, None, None)
            };
            let (q_norm, k_norm) = if config.architecture == Architecture::Qwen3 {
                (
                    Some(named("self_attn.q_norm.weight")?),
                    Some(named("self_attn.k_norm.weight")?),
                )
            } else {
                (None, None)
            };
            layers.push(DecoderLayer {
                input_layernorm: named("input_layernorm.weight")?,
                q_proj: named("self_attn.q_proj.weight")?,
                k_proj: named("self_attn.k_proj.weight")?,
                v_proj: named("self_attn.v_proj.weight")?,
                o_proj: named("self_attn.o_proj.weight")?,
                q_bias,
                k_bias,
                v_bias,
                o_bias,
                q_norm,
                k_norm,
                post_attention_layernorm: named("post_attention_layernorm.weight")?,
                gate_proj: named("mlp.gate_proj.weight")?,
                up_proj: named("mlp.up_proj.weight")?,
                down_proj: named("mlp.down_proj.weight")?,
            });
        }
        let final_norm = take(&mut tensors, "model.norm.weight", dir)?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            take(&mut tensors, "lm_head.weight", dir)?
        };
        Ok(TargetModel {
            config,
            device,
            kind,
            embed_tokens,
            layers,
            final_norm,
            lm_head,
        })
    }
}
