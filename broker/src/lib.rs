//! # dflash-broker
//!
//! The central broker: one shared queue of hidden-state samples that every
//! target pushes to and every drafter pulls from, the completion counter of
//! finished targets, and the coordinated end-of-stream.
//!
//! # Layout
//! - `queue`: the rules, as a synchronous state machine with no gRPC, tokio
//!   or clock in it (time comes in as an argument): `types`, `effects`,
//!   `producers`, `consumers`, `ledger`, `status`. Unit and property tests
//!   live beside it.
//! - `config`: flags with environment fallbacks, and their validation.
//! - `auth`: TLS (optionally mutual) and the bearer token checked on every
//!   RPC, from files or the environment; the token is never printed.
//! - `rpc_error`: [`rpc_error::RpcError`], everything an RPC refuses (the
//!   queue's, the run model's and the τ reports' errors folded in; the run
//!   model's are defined beneath it, so that the room can import it), and
//!   the one table of its gRPC codes and messages: no other code of the
//!   crate builds a `tonic::Status`.
//! - `roles`: credentials with a role (target, drafter, operator) and an
//!   optional identity (`--credentials`), and the check each RPC makes.
//! - `convert`: queue types ↔ `dflash.v1` messages.
//! - `service`: the tonic `Broker` implementation, a thin adapter that runs
//!   queue operations under one lock and routes effects to streams.
//! - `server`: [`serve`], which adds health and reflection, the optional
//!   metrics endpoint, and bounds shutdown; the HTTP/2 limits of one
//!   client (streams per connection, reset guards, header size).
//! - `connections`: the accepted connections: `TCP_NODELAY`, and at most
//!   `--max-connections` open (one more is closed on accept).
//! - `payload`: the broker's form of an item, each tensor's data kept as
//!   the slices of the HTTP/2 frames it arrived in, decoded from a Produce
//!   message as prost would (tested against prost) and encoded back.
//! - `zero_copy`: the Produce and Consume routes, which move payloads from
//!   a producer's stream to a drafter's without copying them: Produce
//!   messages are decoded from the received frames, deliveries leave with
//!   each payload as its own chunk (every other method is the generated
//!   server's).
//! - `metrics`: the Prometheus exposition of a queue snapshot, without I/O.
//! - `wal`: the write-ahead log under `--state-dir` (a segment log with a
//!   header per segment and a CRC per record, compacted to the queue's byte
//!   cap on its own thread, one broker per directory by an `flock`; only a
//!   write cut short at its end is cut, other damage refuses to start),
//!   which the writer thread appends the queue's journal entries to before
//!   anyone is answered (retried while the disk is full).
//! - `lighthouse`: data-parallel drafters' quorum and two-phase commit
//!   (the `Lighthouse` service),
//!   with the run's commit record (H) as the one truth; a step's samples
//!   are pinned in the queue at its vote and acked in the journal entry
//!   that records its commit.
//! - `run_model`: the run's one draft model as rank 0 last sent it (the
//!   store, its checkpoints, the online evaluator's τ curve and registry,
//!   synchronous, with its own settings) and `run_model::service`, the
//!   `ModelSync` service beside the queue that serves it (the lighthouse
//!   is its own service, `lighthouse::rpc`).
//! - `fuzzing` (hidden): the fuzz bodies of the broker's decoders of
//!   untrusted bytes (Produce bodies, ModelSync snapshot sessions, the
//!   model checkpoint reader, write-ahead log segments) and
//!   their seeds; run by
//!   `tests/fuzz` and, over the committed corpus, by `tests/fuzz_corpus.rs`.
//! - `main.rs`: the `broker` binary (flags, telemetry, signals, bind).
//!
//! Per-item `enqueue` and `deliver` spans join the trace whose context the
//! target put in the item (`dflash-telemetry`).
//!
//! Must not depend on libtorch or any model code.

pub mod auth;
pub mod config;
pub mod connections;
pub mod convert;
#[doc(hidden)]
pub mod fuzzing;
pub mod lighthouse;
pub mod metrics;
pub mod payload;
pub mod queue;
pub mod roles;
pub mod rpc_error;
pub mod run_model;
pub mod server;
pub mod service;
pub mod wal;
pub mod zero_copy;

pub use config::BrokerConfig;
pub use server::{serve, serve_with_metrics, ServeError};
