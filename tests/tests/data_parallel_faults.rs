//! Data-parallel drafters survive a hang, a join and a death mid-run: real
//! `broker` and `drafter-server` binaries (real draft models of the tiny
//! target, gradients all-reduced over Gloo on loopback), the producer in
//! the test. In one run:
//!
//! 1. three drafters form a quorum and commit steps;
//! 2. one is stopped (SIGSTOP): the others go on without it within the
//!    collective timeout plus one quorum timeout; continued (SIGCONT), it
//!    asks again, heals from rank 0 and takes part again;
//! 3. a fourth drafter joins mid-run: it heals, and no member's state
//!    checksum ever differs from rank 0's;
//! 4. one is killed (SIGKILL) while the others train: they go on;
//! 5. the broker is killed (SIGKILL) and restarted on its state dir: the
//!    drafters form a quorum again on the new broker and go on;
//! 6. the run ends COMPLETE: acked = produced with no dead letters, the
//!    survivors exit 0, and the run's model the broker wrote is the last
//!    committed step's, finite, and trained on every produced sample.
//!
//! Exactly once, checked by (target, seq) and not by counts: after every
//! phase no member's state ever differed from rank 0's at the same commit
//! (`checksum_mismatches` 0) and no member was on another history
//! (`splits` 0); at the end the broker's per-step record (its log line of
//! each durable commit, naming the samples the commit acked) names every
//! produced (target, seq) in exactly one committed step, and the run's
//! model counts exactly the produced samples.
//!
//! Items are produced phase by phase, so the run cannot end before the
//! faults happened; every wait polls the broker's status.
//!
//! A second run stops one of a pair (SIGSTOP) while the queue holds more
//! than the other's credit: the survivor commits alone once keepalive ends
//! the frozen stream, and the stopped one heals back after SIGCONT.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dflash_broker::run_model::checkpoint::read_model;
use dflash_client::BrokerClient;
use dflash_proto::v1 as proto;
use dflash_testkit::{
    committed_samples, data_parallel_status, init_tiny, tiny_drafter_sample, wait_for_exit,
    wait_until, workspace_binary, BrokerProcess,
};

/// Items sent before each phase: several steps of 6 samples.
const ITEMS_PER_PHASE: u64 = 36;
/// Bound on each waited-for state (a debug build on a loaded 2-core machine).
const PHASE_TIMEOUT: Duration = Duration::from_secs(240);
/// The broker's --quorum-timeout and the drafters' --collective-timeout:
/// how long a stopped or dead member can hold the others.
const FAULT_TIMEOUT: &str = "5s";

fn drafter_id(index: usize) -> String {
    format!("drafter-{index}")
}

fn spawn_drafter(work: &Path, broker: &str, tiny: &Path, index: usize) -> Child {
    let id = drafter_id(index);
    let log = std::fs::File::create(work.join(format!("{id}.log"))).unwrap();
    Command::new(workspace_binary("drafter-server"))
        .args(["--broker", broker, "--drafter-id", &id, "--target-model"])
        .arg(tiny)
        .arg("--output")
        .arg(work.join(&id))
        .args([
            "--device",
            "cpu",
            "--draft-layers",
            "2",
            "--block-size",
            "4",
        ])
        .args(["--num-anchors", "8", "--batch-tokens", "256"])
        .args(["--max-step-samples", "6", "--prefetch-samples", "2"])
        .args(["--linger", "200ms", "--stats-interval", "200ms"])
        .args(["--save-every", "0", "--snapshot-every", "2"])
        .args(["--collective-timeout", FAULT_TIMEOUT])
        // Four trainers share the machine's cores.
        .env("OMP_NUM_THREADS", "1")
        .env("TORCH_CPP_LOG_LEVEL", "ERROR")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start a drafter-server binary")
}

fn drafter_log(work: &Path, index: usize) -> String {
    std::fs::read_to_string(work.join(format!("{}.log", drafter_id(index)))).unwrap_or_default()
}

