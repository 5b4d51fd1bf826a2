//! The real `broker` binary killed with SIGKILL mid-run, with a backlog
//! queued and leased: restarted on the same `--state-dir` the run completes
//! with every (target, seq) delivered and acked, and the duplicates bounded
//! by what was leased at the kill; restarted without one, the clients that
//! remember the old run are refused and nobody reports COMPLETE.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use dflash_client::{BrokerClient, ConsumerEvent};
use dflash_proto::v1 as proto;
use dflash_testkit::{credit, sample, wait_until, BrokerProcess};

const TARGETS: usize = 2;
const ITEMS_PER_TARGET: u64 = 60;
/// Items each target sends before the kill; the rest after the restart.
const SENT_BEFORE_KILL: u64 = 40;
/// Deliveries the drafter acks before the kill; it holds `LEASED_AT_KILL`
/// more unacked when the broker dies.
const ACKED_BEFORE_KILL: usize = 20;
const LEASED_AT_KILL: usize = 8;
const ITEM_BYTES: usize = 4096;

fn target_id(index: usize) -> String {
    format!("target-{index}")
}

/// Sends seqs `from..to` of one target (resuming after what the broker
/// has) and returns the welcome's resume point.
async fn produce(client: &BrokerClient, target: usize, to: u64) -> Option<u64> {
    let mut producer = client.produce(&target_id(target)).await.expect("produce");
    let resume = producer.resume_after_seq();
    let from = resume.map_or(0, |seq| seq + 1);
    for seq in from..to {
        producer
            .send(seq, sample(ITEM_BYTES, seq), HashMap::new())
            .await
            .expect("send");
    }
    let report = producer.finish().await.expect("finish");
    assert!(report.rejected.is_empty(), "{report:?}");
    resume
}

