//! # dflash-drafter-server
//!
//! Trains a DFlash draft model from the broker's shared hidden-state queue on
//! one device and checkpoints it. Evaluation (τ by speculative decoding) and
//! the checkpoint folder's step directories live in `dflash-model`
//! (`eval`, `draft::step_dirs`), so offline tools need no server crate.
//!
//! # Layout
//! The run's steps, in modules named as in `dflash-target-server`:
//! - [`config`]: every flag (clap, with environment fallbacks) and its
//!   checks; `validate` splits them into [`settings`].
//! - [`settings`]: the typed parts each layer takes ([`DrafterSettings`]:
//!   connection, engine, schedule, training loop, pump, model sync, data
//!   parallelism); no layer below [`run()`] sees the flag struct.
//! - [`metrics`]: the Prometheus instruments served at `--metrics-listen`.
//! - [`error`], [`report`]: [`DrafterError`], [`DrafterReport`] and
//!   [`RunEnd`], at the bottom: every module may use them, they use none of
//!   the run's steps.
//! - [`mod@run`]: [`run()`]: register the metrics, prepare `--output`, start
//!   the trainer, consume until the end, join the trainer, report; and the
//!   metrics endpoint.
//! - [`threads`]: the training thread started as a
//!   `dflash_device::DeviceWorker` (engine built behind its handshake), its
//!   channel sizes, commands that are never dropped.
//! - [`pump`]: the async loop: deliveries to the trainer (credit window,
//!   finite check), acks and nacks from the trainer's events, lease extension, stats, the schedule estimate, the
//!   linger flush, reconnects, the graceful stop.
//! - [`stream`]: the Consume stream opened with backoff (reconnects), its
//!   lease clock, the wait for our leases at the end.
//! - [`books`]: what each step does to this drafter's own accounts: the
//!   totals, metrics, stats to the broker, the report.
//! - [`trainer_thread`]: the dedicated training thread (owns all libtorch
//!   state), batching by token budget, steps and checkpoints; it talks to
//!   the async side over its bounded channels only.
//! - [`engine`]: the DFlash trainer and the synthetic stand-in behind one trait.
//! - [`samples`]: wire sample → training sequence, with the checks that
//!   decide dead-lettering.
//! - [`schedule`]: the schedule's length estimate from the broker's run
//!   summary, and a data-parallel member's share of the run's step.
//! - [`data_parallel`]: the default way N drafters train one model: this
//!   drafter's membership in the run's data-parallel trainer (the broker's
//!   quorum and commit vote, gradients all-reduced over c10d).
//! - [`model_sync`]: the link to the broker's copy of the run's model (the
//!   read a starting drafter continues from, rank 0's snapshots, every
//!   member's final one), run from the training thread; its wire streams
//!   and tensor conversion are submodules.
//! - [`broker_link`]: a data-parallel member's one connection to the broker,
//!   shared by [`data_parallel`]'s lighthouse calls and [`model_sync`].
//! - [`test_hooks`]: test-only behaviour, compiled in only with the cargo
//!   feature `test-hooks` (below).
//!
//! Model code lives in `dflash-model` (`draft`, `target_model`, `eval`); this crate adds
//! the queue discipline and must not depend on the broker crate (tests do).
//!
//! # Cargo feature `test-hooks`
//! Off by default. It makes the training thread read
//! `DFLASH_TEST_HANG_TRAINER_AFTER_STEPS=N` (it hangs after N steps, for the
//! liveness tests) and marks `--version` with `+test-hooks`. A release
//! binary has neither; `make test` builds the binaries with the feature, and
//! the tests that need a hook fail with "built without feature test-hooks"
//! otherwise.

pub mod books;
pub mod broker_link;
pub mod config;
pub mod data_parallel;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod model_sync;
pub mod pump;
pub mod report;
pub mod run;
pub mod samples;
pub mod schedule;
pub mod settings;
pub mod stream;
pub mod test_hooks;
pub mod threads;
pub mod trainer_thread;

pub use config::DrafterServerConfig;
pub use error::DrafterError;
pub use report::{DrafterReport, RunEnd};
pub use run::{run, run_with_metrics_listener};
pub use settings::{AttentionChoice, ConfigError, DraftArchitecture, DrafterSettings, ModelMode};
