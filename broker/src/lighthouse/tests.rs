//! The lighthouse's rules, one test each, with the clock as an argument
//! (no sleeps, no tokio).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

const TIMEOUT: Duration = Duration::from_secs(10);
const IDLE: Duration = Duration::from_millis(500);
const COLLECTIVE: Duration = Duration::from_secs(4);
const INSTANCE: u64 = 7;

fn settings() -> LighthouseSettings {
    LighthouseSettings {
        timeout: TIMEOUT,
        min_size: 1,
        idle_wait: IDLE,
        rollback_after: None,
    }
}

fn lighthouse() -> Lighthouse {
    Lighthouse::new(settings(), INSTANCE, None)
}

fn ask(drafter_id: &str, committed: CommitRecord, samples_ready: u64) -> QuorumAsk {
    QuorumAsk {
        drafter_id: drafter_id.to_string(),
        store_address: format!("{drafter_id}:29500"),
        committed,
        state_checksum: 7,
        samples_ready,
        leaving: false,
        collective_timeout: COLLECTIVE,
    }
}

fn vote(drafter_id: &str, formed: &Formed, ok: bool) -> Vote {
    Vote {
        drafter_id: drafter_id.to_string(),
        instance: formed.instance,
        quorum_id: formed.quorum_id,
        step: formed.step,
        nonce: formed.nonce,
        ok,
        reason: if ok {
            String::new()
        } else {
            "all-reduce failed".to_string()
        },
    }
}

/// The quorum answered to `drafter_id`, if one was.
fn formed_for(answers: &Answers, drafter_id: &str) -> Option<Arc<Formed>> {
    answers
        .quorums
        .iter()
        .find_map(|(id, answer)| match answer {
            QuorumAnswer::Formed(formed) if id == drafter_id => Some(formed.clone()),
            _ => None,
        })
}

fn decision_for(answers: &Answers, drafter_id: &str) -> Option<Decision> {
    answers
        .decisions
        .iter()
        .find(|(id, _)| id == drafter_id)
        .map(|(_, decision)| decision.clone())
}

/// Every member of `formed` votes yes, the commit is made durable; the
/// record every member now holds.
fn commit_all(lighthouse: &mut Lighthouse, now: Instant, formed: &Formed) -> CommitRecord {
    let mut settlements = Vec::new();
    for member in &formed.members {
        let answers = lighthouse.vote(now, vote(member, formed, true));
        settlements.extend(answers.settlements);
    }
    let Some(Settlement::Commit { round, record }) = settlements.pop() else {
        panic!("no commit settlement: {settlements:?}");
    };
    let answers = lighthouse.durable(round);
    for member in &formed.members {
        let decision = decision_for(&answers, member).expect("every voter hears the commit");
        assert_eq!(decision.outcome, Outcome::Commit, "{decision:?}");
        assert_eq!(decision.record, Some(record));
    }
    record
}

/// The first round: `askers` ask at `now` (with samples), and the round
/// forms once its gathering wait is over.
fn formed_together(
    lighthouse: &mut Lighthouse,
    now: Instant,
    askers: &[(&str, CommitRecord)],
) -> Arc<Formed> {
    for (drafter_id, committed) in askers {
        let answers = lighthouse.ask(now, ask(drafter_id, *committed, 4));
        assert!(answers.quorums.is_empty(), "the first round gathers");
    }
    let answers = lighthouse.tick(now + IDLE);
    formed_for(&answers, askers[0].0).expect("formed after the gathering wait")
}

/// `askers` ask in turn at `now`; the quorum the last ask formed, if any.
fn ask_all(
    lighthouse: &mut Lighthouse,
    now: Instant,
    askers: &[(&str, CommitRecord)],
) -> Option<Arc<Formed>> {
    let mut formed = None;
    for (drafter_id, committed) in askers {
        let answers = lighthouse.ask(now, ask(drafter_id, *committed, 4));
        formed = formed.or_else(|| formed_for(&answers, drafter_id));
    }
    formed
}