/// Acks `(target, seq)` deliveries into `acked`, counting repeats.
fn record(acked: &mut BTreeMap<(String, u64), u32>, delivery: &proto::Delivery) {
    *acked
        .entry((delivery.target_id.clone(), delivery.seq))
        .or_default() += 1;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_with_a_backlog_then_restart_on_the_state_dir_loses_nothing() {
    let work = tempfile::tempdir().unwrap();
    let state_dir = work.path().join("state");
    let state_dir_arg = state_dir.to_str().unwrap().to_string();
    let mut broker = BrokerProcess::start(
        &[
            "--expected-targets",
            "2",
            "--state-dir",
            &state_dir_arg,
            "--fsync",
            "batch",
            "--lease-timeout",
            "60s",
        ],
        work.path().join("broker.log"),
    )
    .await;
    let run_id = broker.client().await.status().await.unwrap().run_id;

    // Phase 1: both targets send part of their shard; a drafter acks some
    // deliveries and holds a window of others when the broker is killed.
    let client = broker.client().await;
    for target in 0..TARGETS {
        assert_eq!(produce(&client, target, SENT_BEFORE_KILL).await, None);
    }
    let mut acked: BTreeMap<(String, u64), u32> = BTreeMap::new();
    let mut consumer = client
        .consume("drafter-0", credit(LEASED_AT_KILL as u32))
        .await
        .unwrap();
    let handle = consumer.handle();
    for _ in 0..ACKED_BEFORE_KILL {
        let ConsumerEvent::Delivery(delivery) = consumer.next().await.unwrap() else {
            panic!("end-of-stream before the kill")
        };
        record(&mut acked, &delivery);
        handle.ack(vec![delivery.delivery_id]);
    }
    let status = broker.client().await.status().await.unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || async {
            let status = broker.client().await.status().await.unwrap();
            status.acked_items == ACKED_BEFORE_KILL as u64
                && status.leased_items == LEASED_AT_KILL as u64
        })
        .await,
        "backlog before the kill: {status:?}"
    );
    let status = broker.client().await.status().await.unwrap();
    let queued_at_kill = status.queued_items;
    assert_eq!(
        queued_at_kill,
        (TARGETS as u64) * SENT_BEFORE_KILL - (ACKED_BEFORE_KILL + LEASED_AT_KILL) as u64
    );
    broker.kill_9();
    drop(consumer);

    // Phase 2: the same state dir; the same run goes on.
    broker.restart().await;
    let status = broker.client().await.status().await.unwrap();
    assert_eq!(
        status.run_id, run_id,
        "a new run id after a restart on the state dir"
    );
    assert_eq!(status.accepted_items, (TARGETS as u64) * SENT_BEFORE_KILL);
    assert_eq!(status.acked_items, ACKED_BEFORE_KILL as u64);
    assert_eq!(
        status.queued_items,
        queued_at_kill + LEASED_AT_KILL as u64,
        "the leased items are queued again"
    );
    let client = broker.client().await.remembering_run(Some(run_id.clone()));
    for target in 0..TARGETS {
        // Each target resumes right after its true highest seq.
        assert_eq!(
            produce(&client, target, ITEMS_PER_TARGET).await,
            Some(SENT_BEFORE_KILL - 1)
        );
        client
            .report_done(&target_id(target), ITEMS_PER_TARGET)
            .await
            .expect("report done");
    }
    let mut consumer = client.consume("drafter-0", credit(8)).await.unwrap();
    let handle = consumer.handle();
    let mut second_deliveries = 0;
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(60), consumer.next())
            .await
            .expect("a delivery or end-of-stream in time")
            .unwrap()
        {
            ConsumerEvent::Delivery(delivery) => {
                // The items leased at the kill keep their count: this is
                // their second delivery; every other item's first.
                assert!(delivery.delivery_count <= 2, "{delivery:?}");
                if delivery.delivery_count == 2 {
                    second_deliveries += 1;
                }
                record(&mut acked, &delivery);
                handle.ack(vec![delivery.delivery_id]);
            }
            ConsumerEvent::EndOfStream(end) => break end,
        }
    };
    assert_eq!(end.status(), proto::RunStatus::Complete, "{end:?}");
    assert_eq!(
        second_deliveries, LEASED_AT_KILL,
        "delivery counts after the restart"
    );

    // Accounting by (target, seq): nothing lost, duplicates bounded by the
    // leases open at the kill.
    let expected: BTreeSet<(String, u64)> = (0..TARGETS)
        .flat_map(|target| (0..ITEMS_PER_TARGET).map(move |seq| (target_id(target), seq)))
        .collect();
    let delivered: BTreeSet<(String, u64)> = acked.keys().cloned().collect();
    let lost: Vec<_> = expected.difference(&delivered).collect();
    assert!(lost.is_empty(), "lost {lost:?}");
    assert_eq!(delivered, expected);
    let duplicates: u32 = acked.values().map(|count| count - 1).sum();
    assert!(
        duplicates as usize <= LEASED_AT_KILL,
        "{duplicates} duplicates, {LEASED_AT_KILL} were leased at the kill"
    );
    let status = broker.client().await.status().await.unwrap();
    assert_eq!(status.accepted_items, (TARGETS as u64) * ITEMS_PER_TARGET);
    assert_eq!(status.acked_items, (TARGETS as u64) * ITEMS_PER_TARGET);
    assert_eq!(status.dead_letters, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_state_dir_a_restart_fails_the_clients_loudly() {
    let work = tempfile::tempdir().unwrap();
    let mut broker =
        BrokerProcess::start(&["--expected-targets", "1"], work.path().join("broker.log")).await;
    let target_client = broker.client().await;
    assert_eq!(produce(&target_client, 0, 10).await, None);
    let drafter_client = broker.client().await;
    let mut consumer = drafter_client
        .consume("drafter-0", credit(4))
        .await
        .unwrap();
    let ConsumerEvent::Delivery(_) = consumer.next().await.unwrap() else {
        panic!("expected a delivery")
    };
    let old_run = target_client.run_id().expect("a run id from the welcome");

    broker.kill_9();
    drop(consumer);
    broker.restart().await;
    let status = broker.client().await.status().await.unwrap();
    assert_ne!(status.run_id, old_run);
    assert_eq!(status.accepted_items, 0, "the in-memory queue was lost");

    // The target that remembers the old run cannot resume into the new one,
    // nor report done there; the drafter cannot consume from it.
    let error = target_client
        .produce("target-0")
        .await
        .expect_err("old run");
    assert!(!error.is_retryable(), "{error}");
    assert!(error.to_string().contains(&old_run), "{error}");
    let error = target_client
        .report_done("target-0", 10)
        .await
        .expect_err("old run");
    assert!(!error.is_retryable(), "{error}");
    let error = drafter_client
        .consume("drafter-0", credit(4))
        .await
        .expect_err("old run");
    assert!(!error.is_retryable(), "{error}");
    let status = broker.client().await.status().await.unwrap();
    assert_eq!(status.done_targets, 0);
    assert_eq!(status.state(), proto::BrokerState::Running, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_broker_on_the_same_state_dir_refuses_to_start() {
    let work = tempfile::tempdir().unwrap();
    let state_dir = work.path().join("state");
    let state_dir_arg = state_dir.to_str().unwrap().to_string();
    let mut broker = BrokerProcess::start(
        &["--expected-targets", "1", "--state-dir", &state_dir_arg],
        work.path().join("broker.log"),
    )
    .await;
    let run_id = broker.client().await.status().await.unwrap().run_id;

    let second = {
        let state_dir_arg = state_dir_arg.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(dflash_testkit::workspace_binary("broker"))
                .args(["--listen", "127.0.0.1:0", "--expected-targets", "1"])
                .args(["--state-dir", &state_dir_arg])
                .output()
                .expect("run a second broker")
        })
    };
    let output = tokio::time::timeout(Duration::from_secs(60), second)
        .await
        .expect("the second broker exits at once")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(1),
        "{:?}\n{stderr}",
        output.status
    );
    assert!(stderr.contains(&state_dir_arg), "{stderr}");
    assert!(stderr.contains("in use by another broker"), "{stderr}");

    // The first is unharmed; killed with SIGKILL, its lock goes with it and
    // a restart on the directory resumes the same run.
    assert_eq!(broker.client().await.status().await.unwrap().run_id, run_id);
    broker.kill_9();
    broker.restart().await;
    assert_eq!(broker.client().await.status().await.unwrap().run_id, run_id);
}
