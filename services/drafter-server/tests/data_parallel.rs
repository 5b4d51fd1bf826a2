//! Data parallelism's promise, on real parts: N members (each a real
//! DFlash trainer of the tiny target, its own thread) that take their
//! steps through a real in-process broker's quorum and commit vote and
//! all-reduce over real c10d (Gloo on loopback) train what one trainer
//! trains on the same samples, and hold bit-identical weights and
//! optimizer state.
//!
//! The test is the scheduler (each member trains its fixed share of each
//! step), so every run computes the same numbers; the drafter's own loop
//! around the same calls is exercised by the system tests. Two faults run
//! on the same parts: a member that loses the broker's decision after the
//! broker recorded its vote (it fetches it again and ends where the others
//! do), a member that asks late, past `--quorum-timeout` (it is waited
//! for while it is live, not dropped), and the broker restarting on its
//! state dir between the members' votes and their fetch of the decision.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use dflash_broker::BrokerConfig;
use dflash_drafter_server::broker_link::BrokerLink;
use dflash_drafter_server::data_parallel::{DataParallel, DataParallelConfig, StepOutcome};
use dflash_drafter_server::engine::{build_engine, TrainingEngine};
use dflash_drafter_server::DrafterServerConfig;
use dflash_proto::v1 as proto;
use tch::Tensor;

/// Samples per optimizer step (the run's step, whatever N).
const STEP_SAMPLES: usize = 12;
const STEPS: usize = 4;
const LEARNING_RATE: f64 = 16e-3;

fn member_config(work: &std::path::Path, drafter_id: &str, broker: &str) -> DrafterServerConfig {
    let mut config = test_drafter_config(drafter_id, broker, work.join(drafter_id));
    // Every anchor position of these sequences: no sampling, so how the
    // samples are split among members does not change what is trained.
    config.num_anchors = 512;
    config.learning_rate = LEARNING_RATE;
    config.warmup_fraction = 0.0;
    config.total_steps = Some(STEPS as u64);
    config
}

fn engine(config: &DrafterServerConfig) -> Box<dyn TrainingEngine> {
    let settings = config.clone().validate().expect("a valid configuration");
    build_engine(&settings.engine, None, STEPS as u64).expect("the tiny drafter")
}

/// Forward and backward of `samples` on `engine`, one micro-batch.
fn accumulate(engine: &mut Box<dyn TrainingEngine>, samples: &[proto::Sample]) {
    let prepared = samples
        .iter()
        .map(|sample| engine.prepare(sample).expect("a valid sample"))
        .collect();
    engine.accumulate(prepared).expect("a micro-batch");
}

/// Every trainable tensor of an engine's model, by name.
fn weights(engine: &dyn TrainingEngine) -> Vec<(String, Tensor)> {
    let model = engine.draft_model().expect("a DFlash engine");
    let mut tensors: Vec<(String, Tensor)> = model
        .var_store()
        .variables()
        .into_iter()
        .map(|(name, tensor)| (name, tensor.detach().copy()))
        .collect();
    tensors.sort_by(|left, right| left.0.cmp(&right.0));
    tensors
}

/// What a member ends with: its weights, its state checksum and the commit
/// its model holds.
type MemberEnd = (Vec<(String, Tensor)>, u64, proto::CommitRecord);

/// A member's faults: decision fetches that lose their answer, and a
/// pause before asking for one step's quorum.
#[derive(Debug, Clone, Copy, Default)]
struct Faults {
    /// The member's decision fetches that lose their answer (needs the
    /// feature `test-hooks`).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    lose_decisions: u32,
    late_before_step: Option<(usize, Duration)>,
    /// Before asking for this step's quorum, the member waits for the
    /// others (all having accumulated their share): a restarted broker
    /// knows no last quorum to wait for and gathers whoever asks within
    /// 500 ms, as a new one does for the first step.
    regather_before_step: Option<usize>,
}

