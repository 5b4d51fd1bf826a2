//! [`Lighthouse`]: membership (asks, the wait for the last quorum's live
//! members, formation at H). The vote half is in `votes`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::types::{
    Answers, CommitRecord, Decision, Formed, LighthouseCounters, LighthouseSettings, MemberClock,
    QuorumAnswer, QuorumAsk, RoundKey,
};

/// Committed steps' durations kept for the wait bound.
const RECENT_STEPS: usize = 16;
/// Vote rounds kept after their decision, for late voters (each member's
/// last decision is kept apart from these until it asks again).
pub(super) const DECIDED_ROUNDS_KEPT: usize = 16;

/// The votes of one step of one quorum.
#[derive(Debug)]
pub(super) struct VoteRound {
    pub members: BTreeSet<String>,
    pub nonce: u64,
    /// H when the round formed: it commits only if H is still that.
    pub base: CommitRecord,
    pub yes: BTreeSet<String>,
    pub no: BTreeMap<String, String>,
    pub formed_at: Instant,
    pub first_vote_at: Option<Instant>,
    pub decision: Option<Decision>,
    /// A commit is answered only once its record is durable.
    pub durable: bool,
    /// The members' wait bounds, for the vote's timeout.
    pub wait_bound: Duration,
}

/// The lighthouse's state. No tensors, no I/O, no clock: time comes in as
/// an argument, and every call returns what it decided.
#[derive(Debug)]
pub struct Lighthouse {
    pub(super) settings: LighthouseSettings,
    pub(super) instance: u64,
    /// H and the commit that made it.
    pub(super) record: CommitRecord,
    /// No record was restored and no quorum formed yet: the first quorum
    /// adopts the most advanced asker's history (a broker without
    /// `--state-dir` that restarted knows no better).
    pub(super) adopting: bool,
    /// Members of the last quorum still live (not left, stream not gone)
    /// and when each was last heard of.
    pub(super) expected: BTreeMap<String, MemberClock>,
    /// Drafters whose Consume stream is gone: not live until they ask.
    pub(super) gone: BTreeSet<String>,
    /// Drafters that left: not live until they ask.
    pub(super) departed: BTreeSet<String>,
    /// Outstanding asks and when each arrived.
    pub(super) waiting: BTreeMap<String, (QuorumAsk, Instant)>,
    pub(super) round_started: Option<Instant>,
    /// Since when askers wait with no holder of H among them.
    pub(super) no_holder_since: Option<Instant>,
    pub(super) last: Option<Arc<Formed>>,
    pub(super) last_step_failed: bool,
    pub(super) next_quorum_id: u64,
    pub(super) formations: u64,
    pub(super) rounds: BTreeMap<RoundKey, VoteRound>,
    /// Voters waiting for a decision: the round by drafter.
    pub(super) voters: BTreeMap<String, RoundKey>,
    /// Each member's last decision, kept until it asks again.
    pub(super) last_decisions: BTreeMap<String, (RoundKey, Decision)>,
    pub(super) recent_steps: VecDeque<Duration>,
    pub counters: LighthouseCounters,
}

impl Lighthouse {
    /// `instance` tells this lighthouse's quorums apart from those of an
    /// earlier broker process; `restored` is the commit record a state dir
    /// kept (None: a new run, or no state dir).
    pub fn new(
        settings: LighthouseSettings,
        instance: u64,
        restored: Option<CommitRecord>,
    ) -> Self {
        Lighthouse {
            settings,
            instance,
            record: restored.unwrap_or(CommitRecord::GENESIS),
            adopting: restored.is_none(),
            expected: BTreeMap::new(),
            gone: BTreeSet::new(),
            departed: BTreeSet::new(),
            waiting: BTreeMap::new(),
            round_started: None,
            no_holder_since: None,
            last: None,
            last_step_failed: false,
            next_quorum_id: 1,
            formations: 0,
            rounds: BTreeMap::new(),
            voters: BTreeMap::new(),
            last_decisions: BTreeMap::new(),
            recent_steps: VecDeque::new(),
            counters: LighthouseCounters::default(),
        }
    }

