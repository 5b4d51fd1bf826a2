//! Evaluation of a drafter by real speculative decoding against its
//! target, as the reference `dflash_generate` does: the drafter proposes a
//! block from the target's hidden states (a DFlash2 drafter through its
//! candidate selector, as the reference's `propose`), the target verifies
//! the whole block in one forward, the accepted prefix plus the target's
//! own next token (the bonus) is kept, and the accepted length (bonus
//! included) per verification is recorded; τ is its mean. Decoding is
//! greedy (the longest prefix equal to the target's argmax) or sampled
//! (temperature and top-p, speculative rejection sampling), see
//! `decoding`.
//!
//! The target runs with its KV cache: the prompt is prefilled once, each
//! verification runs only the block's positions, and the rejected part of
//! the block is cut from the cache. The same forward captures the hidden
//! states the drafter reads. The drafter keeps its own cache of the context
//! (`DraftContextCache`: each draft layer's keys and values of every
//! committed token), extended by the committed positions after each
//! verification, so each block's draft runs only the block's queries. Both
//! the target's and the drafter's cost are proportional to the tokens
//! generated. The uncached original ([`speculative_generate_uncached`],
//! recomputing the whole sequence for every verification and the drafter's
//! whole context for every block) is kept as the reference the cached path
//! must reproduce token for token, and as the benchmark's baseline.
//!
//! # Layout
//! - `error`: [`EvalError`].
//! - `report`: [`EvalOptions`], [`EvalReport`], [`GenerationTrace`].
//! - `decoding`: how one verification step chooses tokens (greedy or
//!   sampled; the selector's path for DFlash2; for DSpark the Markov-biased
//!   semi-autoregressive walk and the confidence-scheduled verify length).
//! - `generation`: the generation loops, cached and uncached.
//! - `evaluate`: the entry points over prompts, and the untrained baseline.

mod decoding;
mod error;
mod evaluate;
mod generation;
mod report;

pub use error::EvalError;
pub use evaluate::{
    evaluate, evaluate_loaded, evaluate_tensors, evaluate_with_options, load_target,
    write_untrained_baseline,
};
pub use generation::{
    greedy_generate, speculative_generate, speculative_generate_sampled,
    speculative_generate_scheduled, speculative_generate_uncached,
};
pub use report::{EvalOptions, EvalReport, GenerationTrace};
