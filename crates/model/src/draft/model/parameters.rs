//! The draft model's parameters as the checkpoint names them: every
//! `VarStore` name of the reference `DFlashDraftModel.state_dict()` with its
//! shape, the seeded initialisation, the per-layer handles the forward reads
//! through, and the target's frozen embedding and LM head (loaded from the
//! target directory, never saved). Apart from the forward because the
//! checkpoint code (`draft::checkpoint`) depends on these names and shapes,
//! not on how the network computes.

use std::path::Path;

use rand::Rng;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::draft::config::DraftConfig;
use crate::draft::dspark_config::{DsparkConfig, MarkovHeadType};
use crate::draft::error::DraftError;
use crate::target_model::weights::{load_tensors, TensorRequest};
use crate::target_model::TargetConfig;

/// Handles on one decoder layer's parameters (shallow clones of the
/// `VarStore` variables, so optimizer updates are seen here).
pub(super) struct DraftLayerParameters {
    pub(super) input_layernorm: Tensor,
    pub(super) q_proj: Tensor,
    pub(super) k_proj: Tensor,
    pub(super) v_proj: Tensor,
    pub(super) o_proj: Tensor,
    pub(super) q_norm: Tensor,
    pub(super) k_norm: Tensor,
    pub(super) post_attention_layernorm: Tensor,
    pub(super) gate_proj: Tensor,
    pub(super) up_proj: Tensor,
    pub(super) down_proj: Tensor,
    /// DFlash2's convolutions around the attention and the MLP sublayers.
    pub(super) convolutions: Option<LayerConvolutions>,
}

/// One `GroupedDynamicCausalConv` of the reference: `base_kernel`
/// `[2, taps, hidden]` (index 0 for the sublayer's input, 1 for its output)
/// and `kernel_projection` `[2·taps·groups, hidden]`, which turns the
/// sublayer's normed input into both dynamic kernels.
pub(super) struct DynamicConvolution {
    pub(super) base_kernel: Tensor,
    pub(super) kernel_projection: Tensor,
}

/// A DFlash2 layer's two convolutions (`attention_conv`, `mlp_conv`).
pub(super) struct LayerConvolutions {
    pub(super) attention: DynamicConvolution,
    pub(super) mlp: DynamicConvolution,
}

/// The reference `CandidateSelector`'s parameters.
pub(super) struct SelectorParameters {
    /// `[vocab, rank]`: the previous token's factor.
    pub(super) predecessor_codebook: Tensor,
    /// `[vocab, rank]`: the candidate's factor.
    pub(super) successor_codebook: Tensor,
    /// `[rank, hidden]`: the draft hidden state's factor.
    pub(super) hidden_projection: Tensor,
}

/// Handles on DSpark's head parameters (shallow clones of the `VarStore`'s).
pub(super) struct DsparkHeads {
    pub(super) markov: Option<MarkovParameters>,
    pub(super) confidence: Option<ConfidenceParameters>,
    /// The confidence head reads the previous token's `W1` row too.
    pub(super) confidence_with_markov: bool,
}

pub(super) struct MarkovParameters {
    pub(super) head_type: MarkovHeadType,
    pub(super) rank: i64,
    /// `[vocab, rank]`.
    pub(super) w1: Tensor,
    /// `[vocab, rank]` (a `Linear(rank → vocab)`).
    pub(super) w2: Tensor,
    /// Gated: `[rank, hidden + rank]` and `[rank]`.
    pub(super) gate: Option<(Tensor, Tensor)>,
    /// Rnn: `[3·rank, 2·rank + hidden]` and `[3·rank]`.
    pub(super) joint: Option<(Tensor, Tensor)>,
}

pub(super) struct ConfidenceParameters {
    /// `[1, hidden (+ rank)]`.
    pub(super) weight: Tensor,
    /// `[1]`.
    pub(super) bias: Tensor,
}