#[test]
fn three_members_commit_steps_and_keep_one_quorum_id() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(
        &mut lighthouse,
        now,
        &[("d0", genesis), ("d1", genesis), ("d2", genesis)],
    );
    assert_eq!(formed.step, 0);
    assert!(!formed.heal);
    let record = commit_all(&mut lighthouse, now, &formed);
    assert_eq!(
        record,
        CommitRecord {
            step: 1,
            instance: INSTANCE,
            quorum_id: formed.quorum_id
        }
    );
    assert_eq!(lighthouse.record(), record);
    let next = ask_all(
        &mut lighthouse,
        now,
        &[("d0", record), ("d1", record), ("d2", record)],
    )
    .expect("every member asked");
    assert_eq!(next.step, 1);
    assert_eq!(next.quorum_id, formed.quorum_id);
    assert_ne!(next.nonce, formed.nonce, "each formation is its own round");
    assert_eq!(
        next.store_prefix(),
        formed.store_prefix(),
        "the same members keep their group"
    );
    assert_eq!(lighthouse.counters.steps_committed, 1);
}

/// The split: a lone member commits past the others; the others
/// coming back at their old step never form a quorum of their own below H.
#[test]
fn no_quorum_forms_below_h_without_a_holder_of_h() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(
        &mut lighthouse,
        now,
        &[("d0", genesis), ("d1", genesis), ("d2", genesis)],
    );
    let h1 = commit_all(&mut lighthouse, now, &formed);
    // d1 asks; d0 and d2 are gone (their streams ended), so d1 forms alone.
    lighthouse.member_gone(now, "d0");
    lighthouse.member_gone(now, "d2");
    let alone =
        ask_all(&mut lighthouse, now, &[("d1", h1)]).expect("d1 alone is every live member");
    assert_eq!(alone.members, vec!["d1".to_string()]);
    let h2 = commit_all(&mut lighthouse, now, &alone);
    assert_eq!(h2.step, 2);
    // d1 goes quiet (stream gone); d0 and d2 come back at step 1, holding
    // h1, which is no longer H: they wait, they never commit step 2 again.
    lighthouse.member_gone(now, "d1");
    let mut later = now;
    for _ in 0..10 {
        later += TIMEOUT;
        let formed = ask_all(&mut lighthouse, later, &[("d0", h1), ("d2", h1)]);
        assert_eq!(formed, None, "a quorum formed below H without a holder");
        let answers = lighthouse.tick(later + IDLE);
        assert!(answers
            .quorums
            .iter()
            .all(|(_, answer)| *answer == QuorumAnswer::Idle));
    }
    assert!(lighthouse.waiting_for_holder());
    assert_eq!(lighthouse.record(), h2);
    // The holder comes back: one quorum at H, the others healed from it.
    later += TIMEOUT;
    lighthouse.member_back("d1");
    let askers = [("d0", h1), ("d2", h1), ("d1", h2)];
    let formed = ask_all(&mut lighthouse, later, &askers).expect("a holder asked");
    assert_eq!(formed.step, 2);
    assert_eq!(formed.members[0], "d1", "rank 0 holds H");
    assert!(formed.heal);
    assert_eq!(lighthouse.counters.splits, 0, "behind is not a split");
    assert_eq!(lighthouse.counters.checksum_mismatches, 0);
}

#[test]
fn a_member_on_another_history_is_a_counted_split_and_healed() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]);
    let h1 = commit_all(&mut lighthouse, now, &formed);
    let other = CommitRecord {
        step: 1,
        instance: INSTANCE,
        quorum_id: 99,
    };
    let formed = ask_all(&mut lighthouse, now, &[("d0", h1), ("d1", other)]).expect("formed");
    assert_eq!(formed.members[0], "d0");
    assert!(formed.heal);
    assert!(formed.heal_reason.contains("d1"), "{}", formed.heal_reason);
    assert_eq!(lighthouse.counters.splits, 1);
    // A model read from the run's snapshot at H holds no commit: it is
    // new, healed, and no split.
    let record = commit_all(&mut lighthouse, now, &formed);
    let from_snapshot = CommitRecord {
        step: record.step,
        instance: 0,
        quorum_id: 0,
    };
    let formed = ask_all(
        &mut lighthouse,
        now,
        &[("d2", from_snapshot), ("d0", record), ("d1", record)],
    )
    .or_else(|| formed_for(&lighthouse.tick(now + TIMEOUT * 10), "d0"))
    .expect("formed");
    assert!(formed.heal);
    assert_eq!(lighthouse.counters.splits, 1, "no second split");
}

