//! The Produce stream across broker restarts (defects (b) and (c) of #24):
//! the reconnect budget is per outage, so routine restarts of a long run
//! never add up to it; SIGTERM (the run's shutdown token) is honoured
//! while the broker holds the target back; and the run's capture, told in
//! every welcome, must not change under a running target.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use dflash_broker::BrokerConfig;
use dflash_proto::v1::Item;
use dflash_target_server::stream::ResilientProducer;
use dflash_target_server::{run, DeviceChoice, ModelSource, TargetServerConfig};
use dflash_testkit::{sample, wait_until, BrokerProcess, TestBroker};
use tokio_util::sync::CancellationToken;

const ITEM_BYTES: usize = 4096;

fn item(seq: u64) -> Item {
    Item {
        seq,
        sample: Some(sample(ITEM_BYTES, seq)),
        trace_context: HashMap::new(),
    }
}

/// Five SIGKILL-and-restart cycles of the broker binary on its state dir,
/// with items accepted between them, against a budget of 3 attempts: each
/// outage needs one or two, so the budget holds only if it is per outage
/// (the previous, process-wide count gave up at the third restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routine_broker_restarts_never_add_up_to_the_reconnect_budget() {
    const RESTARTS: u64 = 5;
    const ITEMS_BETWEEN: u64 = 3;
    const BUDGET: u32 = 3;
    let work = tempfile::tempdir().unwrap();
    let state_dir = work.path().join("state");
    let mut broker = BrokerProcess::start(
        &[
            "--expected-targets",
            "1",
            "--state-dir",
            state_dir.to_str().unwrap(),
            "--fsync",
            "always",
        ],
        work.path().join("broker.log"),
    )
    .await;
    let mut producer = ResilientProducer::open(broker.client().await, "target-0", BUDGET)
        .await
        .unwrap();
    let mut seq = 0;
    for restart in 0..RESTARTS {
        for _ in 0..ITEMS_BETWEEN {
            producer
                .send_item(item(seq))
                .await
                .unwrap_or_else(|error| panic!("seq {seq} after {restart} restarts: {error}"));
            seq += 1;
        }
        let expected = seq;
        assert!(
            wait_until(Duration::from_secs(30), || async {
                broker.client().await.status().await.unwrap().accepted_items == expected
            })
            .await,
            "the broker has seqs 0..{expected}; log: {}",
            broker.log()
        );
        broker.restart().await;
    }
    producer
        .send_item(item(seq))
        .await
        .unwrap_or_else(|error| panic!("seq {seq} after {RESTARTS} restarts: {error}"));
    let report = producer.finish().await.unwrap();
    assert!(report.rejected.is_empty(), "{report:?}");
    let status = broker.client().await.status().await.unwrap();
    assert_eq!(status.accepted_items, seq + 1, "{status:?}");
}

/// A target held back by a full queue (no drafter) stops when its shutdown
/// token fires instead of waiting for room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_honoured_while_the_broker_holds_the_target_back() {
    const FINISH_TIMEOUT: Duration = Duration::from_secs(2);
    let mut broker_config = BrokerConfig::for_targets(1);
    broker_config.max_queue_bytes = 8 * 1024;
    broker_config.max_item_bytes = 8 * 1024;
    let broker = TestBroker::start(broker_config).await;
    let model: ModelSource = "synthetic:hidden=16,layers=2,tokens_per_s=0,samples=200,seq_len=32"
        .parse()
        .unwrap();
    let mut config = TargetServerConfig::new(&broker.address, "target-0", model, None);
    config.device = DeviceChoice::Cpu;
    config.max_batch_tokens = 64;
    config.finish_timeout = FINISH_TIMEOUT;
    let shutdown = CancellationToken::new();
    let target = tokio::spawn(run(config, shutdown.clone()));
    // Held back: the queue is full and the producer window is spent, so the
    // broker stops reading the stream.
    let last_accepted = std::sync::atomic::AtomicU64::new(u64::MAX);
    assert!(
        wait_until(Duration::from_secs(60), || async {
            let status = broker.status().await;
            let before =
                last_accepted.swap(status.accepted_items, std::sync::atomic::Ordering::Relaxed);
            // Two items of about 3 KiB (2 KiB of states, ids, mask and the
            // broker's bookkeeping) fill the 8 KiB queue.
            status.queued_items >= 2 && status.accepted_items == before
        })
        .await,
        "the target never filled the queue"
    );
    shutdown.cancel();
    // Honoured, by the order of events rather than a clock: the target
    // returns while the broker still holds it back (no drafter ever frees
    // room, so without the shutdown it would wait for ever). The 60 s only
    // stops that hang.
    let outcome = tokio::time::timeout(Duration::from_secs(60), target)
        .await
        .expect("the target ignored its shutdown while held back")
        .unwrap();
    match outcome {
        Ok(report) => assert!(!report.completed, "{report:?}"),
        Err(error) => panic!("an interrupted run is not an error: {error}"),
    }
    let status = broker.status().await;
    assert!(
        status.queued_items >= 2 && status.acked_items == 0,
        "room was freed after all: {status:?}"
    );
    broker.stop().await;
}

