//! The lighthouse's vocabulary: its settings, the commit record, an ask, a
//! formed quorum, a vote, a decision and what one call decided. Plain data,
//! no behaviour beyond naming.

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::queue::CommitRecord;

/// The lighthouse's settings (broker flags).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LighthouseSettings {
    /// The floor of how long a round waits for a live member of the last
    /// quorum that has not asked, and a vote for a member that has not
    /// voted. The bound used is never below a member's own collective
    /// timeout plus twice the longest recent step ([`Self::wait_bound`]).
    pub timeout: Duration,
    /// Fewest members a quorum forms with.
    pub min_size: usize,
    /// How long an asker with nothing to train is held before it is
    /// answered "idle", and how long the first round (no last quorum to
    /// wait for) gathers the drafters that start together.
    pub idle_wait: Duration,
    /// With no holder of the committed step alive for this long, roll the
    /// run's history back to the most advanced asker (logged, counted, the
    /// lost steps named). None: wait for a holder (the default).
    pub rollback_after: Option<Duration>,
}

impl Default for LighthouseSettings {
    fn default() -> Self {
        LighthouseSettings {
            timeout: Duration::from_secs(120),
            min_size: 1,
            idle_wait: Duration::from_millis(500),
            rollback_after: None,
        }
    }
}

impl LighthouseSettings {
    /// How long a round waits for a live member (`collective_timeout` is
    /// the member's own, sent with its ask): never below that timeout plus
    /// twice the longest recent step, so a member still inside a
    /// collective that a dead peer stalled is waited for, not dropped.
    pub fn wait_bound(&self, collective_timeout: Duration, longest_step: Duration) -> Duration {
        self.timeout
            .max(collective_timeout + longest_step.saturating_mul(2))
    }
}

/// One drafter's request for the next step's quorum.
#[derive(Debug, Clone, PartialEq)]
pub struct QuorumAsk {
    pub drafter_id: String,
    /// host:port of the c10d store the drafter hosts.
    pub store_address: String,
    /// The commit its model last applied (its step is the model's step).
    pub committed: CommitRecord,
    /// Checksum of its weights and optimizer state after that commit.
    pub state_checksum: u64,
    /// Samples it trained for the coming step.
    pub samples_ready: u64,
    pub leaving: bool,
    /// Its `--collective-timeout`: how long it may sit in a collective that
    /// a dead peer stalled before it can ask again.
    pub collective_timeout: Duration,
}

/// A formed quorum, the same for every member.
#[derive(Debug, Clone, PartialEq)]
pub struct Formed {
    pub quorum_id: u64,
    /// The lighthouse's instance (see [`super::Lighthouse::new`]): quorum
    /// ids start again after a broker restart, the drafters' stores do not.
    pub instance: u64,
    /// Tells this formation's vote round apart from any other, so a vote
    /// can only be for the round its member was told about.
    pub nonce: u64,
    /// The step every member's model is at once healed: always the run's H.
    pub step: u64,
    /// The commit every member holds once healed (rank 0 holds it).
    pub record: CommitRecord,
    /// Drafter ids by rank; rank 0 holds H and hosts the store.
    pub members: Vec<String>,
    pub store_address: String,
    pub heal: bool,
    pub heal_reason: String,
}

impl Formed {
    /// The key prefix of this quorum's process group in rank 0's store:
    /// unique per lighthouse instance and quorum id (a new id at every
    /// change of members or failed step), so a group never meets another's
    /// keys in a store that outlived a broker restart, and the same members
    /// keep their group from step to step.
    pub fn store_prefix(&self) -> String {
        format!("dflash/{:016x}/quorum-{}", self.instance, self.quorum_id)
    }

    pub fn rank_of(&self, drafter_id: &str) -> Option<usize> {
        self.members.iter().position(|member| member == drafter_id)
    }
}

/// The answer to one [`QuorumAsk`].
#[derive(Debug, Clone, PartialEq)]
pub enum QuorumAnswer {
    /// Take the step with these members, at this rank.
    Formed(Arc<Formed>),
    /// No step formed in time (nobody held samples, too few members, or
    /// no holder of H asked): ask again.
    Idle,
    /// The drafter left the membership.
    Left,
}

/// What a step came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every member voted yes at H: apply it. Its samples are acked.
    Commit,
    /// Nobody applies it; its samples go back to the queue uncharged.
    Abort,
    /// The lighthouse does not know this round (another instance, or
    /// forgotten): the member must not apply it, and heals to H before it
    /// contributes again. Never a "no": the step may have committed.
    Unknown,
}

/// The answer to one vote, the same for every voter of the step.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub outcome: Outcome,
    pub reason: String,
    /// With [`Outcome::Commit`]: the record the step made (H after it).
    pub record: Option<CommitRecord>,
}

impl Decision {
    pub fn abort(reason: impl Into<String>) -> Self {
        Decision {
            outcome: Outcome::Abort,
            reason: reason.into(),
            record: None,
        }
    }

    pub fn unknown(reason: impl Into<String>) -> Self {
        Decision {
            outcome: Outcome::Unknown,
            reason: reason.into(),
            record: None,
        }
    }
}

/// A member's commit vote. Its samples were pinned to the round by the
/// service before the vote reached the state (a vote whose samples could
/// not be pinned arrives as a no).
#[derive(Debug, Clone, PartialEq)]
pub struct Vote {
    pub drafter_id: String,
    pub instance: u64,
    pub quorum_id: u64,
    pub step: u64,
    pub nonce: u64,
    pub ok: bool,
    pub reason: String,
}

/// A vote round: (quorum id, step).
pub type RoundKey = (u64, u64);

/// What the queue must do with the samples pinned to a round.
#[derive(Debug, Clone, PartialEq)]
pub enum Settlement {
    /// Ack them, in the one journal entry that records `record` as H.
    Commit {
        round: RoundKey,
        record: CommitRecord,
    },
    /// Return them to the queue without charging a delivery.
    Abort { round: RoundKey },
}

/// What the lighthouse has done, for status and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LighthouseCounters {
    pub quorums_formed: u64,
    pub steps_committed: u64,
    pub steps_failed: u64,
    pub heals: u64,
    /// Holders of H whose checksum differed from rank 0's: an error.
    pub checksum_mismatches: u64,
    /// Members at or above H on another history: an error, healed.
    pub splits: u64,
    /// Live members dropped from a quorum (gone, or past the wait bound).
    pub members_dropped: u64,
    /// Votes answered UNKNOWN.
    pub unknown_decisions: u64,
    /// Explicit rollbacks (`--rollback-after`) and the steps they lost.
    pub rollbacks: u64,
    pub steps_rolled_back: u64,
}

/// Answers decided by one call: quorum answers and vote decisions by
/// drafter id, and the settlements the queue must apply.
#[derive(Debug, Default, PartialEq)]
pub struct Answers {
    pub quorums: Vec<(String, QuorumAnswer)>,
    pub decisions: Vec<(String, Decision)>,
    pub settlements: Vec<Settlement>,
}

/// When a member of the last quorum was last heard of, for the wait bound.
#[derive(Debug, Clone, Copy)]
pub(super) struct MemberClock {
    pub collective_timeout: Duration,
    pub seen_at: Instant,
}
