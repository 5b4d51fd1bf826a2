//! # dflash-model
//!
//! libtorch (tch) model code shared by `target-server`, `drafter-server` and
//! the `dflash` CLI.
//!
//! # Layout
//! - `target` (owned by the target work): Hugging Face config and safetensors
//!   loading, the Qwen3 / Llama-3 forward with hidden-state capture at the
//!   DFlash layer ids, shared layer primitives (RMSNorm, RoPE, SwiGLU), the
//!   tiny model writer used by tests and `dflash init-tiny`.
//! - `draft` (owned by the drafter work): the DFlash draft model, its
//!   training loss and its checkpoint format.
//!
//! Must not depend on tonic, tokio or the broker: model code is pure compute
//! and runs on dedicated threads of the servers.
