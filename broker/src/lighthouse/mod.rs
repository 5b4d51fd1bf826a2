//! The lighthouse of data-parallel drafters: which drafters take each
//! optimizer step (its quorum) and whether the step commits (the vote),
//! with the run's commit record as the one truth.
//!
//! The drafters are one data-parallel trainer: each trains its share of a
//! step, asks for a quorum, all-reduces its gradient with the quorum's other
//! members over c10d, votes, and applies the step only when told COMMIT.
//! The rules, which make every sample part of exactly one committed step:
//!
//! - **One history.** The lighthouse records H, the highest committed step,
//!   and the commit that made it ([`CommitRecord`]: lighthouse instance,
//!   quorum, step), durably with `--state-dir` (in the queue's journal, in
//!   the same entry that acks the step's samples). A quorum forms only at
//!   H and only with a member that holds H (it applied exactly that
//!   commit); rank 0 is such a holder. A member below H heals from it; a
//!   member at or above H on another history is a split: an error,
//!   counted, healed. With no holder asking, the askers wait: the history
//!   goes back only explicitly (`--rollback-after`: logged, counted, the
//!   lost steps named).
//! - **Liveness, not lateness.** A round waits for every live member of the
//!   last quorum (not left, Consume stream not gone) up to a bound never
//!   below the member's own `--collective-timeout` plus twice the longest
//!   recent step, and needs more than half of those live members among its
//!   askers.
//! - **Two-phase commit.** A step commits only if every member voted yes
//!   (each vote names the lighthouse instance, quorum, step and the
//!   round's nonce) and H is still the step it formed at. The commit is
//!   answered only once durable; each member's last decision is kept until
//!   it asks again; a round not known is UNKNOWN, never "no". A member that
//!   does not vote in time or whose stream goes makes the step fail.
//! - **Acks are the commit.** Each vote's samples are pinned to its round;
//!   the commit acks them in the journal entry that records H, an abort
//!   returns them to the queue (charged only to a member that blamed its
//!   own share).
//! - The same members after a committed step keep the quorum id; any change
//!   of members, or a failed step, makes a new id, and every formation a
//!   new store prefix, so a broken group is never used again.
//!
//! # Layout
//! - `types`: settings, the commit record, asks, quorums, votes,
//!   decisions, settlements, counters (plain data).
//! - `state`: [`Lighthouse`] and its membership half (asks, waits,
//!   formation at H); `votes`: its vote half (admission, decisions,
//!   durability, unknown rounds). No tonic, tokio or clock: time comes in
//!   as an argument and every call returns what it decided.
//! - `config`: the flags; `hub`: the service side (the calls waiting on
//!   the state, the queue's pins and settlements); `rpc`: the two RPCs
//!   (proto ↔ these types, bad input refused naming the value).

pub mod config;
pub mod hub;
pub mod rpc;
mod state;
mod types;
mod votes;

#[cfg(test)]
mod tests;

pub use state::Lighthouse;
pub use types::{
    Answers, CommitRecord, Decision, Formed, LighthouseCounters, LighthouseSettings, Outcome,
    QuorumAnswer, QuorumAsk, RoundKey, Settlement, Vote,
};
pub use votes::Admission;