/// Member `rank` of `members`: its share of every step, through the
/// broker's quorum and c10d. Returns its weights, state checksum and the
/// commit its model holds.
fn run_member(
    config: DrafterServerConfig,
    runtime: tokio::runtime::Handle,
    (rank, members): (usize, usize),
    steps: Arc<Vec<Vec<proto::Sample>>>,
    start: Arc<Barrier>,
    faults: Faults,
) -> MemberEnd {
    let mut engine = engine(&config);
    #[cfg_attr(not(feature = "test-hooks"), allow(unused_mut))]
    let mut parallel_config = DataParallelConfig {
        collective_timeout: Duration::from_secs(30),
        snapshot_every: 0,
        ..DataParallelConfig::default()
    };
    #[cfg(feature = "test-hooks")]
    {
        parallel_config.lose_decisions = faults.lose_decisions;
    }
    let mut member = DataParallel::start(
        runtime,
        BrokerLink::new(&config.broker, Default::default()),
        &config.drafter_id,
        &parallel_config,
    )
    .expect("a member");
    let share_of = |samples: &[proto::Sample]| {
        let share = samples.len() / members;
        samples[rank * share..(rank + 1) * share].to_vec()
    };
    // The first share before the barrier: every member then asks for the
    // first quorum within the broker's gathering wait, however loaded the
    // machine (a member asking later would join the second step, healed).
    accumulate(&mut engine, &share_of(&steps[0]));
    start.wait();
    for (step, samples) in steps.iter().enumerate() {
        if step > 0 {
            accumulate(&mut engine, &share_of(samples));
        }
        if faults.regather_before_step == Some(step) {
            start.wait();
        }
        if let Some((late_step, pause)) = faults.late_before_step {
            if late_step == step {
                std::thread::sleep(pause);
            }
        }
        let trainer = engine.trainer_mut().expect("a trainer");
        match member.step(trainer, &[]) {
            StepOutcome::Committed { report, excluded } => {
                assert!(excluded.is_none(), "step {step}: left out: {excluded:?}");
                assert_eq!(report.step, step as u64 + 1);
                assert_eq!(report.samples, STEP_SAMPLES, "the run's step");
            }
            StepOutcome::NotCommitted { reason, .. } => {
                panic!("step {step}: not committed: {reason}")
            }
            StepOutcome::NoQuorum => panic!("step {step}: no quorum"),
        }
        assert_eq!(member.world_size(), members, "step {step}");
    }
    let checksum = engine.trainer().expect("a trainer").state_checksum();
    let committed = member.committed();
    member.leave(engine.trainer().expect("a trainer"));
    (weights(engine.as_ref()), checksum, committed)
}

/// `members` members against one trainer on the same samples. The bound:
/// the members' summed gradient differs from the one trainer's only by
/// float summation order (about 1e-7 of the gradient in f32), which AdamW's
/// normalisation carries into each step's update at most in proportion;
/// after 4 steps at learning rate 16e-3 the weights may then differ by a
/// small multiple of 1e-7 x the distance moved, far below 1e-3, while the
/// steps must move the largest weight by more than ten times that.
///
/// `restart_at_commit`: once the broker shows that step committed, it is
/// stopped and started again on its state dir (which `broker_config` must
/// name), while the members are still fetching that step's decision.
fn members_against_one_trainer(
    members: usize,
    broker_config: BrokerConfig,
    faults: &[Faults],
    restart_at_commit: Option<u64>,
) -> proto::LighthouseStatus {
    let work = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut broker = runtime.block_on(TestBroker::start(broker_config.clone()));
    let sequences = random_token_sequences(STEP_SAMPLES * STEPS, 20, 5);
    let samples = target_samples(&sequences);
    let steps: Arc<Vec<Vec<proto::Sample>>> =
        Arc::new(samples.chunks(STEP_SAMPLES).map(<[_]>::to_vec).collect());

    // One trainer on every sample of each step.
    let alone_config = member_config(work.path(), "alone", &broker.address);
    let mut alone = engine(&alone_config);
    let initial = weights(alone.as_ref());
    for samples in steps.iter() {
        accumulate(&mut alone, samples);
        alone.step().expect("a step");
    }
    let alone = weights(alone.as_ref());

    let start = Arc::new(Barrier::new(members));
    let threads: Vec<_> = (0..members)
        .map(|rank| {
            let config = member_config(work.path(), &format!("member-{rank}"), &broker.address);
            let (runtime, steps, start) = (runtime.handle().clone(), steps.clone(), start.clone());
            let faults = faults.get(rank).copied().unwrap_or_default();
            std::thread::spawn(move || {
                run_member(config, runtime, (rank, members), steps, start, faults)
            })
        })
        .collect();
    if let Some(step) = restart_at_commit {
        broker = runtime.block_on(async {
            let client = broker.client().await;
            let committed = wait_until(Duration::from_secs(120), || async {
                dflash_testkit::data_parallel_status(&client)
                    .await
                    .committed_step
                    >= step
            })
            .await;
            let status = dflash_testkit::data_parallel_status(&client).await;
            assert!(committed, "step {step} committed: {status:?}");
            // Every member is still fetching this step's decision (their
            // hook loses the answers of the first tries): the next step
            // cannot have formed.
            assert_eq!(status.committed_step, step, "{status:?}");
            broker.restart(broker_config).await
        });
    }
    let results: Vec<MemberEnd> = threads
        .into_iter()
        .map(|thread| thread.join().unwrap())
        .collect();

    let first = &results[0].0;
    for (held_weights, checksum, committed) in &results[1..] {
        assert_eq!(*checksum, results[0].1, "the members' states differ");
        assert_eq!(
            *committed, results[0].2,
            "the members hold different commits"
        );
        for ((name, held), (_, reference)) in held_weights.iter().zip(first) {
            assert!(
                held.equal(reference),
                "tensor {name} differs between members"
            );
        }
    }
    let mut moved = 0.0f64;
    let mut apart = 0.0f64;
    for (((name, member), (_, alone)), (_, initial)) in first.iter().zip(&alone).zip(&initial) {
        assert_eq!(member.size(), alone.size(), "{name}");
        moved = moved.max((alone - initial).abs().max().double_value(&[]));
        apart = apart.max((member - alone).abs().max().double_value(&[]));
    }
    eprintln!(
        "{members} members against one trainer: {apart:.3e} apart, the steps moved {moved:.3e}"
    );
    assert!(
        moved > 1e-2,
        "the steps moved the weights by {moved:.3e} only"
    );
    assert!(
        apart <= 1e-3,
        "the members are {apart:.3e} from one trainer's weights"
    );
    let status = runtime
        .block_on(async { dflash_testkit::data_parallel_status(&broker.client().await).await });
    assert_eq!(
        results[0].2.step, STEPS as u64,
        "every member holds the last commit"
    );
    assert_eq!(status.committed_step, STEPS as u64, "{status:?}");
    // Counted by this broker process: a restarted one committed the rest.
    let committed_here = STEPS as u64 - restart_at_commit.unwrap_or(0);
    assert_eq!(status.steps_committed, committed_here, "{status:?}");
    assert_eq!(status.checksum_mismatches, 0, "{status:?}");
    assert_eq!(status.splits, 0, "{status:?}");
    runtime.block_on(broker.stop());
    status
}

