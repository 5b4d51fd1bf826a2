//! The broker's queue as a synchronous state machine.
//!
//! No tonic, no tokio, no clock: every operation takes `now` as an argument
//! and records what the transport must do (deliver an item, end a drafter's
//! stream, close a producer's stream) in an outbox that the caller drains
//! with [`Queue::take_effects`]. That keeps every rule of the shared queue
//! testable exhaustively (see `tests.rs` and the property tests).
//!
//! The rules, in one place:
//! - One FIFO shared by every producer and consumer. A delivery goes to the
//!   next connected consumer (round robin) whose credit window has room.
//! - Memory is bounded: the bytes held (queued + leased) never exceed
//!   `max_held_bytes`; [`Queue::accept_item`] answers `QueueFull` and the
//!   transport stops reading that producer until [`Queue::has_room_for`].
//! - Every delivery is a lease until acked. A consumer that goes away returns
//!   all its leases to the head of the queue; a lease not acked or extended
//!   within `lease_timeout` is taken back. An item returned after
//!   `max_deliveries` deliveries, or nacked as poison, is dead-lettered.
//! - (target_id, seq) is accepted once; a repeat is acknowledged as a
//!   duplicate and not queued. A newer producer stream for a target replaces
//!   the older one.
//! - The completion counter is the set of finished targets. End-of-stream
//!   COMPLETE goes to every consumer only when every expected target is
//!   finished, the queue is empty and nothing is leased.
//! - A target whose stream is gone for longer than `target_grace` without
//!   reporting done fails; the failure policy aborts the run or counts it as
//!   finished-with-loss.

#[cfg(test)]
mod proptests;
mod rate;
mod state;
#[cfg(test)]
mod tests;

pub use rate::RateMeter;
pub use state::*;