impl DsparkHeads {
    /// The handles of a model whose store holds every DSpark parameter.
    pub(super) fn fetch(
        config: &DsparkConfig,
        fetch: &dyn Fn(String) -> Result<Tensor, DraftError>,
    ) -> Result<Self, DraftError> {
        let pair = |weight: &str, bias: &str| -> Result<(Tensor, Tensor), DraftError> {
            Ok((fetch(weight.to_string())?, fetch(bias.to_string())?))
        };
        let markov = if config.has_markov_head() {
            Some(MarkovParameters {
                head_type: config.markov_head_type,
                rank: config.markov_rank,
                w1: fetch(MARKOV_W1_NAME.to_string())?,
                w2: fetch(MARKOV_W2_NAME.to_string())?,
                gate: match config.markov_head_type {
                    MarkovHeadType::Gated => {
                        Some(pair(MARKOV_GATE_WEIGHT_NAME, MARKOV_GATE_BIAS_NAME)?)
                    }
                    _ => None,
                },
                joint: match config.markov_head_type {
                    MarkovHeadType::Rnn => {
                        Some(pair(MARKOV_JOINT_WEIGHT_NAME, MARKOV_JOINT_BIAS_NAME)?)
                    }
                    _ => None,
                },
            })
        } else {
            None
        };
        let confidence = if config.enable_confidence_head {
            let (weight, bias) = pair(CONFIDENCE_WEIGHT_NAME, CONFIDENCE_BIAS_NAME)?;
            Some(ConfidenceParameters { weight, bias })
        } else {
            None
        };
        Ok(DsparkHeads {
            markov,
            confidence,
            confidence_with_markov: config.confidence_head_with_markov,
        })
    }
}

/// How [`crate::draft::DraftModel::new`] initialises a parameter: like the
/// reference's `_init_weights` (norms at one, linear weights normal) and,
/// for DFlash2, speculators' `reset_parameters` (each convolution the
/// identity: base kernel tap 0 at one, the rest and the projection zero).
pub(super) enum Initialisation {
    Ones,
    Normal,
    /// Normal with this standard deviation instead of `initializer_range`
    /// (speculators draws DSpark's `markov_w1` with 0.01).
    NormalWithStandardDeviation(f64),
    Zeros,
    IdentityConvolution,
}

/// The initialisation of a parameter by its checkpoint name.
pub(super) fn initialisation_of(name: &str) -> Initialisation {
    if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
        Initialisation::Ones
    } else if name.ends_with("_conv.base_kernel") {
        Initialisation::IdentityConvolution
    } else if name.ends_with("_conv.kernel_projection.weight") || name.ends_with(".bias") {
        Initialisation::Zeros
    } else if name == MARKOV_W1_NAME {
        Initialisation::NormalWithStandardDeviation(0.01)
    } else {
        Initialisation::Normal
    }
}

/// The frozen pieces of the target the drafter reads tokens through.
pub struct FrozenTargetHeads {
    /// `[vocab, hidden]`: embeds the block's tokens (anchor and masks).
    pub embed_tokens: Tensor,
    /// `[vocab, hidden]`: turns draft hidden states into logits.
    pub lm_head: Tensor,
}

impl FrozenTargetHeads {
    /// Reads only the embedding and LM head of a Hugging Face target
    /// directory (the LM head is the embedding when they are tied), so a
    /// drafter does not hold the whole target in memory.
    pub fn load(
        target_dir: &Path,
        device: Device,
        kind: Kind,
    ) -> Result<(TargetConfig, Self), DraftError> {
        let config =
            TargetConfig::from_file(&target_dir.join(crate::target_model::CONFIG_FILE_NAME))?;
        let shape = vec![config.vocab_size, config.hidden_size];
        let mut requests = vec![TensorRequest {
            name: EMBED_TOKENS_NAME.to_string(),
            shape: shape.clone(),
        }];
        if !config.tie_word_embeddings {
            requests.push(TensorRequest {
                name: LM_HEAD_NAME.to_string(),
                shape,
            });
        }
        let mut tensors = tch::no_grad(|| load_tensors(target_dir, &requests, device, kind))?;
        let missing =
            |name: &str| DraftError::MissingParameter(format!("{}: {name}", target_dir.display()));
        let embed_tokens = tensors
            .remove(EMBED_TOKENS_NAME)
            .ok_or_else(|| missing(EMBED_TOKENS_NAME))?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            tensors
                .remove(LM_HEAD_NAME)
                .ok_or_else(|| missing(LM_HEAD_NAME))?
        };
        Ok((
            config,
            FrozenTargetHeads {
                embed_tokens,
                lm_head,
            },
        ))
    }
}

/// Tensor names of the target's embedding and LM head in HF checkpoints.
const EMBED_TOKENS_NAME: &str = "model.embed_tokens.weight";
const LM_HEAD_NAME: &str = "lm_head.weight";