fn members_are(status: &proto::LighthouseStatus, indices: &[usize]) -> bool {
    let mut members = status.members.clone();
    members.sort();
    let mut expected: Vec<String> = indices.iter().map(|&index| drafter_id(index)).collect();
    expected.sort();
    members == expected
}

/// Waits until a quorum of exactly `indices` committed a step after
/// `after` committed steps; panics naming the state and the logs if not.
async fn wait_for_quorum(
    client: &BrokerClient,
    work: &Path,
    indices: &[usize],
    after: u64,
    what: &str,
) -> proto::LighthouseStatus {
    let reached = wait_until(PHASE_TIMEOUT, || async {
        let status = data_parallel_status(client).await;
        members_are(&status, indices) && status.steps_committed > after + 1
    })
    .await;
    let status = data_parallel_status(client).await;
    assert!(
        reached,
        "{what}: {status:?}; drafter-0 log tail: {}",
        tail(&drafter_log(work, 0))
    );
    status
}

/// Waits until the drafters `indices` have their Consume streams open (so
/// the next items are dealt to them too, and each takes part in a step).
async fn wait_connected(client: &BrokerClient, work: &Path, indices: &[usize]) {
    let connected = wait_until(PHASE_TIMEOUT, || async {
        let Ok(status) = client.status().await else {
            return false;
        };
        indices.iter().all(|&index| {
            status
                .drafters
                .iter()
                .any(|drafter| drafter.drafter_id == drafter_id(index) && drafter.connected)
        })
    })
    .await;
    assert!(
        connected,
        "drafters {indices:?} connected; drafter-{} log tail: {}",
        indices[0],
        tail(&drafter_log(work, indices[0]))
    );
}

/// Waits until each drafter of `indices` grants the broker `items` credit:
/// its share of the step (`--max-step-samples` 6 over the members) plus
/// its `--prefetch-samples` 2, so no member leases a whole step's samples.
async fn wait_for_credit(client: &BrokerClient, work: &Path, indices: &[usize], items: u32) {
    let credits = || async {
        let status = client.status().await.unwrap_or_default();
        indices
            .iter()
            .map(|&index| {
                status
                    .drafters
                    .iter()
                    .find(|drafter| drafter.drafter_id == drafter_id(index))
                    .and_then(|drafter| drafter.credit)
                    .map(|credit| credit.items)
            })
            .collect::<Vec<_>>()
    };
    let sized = wait_until(PHASE_TIMEOUT, || async {
        credits().await.iter().all(|credit| *credit == Some(items))
    })
    .await;
    assert!(
        sized,
        "drafters {indices:?} grant {:?} items, expected {items} each; drafter-{} log tail: {}",
        credits().await,
        indices[0],
        tail(&drafter_log(work, indices[0]))
    );
}

/// No member ever differed from rank 0 at the same commit, and none was on
/// another history: the run has one history.
fn assert_one_history(status: &proto::LighthouseStatus, phase: &str) {
    assert_eq!(status.checksum_mismatches, 0, "{phase}: {status:?}");
    assert_eq!(status.splits, 0, "{phase}: {status:?}");
    assert_eq!(status.rollbacks, 0, "{phase}: {status:?}");
}