/// Two quorums at the same H (the later one formed after the first's
/// members were lost): only one of them commits step H + 1.
#[test]
fn a_round_commits_only_while_h_is_the_step_it_formed_at() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis)]);
    // The round is open; fake a commit of the same step by another round
    // (as a restarted broker without a record could): the open round
    // must not commit a second step 1.
    lighthouse.record = CommitRecord {
        step: 1,
        instance: INSTANCE,
        quorum_id: 42,
    };
    let answers = lighthouse.vote(now, vote("d0", &formed, true));
    let decision = decision_for(&answers, "d0").expect("decided");
    assert_eq!(decision.outcome, Outcome::Abort, "{decision:?}");
    assert!(decision.reason.contains("moved"), "{}", decision.reason);
    assert_eq!(
        answers.settlements,
        vec![Settlement::Abort {
            round: (formed.quorum_id, 0)
        }]
    );
}

#[test]
fn a_vote_for_an_unknown_round_is_unknown_never_no() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let stranger = Vote {
        drafter_id: "d0".to_string(),
        instance: INSTANCE,
        quorum_id: 12,
        step: 40,
        nonce: 1,
        ok: true,
        reason: String::new(),
    };
    let answers = lighthouse.vote(now, stranger.clone());
    assert_eq!(
        decision_for(&answers, "d0").unwrap().outcome,
        Outcome::Unknown
    );
    let other_instance = Vote {
        instance: INSTANCE + 1,
        ..stranger
    };
    let answers = lighthouse.vote(now, other_instance);
    assert_eq!(
        decision_for(&answers, "d0").unwrap().outcome,
        Outcome::Unknown
    );
    assert_eq!(lighthouse.counters.unknown_decisions, 2);
    assert!(
        answers.settlements.is_empty(),
        "an unknown vote changes nothing"
    );
}

/// The decision fetch is idempotent: a retried vote gets the same answer,
/// even once its round is forgotten, until the member asks again.
#[test]
fn a_retried_vote_gets_the_decision_again() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]);
    let record = commit_all(&mut lighthouse, now, &formed);
    let again = lighthouse.vote(now, vote("d1", &formed, true));
    assert_eq!(decision_for(&again, "d1").unwrap().record, Some(record));
    assert!(
        again.settlements.is_empty(),
        "a retry settles nothing twice"
    );
    lighthouse.rounds.clear();
    let forgotten = lighthouse.vote(now, vote("d1", &formed, true));
    assert_eq!(
        decision_for(&forgotten, "d1").unwrap().outcome,
        Outcome::Commit
    );
}

#[test]
fn a_commit_is_answered_only_once_durable() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]);
    assert!(lighthouse
        .vote(now, vote("d0", &formed, true))
        .decisions
        .is_empty());
    let answers = lighthouse.vote(now, vote("d1", &formed, true));
    assert!(
        answers.decisions.is_empty(),
        "nobody hears a commit before it is durable"
    );
    assert_eq!(answers.settlements.len(), 1);
    // A retry meanwhile waits as well.
    assert!(lighthouse
        .vote(now, vote("d0", &formed, true))
        .decisions
        .is_empty());
    let answers = lighthouse.durable((formed.quorum_id, formed.step));
    let heard: BTreeSet<&str> = answers
        .decisions
        .iter()
        .map(|(id, _)| id.as_str())
        .collect();
    assert_eq!(heard, BTreeSet::from(["d0", "d1"]));
}

