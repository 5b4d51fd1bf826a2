//! The lighthouse of data-parallel drafters: which drafters take each
//! optimizer step (its quorum) and whether the step commits (the vote). No
//! tensors, no I/O, no clock: time comes in as an argument, and every call
//! returns the answers it decided, for the service to send.
//!
//! The drafters are one data-parallel trainer: each trains its share of a
//! step, asks for a quorum, all-reduces its gradient with the quorum's other
//! members over c10d, votes, and applies the step only when every member
//! voted ok. The rules:
//!
//! - A quorum forms once every member of the last one has asked again (or
//!   left, or missed the round's timeout) and at least one asker holds
//!   samples; every asker is in it. Without a last quorum (the run's first
//!   step, or after every member left) a round gathers askers for
//!   `idle_wait` first. Askers with nothing to train wait (an
//!   idle member contributes zero), and are answered "idle" after
//!   `idle_wait` so that they go back to their deliveries.
//! - The same members after a committed step keep the quorum id (and their
//!   process group); any change of members, or a failed step, makes a new
//!   id, so a broken group is never used again.
//! - Rank 0 is a member at the quorum's step (the highest any member has
//!   committed) and hosts the group's store; a member that is new, behind,
//!   or whose state checksum differs from rank 0's makes the quorum `heal`:
//!   every member takes rank 0's state before the step. A checksum that
//!   differs at the same step is an error (counted and logged), never
//!   silent.
//! - A step commits only if every member of its quorum voted ok. One no
//!   decides at once; members that have not voted `timeout` after the first
//!   vote count as no. A vote for a quorum or step that is not open is
//!   answered no and changes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The lighthouse's settings (broker flags).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuorumSettings {
    /// How long a round waits for the last quorum's members that have not
    /// asked yet, and a vote for the members that have not voted.
    pub timeout: Duration,
    /// Fewest members a quorum forms with.
    pub min_size: usize,
    /// How long an asker with nothing to train is held before it is
    /// answered "idle", and how long the first round (no last quorum to
    /// wait for) gathers the drafters that start together.
    pub idle_wait: Duration,
}

impl Default for QuorumSettings {
    fn default() -> Self {
        QuorumSettings {
            timeout: Duration::from_secs(30),
            min_size: 1,
            idle_wait: Duration::from_millis(500),
        }
    }
}

/// One drafter's request for the next step's quorum.
#[derive(Debug, Clone, PartialEq)]
pub struct QuorumAsk {
    pub drafter_id: String,
    /// host:port of the c10d store the drafter hosts.
    pub store_address: String,
    /// Optimizer steps its model has committed.
    pub step: u64,
    /// Checksum of its weights and optimizer state after `step`.
    pub state_checksum: u64,
    /// Samples it trained for the coming step.
    pub samples_ready: u64,
    pub leaving: bool,
}

/// A formed quorum, the same for every member.
#[derive(Debug, Clone, PartialEq)]
pub struct Formed {
    pub quorum_id: u64,
    /// The lighthouse's instance (see [`QuorumState::new`]): quorum ids
    /// start again after a broker restart, the drafters' stores do not.
    pub instance: u64,
    /// The step every member's model is at once healed.
    pub step: u64,
    /// Drafter ids by rank; rank 0 hosts the store.
    pub members: Vec<String>,
    pub store_address: String,
    pub heal: bool,
    pub heal_reason: String,
}

impl Formed {
    /// The key prefix of this quorum's process group in rank 0's store:
    /// unique per lighthouse instance and quorum, so a group never meets
    /// another's keys in a store that outlived a broker restart.
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
    /// No step formed in time (nobody held samples, or too few members):
    /// ask again.
    Idle,
    /// The drafter left the membership.
    Left,
}

/// The answer to one vote, the same for every voter of the step.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub commit: bool,
    pub reason: String,
}

/// A member's commit vote.
#[derive(Debug, Clone, PartialEq)]
pub struct Vote {
    pub drafter_id: String,
    pub quorum_id: u64,
    pub step: u64,
    pub ok: bool,
    pub reason: String,
}

/// The votes of one step of one quorum.
#[derive(Debug)]
struct VoteRound {
    members: BTreeSet<String>,
    yes: BTreeSet<String>,
    no: BTreeMap<String, String>,
    first_vote_at: Option<Instant>,
    decision: Option<Decision>,
}

