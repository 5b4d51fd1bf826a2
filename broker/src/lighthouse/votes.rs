//! The vote half of [`Lighthouse`]: a step commits only if every member of
//! its quorum voted yes and H is still the step it formed at; a commit is
//! answered only once its record is durable; a round the lighthouse does
//! not know is UNKNOWN, never "no".

use std::time::Instant;

use super::state::{Lighthouse, DECIDED_ROUNDS_KEPT};
use super::types::{Answers, CommitRecord, Decision, Outcome, RoundKey, Settlement, Vote};

/// Whether a vote reaches an open round as a member's first vote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Pin its samples to the round, then [`Lighthouse::vote`].
    Open(RoundKey),
    /// Answer it from what is known (a decided round, another instance,
    /// a stranger): [`Lighthouse::vote`] answers without a change.
    Answered,
}

impl Lighthouse {
    /// Whether `vote` is a member's first vote on an open round of this
    /// instance, the only case where its samples are pinned.
    pub fn admits(&self, vote: &Vote) -> Admission {
        let key = (vote.quorum_id, vote.step);
        match self.rounds.get(&key) {
            Some(round)
                if vote.instance == self.instance
                    && round.decision.is_none()
                    && round.nonce == vote.nonce
                    && round.members.contains(&vote.drafter_id)
                    && !round.yes.contains(&vote.drafter_id)
                    && !round.no.contains_key(&vote.drafter_id) =>
            {
                Admission::Open(key)
            }
            _ => Admission::Answered,
        }
    }

    /// A member's commit vote, or its retry of the decision fetch.
    pub fn vote(&mut self, now: Instant, vote: Vote) -> Answers {
        let mut answers = Answers::default();
        let key = (vote.quorum_id, vote.step);
        let drafter_id = vote.drafter_id.clone();
        if vote.instance != self.instance {
            let decision = self.decision_of_unknown_round(&vote);
            self.answer(&drafter_id, decision, &mut answers);
            return answers;
        }
        let Some(round) = self.rounds.get_mut(&key) else {
            let decision = match self.last_decisions.get(&drafter_id) {
                Some((decided, decision)) if *decided == key => decision.clone(),
                _ => self.decision_of_unknown_round(&vote),
            };
            self.answer(&drafter_id, decision, &mut answers);
            return answers;
        };
        if !round.members.contains(&drafter_id) || round.nonce != vote.nonce {
            let reason = if round.members.contains(&drafter_id) {
                format!(
                    "nonce {:#018x} is not quorum {}'s step {} round",
                    vote.nonce, vote.quorum_id, vote.step
                )
            } else {
                format!("{drafter_id} is not a member of quorum {}", vote.quorum_id)
            };
            answers
                .decisions
                .push((drafter_id, Decision::abort(reason)));
            return answers;
        }
        if let Some(decision) = &round.decision {
            if round.durable {
                let decision = decision.clone();
                self.answer(&drafter_id, decision, &mut answers);
            } else {
                self.voters.insert(drafter_id, key);
            }
            return answers;
        }
        round.first_vote_at.get_or_insert(now);
        if vote.ok {
            round.yes.insert(drafter_id.clone());
        } else {
            let reason = if vote.reason.is_empty() {
                "no reason given".to_string()
            } else {
                vote.reason.clone()
            };
            round.no.insert(drafter_id.clone(), reason);
        }
        let everyone_yes = round.yes.len() == round.members.len();
        self.voters.insert(drafter_id.clone(), key);
        if !vote.ok {
            let reason = format!("{drafter_id} voted no: {}", vote.reason);
            self.decide(now, key, Decision::abort(reason), &mut answers);
        } else if everyone_yes {
            self.commit_if_at_h(now, key, &mut answers);
        }
        answers
    }

    /// The queue made the commit of `key` durable: its voters hear it now.
    pub fn durable(&mut self, key: RoundKey) -> Answers {
        let mut answers = Answers::default();
        let Some(round) = self.rounds.get_mut(&key) else {
            return answers;
        };
        round.durable = true;
        if let Some(decision) = round.decision.clone() {
            self.release_voters(key, &decision, &mut answers);
        }
        answers
    }