#[test]
fn two_members_train_what_one_trainer_trains() {
    members_against_one_trainer(2, BrokerConfig::for_targets(1), &[], None);
}

#[test]
fn three_members_train_what_one_trainer_trains() {
    members_against_one_trainer(3, BrokerConfig::for_targets(1), &[], None);
}

#[test]
fn four_members_train_what_one_trainer_trains() {
    members_against_one_trainer(4, BrokerConfig::for_targets(1), &[], None);
}

/// Member 1 loses the broker's answer twice at every step, after the broker
/// recorded its vote: it fetches the decision again, applies exactly the
/// steps the others apply, and nobody's state ever differs.
#[cfg(feature = "test-hooks")]
#[test]
fn a_member_that_loses_the_decision_fetches_it_again_and_ends_at_h() {
    let lossy = Faults {
        lose_decisions: 2,
        ..Faults::default()
    };
    let status = members_against_one_trainer(
        3,
        BrokerConfig::for_targets(1),
        &[Faults::default(), lossy],
        None,
    );
    assert_eq!(status.steps_failed, 0, "{status:?}");
    assert_eq!(status.unknown_decisions, 0, "{status:?}");
}

/// The broker stops after it committed step 2 and before any member learned
/// it, and starts again on its state dir: each member's next try reaches the
/// new broker, which answers COMMIT for the old instance's vote of the step
/// that made H; every member applies it, the run goes on at H on the new
/// broker, and every member ends at the last step with the same state.
///
/// Each member loses the answers of its first 6 tries of every decision
/// (6.3 s of pauses, 0.1 s doubling): the restart (well under a second
/// in-process) falls inside them. The members then wait for each other
/// before asking the new broker for step 3 (a new broker knows no last
/// quorum to wait for and gathers whoever asks within 500 ms; a loaded
/// machine could spread their asks wider).
#[cfg(feature = "test-hooks")]
#[test]
fn the_broker_restarting_between_vote_and_decision_loses_no_step() {
    let state = tempfile::tempdir().unwrap();
    let mut config = BrokerConfig::for_targets(1);
    config.state_dir = Some(state.path().to_path_buf());
    let lossy = Faults {
        lose_decisions: 6,
        // Step index 2 asks for step 3, the first on the restarted broker.
        regather_before_step: Some(2),
        ..Faults::default()
    };
    let status = members_against_one_trainer(3, config, &[lossy; 3], Some(2));
    assert_eq!(status.steps_failed, 0, "{status:?}");
    assert_eq!(status.unknown_decisions, 0, "{status:?}");
    assert_eq!(status.heals, 0, "no member was behind H: {status:?}");
}

/// Member 2 asks for step 2's quorum 3 s late, past the broker's 1 s
/// --quorum-timeout but within its own collective timeout (30 s): it is
/// live, so it is waited for, and every step has every member.
#[test]
fn a_live_member_asking_past_the_quorum_timeout_is_waited_for() {
    let mut config = BrokerConfig::for_targets(1);
    config.lighthouse.quorum_timeout = Duration::from_secs(1);
    let late = Faults {
        late_before_step: Some((2, Duration::from_secs(3))),
        ..Faults::default()
    };
    let status = members_against_one_trainer(
        3,
        config,
        &[Faults::default(), Faults::default(), late],
        None,
    );
    assert_eq!(status.members_dropped, 0, "{status:?}");
    assert_eq!(status.steps_failed, 0, "{status:?}");
}