/// What the lighthouse has done, for status and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuorumCounters {
    pub quorums_formed: u64,
    pub steps_committed: u64,
    pub steps_failed: u64,
    pub heals: u64,
    pub checksum_mismatches: u64,
    pub members_dropped: u64,
}

/// Answers decided by one call: quorum answers and vote decisions by
/// drafter id.
#[derive(Debug, Default, PartialEq)]
pub struct Answers {
    pub quorums: Vec<(String, QuorumAnswer)>,
    pub decisions: Vec<(String, Decision)>,
}

/// Vote rounds kept after their decision, for late voters.
const DECIDED_ROUNDS_KEPT: usize = 16;

/// The lighthouse's state.
#[derive(Debug)]
pub struct QuorumState {
    settings: QuorumSettings,
    instance: u64,
    /// Members of the last formed quorum, less those that left since.
    expected: BTreeSet<String>,
    /// Outstanding asks and when each arrived.
    waiting: BTreeMap<String, (QuorumAsk, Instant)>,
    /// When the round being gathered got its first ask.
    round_started: Option<Instant>,
    last: Option<Arc<Formed>>,
    /// Whether the last quorum's last step failed (a new id then).
    last_step_failed: bool,
    next_quorum_id: u64,
    /// Vote rounds by (quorum id, step), voters waiting included.
    rounds: BTreeMap<(u64, u64), VoteRound>,
    /// Voters waiting for a decision: (quorum id, step) by drafter.
    voters: BTreeMap<String, (u64, u64)>,
    pub counters: QuorumCounters,
}

impl QuorumState {
    /// `instance` tells this lighthouse's quorums apart from those of an
    /// earlier broker process (any value unlikely to repeat: the service
    /// takes the clock and the process id).
    pub fn new(settings: QuorumSettings, instance: u64) -> Self {
        QuorumState {
            settings,
            instance,
            expected: BTreeSet::new(),
            waiting: BTreeMap::new(),
            round_started: None,
            last: None,
            last_step_failed: false,
            next_quorum_id: 1,
            rounds: BTreeMap::new(),
            voters: BTreeMap::new(),
            counters: QuorumCounters::default(),
        }
    }

    pub fn settings(&self) -> QuorumSettings {
        self.settings
    }

    /// The last formed quorum.
    pub fn last(&self) -> Option<&Formed> {
        self.last.as_deref()
    }

    /// Drafters the next quorum waits for.
    pub fn expected(&self) -> &BTreeSet<String> {
        &self.expected
    }

    /// A drafter asks for the next step's quorum (or leaves).
    pub fn ask(&mut self, now: Instant, ask: QuorumAsk) -> Answers {
        let mut answers = Answers::default();
        let drafter_id = ask.drafter_id.clone();
        if ask.leaving {
            self.waiting.remove(&drafter_id);
            self.expected.remove(&drafter_id);
            tracing::info!(drafter_id, "data parallelism: member left");
            answers.quorums.push((drafter_id, QuorumAnswer::Left));
        } else {
            self.waiting.insert(drafter_id, (ask, now));
            self.round_started.get_or_insert(now);
        }
        self.try_form(now, &mut answers);
        answers
    }

    /// The drafter stopped waiting (its call ended): its ask is withdrawn;
    /// it stays expected until a round's timeout drops it.
    pub fn withdraw(&mut self, drafter_id: &str) {
        self.waiting.remove(drafter_id);
        if self.waiting.is_empty() {
            self.round_started = None;
        }
        self.voters.remove(drafter_id);
    }

    /// Time passes: idle askers are answered, a round past its timeout
    /// forms without the members that did not ask, a vote past its timeout
    /// decides no.
    pub fn tick(&mut self, now: Instant) -> Answers {
        let mut answers = Answers::default();
        self.try_form(now, &mut answers);
        let timeout = self.settings.timeout;
        let overdue: Vec<(u64, u64)> = self
            .rounds
            .iter()
            .filter(|(_, round)| {
                round.decision.is_none()
                    && round
                        .first_vote_at
                        .is_some_and(|first| now.saturating_duration_since(first) >= timeout)
            })
            .map(|(key, _)| *key)
            .collect();
        for key in overdue {
            let missing: Vec<String> = match self.rounds.get(&key) {
                Some(round) => round
                    .members
                    .iter()
                    .filter(|member| {
                        !round.yes.contains(*member) && !round.no.contains_key(*member)
                    })
                    .cloned()
                    .collect(),
                None => continue,
            };
            let reason = format!(
                "members {} did not vote within {:?} of the first vote",
                missing.join(", "),
                timeout
            );
            self.decide(key, false, reason, &mut answers);
        }
        answers
    }