    pub fn settings(&self) -> LighthouseSettings {
        self.settings
    }

    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// H and the commit that made it.
    pub fn record(&self) -> CommitRecord {
        self.record
    }

    /// The last formed quorum.
    pub fn last(&self) -> Option<&Formed> {
        self.last.as_deref()
    }

    /// Drafters the next quorum waits for.
    pub fn expected(&self) -> impl Iterator<Item = &str> {
        self.expected.keys().map(String::as_str)
    }

    /// Whether askers wait for a holder of H (none of them holds it).
    pub fn waiting_for_holder(&self) -> bool {
        self.no_holder_since.is_some()
    }

    pub(super) fn longest_recent_step(&self) -> Duration {
        self.recent_steps.iter().copied().max().unwrap_or_default()
    }

    /// A drafter asks for the next step's quorum (or leaves).
    pub fn ask(&mut self, now: Instant, ask: QuorumAsk) -> Answers {
        let mut answers = Answers::default();
        let drafter_id = ask.drafter_id.clone();
        self.last_decisions.remove(&drafter_id);
        self.departed.remove(&drafter_id);
        if ask.leaving {
            self.departed.insert(drafter_id.clone());
            self.waiting.remove(&drafter_id);
            self.expected.remove(&drafter_id);
            tracing::info!(drafter_id, "data parallelism: member left");
            self.member_lost(now, &drafter_id, "it left", &mut answers);
            answers.quorums.push((drafter_id, QuorumAnswer::Left));
        } else {
            if let Some(clock) = self.expected.get_mut(&drafter_id) {
                clock.seen_at = now;
                clock.collective_timeout = ask.collective_timeout;
            }
            self.waiting.insert(drafter_id, (ask, now));
            self.round_started.get_or_insert(now);
        }
        self.try_form(now, &mut answers);
        answers
    }

    /// The drafter opened a Consume stream: live again. Only a stream makes
    /// a drafter live: an ask from a process whose stream is gone (a
    /// trainer outliving its stream) is served, but nobody waits for it.
    pub fn member_back(&mut self, drafter_id: &str) {
        self.gone.remove(drafter_id);
    }

    /// The drafter stopped waiting (its call ended): its ask is withdrawn;
    /// it stays expected while it is live.
    pub fn withdraw(&mut self, drafter_id: &str) {
        self.waiting.remove(drafter_id);
        if self.waiting.is_empty() {
            self.round_started = None;
        }
        self.voters.remove(drafter_id);
    }

    /// The drafter's Consume stream is gone (its process died or was cut
    /// off): it is no longer live, so no round waits for it, and a step it
    /// has not voted on fails now.
    pub fn member_gone(&mut self, now: Instant, drafter_id: &str) -> Answers {
        let mut answers = Answers::default();
        self.gone.insert(drafter_id.to_string());
        if self.expected.remove(drafter_id).is_some() {
            self.counters.members_dropped += 1;
            tracing::warn!(
                drafter_id,
                "data parallelism: member's stream is gone; dropped from the membership"
            );
        }
        self.member_lost(now, drafter_id, "its Consume stream ended", &mut answers);
        self.try_form(now, &mut answers);
        answers
    }

    /// Time passes: idle askers are answered, a round forms once the live
    /// members it waits for asked or passed their bound, a vote past its
    /// bound decides no.
    pub fn tick(&mut self, now: Instant) -> Answers {
        let mut answers = Answers::default();
        self.try_form(now, &mut answers);
        self.vote_timeouts(now, &mut answers);
        answers
    }

