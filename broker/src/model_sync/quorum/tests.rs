use super::*;

const TIMEOUT: Duration = Duration::from_secs(10);
const IDLE: Duration = Duration::from_millis(500);

fn state() -> QuorumState {
    QuorumState::new(
        QuorumSettings {
            timeout: TIMEOUT,
            min_size: 1,
            idle_wait: IDLE,
        },
        7,
    )
}

fn ask(drafter_id: &str, step: u64, samples_ready: u64) -> QuorumAsk {
    QuorumAsk {
        drafter_id: drafter_id.to_string(),
        store_address: format!("{drafter_id}:29500"),
        step,
        state_checksum: 7,
        samples_ready,
        leaving: false,
    }
}

fn vote(drafter_id: &str, formed: &Formed, ok: bool) -> Vote {
    Vote {
        drafter_id: drafter_id.to_string(),
        quorum_id: formed.quorum_id,
        step: formed.step,
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

/// d0 and d1 form a quorum at `step` and commit it.
fn committed_pair(quorum: &mut QuorumState, now: Instant, step: u64) -> Arc<Formed> {
    let answers = formed_together(quorum, now, &[("d0", step), ("d1", step)]);
    let formed = formed_for(&answers, "d0").expect("formed");
    quorum.vote(now, vote("d0", &formed, true));
    let answers = quorum.vote(now, vote("d1", &formed, true));
    assert!(decision_for(&answers, "d0").unwrap().commit);
    formed
}

/// The first round: `askers` ask at `now` (with samples), and the round
/// forms once its gathering wait is over.
fn formed_together(quorum: &mut QuorumState, now: Instant, askers: &[(&str, u64)]) -> Answers {
    for (drafter_id, step) in askers {
        let answers = quorum.ask(now, ask(drafter_id, *step, 4));
        assert!(answers.quorums.is_empty(), "the first round gathers");
    }
    assert!(quorum.tick(now + IDLE / 2).quorums.is_empty());
    quorum.tick(now + IDLE)
}

#[test]
fn the_first_asker_with_samples_forms_a_quorum_of_itself_after_the_gathering_wait() {
    let mut quorum = state();
    let now = Instant::now();
    let answers = formed_together(&mut quorum, now, &[("d0", 0)]);
    let formed = formed_for(&answers, "d0").expect("a quorum of one");
    assert_eq!(formed.members, vec!["d0".to_string()]);
    assert_eq!(formed.step, 0);
    assert_eq!(formed.store_address, "d0:29500");
    assert!(!formed.heal);
}

#[test]
fn a_quorum_waits_for_every_member_of_the_last_one() {
    let mut quorum = state();
    let now = Instant::now();
    let first = committed_pair(&mut quorum, now, 0);
    // d0 asks for step 1; d1 has not asked yet: nobody is answered.
    let answers = quorum.ask(now, ask("d0", 1, 4));
    assert!(answers.quorums.is_empty());
    assert!(quorum.tick(now + TIMEOUT / 2).quorums.is_empty());
    let answers = quorum.ask(now + TIMEOUT / 2, ask("d1", 1, 0));
    let formed = formed_for(&answers, "d1").expect("formed once d1 asked");
    assert_eq!(formed_for(&answers, "d0").as_deref(), Some(&*formed));
    // The same members after a committed step keep the quorum (and group).
    assert_eq!(formed.quorum_id, first.quorum_id);
    assert_eq!(formed.step, 1);
    assert_eq!(formed.members.len(), 2);
}

#[test]
fn a_member_that_does_not_ask_within_the_timeout_is_dropped() {
    let mut quorum = state();
    let now = Instant::now();
    let first = committed_pair(&mut quorum, now, 0);
    quorum.ask(now, ask("d0", 1, 4));
    assert!(quorum
        .tick(now + TIMEOUT - Duration::from_millis(1))
        .quorums
        .is_empty());
    let answers = quorum.tick(now + TIMEOUT);
    let formed = formed_for(&answers, "d0").expect("formed without d1");
    assert_eq!(formed.members, vec!["d0".to_string()]);
    assert_ne!(
        formed.quorum_id, first.quorum_id,
        "a membership change is a new quorum"
    );
    assert_eq!(quorum.counters.members_dropped, 1);
    assert!(!quorum.expected().contains("d1"));
}

#[test]
fn askers_with_nothing_to_train_are_answered_idle_and_form_nothing() {
    let mut quorum = state();
    let now = Instant::now();
    quorum.ask(now, ask("d0", 0, 0));
    quorum.ask(now, ask("d1", 0, 0));
    assert!(quorum.tick(now + IDLE / 2).quorums.is_empty());
    let answers = quorum.tick(now + IDLE);
    assert_eq!(answers.quorums.len(), 2);
    assert!(answers
        .quorums
        .iter()
        .all(|(_, answer)| *answer == QuorumAnswer::Idle));
    assert!(quorum.last().is_none());
}

#[test]
fn an_idle_member_waiting_is_in_the_quorum_of_one_with_samples() {
    let mut quorum = state();
    let now = Instant::now();
    committed_pair(&mut quorum, now, 0);
    quorum.ask(now, ask("d1", 1, 0));
    let answers = quorum.ask(now, ask("d0", 1, 5));
    let formed = formed_for(&answers, "d1").expect("the idle member takes part");
    assert_eq!(formed.members.len(), 2);
}

#[test]
fn one_no_vote_fails_the_step_for_everyone_and_the_next_quorum_is_new() {
    let mut quorum = state();
    let now = Instant::now();
    let answers = formed_together(&mut quorum, now, &[("d0", 0), ("d1", 0)]);
    let formed = formed_for(&answers, "d0").unwrap();
    let answers = quorum.vote(now, vote("d0", &formed, true));
    assert!(answers.decisions.is_empty(), "d0 waits for d1's vote");
    let answers = quorum.vote(now, vote("d1", &formed, false));
    assert!(!decision_for(&answers, "d0").unwrap().commit);
    assert!(!decision_for(&answers, "d1").unwrap().commit);
    assert!(decision_for(&answers, "d1")
        .unwrap()
        .reason
        .contains("all-reduce failed"));
    assert_eq!(quorum.counters.steps_failed, 1);
    // Same members, same step again: a new quorum id (the group is suspect).
    quorum.ask(now, ask("d0", 0, 4));
    let answers = quorum.ask(now, ask("d1", 0, 4));
    let again = formed_for(&answers, "d0").unwrap();
    assert_ne!(again.quorum_id, formed.quorum_id);
    assert_eq!(again.step, 0);
}

#[test]
fn a_member_that_never_votes_fails_the_step_after_the_timeout() {
    let mut quorum = state();
    let now = Instant::now();
    let answers = formed_together(&mut quorum, now, &[("d0", 0), ("d1", 0)]);
    let formed = formed_for(&answers, "d0").unwrap();
    quorum.vote(now, vote("d0", &formed, true));
    assert!(quorum.tick(now + TIMEOUT / 2).decisions.is_empty());
    let answers = quorum.tick(now + TIMEOUT);
    let decision = decision_for(&answers, "d0").expect("decided at the timeout");
    assert!(!decision.commit);
    assert!(decision.reason.contains("d1"), "{}", decision.reason);
    // A late vote gets the same decision and changes nothing.
    let late = quorum.vote(now + TIMEOUT, vote("d1", &formed, true));
    assert_eq!(decision_for(&late, "d1"), Some(decision));
    assert_eq!(quorum.counters.steps_committed, 0);
}

#[test]
fn a_vote_for_a_quorum_or_step_that_is_not_open_is_no_and_changes_nothing() {
    let mut quorum = state();
    let now = Instant::now();
    let formed = committed_pair(&mut quorum, now, 0);
    let stale = Vote {
        step: formed.step + 5,
        ..vote("d0", &formed, true)
    };
    let answers = quorum.vote(now, stale);
    assert!(!decision_for(&answers, "d0").unwrap().commit);
    let stranger = quorum.vote(now, vote("d9", &formed, true));
    assert!(!decision_for(&stranger, "d9").unwrap().commit);
    assert_eq!(quorum.counters.steps_committed, 1);
    assert_eq!(quorum.counters.steps_failed, 0);
}

#[test]
fn a_new_or_behind_member_makes_the_quorum_heal_from_one_at_the_step() {
    let mut quorum = state();
    let now = Instant::now();
    let first = committed_pair(&mut quorum, now, 4);
    // d2 is new: it waits for the old members, and is in their quorum.
    assert!(quorum.ask(now, ask("d2", 0, 4)).quorums.is_empty());
    quorum.ask(now, ask("d0", 5, 4));
    let answers = quorum.ask(now, ask("d1", 5, 4));
    let formed = formed_for(&answers, "d2").expect("formed");
    assert!(formed.heal);
    assert!(
        formed.heal_reason.contains("d2 at step 0 of 5"),
        "{}",
        formed.heal_reason
    );
    assert_eq!(formed.step, 5);
    assert_eq!(
        formed.members[0], "d0",
        "rank 0 stays the last quorum's rank 0"
    );
    assert_eq!(formed.members.len(), 3);
    assert_ne!(formed.quorum_id, first.quorum_id);
    assert_eq!(quorum.counters.heals, 1);
}

#[test]
fn a_dropped_member_that_comes_back_is_healed_from_one_at_the_step() {
    let mut quorum = state();
    let now = Instant::now();
    committed_pair(&mut quorum, now, 0);
    // d0 (rank 0) stalls; d1 goes on alone and commits step 1.
    quorum.ask(now, ask("d1", 1, 4));
    let later = now + TIMEOUT;
    let alone = formed_for(&quorum.tick(later), "d1").expect("d1 alone");
    quorum.vote(later, vote("d1", &alone, true));
    // d0 comes back at step 1, d1 is at step 2: rank 0 is d1, and d0 heals.
    quorum.ask(later, ask("d0", 1, 4));
    let answers = quorum.ask(later, ask("d1", 2, 4));
    let formed = formed_for(&answers, "d0").expect("formed");
    assert_eq!(formed.members, vec!["d1".to_string(), "d0".to_string()]);
    assert_eq!(formed.step, 2);
    assert!(formed.heal);
    assert_eq!(formed.store_address, "d1:29500");
}

#[test]
fn a_checksum_that_differs_at_the_same_step_heals_and_is_counted() {
    let mut quorum = state();
    let now = Instant::now();
    quorum.ask(now, ask("d0", 3, 4));
    quorum.ask(
        now,
        QuorumAsk {
            state_checksum: 8,
            ..ask("d1", 3, 4)
        },
    );
    let formed = formed_for(&quorum.tick(now + IDLE), "d1").unwrap();
    assert!(formed.heal);
    assert!(
        formed.heal_reason.contains("checksum"),
        "{}",
        formed.heal_reason
    );
    assert_eq!(quorum.counters.checksum_mismatches, 1);
}

#[test]
fn a_leaving_member_is_not_waited_for() {
    let mut quorum = state();
    let now = Instant::now();
    committed_pair(&mut quorum, now, 0);
    quorum.ask(now, ask("d0", 1, 4));
    let answers = quorum.ask(
        now,
        QuorumAsk {
            leaving: true,
            ..ask("d1", 1, 0)
        },
    );
    assert_eq!(
        answers
            .quorums
            .iter()
            .find(|(id, _)| id == "d1")
            .map(|(_, a)| a.clone()),
        Some(QuorumAnswer::Left)
    );
    let formed = formed_for(&answers, "d0").expect("d0 goes on at once");
    assert_eq!(formed.members, vec!["d0".to_string()]);
}

#[test]
fn a_new_quorum_before_the_vote_ended_fails_the_open_step() {
    let mut quorum = state();
    let now = Instant::now();
    let answers = formed_together(&mut quorum, now, &[("d0", 0), ("d1", 0)]);
    let formed = formed_for(&answers, "d0").unwrap();
    // Both ask again without voting (their heal broadcast failed).
    quorum.ask(now, ask("d0", 0, 4));
    let answers = quorum.ask(now, ask("d1", 0, 4));
    let again = formed_for(&answers, "d0").unwrap();
    assert_ne!(again.quorum_id, formed.quorum_id);
    let late = quorum.vote(now, vote("d0", &formed, true));
    assert!(!decision_for(&late, "d0").unwrap().commit);
}

#[test]
fn min_size_holds_a_quorum_back_and_idles_its_askers() {
    let mut quorum = QuorumState::new(
        QuorumSettings {
            timeout: TIMEOUT,
            min_size: 2,
            idle_wait: IDLE,
        },
        7,
    );
    let now = Instant::now();
    assert!(quorum.ask(now, ask("d0", 0, 4)).quorums.is_empty());
    let answers = quorum.tick(now + IDLE);
    assert_eq!(
        answers.quorums,
        vec![("d0".to_string(), QuorumAnswer::Idle)]
    );
    quorum.ask(now + IDLE, ask("d0", 0, 4));
    quorum.ask(now + IDLE, ask("d1", 0, 0));
    let answers = quorum.tick(now + 2 * IDLE);
    assert_eq!(formed_for(&answers, "d0").unwrap().members.len(), 2);
}

#[test]
fn store_prefixes_differ_between_lighthouse_instances_and_quorums() {
    let now = Instant::now();
    let formed = |instance: u64| {
        let mut quorum = QuorumState::new(QuorumSettings::default(), instance);
        let answers = formed_together(&mut quorum, now, &[("d0", 0)]);
        formed_for(&answers, "d0").unwrap()
    };
    let (first, restarted) = (formed(1), formed(2));
    assert_eq!(first.quorum_id, restarted.quorum_id, "ids start again");
    assert_ne!(first.store_prefix(), restarted.store_prefix());
}