/// Checkpoint names of the selector's codebooks. The reference module holds
/// them as `nn.Embedding` (`….weight`) but loads them from the speculators
/// layout without the suffix (`DFlash2DraftModel.from_pretrained`'s
/// `key_mapping`), so that is how they are stored.
pub const PREDECESSOR_CODEBOOK_NAME: &str = "candidate_selector.predecessor_codebook";
pub const SUCCESSOR_CODEBOOK_NAME: &str = "candidate_selector.successor_codebook";
pub const HIDDEN_PROJECTION_NAME: &str = "candidate_selector.hidden_projection.weight";

/// Checkpoint names of DSpark's heads, as speculators' `DSparkDraftModel`
/// names its modules: the Markov head's `W1` (an embedding of the previous
/// token, `[vocab, rank]`) and `W2` (rank → vocabulary, `[vocab, rank]`),
/// the gated variant's `gate_proj`, the recurrent variant's `joint_proj`,
/// and the confidence head's `proj` (`[1, width]` and its bias).
pub const MARKOV_W1_NAME: &str = "markov_head.markov_w1.weight";
pub const MARKOV_W2_NAME: &str = "markov_head.markov_w2.weight";
pub const MARKOV_GATE_WEIGHT_NAME: &str = "markov_head.gate_proj.weight";
pub const MARKOV_GATE_BIAS_NAME: &str = "markov_head.gate_proj.bias";
pub const MARKOV_JOINT_WEIGHT_NAME: &str = "markov_head.joint_proj.weight";
pub const MARKOV_JOINT_BIAS_NAME: &str = "markov_head.joint_proj.bias";
pub const CONFIDENCE_WEIGHT_NAME: &str = "confidence_head.proj.weight";
pub const CONFIDENCE_BIAS_NAME: &str = "confidence_head.proj.bias";

/// Every parameter name of the reference `DFlashDraftModel.state_dict()`
/// (for DFlash2 `DFlash2DraftModel`'s, codebooks as the checkpoint names
/// them) with its shape, in a stable order: DFlash's first, so a DFlash2
/// model drawn from a seed starts with the DFlash model of that seed.
pub fn parameter_shapes(config: &DraftConfig) -> Vec<(String, Vec<i64>)> {
    let hidden = config.hidden_size;
    let query_width = config.num_attention_heads * config.head_dim;
    let key_value_width = config.num_key_value_heads * config.head_dim;
    let mut shapes = vec![
        (
            "fc.weight".to_string(),
            vec![hidden, config.target_hidden_width()],
        ),
        ("hidden_norm.weight".to_string(), vec![hidden]),
        ("norm.weight".to_string(), vec![hidden]),
    ];
    for index in 0..config.num_draft_layers {
        let prefix = format!("layers.{index}");
        shapes.extend([
            (format!("{prefix}.input_layernorm.weight"), vec![hidden]),
            (
                format!("{prefix}.self_attn.q_proj.weight"),
                vec![query_width, hidden],
            ),
            (
                format!("{prefix}.self_attn.k_proj.weight"),
                vec![key_value_width, hidden],
            ),
            (
                format!("{prefix}.self_attn.v_proj.weight"),
                vec![key_value_width, hidden],
            ),
            (
                format!("{prefix}.self_attn.o_proj.weight"),
                vec![hidden, query_width],
            ),
            (
                format!("{prefix}.self_attn.q_norm.weight"),
                vec![config.head_dim],
            ),
            (
                format!("{prefix}.self_attn.k_norm.weight"),
                vec![config.head_dim],
            ),
            (
                format!("{prefix}.post_attention_layernorm.weight"),
                vec![hidden],
            ),
            (
                format!("{prefix}.mlp.gate_proj.weight"),
                vec![config.intermediate_size, hidden],
            ),
            (
                format!("{prefix}.mlp.up_proj.weight"),
                vec![config.intermediate_size, hidden],
            ),
            (
                format!("{prefix}.mlp.down_proj.weight"),
                vec![hidden, config.intermediate_size],
            ),
        ]);
    }
    if let Some(dflash2) = &config.dflash2 {
        let taps = dflash2.conv_kernel_size;
        let groups = dflash2.conv_groups(hidden);
        for index in 0..config.num_draft_layers {
            for convolution in ["attention_conv", "mlp_conv"] {
                let prefix = format!("layers.{index}.{convolution}");
                shapes.extend([
                    (format!("{prefix}.base_kernel"), vec![2, taps, hidden]),
                    (
                        format!("{prefix}.kernel_projection.weight"),
                        vec![2 * taps * groups, hidden],
                    ),
                ]);
            }
        }
        let rank = dflash2.selector_rank;
        shapes.extend([
            (
                PREDECESSOR_CODEBOOK_NAME.to_string(),
                vec![config.vocab_size, rank],
            ),
            (
                SUCCESSOR_CODEBOOK_NAME.to_string(),
                vec![config.vocab_size, rank],
            ),
            (HIDDEN_PROJECTION_NAME.to_string(), vec![rank, hidden]),
        ]);
    }
    if let Some(dspark) = &config.dspark {
        let rank = dspark.markov_rank;
        if dspark.has_markov_head() {
            shapes.extend([
                (MARKOV_W1_NAME.to_string(), vec![config.vocab_size, rank]),
                (MARKOV_W2_NAME.to_string(), vec![config.vocab_size, rank]),
            ]);
            match dspark.markov_head_type {
                MarkovHeadType::Vanilla => {}
                MarkovHeadType::Gated => shapes.extend([
                    (
                        MARKOV_GATE_WEIGHT_NAME.to_string(),
                        vec![rank, hidden + rank],
                    ),
                    (MARKOV_GATE_BIAS_NAME.to_string(), vec![rank]),
                ]),
                MarkovHeadType::Rnn => shapes.extend([
                    (
                        MARKOV_JOINT_WEIGHT_NAME.to_string(),
                        vec![3 * rank, 2 * rank + hidden],
                    ),
                    (MARKOV_JOINT_BIAS_NAME.to_string(), vec![3 * rank]),
                ]),
            }
        }
        if dspark.enable_confidence_head {
            shapes.extend([
                (
                    CONFIDENCE_WEIGHT_NAME.to_string(),
                    vec![1, dspark.confidence_input_width(hidden)],
                ),
                (CONFIDENCE_BIAS_NAME.to_string(), vec![1]),
            ]);
        }
    }
    shapes
}

