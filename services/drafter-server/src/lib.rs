//! # dflash-drafter-server
//!
//! Trains a DFlash draft model from the broker's shared hidden-state queue on
//! one device, checkpoints it, and evaluates drafters by speculative decoding.
//!
//! # Layout
//! - [`config`]: every flag (clap, with environment fallbacks) and its checks.
//! - [`server`]: [`run`], the async side: connect, start the trainer,
//!   pump (Consume stream, credit window, ack-after-step, nacks, lease
//!   extension, stats, schedule estimate, reconnects, graceful stop), join
//!   the trainer; and the metrics endpoint.
//! - [`trainer_thread`]: the dedicated training thread (owns all libtorch
//!   state), batching by token budget, steps and checkpoints; it runs as a
//!   `dflash_device::DeviceWorker` and talks to the async side over its
//!   bounded channels only.
//! - [`engine`]: the DFlash trainer and the synthetic stand-in behind one trait.
//! - [`samples`]: wire sample → training sequence, with the checks that
//!   decide dead-lettering.
//! - [`schedule`]: where a step is in its learning-rate schedule: the
//!   run-wide schedule of model sync ([`schedule::RunClock`]), or an
//!   independent drafter's length estimate from the broker's run summary.
//! - [`model_sync`]: the exchange with the broker's shared draft model
//!   (asynchronous local SGD: join from the center, a delta every
//!   `--sync-every` steps, a final delta), run from the training thread.
//! - [`checkpoints`]: the checkpoint folder (step directories, `latest`, pruning).
//! - [`eval`]: [`eval::evaluate`], speculative decoding to measure τ.
//! - [`metrics`]: the Prometheus instruments served at `--metrics-listen`.
//!
//! Model code lives in `dflash-model` (`draft`, `target`); this crate adds
//! the queue discipline and must not depend on the broker crate (tests do).

pub mod checkpoints;
pub mod config;
pub mod engine;
pub mod eval;
pub mod metrics;
pub mod model_sync;
pub mod samples;
pub mod schedule;
pub mod server;
pub mod trainer_thread;

pub use config::{AttentionChoice, DrafterServerConfig, ModelMode};
pub use eval::{evaluate, EvalOptions, EvalReport};
pub use server::{run, run_with_metrics_listener, DrafterError, DrafterReport, RunEnd};
