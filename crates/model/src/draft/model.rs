//! The DFlash draft network: `fc` + `hidden_norm` fuse the tapped target
//! hidden states into one context stream, then `layers.{i}` Qwen3 decoder
//! layers with the DFlash attention, then the final `norm`.
//!
//! Parameters live in a `tch::nn::VarStore` under exactly the names of the
//! reference `DFlashDraftModel.state_dict()` (`fc.weight`,
//! `layers.0.self_attn.q_proj.weight`, ...), so the store is the checkpoint.
//! The target's `embed_tokens` and `lm_head` are held outside the store:
//! they are frozen and never saved.
//!
//! Training packs many blocks per sequence. Attention is computed in two
//! parts that share one softmax: each block's queries against the context
//! positions before its anchor, and against the block's own keys. This is
//! the same function as the reference's dense mask over
//! `[context ‖ all blocks]`, at O(blocks·B·(T + B)) instead of
//! O(blocks·B·(T + blocks·B)) memory. With `AttentionImplementation::Fused`
//! the context part goes through libtorch's fused attention kernel, a chunk
//! of blocks per call, so not even the O(blocks·B·T) scores are materialised.
//!
//! Speculative decoding drafts one block at a time after a growing context:
//! [`DraftContextCache`] (in `context_cache`) keeps each layer's projected
//! context keys and values, so each committed position is projected once.
//!
//! # Layout
//! This file only declares the modules and names what they export; each
//! module depends on the ones listed before it, never on a later one:
//! - `attention_implementation`: the [`AttentionImplementation`] setting.
//! - `parameters`: the checkpoint names and shapes of every parameter
//!   ([`parameter_shapes`]), the seeded initialisation, and the frozen
//!   target embedding and LM head ([`FrozenTargetHeads`]).
//! - `network`: [`DraftModel`] itself: its construction from a seeded
//!   initialisation or a loaded `VarStore`, and its accessors; and
//!   [`BlockInputs`]. The modules below add the computations as further
//!   `impl DraftModel` blocks, one concern each.
//! - `forward`: the training forward over packed blocks, with and without
//!   layer checkpointing: shared preparation, one decoder layer, final norm.
//! - `attention`: the block-over-context attention, the projection of a
//!   layer's queries, keys and values and the three interchangeable
//!   kernels ([`AttentionImplementation`]).
//! - `attention_masks`: which context positions each query sees, in the
//!   form each kernel wants (boolean, or additive per chunk of blocks).
//! - `context_cache`: [`DraftContextCache`] and the cached one-block forward
//!   of speculative decoding.
//! - `markov`: DSpark's Markov and confidence heads over the final draft
//!   hidden states, over whole blocks (training) or one position at a time
//!   (decoding, [`MarkovState`]).

mod attention;
mod attention_implementation;
mod attention_masks;
mod context_cache;
mod convolution;
mod forward;
mod markov;
mod network;
mod parameters;
mod selector;

pub use attention_implementation::{AttentionImplementation, DEFAULT_BLOCKS_PER_ATTENTION_CHUNK};
pub use context_cache::DraftContextCache;
pub(crate) use forward::backward_with_gradient;
pub use markov::{DsparkBlockHeads, DsparkPositionHeads, MarkovState};
pub use network::{BlockInputs, DraftModel};
pub(crate) use parameters::add_named_variable;
pub use parameters::{
    parameter_shapes, FrozenTargetHeads, HIDDEN_PROJECTION_NAME, PREDECESSOR_CODEBOOK_NAME,
    SUCCESSOR_CODEBOOK_NAME,
};
pub use selector::SelectorPath;
