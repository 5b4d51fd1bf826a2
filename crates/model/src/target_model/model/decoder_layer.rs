//! One decoder layer of the target: its weights and its pre-norm residual
//! computation (query/key/value projections with optional biases, the
//! Qwen3 per-head norms, RoPE, grouped-query attention, the SwiGLU MLP).
//! Apart from the two forwards of `model` because both run it: the full
//! forward through `DecoderLayer::forward`, the cached one through
//! `query_key_value` and `attend` around its key/value cache.

use tch::Tensor;

use crate::layers::{apply_rotary, repeat_key_value_heads, rms_norm, swiglu_mlp};
use crate::target_model::config::TargetConfig;

/// The weights of one decoder layer.
pub(super) struct DecoderLayer {
    pub(super) input_layernorm: Tensor,
    pub(super) q_proj: Tensor,
    pub(super) k_proj: Tensor,
    pub(super) v_proj: Tensor,
    pub(super) o_proj: Tensor,
    /// Projection biases, present when `attention_bias` is set.
    pub(super) q_bias: Option<Tensor>,
    pub(super) k_bias: Option<Tensor>,
    pub(super) v_bias: Option<Tensor>,
    pub(super) o_bias: Option<Tensor>,
    /// Per-head RMSNorm weights of Qwen3; `None` for Llama.
    pub(super) q_norm: Option<Tensor>,
    pub(super) k_norm: Option<Tensor>,
    pub(super) post_attention_layernorm: Tensor,
    pub(super) gate_proj: Tensor,
    pub(super) up_proj: Tensor,
    pub(super) down_proj: Tensor,
}

impl DecoderLayer {
    pub(super) fn forward(
        &self,
        config: &TargetConfig,
        hidden: &Tensor,
        attention_allowed: Option<&Tensor>,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Tensor {
        let eps = config.rms_norm_eps;
        let normed = rms_norm(hidden, &self.input_layernorm, eps);
        let attention = self.self_attention(config, &normed, attention_allowed, cos, sin);
        let hidden = hidden + attention;
        let normed = rms_norm(&hidden, &self.post_attention_layernorm, eps);
        let mlp = swiglu_mlp(&normed, &self.gate_proj, &self.up_proj, &self.down_proj);
        hidden + mlp
    }

    /// Projects `hidden` to query, key and value heads `[B, heads, T, D]`,
    /// with the Qwen3 per-head norms and RoPE applied to queries and keys.
    pub(super) fn query_key_value(
        &self,
        config: &TargetConfig,
        hidden: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let size = hidden.size();
        let (batch, length) = (size[0], size[1]);
        let head_dim = config.head_dim;
        let project_heads =
            |weight: &Tensor, bias: Option<&Tensor>, heads: i64, norm: Option<&Tensor>| {
                let projected = hidden
                    .linear(weight, bias)
                    .view([batch, length, heads, head_dim]);
                let projected = match norm {
                    Some(norm_weight) => rms_norm(&projected, norm_weight, config.rms_norm_eps),
                    None => projected,
                };
                projected.transpose(1, 2)
            };
        let query = project_heads(
            &self.q_proj,
            self.q_bias.as_ref(),
            config.num_attention_heads,
            self.q_norm.as_ref(),
        );
        let key = project_heads(
            &self.k_proj,
            self.k_bias.as_ref(),
            config.num_key_value_heads,
            self.k_norm.as_ref(),
        );
        let value = project_heads(
            &self.v_proj,
            self.v_bias.as_ref(),
            config.num_key_value_heads,
            None,
        );
        (
            apply_rotary(&query, cos, sin),
            apply_rotary(&key, cos, sin),
            value,
        )
    }

    /// Scaled dot-product attention of `query` over `key`/`value` (grouped
    /// heads repeated), then the output projection: `[B, T, H]`. Without a
    /// mask the fused causal kernel runs.
    pub(super) fn attend(
        &self,
        config: &TargetConfig,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        attention_allowed: Option<&Tensor>,
    ) -> Tensor {
        let size = query.size();
        let (batch, heads, length, head_dim) = (size[0], size[1], size[2], size[3]);
        let repeats = heads / config.num_key_value_heads;
        let key = repeat_key_value_heads(key, repeats);
        let value = repeat_key_value_heads(value, repeats);
        let attended = Tensor::scaled_dot_product_attention(
            query,
            &key,
            &value,
            attention_allowed,
            0.0,
            attention_allowed.is_none(),
            Some(1.0 / (head_dim as f64).sqrt()),
            false,
        );
        attended
            .transpose(1, 2)
            .reshape([batch, length, heads * head_dim])
            .linear(&self.o_proj, self.o_bias.as_ref())
    }

    fn self_attention(
        &self,
        config: &TargetConfig,
        hidden: &Tensor,
        attention_allowed: Option<&Tensor>,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Tensor {
        let (query, key, value) = self.query_key_value(config, hidden, cos, sin);
        self.attend(config, &query, &key, &value, attention_allowed)
    }
}