/// A broker restarted with its state dir: the restored record is H, the
/// members holding it form at once, and a vote of the old instance for the
/// step that made H is answered COMMIT.
#[test]
fn a_restart_restores_h_and_answers_the_commit_it_recorded() {
    let now = Instant::now();
    let recorded = CommitRecord {
        step: 9,
        instance: 3,
        quorum_id: 5,
    };
    let mut lighthouse = Lighthouse::new(settings(), INSTANCE, Some(recorded));
    let late = Vote {
        drafter_id: "d0".to_string(),
        instance: 3,
        quorum_id: 5,
        step: 8,
        nonce: 77,
        ok: true,
        reason: String::new(),
    };
    let answers = lighthouse.vote(now, late.clone());
    let decision = decision_for(&answers, "d0").unwrap();
    assert_eq!(decision.outcome, Outcome::Commit);
    assert_eq!(decision.record, Some(recorded));
    let earlier = Vote { step: 7, ..late };
    let answers = lighthouse.vote(now, earlier);
    assert_eq!(
        decision_for(&answers, "d0").unwrap().outcome,
        Outcome::Unknown
    );
    // Members behind the record alone never form.
    let behind = CommitRecord {
        step: 8,
        instance: 3,
        quorum_id: 5,
    };
    lighthouse.ask(now, ask("d1", behind, 4));
    assert!(formed_for(&lighthouse.tick(now + IDLE), "d1").is_none());
    let formed = ask_all(
        &mut lighthouse,
        now + IDLE,
        &[("d0", recorded), ("d1", behind)],
    )
    .or_else(|| formed_for(&lighthouse.tick(now + IDLE * 3), "d0"))
    .expect("a holder asked");
    assert_eq!(formed.step, 9);
    assert_eq!(formed.members[0], "d0");
}

/// Without a state dir a restarted broker adopts the most advanced member.
#[test]
fn a_broker_without_a_record_adopts_the_most_advanced_member() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let old = CommitRecord {
        step: 30,
        instance: 3,
        quorum_id: 2,
    };
    let behind = CommitRecord {
        step: 29,
        instance: 3,
        quorum_id: 2,
    };
    let formed = formed_together(&mut lighthouse, now, &[("d1", behind), ("d0", old)]);
    assert_eq!(formed.step, 30);
    assert_eq!(formed.members[0], "d0");
    assert!(formed.heal);
    assert_eq!(lighthouse.record(), old);
}

#[test]
fn a_live_member_is_waited_for_up_to_its_collective_timeout_plus_two_steps() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(
        &mut lighthouse,
        now,
        &[("d0", genesis), ("d1", genesis), ("d2", genesis)],
    );
    let step_time = Duration::from_secs(6);
    let asked = now + IDLE + step_time;
    let record = commit_all(&mut lighthouse, asked, &formed);
    // Bound: max(10 s, 4 s + 2 × 6 s) = 16 s.
    assert!(ask_all(&mut lighthouse, asked, &[("d0", record), ("d1", record)]).is_none());
    let before = lighthouse.tick(asked + Duration::from_secs(15));
    assert!(
        formed_for(&before, "d0").is_none(),
        "d2 is still within its bound"
    );
    let after = lighthouse.tick(asked + Duration::from_secs(16));
    let formed = formed_for(&after, "d0").expect("d2 dropped past its bound");
    assert_eq!(formed.members.len(), 2);
    assert_eq!(lighthouse.counters.members_dropped, 1);
}