    /// A member's commit vote.
    pub fn vote(&mut self, now: Instant, vote: Vote) -> Answers {
        let mut answers = Answers::default();
        let key = (vote.quorum_id, vote.step);
        let Some(round) = self.rounds.get_mut(&key) else {
            answers.decisions.push((
                vote.drafter_id,
                Decision {
                    commit: false,
                    reason: format!(
                        "quorum {} step {} is not open (a newer quorum formed): ask for a quorum again",
                        vote.quorum_id, vote.step
                    ),
                },
            ));
            return answers;
        };
        if !round.members.contains(&vote.drafter_id) {
            answers.decisions.push((
                vote.drafter_id.clone(),
                Decision {
                    commit: false,
                    reason: format!(
                        "{} is not a member of quorum {}",
                        vote.drafter_id, vote.quorum_id
                    ),
                },
            ));
            return answers;
        }
        if let Some(decision) = &round.decision {
            answers
                .decisions
                .push((vote.drafter_id.clone(), decision.clone()));
            return answers;
        }
        round.first_vote_at.get_or_insert(now);
        if vote.ok {
            round.yes.insert(vote.drafter_id.clone());
        } else {
            let reason = if vote.reason.is_empty() {
                "no reason given".to_string()
            } else {
                vote.reason.clone()
            };
            round.no.insert(vote.drafter_id.clone(), reason);
        }
        self.voters.insert(vote.drafter_id.clone(), key);
        if !vote.ok {
            let reason = format!("{} voted no: {}", vote.drafter_id, vote.reason);
            self.decide(key, false, reason, &mut answers);
        } else if round.yes.len() == round.members.len() {
            self.decide(key, true, String::new(), &mut answers);
        }
        answers
    }

    fn decide(&mut self, key: (u64, u64), commit: bool, reason: String, answers: &mut Answers) {
        let Some(round) = self.rounds.get_mut(&key) else {
            return;
        };
        let decision = Decision { commit, reason };
        round.decision = Some(decision.clone());
        if commit {
            self.counters.steps_committed += 1;
        } else {
            self.counters.steps_failed += 1;
            tracing::warn!(
                quorum_id = key.0,
                step = key.1,
                reason = %decision.reason,
                "data parallelism: step not committed; nobody applies it"
            );
            if self
                .last
                .as_ref()
                .is_some_and(|last| last.quorum_id == key.0)
            {
                self.last_step_failed = true;
            }
        }
        let waiting: Vec<String> = self
            .voters
            .iter()
            .filter(|(_, voted)| **voted == key)
            .map(|(drafter_id, _)| drafter_id.clone())
            .collect();
        for drafter_id in waiting {
            self.voters.remove(&drafter_id);
            answers.decisions.push((drafter_id, decision.clone()));
        }
        while self.rounds.len() > DECIDED_ROUNDS_KEPT {
            let Some(oldest) = self
                .rounds
                .iter()
                .find(|(_, round)| round.decision.is_some())
                .map(|(key, _)| *key)
            else {
                break;
            };
            self.rounds.remove(&oldest);
        }
    }

    fn try_form(&mut self, now: Instant, answers: &mut Answers) {
        let Some(started) = self.round_started else {
            return;
        };
        let everyone_in = if self.expected.is_empty() {
            // No last quorum: gather whoever starts together.
            now.saturating_duration_since(started) >= self.settings.idle_wait
        } else {
            self.expected
                .iter()
                .all(|member| self.waiting.contains_key(member))
        };
        let timed_out = now.saturating_duration_since(started) >= self.settings.timeout;
        let anyone_ready = self.waiting.values().any(|(ask, _)| ask.samples_ready > 0);
        let enough = self.waiting.len() >= self.settings.min_size.max(1);
        if (everyone_in || timed_out) && anyone_ready && enough {
            self.form(answers);
            return;
        }
        if anyone_ready && enough {
            // A step is forming: every asker waits for the stragglers.
            return;
        }
        // No step to take yet: askers go back to their deliveries.
        let idle_wait = self.settings.idle_wait;
        let idle: Vec<String> = self
            .waiting
            .iter()
            .filter(|(_, (_, at))| now.saturating_duration_since(*at) >= idle_wait)
            .map(|(drafter_id, _)| drafter_id.clone())
            .collect();
        for drafter_id in idle {
            self.waiting.remove(&drafter_id);
            answers.quorums.push((drafter_id, QuorumAnswer::Idle));
        }
        if self.waiting.is_empty() {
            self.round_started = None;
        }
    }

