//! [`DraftModel`]: the draft network's parameters and settings, its
//! construction from a seeded initialisation or a loaded `VarStore`, and its
//! accessors. The computations live in the sibling modules.

use rand::SeedableRng;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::attention_implementation::AttentionImplementation;
use super::parameters::{
    add_named_variable, check_frozen_shapes, initialisation_of, parameter_shapes, seeded_normal,
    DraftLayerParameters, DsparkHeads, DynamicConvolution, FrozenTargetHeads, Initialisation,
    LayerConvolutions, SelectorParameters, HIDDEN_PROJECTION_NAME, PREDECESSOR_CODEBOOK_NAME,
    SUCCESSOR_CODEBOOK_NAME,
};
use crate::draft::config::DraftConfig;
use crate::draft::error::DraftError;

/// One forward's inputs, already batched and padded.
pub struct BlockInputs<'a> {
    /// `[batch, context_len, n·hidden]` tapped target states (any float kind).
    pub target_hidden: &'a Tensor,
    /// `[batch, blocks, block_size]` token ids of every block: the anchor
    /// token followed by mask tokens.
    pub block_token_ids: &'a Tensor,
    /// `[batch, blocks]` absolute position of each block's first token; a
    /// block sees the context positions strictly before it.
    pub anchor_positions: &'a Tensor,
}

/// The trainable draft model plus the frozen target embedding and head.
pub struct DraftModel {
    pub(super) config: DraftConfig,
    pub(super) var_store: VarStore,
    pub(super) fc: Tensor,
    pub(super) hidden_norm: Tensor,
    pub(super) layers: Vec<DraftLayerParameters>,
    pub(super) norm: Tensor,
    /// DFlash2's candidate selector; `None` for DFlash.
    pub(super) selector: Option<SelectorParameters>,
    /// DSpark's Markov and confidence heads; `None` for DFlash and DFlash2.
    pub(super) dspark_heads: Option<DsparkHeads>,
    pub(super) frozen: FrozenTargetHeads,
    /// Kind the forward computes in: f32 on the CPU, bf16 on a GPU. The
    /// master weights in the `VarStore` stay f32 either way.
    pub(super) compute_kind: Kind,
    /// How the block-over-context attention is computed.
    pub(super) attention: AttentionImplementation,
}

impl DraftModel {
    /// A freshly initialised model (linear weights ~ N(0, initializer_range),
    /// norms at one, like HF `_init_weights`) drawn from a seeded generator
    /// so that two runs with the same seed are identical.
    pub fn new(
        config: DraftConfig,
        frozen: FrozenTargetHeads,
        device: Device,
        compute_kind: Kind,
        seed: u64,
    ) -> Result<Self, DraftError> {
        config.validate()?;
        check_frozen_shapes(&config, &frozen)?;
        let var_store = VarStore::new(device);
        let mut generator = rand::rngs::StdRng::seed_from_u64(seed);
        let standard_deviation = config.initializer_range;
        for (name, shape) in parameter_shapes(&config) {
            let options = (Kind::Float, Device::Cpu);
            let initial = match initialisation_of(&name) {
                Initialisation::Ones => Tensor::ones(shape.as_slice(), options),
                Initialisation::Normal => seeded_normal(&shape, standard_deviation, &mut generator),
                Initialisation::NormalWithStandardDeviation(deviation) => {
                    seeded_normal(&shape, deviation, &mut generator)
                }
                Initialisation::Zeros => Tensor::zeros(shape.as_slice(), options),
                Initialisation::IdentityConvolution => {
                    let kernel = Tensor::zeros(shape.as_slice(), options);
                    let _ = kernel.narrow(1, 0, 1).fill_(1.0);
                    kernel
                }
            };
            add_named_variable(&var_store, &name, &initial)?;
        }
        Self::from_var_store(config, var_store, frozen, compute_kind)
    }