/// The broker's log lines that drop a member, for failure messages.
fn dropped_lines(log: &str) -> String {
    log.lines()
        .filter(|line| line.contains("dropped"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

async fn produce(producer: &mut dflash_client::Producer, from: u64, count: u64) {
    for seq in from..from + count {
        producer
            .send(seq, tiny_drafter_sample(seq), Default::default())
            .await
            .unwrap();
    }
}

/// Sends `signal` (e.g. "STOP") to `child` with kill(1).
fn signal(child: &Child, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {}", child.id());
}

/// Every produced (target-0, seq) in exactly one committed step, read from
/// the broker's per-step record (its log line of each durable commit).
fn assert_each_sample_in_one_committed_step(broker_log: &str, produced: u64) {
    let trained = committed_samples(broker_log);
    let missing: Vec<u64> = (0..produced)
        .filter(|seq| !trained.contains_key(&("target-0".to_string(), *seq)))
        .collect();
    let twice: Vec<(&(String, u64), &Vec<u64>)> = trained
        .iter()
        .filter(|(_, steps)| steps.len() > 1)
        .collect();
    let strangers: Vec<&(String, u64)> = trained
        .keys()
        .filter(|(target_id, seq)| target_id != "target-0" || *seq >= produced)
        .collect();
    assert!(
        missing.is_empty() && twice.is_empty() && strangers.is_empty(),
        "samples in no committed step: {missing:?}; in more than one: {twice:?}; never produced: {strangers:?}"
    );
}

/// A broker process (one target, the fault timeouts, `extra` flags), its
/// client, `drafters` drafter-server processes and target-0's producer.
async fn start_run(
    work: &Path,
    tiny: &Path,
    extra: &[&str],
    drafters: usize,
) -> (
    BrokerProcess,
    BrokerClient,
    Vec<Child>,
    dflash_client::Producer,
) {
    let mut flags = vec![
        "--expected-targets",
        "1",
        "--quorum-timeout",
        FAULT_TIMEOUT,
        "--lease-timeout",
        "60s",
    ];
    flags.extend_from_slice(extra);
    let broker = BrokerProcess::start(&flags, work.join("broker.log")).await;
    let client = broker.client().await;
    let children = (0..drafters)
        .map(|index| spawn_drafter(work, &broker.address, tiny, index))
        .collect();
    let producer = client.produce("target-0").await.unwrap();
    (broker, client, children, producer)
}

/// The run ends: the target reports done, the drafters `live` exit 0, the
/// run is COMPLETE with every produced item acked and no dead letter, on
/// one history, and every produced (target-0, seq) in exactly one
/// committed step. The data-parallel status at the end.
async fn end_the_run(
    client: &BrokerClient,
    work: &Path,
    drafters: &mut [Child],
    live: &[usize],
    produced: u64,
    broker: &BrokerProcess,
) -> proto::LighthouseStatus {
    client.report_done("target-0", produced).await.unwrap();
    for &index in live {
        let exit = wait_for_exit(&mut drafters[index], PHASE_TIMEOUT).await;
        assert!(
            exit.is_some_and(|status| status.success()),
            "{} exited {exit:?}; log: {}",
            drafter_id(index),
            tail(&drafter_log(work, index))
        );
    }
    let status = client.status().await.unwrap();
    assert_eq!(status.state, proto::BrokerState::Complete as i32);
    let summary = status.summary.clone().unwrap_or_default();
    assert_eq!(summary.acked_items, produced, "{summary:?}");
    assert_eq!(summary.dead_letters, 0, "{summary:?}");
    let parallel = status.lighthouse.unwrap_or_default();
    eprintln!("data parallelism at the end: {parallel:?}");
    assert_one_history(&parallel, "the end");
    assert_each_sample_in_one_committed_step(&broker.log(), produced);
    parallel
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn data_parallel_drafters_survive_a_hang_a_join_and_a_death() {
    let work = tempfile::tempdir().unwrap();
    let tiny = init_tiny(work.path());
    let model_dir = work.path().join("model");
    let model_arg = model_dir.to_str().unwrap().to_string();
    let state_arg = work.path().join("state").to_str().unwrap().to_string();
    let (mut broker, client, mut drafters, mut producer) = start_run(
        work.path(),
        &tiny,
        &["--state-dir", &state_arg, "--model-output", &model_arg],
        3,
    )
    .await;
    let mut produced = 0u64;

    // 1. Three members commit steps together.
    wait_connected(&client, work.path(), &[0, 1, 2]).await;
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let status = wait_for_quorum(&client, work.path(), &[0, 1, 2], 0, "three members").await;
    assert_one_history(&status, "three members");
    // Each member's credit window is its share of the step, 6 / 3, plus 2.
    wait_for_credit(&client, work.path(), &[0, 1, 2], 4).await;

    // 2. drafter-1 hangs: the others go on without it, then it comes back.
    signal(&drafters[1], "STOP");
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let status = wait_for_quorum(
        &client,
        work.path(),
        &[0, 2],
        status.steps_committed,
        "the others without the stopped member",
    )
    .await;
    assert!(status.members_dropped >= 1, "{status:?}");
    assert_one_history(&status, "without the stopped member");
    // Two members: each one's share grows to 6 / 2, and its window with it.
    wait_for_credit(&client, work.path(), &[0, 2], 5).await;
    signal(&drafters[1], "CONT");
    let heals_before = status.heals;
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let status = wait_for_quorum(
        &client,
        work.path(),
        &[0, 1, 2],
        status.steps_committed,
        "the continued member back in",
    )
    .await;
    assert!(status.heals > heals_before, "it healed back: {status:?}");
    assert_one_history(&status, "the continued member back in");

    // 3. drafter-3 joins mid-run.
    drafters.push(spawn_drafter(work.path(), &broker.address, &tiny, 3));
    wait_connected(&client, work.path(), &[3]).await;
    let heals_before = status.heals;
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let status = wait_for_quorum(
        &client,
        work.path(),
        &[0, 1, 2, 3],
        status.steps_committed,
        "the joiner in",
    )
    .await;
    assert!(status.heals > heals_before, "the joiner healed: {status:?}");
    assert_one_history(&status, "the joiner in");

    // 4. drafter-0 dies while the others train: its stream ends, so it is
    // dropped at once, and it alone.
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let dropped_before = data_parallel_status(&client).await.members_dropped;
    drafters[0].kill().unwrap();
    drafters[0].wait().unwrap();
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let status = wait_for_quorum(
        &client,
        work.path(),
        &[1, 2, 3],
        status.steps_committed,
        "the survivors after the kill",
    )
    .await;
    assert_eq!(
        status.members_dropped,
        dropped_before + 1,
        "only the killed member was dropped: {status:?}; the broker's drops: {}",
        dropped_lines(&broker.log())
    );
    assert_one_history(&status, "the survivors after the kill");

    // 5. The broker dies and comes back on its state dir; the drafters go on.
    let report = producer.finish().await.unwrap();
    assert_eq!(report.accepted, produced, "{report:?}");
    let step_before_restart = status.step;
    broker.restart().await;
    let client = broker.client().await;
    let mut producer = client.produce("target-0").await.unwrap();
    let resumed_from = produced;
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let status = wait_for_quorum(
        &client,
        work.path(),
        &[1, 2, 3],
        0,
        "the survivors on the restarted broker",
    )
    .await;
    assert!(
        status.step > step_before_restart,
        "the steps go on from where they were: {status:?}"
    );
    assert!(
        status.committed_step > step_before_restart,
        "the restarted broker kept H: {status:?}"
    );
    assert_one_history(&status, "the survivors on the restarted broker");

    // 6. The run ends: every item acked once, the survivors exit 0.
    let report = producer.finish().await.unwrap();
    assert_eq!(report.accepted, produced - resumed_from, "{report:?}");
    let parallel = end_the_run(
        &client,
        work.path(),
        &mut drafters,
        &[1, 2, 3],
        produced,
        &broker,
    )
    .await;

    // The run's model on disk is the last committed step's, whole and finite.
    let final_saved = wait_until(Duration::from_secs(60), || async {
        client
            .status()
            .await
            .ok()
            .and_then(|status| status.model_sync)
            .is_some_and(|sync| sync.final_saved)
    })
    .await;
    assert!(final_saved, "final model written; log: {}", broker.log());
    let model = read_model(&model_dir).unwrap().expect("a model on disk");
    assert_eq!(model.version, parallel.committed_step, "{parallel:?}");
    let sync = client
        .status()
        .await
        .unwrap()
        .model_sync
        .unwrap_or_default();
    assert_eq!(
        sync.model_samples, produced,
        "the run's model trained every produced sample once: {sync:?}"
    );
    assert!(!model.tensors.is_empty());
    for tensor in &model.tensors {
        let elements = tensor.shape.iter().product::<u64>() as usize;
        assert_eq!(tensor.values.len(), elements, "{}", tensor.name);
        assert!(
            tensor.values.iter().all(|value| value.is_finite()),
            "{} has a non-finite value",
            tensor.name
        );
    }
}

/// A pair whose one member hangs (SIGSTOP) while the queue holds more than
/// the other's credit. The survivor's step finds no majority while the
/// stopped member's stream lives; once keepalive ends that stream, the
/// survivor must ask again by itself, since no delivery comes to wake it
/// (its credit is all in the step), and commit alone. Continued, the
/// stopped member heals back. Found by `scripts/operator-faults.py` on the
/// demo: the survivor waited for a delivery that never came.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_survivor_with_its_credit_in_its_step_asks_again_when_its_partner_hangs() {
    let work = tempfile::tempdir().unwrap();
    let tiny = init_tiny(work.path());
    // The stopped member's stream ends 15 to 20 s after it froze: after
    // the survivor's quorum call gave up on it (its wait bound, the
    // collective timeout plus two steps, counted from the survivor's ask,
    // which comes at most a collective timeout after the freeze), as with
    // the default 10 s + 20 s.
    let (broker, client, mut drafters, mut producer) = start_run(
        work.path(),
        &tiny,
        &["--keepalive-interval", "5s", "--keepalive-timeout", "15s"],
        2,
    )
    .await;
    let mut produced = 0u64;
    wait_connected(&client, work.path(), &[0, 1]).await;
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let status = wait_for_quorum(&client, work.path(), &[0, 1], 0, "the pair").await;
    assert_one_history(&status, "the pair");

    signal(&drafters[1], "STOP");
    // Far more than drafter-0's credit: what it cannot hold stays queued,
    // and drafter-1's leases come back to the queue, not to drafter-0.
    produce(&mut producer, produced, 4 * ITEMS_PER_PHASE).await;
    produced += 4 * ITEMS_PER_PHASE;
    // Keepalive ends the frozen stream within 20 s, and the survivor's ask
    // is held at most half a second: 90 s is ample, and without the
    // survivor asking again it never comes.
    let reached = wait_until(Duration::from_secs(90), || async {
        let now = data_parallel_status(&client).await;
        members_are(&now, &[0]) && now.steps_committed > status.steps_committed + 1
    })
    .await;
    let status = data_parallel_status(&client).await;
    assert!(
        reached,
        "the survivor alone once its partner's stream is gone: {status:?}; drafter-0 log tail: {}",
        tail(&drafter_log(work.path(), 0))
    );
    assert_one_history(&status, "the survivor alone");

    signal(&drafters[1], "CONT");
    let heals_before = status.heals;
    produce(&mut producer, produced, ITEMS_PER_PHASE).await;
    produced += ITEMS_PER_PHASE;
    let status = wait_for_quorum(
        &client,
        work.path(),
        &[0, 1],
        status.steps_committed,
        "the continued member back in",
    )
    .await;
    assert!(status.heals > heals_before, "it healed back: {status:?}");
    assert_one_history(&status, "the continued member back in");

    let report = producer.finish().await.unwrap();
    assert_eq!(report.accepted, produced, "{report:?}");
    end_the_run(
        &client,
        work.path(),
        &mut drafters,
        &[0, 1],
        produced,
        &broker,
    )
    .await;
    // The members' last snapshots reach the broker as they stop.
    let counted = wait_until(Duration::from_secs(60), || async {
        client
            .status()
            .await
            .ok()
            .and_then(|status| status.model_sync)
            .is_some_and(|sync| sync.model_samples == produced)
    })
    .await;
    let sync = client
        .status()
        .await
        .unwrap()
        .model_sync
        .unwrap_or_default();
    assert!(
        counted,
        "the run's model trained every produced sample once: {sync:?}"
    );
}