    /// Votes past their bound (from the first vote) decide no.
    pub(super) fn vote_timeouts(&mut self, now: Instant, answers: &mut Answers) {
        let overdue: Vec<(RoundKey, Vec<String>)> = self
            .rounds
            .iter()
            .filter(|(_, round)| {
                round.decision.is_none()
                    && round.first_vote_at.is_some_and(|first| {
                        now.saturating_duration_since(first) >= round.wait_bound
                    })
            })
            .map(|(key, round)| {
                let missing = round
                    .members
                    .iter()
                    .filter(|member| {
                        !round.yes.contains(*member) && !round.no.contains_key(*member)
                    })
                    .cloned()
                    .collect();
                (*key, missing)
            })
            .collect();
        for (key, missing) in overdue {
            let bound = self.rounds.get(&key).map(|round| round.wait_bound);
            let reason = format!(
                "members {} did not vote within {bound:?} of the first vote",
                missing.join(", ")
            );
            self.decide(now, key, Decision::abort(reason), answers);
        }
    }

    /// Every member voted yes: the step commits if H is still the step the
    /// round formed at (another quorum may have committed it meanwhile).
    fn commit_if_at_h(&mut self, now: Instant, key: RoundKey, answers: &mut Answers) {
        let Some(round) = self.rounds.get(&key) else {
            return;
        };
        if round.base != self.record {
            let reason = format!(
                "the run's history moved from {} to {} while this step was voted",
                round.base, self.record
            );
            self.decide(now, key, Decision::abort(reason), answers);
            return;
        }
        let record = CommitRecord {
            step: round.base.step + 1,
            instance: self.instance,
            quorum_id: key.0,
        };
        let decision = Decision {
            outcome: Outcome::Commit,
            reason: String::new(),
            record: Some(record),
        };
        self.decide(now, key, decision, answers);
    }

    pub(super) fn decide(
        &mut self,
        now: Instant,
        key: RoundKey,
        decision: Decision,
        answers: &mut Answers,
    ) {
        let Some(round) = self.rounds.get_mut(&key) else {
            return;
        };
        if round.decision.is_some() {
            return;
        }
        round.decision = Some(decision.clone());
        let elapsed = now.saturating_duration_since(round.formed_at);
        match (decision.outcome, decision.record) {
            (Outcome::Commit, Some(record)) => {
                self.record = record;
                self.adopting = false;
                self.counters.steps_committed += 1;
                self.record_step_time(elapsed);
                answers
                    .settlements
                    .push(Settlement::Commit { round: key, record });
                // Its voters hear it once `durable` is called.
            }
            _ => {
                round.durable = true;
                self.counters.steps_failed += 1;
                tracing::warn!(
                    quorum_id = key.0,
                    step = key.1,
                    reason = %decision.reason,
                    "data parallelism: step not committed; nobody applies it, its samples go back to the queue"
                );
                if self
                    .last
                    .as_ref()
                    .is_some_and(|last| last.quorum_id == key.0)
                {
                    self.last_step_failed = true;
                }
                answers.settlements.push(Settlement::Abort { round: key });
                self.release_voters(key, &decision, answers);
            }
        }
        self.forget_old_rounds();
    }

    fn release_voters(&mut self, key: RoundKey, decision: &Decision, answers: &mut Answers) {
        let members: Vec<String> = self
            .rounds
            .get(&key)
            .map(|round| round.members.iter().cloned().collect())
            .unwrap_or_default();
        for member in members {
            self.last_decisions
                .insert(member.clone(), (key, decision.clone()));
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
    }

    fn forget_old_rounds(&mut self) {
        while self.rounds.len() > DECIDED_ROUNDS_KEPT {
            let Some(oldest) = self
                .rounds
                .iter()
                .find(|(_, round)| round.decision.is_some() && round.durable)
                .map(|(key, _)| *key)
            else {
                break;
            };
            self.rounds.remove(&oldest);
        }
    }

    fn answer(&mut self, drafter_id: &str, decision: Decision, answers: &mut Answers) {
        if decision.outcome == Outcome::Unknown {
            self.counters.unknown_decisions += 1;
        }
        answers.decisions.push((drafter_id.to_string(), decision));
    }

    /// A vote for a round not kept (of an earlier broker process, or of
    /// this one and forgotten): committed if it made the record, which is
    /// durable before any commit is answered; else unknown, never a no.
    fn decision_of_unknown_round(&self, vote: &Vote) -> Decision {
        let record = CommitRecord {
            step: vote.step + 1,
            instance: vote.instance,
            quorum_id: vote.quorum_id,
        };
        if record == self.record {
            return Decision {
                outcome: Outcome::Commit,
                reason: String::new(),
                record: Some(record),
            };
        }
        let whose = if vote.instance == self.instance {
            "is not known (forgotten or never formed)".to_string()
        } else {
            format!(
                "is of lighthouse {:016x}, not this one ({:016x})",
                vote.instance, self.instance
            )
        };
        Decision::unknown(format!(
            "quorum {} step {} {whose}; the run is at {}: heal to it",
            vote.quorum_id, vote.step, self.record
        ))
    }
}
