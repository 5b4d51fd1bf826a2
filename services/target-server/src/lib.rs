//! # dflash-target-server
//!
//! A frozen target LLM on one device: reads its shard of a JSONL data set,
//! runs the target forward, captures the hidden states a DFlash drafter
//! trains on and streams them into the broker, then reports done.
//!
//! # Layout
//! The run's steps, in modules named as in `dflash-drafter-server`:
//! - `config`: flags with environment fallbacks ([`TargetServerConfig`])
//!   and their checks; `validate` splits them into `settings`.
//! - `settings`: the typed parts each layer takes ([`TargetSettings`]:
//!   connection, shard, input, compute, pump); no layer below [`run()`]
//!   sees the flag struct.
//! - `metrics`: [`TargetMetrics`], the counters and gauges served at
//!   `/metrics` (`--metrics-listen`) through `dflash-telemetry`.
//! - `error`, `report`: [`TargetServerError`] and [`TargetReport`], at the
//!   bottom: every module below `run` may use them, they use none of those.
//! - `run`: [`run()`]: check, register the metrics, start the threads,
//!   connect and stream the shard, join every thread within
//!   `--finish-timeout`, ReportDone.
//! - `threads`: the pipeline's threads started and joined as one: the
//!   compute thread (a `dflash_device::DeviceWorker`, model loaded behind
//!   its start handshake), the reader and the host-copy thread.
//! - `pump`: the async loop: ready samples to the broker, progress stats,
//!   the watchdog, the stream's close with the report.
//! - `stream`: the Produce stream with reconnect-and-resume.
//! - `capture`: what the run asks each sample to carry beyond DFlash's
//!   tensors (the broker's welcome, `ProducerWelcome.capture`), known
//!   before the compute thread takes its first batch.
//! - `shard`: which records belong to this target, and the defaults from the
//!   target id and the broker.
//! - `batching`: length-sorted windows, `seq` numbering, token-budget batches.
//! - `reader`: the data thread's work (records → batches), resume skipping,
//!   bad-line accounting, the synthetic mode's generated records.
//! - `compute`: the compute thread's work (model or synthetic) and the
//!   host-copy thread that turns device tensors into wire samples.
//! - `test_hooks`: test-only flags, compiled in only with the cargo feature
//!   `test-hooks` (below).
//! - `main.rs`: the `target-server` binary (flags, logging, signals).
//!
//! Chat data (JSONL line formats, the chat template, tokenization with the
//! assistant-only loss mask) lives in `dflash_model::chat`, shared with
//! `dflash regenerate`.
//!
//! Async code never touches tch: tensors live on the compute and host-copy
//! threads, which talk to the async side over bounded channels. Depends on
//! the model crate and the broker client, never on the broker itself.
//!
//! # Cargo feature `test-hooks`
//! Off by default. It adds the hidden flag `--test-hang-compute-after-batches
//! N` (the compute thread hangs after N batches, for the watchdog tests) and
//! marks `--version` with `+test-hooks`. A release binary has neither;
//! `make test` builds the binaries with the feature, and the tests that need
//! a hook fail with "built without feature test-hooks" otherwise.

pub mod batching;
pub mod capture;
pub mod compute;
pub mod config;
pub mod error;
pub mod metrics;
pub mod pump;
pub mod reader;
pub mod report;
pub mod run;
pub mod settings;
pub mod shard;
pub mod stream;
pub mod test_hooks;
pub mod threads;

pub use capture::{Capture, CaptureError};
pub use config::{DeviceChoice, DtypeChoice, TargetServerConfig};
pub use error::TargetServerError;
pub use metrics::TargetMetrics;
pub use report::TargetReport;
pub use run::{run, run_with_metrics_listener, run_with_registry};
pub use settings::{ModelSource, NonFiniteAction, SyntheticSpec, TargetSettings};