    fn form(&mut self, answers: &mut Answers) {
        let asks: Vec<QuorumAsk> = std::mem::take(&mut self.waiting)
            .into_values()
            .map(|(ask, _)| ask)
            .collect();
        self.round_started = None;
        let step = asks.iter().map(|ask| ask.step).max().unwrap_or(0);
        // Rank 0: the last quorum's rank 0 if it is at the step, else the
        // first member (by id) that is.
        let previous_source = self
            .last
            .as_ref()
            .and_then(|last| last.members.first().cloned());
        let source = asks
            .iter()
            .find(|ask| Some(&ask.drafter_id) == previous_source.as_ref() && ask.step == step)
            .or_else(|| asks.iter().find(|ask| ask.step == step))
            .cloned();
        let Some(source) = source else {
            return;
        };
        let mut members = vec![source.drafter_id.clone()];
        members.extend(
            asks.iter()
                .filter(|ask| ask.drafter_id != source.drafter_id)
                .map(|ask| ask.drafter_id.clone()),
        );
        let member_set: BTreeSet<String> = members.iter().cloned().collect();
        let mut heal_reasons = Vec::new();
        for ask in &asks {
            if ask.step < step {
                heal_reasons.push(format!("{} at step {} of {step}", ask.drafter_id, ask.step));
            } else if ask.state_checksum != source.state_checksum {
                self.counters.checksum_mismatches += 1;
                tracing::error!(
                    drafter_id = %ask.drafter_id,
                    checksum = ask.state_checksum,
                    rank0 = %source.drafter_id,
                    rank0_checksum = source.state_checksum,
                    step,
                    "data parallelism: state checksum differs from rank 0's at the same step; the member takes rank 0's state"
                );
                heal_reasons.push(format!(
                    "{} checksum {:#018x} differs from {}'s {:#018x} at step {step}",
                    ask.drafter_id, ask.state_checksum, source.drafter_id, source.state_checksum
                ));
            }
        }
        let dropped: Vec<String> = self.expected.difference(&member_set).cloned().collect();
        if !dropped.is_empty() {
            self.counters.members_dropped += dropped.len() as u64;
            tracing::warn!(
                dropped = %dropped.join(", "),
                timeout = ?self.settings.timeout,
                "data parallelism: members that did not ask in time are dropped from the quorum"
            );
        }
        // A step of the last quorum still without a decision never will
        // get one now: its members asked again instead of voting.
        if let Some(last) = &self.last {
            let key = (last.quorum_id, last.step);
            if self
                .rounds
                .get(&key)
                .is_some_and(|round| round.decision.is_none())
            {
                self.decide(
                    key,
                    false,
                    "its members asked for a new quorum before every vote came".to_string(),
                    answers,
                );
            }
        }
        let same_members = self.last.as_ref().is_some_and(|last| {
            last.members.iter().cloned().collect::<BTreeSet<_>>() == member_set
        });
        let quorum_id = match &self.last {
            Some(last) if same_members && !self.last_step_failed => last.quorum_id,
            _ => {
                let id = self.next_quorum_id;
                self.next_quorum_id += 1;
                id
            }
        };
        let heal = !heal_reasons.is_empty();
        if heal {
            self.counters.heals += 1;
        }
        let formed = Arc::new(Formed {
            quorum_id,
            instance: self.instance,
            step,
            members,
            store_address: source.store_address.clone(),
            heal,
            heal_reason: heal_reasons.join("; "),
        });
        if self
            .last
            .as_ref()
            .is_none_or(|last| last.quorum_id != quorum_id)
        {
            tracing::info!(
                quorum_id,
                step,
                members = %formed.members.join(", "),
                heal,
                "data parallelism: new quorum"
            );
        }
        self.counters.quorums_formed += 1;
        self.rounds.insert(
            (quorum_id, step),
            VoteRound {
                members: member_set.clone(),
                yes: BTreeSet::new(),
                no: BTreeMap::new(),
                first_vote_at: None,
                decision: None,
            },
        );
        self.expected = member_set;
        self.last_step_failed = false;
        self.last = Some(formed.clone());
        for member in &formed.members {
            answers
                .quorums
                .push((member.clone(), QuorumAnswer::Formed(formed.clone())));
        }
    }
}

#[cfg(test)]
mod tests;
