//! # dflash-model
//!
//! libtorch (tch) model code shared by `target-server`, `drafter-server` and
//! the `dflash` CLI.
//!
//! # Layout
//! - `device`: the services' `--device`/`--dtype` flags resolved against the
//!   devices libtorch sees (a missing GPU is an error at once), the device
//!   label every role reports.
//! - `layers`: free-function layer primitives over plain tensors (RMSNorm,
//!   RoPE incl. llama3 scaling, SwiGLU) shared by the frozen target and the
//!   trainable drafter, numerically matching Hugging Face.
//! - `target_model`: the frozen target LLM: Hugging Face config and safetensors loading (single or
//!   sharded), the Qwen3 / Llama-3 forward with hidden-state capture at the
//!   DFlash layer ids (`build_target_layer_ids`), full logits for evaluation,
//!   and the key/value cache of incremental decoding.
//! - `generate`: batched, KV-cached generation with the target (greedy or
//!   sampled), batches planned by a token budget; the uncached greedy
//!   reference it must reproduce. Used by demo data, `dflash regenerate`
//!   and τ evaluation.
//! - `sampling`: temperature / top-p sampling with a seeded generator per
//!   sequence.
//! - `tiny`: writes a small seeded Qwen3/Llama model directory (config,
//!   weights, byte-level BPE tokenizer, ChatML template) for tests and
//!   `dflash init-tiny`, so nothing is ever downloaded.
//! - `draft`: the DFlash draft model and its DFlash2 and DSpark variants,
//!   their training losses, their checkpoint formats (the reference
//!   `dflash` one, speculators' for DSpark) and the step directories of a
//!   drafter's output folder (`draft::step_dirs`).
//! - `chat`: one JSONL line → token ids and the assistant-only loss mask
//!   (pre-tokenized, OpenAI messages, ShareGPT), rendered with the model's
//!   own chat template (minijinja) and tokenizer (`tokenizers`).
//! - `eval`: speculative decoding with a drafter and the target (lossless
//!   against greedy; DSpark's Markov-biased walk and confidence-scheduled
//!   verify length), τ, the untrained baseline.
//! - `tokens`: the drafter's mask token id (the tokenizer's `mask_token`,
//!   else the DFlash reserved id past the vocabulary) and the target's EOS
//!   ids, read from a model directory.
//!
//! Must not depend on tonic, tokio or the broker: model code is pure compute
//! and runs on dedicated threads of the servers.

pub mod chat;
pub mod device;
pub mod draft;
pub mod eval;
pub mod generate;
pub mod layers;
pub mod sampling;
pub mod target_model;
pub mod tiny;
pub mod tokens;

pub use target_model::ModelError;