    fn try_form(&mut self, now: Instant, answers: &mut Answers) {
        let Some(started) = self.round_started else {
            return;
        };
        let waited = now.saturating_duration_since(started);
        // Members whose stream is gone are not waited for.
        let gone: Vec<String> = self
            .expected
            .keys()
            .filter(|drafter_id| {
                self.gone.contains(*drafter_id) && !self.waiting.contains_key(*drafter_id)
            })
            .cloned()
            .collect();
        for drafter_id in gone {
            self.expected.remove(&drafter_id);
            self.counters.members_dropped += 1;
            tracing::warn!(
                drafter_id,
                "data parallelism: member's stream is gone; dropped from the membership"
            );
        }
        // Live members past their bound are dropped, with the reason. The
        // wait counts from the round's start, or from the member's own
        // last ask in this round: a member between an idle answer and its
        // next ask is asking, not late.
        let longest = self.longest_recent_step();
        let overdue: Vec<(String, Duration)> = self
            .expected
            .iter()
            .filter(|(drafter_id, _)| !self.waiting.contains_key(*drafter_id))
            .filter(|(_, clock)| {
                let since = started.max(clock.seen_at);
                now.saturating_duration_since(since)
                    >= self.settings.wait_bound(clock.collective_timeout, longest)
            })
            .map(|(drafter_id, clock)| {
                (
                    drafter_id.clone(),
                    self.settings.wait_bound(clock.collective_timeout, longest),
                )
            })
            .collect();
        for (drafter_id, bound) in overdue {
            self.expected.remove(&drafter_id);
            self.counters.members_dropped += 1;
            tracing::warn!(drafter_id, ?bound, "data parallelism: a live member did not ask within its wait bound; dropped from this quorum");
        }
        let everyone_in = if self.live_last_members().is_empty() {
            // No last quorum to wait for: gather whoever starts together.
            waited >= self.settings.idle_wait
        } else {
            self.expected
                .keys()
                .all(|member| self.waiting.contains_key(member))
        };
        let anyone_ready = self.waiting.values().any(|(ask, _)| ask.samples_ready > 0);
        let enough = self.waiting.len() >= self.settings.min_size.max(1);
        let majority = self.has_majority();
        let holder = self.holder_among_askers(now);
        if everyone_in && anyone_ready && enough && majority && holder {
            self.form(now, answers);
            return;
        }
        if anyone_ready && enough && !everyone_in {
            // A step is forming: every asker waits for the live members.
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

    /// Members of the last quorum still live: their stream is not gone and
    /// they did not leave (those dropped for lateness still count).
    fn live_last_members(&self) -> Vec<&String> {
        self.last.as_ref().map_or_else(Vec::new, |last| {
            last.members
                .iter()
                .filter(|member| !self.gone.contains(*member) && !self.departed.contains(*member))
                .collect()
        })
    }

    /// A quorum needs more than half of the last quorum's live members
    /// among its askers, so a lone fast member never takes the run while
    /// the rest are slow but alive.
    fn has_majority(&self) -> bool {
        let live = self.live_last_members();
        if live.is_empty() {
            return true;
        }
        let asking = live
            .iter()
            .filter(|member| self.waiting.contains_key(**member))
            .count();
        asking * 2 > live.len()
    }

    /// Whether an asker holds H (or, adopting, any asker). Without one the
    /// askers wait; after `--rollback-after` the history is rolled back to
    /// the most advanced asker, explicitly.
    fn holder_among_askers(&mut self, now: Instant) -> bool {
        if self.waiting.is_empty() {
            return false;
        }
        if self.adopting
            || self
                .waiting
                .values()
                .any(|(ask, _)| ask.committed == self.record)
        {
            self.no_holder_since = None;
            return true;
        }
        let since = *self.no_holder_since.get_or_insert_with(|| {
            tracing::warn!(
                record = %self.record,
                askers = %self.waiting.keys().cloned().collect::<Vec<_>>().join(", "),
                "data parallelism: no asker holds the committed step; waiting for a holder (no quorum forms below it)"
            );
            now
        });
        let Some(after) = self.settings.rollback_after else {
            return false;
        };
        if now.saturating_duration_since(since) < after {
            return false;
        }
        let Some(best) = self.waiting.values().map(|(ask, _)| ask.committed).max() else {
            return false;
        };
        let lost = self.record.step.saturating_sub(best.step);
        self.counters.rollbacks += 1;
        self.counters.steps_rolled_back += lost;
        tracing::error!(
            from = %self.record,
            to = %best,
            lost_steps = lost,
            "data parallelism: ROLLBACK: no holder of the committed step came back within --rollback-after; the run's history goes back, and the samples of steps {}..={} are lost from the model",
            best.step + 1,
            self.record.step
        );
        self.record = best;
        self.no_holder_since = None;
        true
    }

    fn form(&mut self, now: Instant, answers: &mut Answers) {
        let asks: Vec<QuorumAsk> = std::mem::take(&mut self.waiting)
            .into_values()
            .map(|(ask, _)| ask)
            .collect();
        self.round_started = None;
        if self.adopting {
            if let Some(best) = asks.iter().map(|ask| ask.committed).max() {
                if best != CommitRecord::GENESIS {
                    tracing::info!(record = %best, "data parallelism: no commit record kept; adopting the most advanced member's");
                }
                self.record = best;
            }
            self.adopting = false;
        }
        let record = self.record;
        // Rank 0: the last quorum's rank 0 if it holds H, else the first
        // holder by id.
        let previous_source = self
            .last
            .as_ref()
            .and_then(|last| last.members.first().cloned());
        let source = asks
            .iter()
            .find(|ask| {
                Some(&ask.drafter_id) == previous_source.as_ref() && ask.committed == record
            })
            .or_else(|| asks.iter().find(|ask| ask.committed == record))
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
        let heal_reasons = self.heal_reasons(&asks, &source, record);
        let dropped: Vec<String> = self
            .last
            .iter()
            .flat_map(|last| last.members.iter())
            .filter(|member| !member_set.contains(*member))
            .cloned()
            .collect();
        if !dropped.is_empty() {
            tracing::info!(dropped = %dropped.join(", "), "data parallelism: quorum forms without members that left, are gone or were dropped");
        }
        // A step of the last quorum still without a decision never gets
        // one now: its members asked for a new quorum instead of voting.
        if let Some(last) = &self.last {
            let key = (last.quorum_id, last.step);
            if self
                .rounds
                .get(&key)
                .is_some_and(|round| round.decision.is_none())
            {
                self.decide(
                    now,
                    key,
                    Decision::abort("its members asked for a new quorum before every vote came"),
                    answers,
                );
            }
        }
        let same_members = self.last.as_ref().is_some_and(|last| {
            last.members.iter().cloned().collect::<BTreeSet<_>>() == member_set
        });
        let mut quorum_id = match &self.last {
            Some(last) if same_members && !self.last_step_failed => last.quorum_id,
            _ => self.new_quorum_id(),
        };
        if self.rounds.contains_key(&(quorum_id, record.step)) {
            // Never reuse a round's key: a decided round keeps its decision.
            quorum_id = self.new_quorum_id();
        }
        let heal = !heal_reasons.is_empty();
        if heal {
            self.counters.heals += 1;
        }
        self.formations += 1;
        let nonce = mix(self.instance ^ quorum_id.rotate_left(32), self.formations);
        let formed = Arc::new(Formed {
            quorum_id,
            instance: self.instance,
            nonce,
            step: record.step,
            record,
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
                step = record.step,
                members = %formed.members.join(", "),
                heal,
                "data parallelism: new quorum"
            );
        }
        self.counters.quorums_formed += 1;
        let longest = self.longest_recent_step();
        let wait_bound = asks
            .iter()
            .map(|ask| self.settings.wait_bound(ask.collective_timeout, longest))
            .max()
            .unwrap_or(self.settings.timeout);
        self.rounds.insert(
            (quorum_id, record.step),
            VoteRound {
                members: member_set,
                nonce,
                base: record,
                yes: BTreeSet::new(),
                no: BTreeMap::new(),
                formed_at: now,
                first_vote_at: None,
                decision: None,
                durable: false,
                wait_bound,
            },
        );
        self.expected = asks
            .iter()
            .map(|ask| {
                (
                    ask.drafter_id.clone(),
                    MemberClock {
                        collective_timeout: ask.collective_timeout,
                        seen_at: now,
                    },
                )
            })
            .collect();
        self.last_step_failed = false;
        self.last = Some(formed.clone());
        for member in &formed.members {
            answers
                .quorums
                .push((member.clone(), QuorumAnswer::Formed(formed.clone())));
        }
    }

    fn new_quorum_id(&mut self) -> u64 {
        let id = self.next_quorum_id;
        self.next_quorum_id += 1;
        id
    }

    /// Why the quorum heals (empty: it does not): members behind H or new
    /// (a model from a snapshot or checkpoint holds no commit), members on
    /// another history (a split: an error), holders whose checksum differs
    /// from rank 0's (an error).
    fn heal_reasons(
        &mut self,
        asks: &[QuorumAsk],
        source: &QuorumAsk,
        record: CommitRecord,
    ) -> Vec<String> {
        let mut reasons = Vec::new();
        for ask in asks {
            if ask.committed == record {
                if ask.state_checksum != source.state_checksum {
                    self.counters.checksum_mismatches += 1;
                    tracing::error!(
                        drafter_id = %ask.drafter_id,
                        checksum = ask.state_checksum,
                        rank0 = %source.drafter_id,
                        rank0_checksum = source.state_checksum,
                        record = %record,
                        "data parallelism: state checksum differs from rank 0's at the same commit; the member takes rank 0's state"
                    );
                    reasons.push(format!(
                        "{} checksum {:#018x} differs from {}'s {:#018x} at {record}",
                        ask.drafter_id,
                        ask.state_checksum,
                        source.drafter_id,
                        source.state_checksum
                    ));
                }
            } else if ask.committed.step >= record.step
                && (ask.committed.instance, ask.committed.quorum_id) != (0, 0)
            {
                self.counters.splits += 1;
                tracing::error!(
                    drafter_id = %ask.drafter_id,
                    member = %ask.committed,
                    run = %record,
                    "data parallelism: SPLIT: a member holds a history the run never committed; it takes rank 0's state"
                );
                reasons.push(format!(
                    "{} at {} is not the run's history ({record})",
                    ask.drafter_id, ask.committed
                ));
            } else {
                reasons.push(format!(
                    "{} at step {} of {}",
                    ask.drafter_id, ask.committed.step, record.step
                ));
            }
        }
        reasons
    }

    /// A member is lost (gone or left): a step it has not voted on fails.
    fn member_lost(&mut self, now: Instant, drafter_id: &str, why: &str, answers: &mut Answers) {
        let open: Vec<RoundKey> = self
            .rounds
            .iter()
            .filter(|(_, round)| {
                round.decision.is_none()
                    && round.members.contains(drafter_id)
                    && !round.yes.contains(drafter_id)
                    && !round.no.contains_key(drafter_id)
            })
            .map(|(key, _)| *key)
            .collect();
        for key in open {
            let reason = format!("member {drafter_id} did not vote: {why}");
            self.decide(now, key, Decision::abort(reason), answers);
        }
    }

    /// Records a committed step's duration for the wait bound.
    pub(super) fn record_step_time(&mut self, elapsed: Duration) {
        self.recent_steps.push_back(elapsed);
        while self.recent_steps.len() > RECENT_STEPS {
            self.recent_steps.pop_front();
        }
    }
}

/// splitmix64 of `a` and `b`: a round's nonce.
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.wrapping_add(b.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