#[test]
fn a_member_between_an_idle_answer_and_its_next_ask_is_not_late() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(
        &mut lighthouse,
        now,
        &[("d0", genesis), ("d1", genesis), ("d2", genesis)],
    );
    let record = commit_all(&mut lighthouse, now, &formed);
    // d2 hangs. d0 and d1 hold nothing: each asks, is answered idle after
    // the idle wait and asks again 100 ms later; the broker ticks every
    // 50 ms, so some ticks find one of them between two asks. The round
    // goes on past every bound (max(10 s, 4 s + 0) = 10 s), and only the
    // silent d2 is late.
    let tick = Duration::from_millis(50);
    let again = Duration::from_millis(100);
    let mut next_ask: Vec<(&str, Instant)> = vec![("d0", now), ("d1", now + IDLE / 2)];
    let mut t = now;
    while t < now + 3 * TIMEOUT {
        for (drafter_id, at) in next_ask.iter_mut() {
            if *at <= t {
                lighthouse.ask(t, ask(drafter_id, record, 0));
                *at = t + Duration::from_secs(3600);
            }
        }
        t += tick;
        let answers = lighthouse.tick(t);
        for (drafter_id, answer) in &answers.quorums {
            assert_eq!(*answer, QuorumAnswer::Idle, "{drafter_id}: nothing to step");
            if let Some((_, at)) = next_ask.iter_mut().find(|(id, _)| id == drafter_id) {
                *at = t + again;
            }
        }
    }
    assert_eq!(
        lighthouse.counters.members_dropped, 1,
        "d2 alone is dropped, d0 and d1 kept asking"
    );
    // Samples come to d0: it steps with d1 (whose idle ask is held or
    // comes next), without waiting for d2.
    let mut formed = formed_for(&lighthouse.ask(t, ask("d0", record, 4)), "d0");
    if formed.is_none() {
        formed = formed_for(&lighthouse.ask(t, ask("d1", record, 0)), "d0");
    }
    let formed = formed.expect("d0 and d1 step");
    assert_eq!(formed.members.len(), 2, "{formed:?}");
}

#[test]
fn a_quorum_needs_a_majority_of_the_last_quorums_live_members() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(
        &mut lighthouse,
        now,
        &[("d0", genesis), ("d1", genesis), ("d2", genesis)],
    );
    let record = commit_all(&mut lighthouse, now, &formed);
    // d0 alone, d1 and d2 live but silent: past every bound, still no
    // quorum of one out of three live members.
    lighthouse.ask(now, ask("d0", record, 4));
    let much_later = now + Duration::from_secs(3600);
    assert!(formed_for(&lighthouse.tick(much_later), "d0").is_none());
    // d1's stream goes: one of two live members is not a majority either.
    lighthouse.member_gone(much_later, "d1");
    lighthouse.ask(much_later, ask("d0", record, 4));
    assert!(formed_for(&lighthouse.tick(much_later + IDLE), "d0").is_none());
    // d2's too: d0 is every live member.
    lighthouse.member_gone(much_later, "d2");
    let answers = lighthouse.ask(much_later + IDLE, ask("d0", record, 4));
    assert!(formed_for(&answers, "d0").is_some());
}

#[test]
fn one_no_vote_aborts_for_everyone_and_the_next_quorum_is_new() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]);
    lighthouse.vote(now, vote("d0", &formed, true));
    let answers = lighthouse.vote(now, vote("d1", &formed, false));
    for member in ["d0", "d1"] {
        assert_eq!(
            decision_for(&answers, member).unwrap().outcome,
            Outcome::Abort
        );
    }
    assert_eq!(
        answers.settlements,
        vec![Settlement::Abort {
            round: (formed.quorum_id, 0)
        }]
    );
    assert_eq!(lighthouse.record(), genesis);
    let next = ask_all(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]).expect("formed");
    assert_ne!(next.quorum_id, formed.quorum_id);
}

#[test]
fn a_member_whose_stream_goes_before_its_vote_aborts_the_step() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]);
    assert!(lighthouse
        .vote(now, vote("d0", &formed, true))
        .decisions
        .is_empty());
    let answers = lighthouse.member_gone(now, "d1");
    let decision = decision_for(&answers, "d0").expect("d0 hears at once");
    assert_eq!(decision.outcome, Outcome::Abort);
    assert!(decision.reason.contains("d1"), "{}", decision.reason);
}

