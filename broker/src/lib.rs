//! # dflash-broker
//!
//! The central broker: one shared queue of hidden-state samples that every
//! target pushes to and every drafter pulls from, the completion counter of
//! finished targets, and the coordinated end-of-stream.
//!
//! # Layout
//! - `queue`: the rules, as a synchronous state machine with no gRPC, tokio
//!   or clock in it (time comes in as an argument). Unit and property tests
//!   live beside it.
//!
//! Must not depend on libtorch or any model code.

pub mod queue;
