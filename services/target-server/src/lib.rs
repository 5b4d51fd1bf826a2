//! # dflash-target-server
//!
//! A frozen target LLM on one device: reads its shard of a JSONL data set,
//! runs the target forward, captures the hidden states a DFlash drafter
//! trains on and streams them into the broker, then reports done.
//!
//! # Layout
//! - `config`: flags with environment fallbacks ([`TargetServerConfig`]).
//! - `data`: JSONL line formats, chat-template rendering (minijinja) and
//!   tokenization (`tokenizers`) with the assistant-only loss mask.
//! - `shard`: which records belong to this target, and the defaults from the
//!   target id and the broker.
//! - `batching`: length-sorted windows, `seq` numbering, token-budget batches.
//! - `reader`: the data thread's work (records → batches), resume skipping,
//!   bad-line accounting.
//! - `compute`: the compute thread (model or synthetic) and the host-copy
//!   thread that turns device tensors into wire samples.
//! - `sender`: the Produce stream with reconnect-and-resume.
//! - `metrics`: [`TargetMetrics`], the counters and gauges served at
//!   `/metrics` (`--metrics-listen`) through `dflash-telemetry`.
//! - `service`: [`run`]: connect, start the compute thread (a
//!   `dflash_device::DeviceWorker`, model loaded behind its start
//!   handshake) and the reader and host-copy threads, pump samples to the
//!   broker, join every thread within `--finish-timeout`, ReportDone.
//! - `main.rs`: the `target-server` binary (flags, logging, signals).
//!
//! Async code never touches tch: tensors live on the compute and host-copy
//! threads, which talk to the async side over bounded channels. Depends on
//! the model crate and the broker client, never on the broker itself.

pub mod batching;
pub mod compute;
pub mod config;
pub mod data;
pub mod metrics;
pub mod reader;
pub mod sender;
pub mod service;
pub mod shard;

pub use config::{
    DeviceChoice, DtypeChoice, ModelSource, NonFiniteAction, SyntheticSpec, TargetServerConfig,
};
pub use metrics::TargetMetrics;
pub use service::{
    run, run_with_metrics_listener, run_with_registry, TargetReport, TargetServerError,
};