#[test]
fn a_vote_with_a_stale_nonce_or_from_a_stranger_changes_nothing() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]);
    let mut stale = vote("d0", &formed, true);
    stale.nonce ^= 1;
    assert_eq!(lighthouse.admits(&stale), Admission::Answered);
    let answers = lighthouse.vote(now, stale);
    assert_eq!(
        decision_for(&answers, "d0").unwrap().outcome,
        Outcome::Abort
    );
    let stranger = vote("d9", &formed, true);
    assert_eq!(lighthouse.admits(&stranger), Admission::Answered);
    lighthouse.vote(now, stranger);
    // The round is still open for its members.
    assert_eq!(
        lighthouse.admits(&vote("d0", &formed, true)),
        Admission::Open((formed.quorum_id, formed.step))
    );
    commit_all(&mut lighthouse, now, &formed);
}

#[test]
fn a_member_that_never_votes_aborts_the_step_past_the_vote_bound() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]);
    lighthouse.vote(now, vote("d0", &formed, true));
    assert!(lighthouse
        .tick(now + TIMEOUT - Duration::from_millis(1))
        .decisions
        .is_empty());
    let answers = lighthouse.tick(now + TIMEOUT);
    assert_eq!(
        decision_for(&answers, "d0").unwrap().outcome,
        Outcome::Abort
    );
}

#[test]
fn rollback_is_explicit_counted_and_names_the_lost_steps() {
    let mut lighthouse = Lighthouse::new(
        LighthouseSettings {
            rollback_after: Some(Duration::from_secs(60)),
            ..settings()
        },
        INSTANCE,
        Some(CommitRecord {
            step: 12,
            instance: 3,
            quorum_id: 1,
        }),
    );
    let now = Instant::now();
    let behind = CommitRecord {
        step: 10,
        instance: 3,
        quorum_id: 1,
    };
    lighthouse.ask(now, ask("d0", behind, 4));
    assert!(formed_for(&lighthouse.tick(now + Duration::from_secs(59)), "d0").is_none());
    lighthouse.ask(now + Duration::from_secs(59), ask("d0", behind, 4));
    let answers = lighthouse.tick(now + Duration::from_secs(60));
    let formed = formed_for(&answers, "d0").expect("rolled back");
    assert_eq!(formed.step, 10);
    assert_eq!(lighthouse.counters.rollbacks, 1);
    assert_eq!(lighthouse.counters.steps_rolled_back, 2);
}

#[test]
fn a_leaving_member_is_not_waited_for_and_fails_its_open_step() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    let formed = formed_together(&mut lighthouse, now, &[("d0", genesis), ("d1", genesis)]);
    let record = commit_all(&mut lighthouse, now, &formed);
    let mut leaving = ask("d1", record, 0);
    leaving.leaving = true;
    let answers = lighthouse.ask(now, leaving);
    assert!(answers
        .quorums
        .contains(&("d1".to_string(), QuorumAnswer::Left)));
    let formed =
        ask_all(&mut lighthouse, now, &[("d0", record)]).expect("d0 alone is every live member");
    assert_eq!(formed.members, vec!["d0".to_string()]);
}

/// Only a Consume stream makes a drafter live: a process whose stream is
/// gone may still ask (a trainer outliving its stream), but once it stops
/// asking nobody waits for it.
#[test]
fn an_ask_after_the_stream_is_gone_is_served_but_not_waited_for_after() {
    let mut lighthouse = lighthouse();
    let now = Instant::now();
    let genesis = CommitRecord::GENESIS;
    lighthouse.member_gone(now, "zombie");
    let formed = formed_together(
        &mut lighthouse,
        now,
        &[("zombie", genesis), ("d1", genesis)],
    );
    assert_eq!(formed.members.len(), 2, "its ask is served");
    let record = commit_all(&mut lighthouse, now, &formed);
    let answers = lighthouse.ask(now, ask("d1", record, 4));
    let formed = formed_for(&answers, "d1").expect("the zombie is not waited for");
    assert_eq!(formed.members, vec!["d1".to_string()]);
    lighthouse.member_back("zombie");
    lighthouse.ask(now, ask("zombie", record, 4));
    assert!(!lighthouse.waiting_for_holder());
}
