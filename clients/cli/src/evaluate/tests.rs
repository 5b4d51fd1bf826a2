//! The evaluator's schedule and watch loop decisions, without a broker.

use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;

use super::watch::run_over;
use super::*;

#[test]
fn an_evaluation_is_due_every_k_versions_or_t_and_never_twice() {
    let schedule = Schedule {
        every_versions: 5,
        every: Duration::from_secs(60),
    };
    let start = Instant::now();
    assert!(schedule.due(0, None, start), "the first model");
    let last = Some((3, start));
    assert!(
        !schedule.due(3, last, start + Duration::from_secs(600)),
        "same version"
    );
    assert!(!schedule.due(7, last, start + Duration::from_secs(59)));
    assert!(schedule.due(8, last, start), "5 versions on");
    assert!(
        schedule.due(4, last, start + Duration::from_secs(60)),
        "a minute on"
    );
}

/// Every 10 versions (the time rule out of the way), `backlog` ahead;
/// what a version read holds is its number, to check the order.
fn every_ten_versions(backlog: u32) -> Watcher<u64> {
    let schedule = Schedule {
        every_versions: 10,
        every: Duration::from_secs(3600),
    };
    Watcher::new(schedule, backlog)
}

/// Reads `version` as the loop does once `on_status` says `Read`.
fn read(watcher: &mut Watcher<u64>, version: u64, now: Instant) {
    watcher.read(version, version, now);
}

/// Starts the next measurement, as the loop does when none runs, and
/// returns the version it measures.
fn start_measuring(watcher: &mut Watcher<u64>) -> u64 {
    let version = watcher.next_to_measure().unwrap();
    assert_eq!(watcher.next_to_measure(), None, "one measurement at a time");
    version
}

/// A measurement slower than the versions come: each due version is
/// read at once, up to the backlog (and the broker's bound), measured
/// in turn, oldest first; the final version is read once the run is
/// over and the watcher stops only when all is measured.
#[test]
fn due_versions_are_read_while_measuring_up_to_the_backlog_then_the_final_one() {
    let start = Instant::now();
    let mut watcher = every_ten_versions(3);
    assert_eq!(
        watcher.on_status(None, 4, false, start),
        Next::Wait,
        "no model yet"
    );
    assert_eq!(watcher.next_to_measure(), None, "nothing read");
    assert_eq!(watcher.on_status(Some(0), 4, false, start), Next::Read);
    read(&mut watcher, 0, start);
    assert_eq!(start_measuring(&mut watcher), 0);
    // Version 0 is being measured; 5 is not due, 10 and 20 are.
    assert_eq!(watcher.on_status(Some(5), 4, false, start), Next::Wait);
    for version in [10, 20] {
        assert_eq!(
            watcher.on_status(Some(version), 4, false, start),
            Next::Read
        );
        read(&mut watcher, version, start);
    }
    assert_eq!(watcher.unmeasured(), 3);
    assert_eq!(
        watcher.on_status(Some(30), 4, false, start),
        Next::Wait,
        "the backlog is full"
    );
    assert_eq!(watcher.measured(0, true), Ok(()));
    assert_eq!(watcher.unmeasured(), 2);
    assert_eq!(start_measuring(&mut watcher), 10);
    // The broker keeps 2: two unmeasured are as many as it holds.
    assert_eq!(watcher.on_status(Some(30), 2, false, start), Next::Wait);
    assert_eq!(watcher.on_status(Some(30), 4, false, start), Next::Read);
    read(&mut watcher, 30, start);
    // The run ends at version 33: read at once when there is room,
    // and the watcher stops only once every version is measured.
    assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Wait);
    assert_eq!(watcher.measured(10, true), Ok(()));
    assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Read);
    read(&mut watcher, 33, start);
    assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Wait);
    for version in [20, 30] {
        assert_eq!(start_measuring(&mut watcher), version);
        assert_eq!(watcher.measured(version, true), Ok(()));
        assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Wait);
    }
    assert_eq!(start_measuring(&mut watcher), 33);
    assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Wait);
    assert_eq!(watcher.measured(33, true), Ok(()));
    assert_eq!(watcher.unmeasured(), 0);
    assert_eq!(watcher.on_status(Some(33), 4, true, start), Next::Stop);
}

#[test]
fn a_failed_measurement_is_read_again_unless_it_is_the_final_one() {
    let start = Instant::now();
    let mut watcher = every_ten_versions(2);
    assert_eq!(watcher.on_status(Some(4), 0, false, start), Next::Read);
    read(&mut watcher, 4, start);
    assert_eq!(start_measuring(&mut watcher), 4);
    assert_eq!(watcher.measured(4, false), Ok(()));
    assert_eq!(
        watcher.on_status(Some(6), 0, false, start),
        Next::Read,
        "read again"
    );
    read(&mut watcher, 6, start);
    assert_eq!(watcher.on_status(Some(9), 0, true, start), Next::Read);
    read(&mut watcher, 9, start);
    assert_eq!(start_measuring(&mut watcher), 6);
    assert_eq!(watcher.measured(6, true), Ok(()));
    assert_eq!(start_measuring(&mut watcher), 9);
    assert_eq!(
        watcher.measured(9, false),
        Err(9),
        "the final version failed"
    );
}

#[test]
fn a_version_no_longer_kept_is_told_apart_from_a_broker_that_did_not_answer() {
    let refusal = || {
        tonic::Status::failed_precondition(
            "model version 7 is not kept for evaluation (kept: [8]); read the current model",
        )
    };
    let refused = ReadError::from_status(refusal(), Some(7));
    assert!(!refused.may_pass_again());
    assert!(
        refused
            .to_string()
            .contains("no longer keeps model version 7")
            && refused.to_string().contains("kept: [8]"),
        "{refused}"
    );
    // Refused while reading the current model ("no model yet"): a
    // drafter may join, so a later read may pass.
    assert!(ReadError::from_status(refusal(), None).may_pass_again());
    let unanswered = tonic::Status::unavailable("connection refused");
    assert!(ReadError::from_status(unanswered, Some(7)).may_pass_again());
    assert!(!ReadError::Malformed("expected the header first".into()).may_pass_again());
}

#[test]
fn a_run_over_without_a_model_stops_at_once() {
    let schedule = Schedule {
        every_versions: 1,
        every: Duration::from_secs(1),
    };
    let mut watcher: Watcher<()> = Watcher::new(schedule, 1);
    assert_eq!(watcher.on_status(None, 0, true, Instant::now()), Next::Stop);
}

#[test]
fn the_run_is_over_once_complete_with_the_final_model_or_aborted() {
    let mut snapshot = proto::StatusSnapshot {
        state: proto::BrokerState::Complete as i32,
        model_sync: Some(proto::ModelSyncStatus {
            has_model: true,
            final_saved: false,
            ..Default::default()
        }),
        ..Default::default()
    };
    assert!(!run_over(&snapshot), "the final model is not written yet");
    if let Some(sync) = snapshot.model_sync.as_mut() {
        sync.final_saved = true;
    }
    assert!(run_over(&snapshot));
    snapshot.state = proto::BrokerState::Running as i32;
    assert!(!run_over(&snapshot));
    snapshot.state = proto::BrokerState::Aborted as i32;
    assert!(run_over(&snapshot));
}