/// Adds a trainable variable under a dotted name (`layers.0.mlp.up_proj.weight`):
/// tch wants the dots as path components, not inside a variable name.
pub(crate) fn add_named_variable(
    var_store: &VarStore,
    dotted_name: &str,
    value: &Tensor,
) -> Result<(), DraftError> {
    let mut components: Vec<&str> = dotted_name.split('.').collect();
    let variable_name = components.pop().unwrap_or_default();
    let path = components
        .iter()
        .fold(var_store.root(), |path, component| path / *component);
    let _ = path.f_var_copy(variable_name, value)?;
    Ok(())
}

/// Normal samples from a seeded generator (Box–Muller), so initialisation
/// does not depend on libtorch's global RNG, which concurrent tests share.
pub(super) fn seeded_normal(
    shape: &[i64],
    standard_deviation: f64,
    generator: &mut rand::rngs::StdRng,
) -> Tensor {
    let count: i64 = shape.iter().product();
    let mut values = Vec::with_capacity(count as usize);
    while values.len() < count as usize {
        let uniform_a: f64 = generator.random::<f64>().max(f64::MIN_POSITIVE);
        let uniform_b: f64 = generator.random::<f64>();
        let radius = (-2.0 * uniform_a.ln()).sqrt() * standard_deviation;
        let angle = std::f64::consts::TAU * uniform_b;
        values.push((radius * angle.cos()) as f32);
        values.push((radius * angle.sin()) as f32);
    }
    values.truncate(count as usize);
    Tensor::from_slice(&values).view(shape)
}

pub(super) fn check_frozen_shapes(
    config: &DraftConfig,
    frozen: &FrozenTargetHeads,
) -> Result<(), DraftError> {
    let expected = vec![config.vocab_size, config.hidden_size];
    for (name, tensor) in [
        ("embed_tokens", &frozen.embed_tokens),
        ("lm_head", &frozen.lm_head),
    ] {
        if tensor.size() != expected {
            return Err(DraftError::ShapeMismatch(format!(
                "target {name} has shape {:?}, the draft config expects {expected:?}",
                tensor.size()
            )));
        }
    }
    Ok(())
}