    /// Wraps a `VarStore` that already holds every parameter (for example
    /// loaded from a checkpoint).
    pub fn from_var_store(
        config: DraftConfig,
        var_store: VarStore,
        frozen: FrozenTargetHeads,
        compute_kind: Kind,
    ) -> Result<Self, DraftError> {
        config.validate()?;
        check_frozen_shapes(&config, &frozen)?;
        let variables = var_store.variables();
        let fetch = |name: String| -> Result<Tensor, DraftError> {
            variables
                .get(&name)
                .map(Tensor::shallow_clone)
                .ok_or(DraftError::MissingParameter(name))
        };
        let layers = (0..config.num_draft_layers)
            .map(|index| {
                let prefix = format!("layers.{index}");
                Ok(DraftLayerParameters {
                    input_layernorm: fetch(format!("{prefix}.input_layernorm.weight"))?,
                    q_proj: fetch(format!("{prefix}.self_attn.q_proj.weight"))?,
                    k_proj: fetch(format!("{prefix}.self_attn.k_proj.weight"))?,
                    v_proj: fetch(format!("{prefix}.self_attn.v_proj.weight"))?,
                    o_proj: fetch(format!("{prefix}.self_attn.o_proj.weight"))?,
                    q_norm: fetch(format!("{prefix}.self_attn.q_norm.weight"))?,
                    k_norm: fetch(format!("{prefix}.self_attn.k_norm.weight"))?,
                    post_attention_layernorm: fetch(format!(
                        "{prefix}.post_attention_layernorm.weight"
                    ))?,
                    gate_proj: fetch(format!("{prefix}.mlp.gate_proj.weight"))?,
                    up_proj: fetch(format!("{prefix}.mlp.up_proj.weight"))?,
                    down_proj: fetch(format!("{prefix}.mlp.down_proj.weight"))?,
                    convolutions: match config.dflash2 {
                        None => None,
                        Some(_) => {
                            let convolution = |name: &str| -> Result<_, DraftError> {
                                Ok(DynamicConvolution {
                                    base_kernel: fetch(format!("{prefix}.{name}.base_kernel"))?,
                                    kernel_projection: fetch(format!(
                                        "{prefix}.{name}.kernel_projection.weight"
                                    ))?,
                                })
                            };
                            Some(LayerConvolutions {
                                attention: convolution("attention_conv")?,
                                mlp: convolution("mlp_conv")?,
                            })
                        }
                    },
                })
            })
            .collect::<Result<Vec<_>, DraftError>>()?;
        let selector = match config.dflash2 {
            None => None,
            Some(_) => Some(SelectorParameters {
                predecessor_codebook: fetch(PREDECESSOR_CODEBOOK_NAME.to_string())?,
                successor_codebook: fetch(SUCCESSOR_CODEBOOK_NAME.to_string())?,
                hidden_projection: fetch(HIDDEN_PROJECTION_NAME.to_string())?,
            }),
        };
        let dspark_heads = match &config.dspark {
            None => None,
            Some(dspark) => Some(DsparkHeads::fetch(dspark, &fetch)?),
        };
        let frozen = FrozenTargetHeads {
            embed_tokens: frozen
                .embed_tokens
                .to_device(var_store.device())
                .to_kind(compute_kind)
                .detach(),
            lm_head: frozen
                .lm_head
                .to_device(var_store.device())
                .to_kind(compute_kind)
                .detach(),
        };
        Ok(DraftModel {
            fc: fetch("fc.weight".to_string())?,
            hidden_norm: fetch("hidden_norm.weight".to_string())?,
            norm: fetch("norm.weight".to_string())?,
            layers,
            selector,
            dspark_heads,
            config,
            var_store,
            frozen,
            compute_kind,
            attention: AttentionImplementation::default(),
        })
    }

    pub fn config(&self) -> &DraftConfig {
        &self.config
    }

    /// The trainable parameters, under their checkpoint names.
    pub fn var_store(&self) -> &VarStore {
        &self.var_store
    }

    pub fn device(&self) -> Device {
        self.var_store.device()
    }

    pub fn compute_kind(&self) -> Kind {
        self.compute_kind
    }

    /// Number of trainable parameters (embedding and LM head excluded).
    pub fn num_parameters(&self) -> i64 {
        self.var_store
            .trainable_variables()
            .iter()
            .map(Tensor::numel)
            .map(|n| n as i64)
            .sum()
    }

    /// A master weight in the compute kind; the cast is differentiable, so
    /// gradients reach the f32 master weight.
    pub(super) fn weight(&self, master: &Tensor) -> Tensor {
        if master.kind() == self.compute_kind {
            master.shallow_clone()
        } else {
            master.to_kind(self.compute_kind)
        }
    }

    /// Embeds block tokens with the target's (frozen) embedding.
    pub fn embed(&self, token_ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.frozen.embed_tokens, token_ids, -1, false, false)
    }

    /// Logits of draft hidden states through the target's (frozen) LM head,
    /// in f32 so the softmax and cross-entropy do not lose precision.
    pub fn logits(&self, draft_hidden: &Tensor) -> Tensor {
        draft_hidden
            .linear::<Tensor>(&self.frozen.lm_head, None)
            .to_kind(Kind::Float)
    }

    /// How the block-over-context attention is computed (split by default).
    pub fn attention(&self) -> AttentionImplementation {
        self.attention
    }

    /// Chooses the attention implementation; both compute the same function.
    pub fn set_attention(&mut self, attention: AttentionImplementation) -> Result<(), DraftError> {
        if let Some(blocks_per_chunk) = attention.blocks_per_chunk() {
            if blocks_per_chunk < 1 {
                return Err(DraftError::InvalidConfig(format!(
                    "fused attention with {blocks_per_chunk} blocks per chunk, expected at least 1"
                )));
            }
        }
        self.attention = attention;
        Ok(())
    }
}