/// `--on-non-finite skip` (the default): a capture with a NaN is counted and
/// never sent; ReportDone's total leaves it out, so the run still completes
/// with every other (target, seq) accepted. `fail` stops the target naming
/// the seq, before ReportDone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_finite_capture_is_never_sent_and_skip_or_fail_is_honoured() {
    use dflash_target_server::NonFiniteAction;
    const SAMPLES: u64 = 8;
    const POISONED: u64 = 3;
    let model: ModelSource =
        format!("synthetic:hidden=16,layers=2,tokens_per_s=0,samples={SAMPLES},seq_len=16,nan_at_seq={POISONED}")
            .parse()
            .unwrap();

    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let mut config = TargetServerConfig::new(&broker.address, "target-0", model.clone(), None);
    config.device = DeviceChoice::Cpu;
    let drafter =
        dflash_testkit::spawn_drafter(broker.client().await, "drafter-0", Duration::from_secs(60));
    let report = run(config, CancellationToken::new()).await.unwrap();
    assert!(report.completed, "{report:?}");
    assert_eq!(report.non_finite_skipped, 1, "{report:?}");
    assert_eq!(report.reported_total, Some(SAMPLES - 1));
    let drained = drafter.await.unwrap().unwrap();
    let mut seqs: Vec<u64> = drained
        .deliveries
        .iter()
        .map(|delivery| delivery.seq)
        .collect();
    seqs.sort_unstable();
    let expected: Vec<u64> = (0..SAMPLES).filter(|&seq| seq != POISONED).collect();
    assert_eq!(seqs, expected, "every seq but the poisoned one, once");
    broker.stop().await;

    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let mut config = TargetServerConfig::new(&broker.address, "target-0", model, None);
    config.device = DeviceChoice::Cpu;
    config.on_non_finite = NonFiniteAction::Fail;
    let error = run(config, CancellationToken::new())
        .await
        .expect_err("the target stops");
    assert!(error.to_string().contains("seq 3"), "{error}");
    assert_eq!(broker.status().await.done_targets, 0);
    broker.stop().await;
}

/// The run's capture comes with every welcome and must not change under a
/// running target: a broker restarted on its state dir with another
/// `--target-capture` is noticed at the reconnect, and the target stops
/// naming both values before it re-sends anything made for the old one.
/// (A broker refuses such a restart when its state dir records the run's
/// capture; one written by an older broker does not, as here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_whose_welcome_changes_the_capture_stops_the_target_naming_both() {
    use dflash_broker::config::CapturedTensor;
    let work = tempfile::tempdir().unwrap();
    let first_config = BrokerConfig {
        state_dir: Some(work.path().join("state")),
        ..BrokerConfig::for_targets(1)
    };
    let broker = TestBroker::start(first_config.clone()).await;
    let mut producer = ResilientProducer::open(broker.client().await, "target-0", 3)
        .await
        .unwrap();
    assert!(!producer.capture().last_hidden_states);
    producer.send_item(item(0)).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || async {
            broker.status().await.accepted_items == 1
        })
        .await,
        "seq 0 was never accepted"
    );
    let state_dir = work.path().join("state");
    let broker = broker
        .restart_after(
            BrokerConfig {
                target_capture: vec![CapturedTensor::LastHiddenStates],
                ..first_config
            },
            || std::fs::remove_file(state_dir.join("target-capture")).unwrap(),
        )
        .await;
    // Sends on the broken stream fail once its end is seen, at the latest
    // when the window of unanswered items is spent.
    let mut failure = None;
    for seq in 1..64 {
        if let Err(error) = producer.send_item(item(seq)).await {
            failure = Some(error);
            break;
        }
    }
    let error = failure
        .expect("every send went through: the changed capture went unnoticed")
        .to_string();
    assert!(
        error.contains("first welcome asked for none")
            && error.contains("after a reconnect for last-hidden-states"),
        "{error}"
    );
    let status = broker.status().await;
    assert_eq!(status.accepted_items, 1, "nothing was re-sent: {status:?}");
    broker.stop().await;
}

/// A synthetic model has no last hidden state: a run that asks for it gets
/// an error naming the broker's flag, and not one sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synthetic_target_refuses_a_run_that_asks_for_the_last_hidden_state() {
    use dflash_broker::config::CapturedTensor;
    let broker = TestBroker::start(BrokerConfig {
        target_capture: vec![CapturedTensor::LastHiddenStates],
        ..BrokerConfig::for_targets(1)
    })
    .await;
    let model: ModelSource = "synthetic:hidden=16,layers=2,tokens_per_s=0,samples=8,seq_len=16"
        .parse()
        .unwrap();
    let mut config = TargetServerConfig::new(&broker.address, "target-0", model, None);
    config.device = DeviceChoice::Cpu;
    let error = run(config, CancellationToken::new())
        .await
        .expect_err("the target refuses")
        .to_string();
    assert!(
        error.contains("--target-capture last-hidden-states") && error.contains("synthetic"),
        "{error}"
    );
    let status = broker.status().await;
    assert_eq!(
        (status.accepted_items, status.done_targets),
        (0, 0),
        "{status:?}"
    );
    broker.stop().await;
}
