//! Liveness with real processes (issue #9):
//!
//! - a `drafter-server` whose training thread hangs (its test hook, in a
//!   build with the cargo feature `test-hooks`, as `make test` makes) stops
//!   extending its leases after `--trainer-stall-timeout`; the broker takes
//!   them back after `--lease-timeout` and another consumer gets and acks
//!   them, each (target, seq) acked exactly once;
//! - a `target-server` frozen with SIGSTOP is dropped by HTTP/2 keepalive
//!   and fails as one `--target-grace` after it froze: the grace counts
//!   from its last message, not from the drop (checked by the broker's
//!   states, not by our clock).

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use dflash_broker::config::FailurePolicy;
use dflash_broker::BrokerConfig;
use dflash_client::ConsumerEvent;
use dflash_proto::v1 as proto;
use dflash_testkit::{
    credit, drafter_status, require_test_hooks, sample, spawn_drafter, wait_until,
    workspace_binary, TestBroker,
};

const ITEMS: u64 = 16;

/// Kills a child process when the test ends, however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(pid: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stuck_trainer_loses_its_leases_to_another_drafter() {
    let lease_timeout = Duration::from_secs(3);
    let trainer_stall = Duration::from_secs(1);
    let drafter_binary = workspace_binary("drafter-server");
    require_test_hooks(&drafter_binary);
    // The lifetime cap far beyond every wait below (60 s each, hang guards):
    // a lease that expires in this test expired because the drafter stopped
    // extending it, never because of the cap.
    let max_lease_lifetime = Duration::from_secs(3600);
    let broker = TestBroker::start(BrokerConfig {
        lease_timeout,
        max_lease_lifetime,
        ..BrokerConfig::for_targets(1)
    })
    .await;
    let client = broker.client().await;
    let mut producer = client.produce("target-0").await.unwrap();
    for seq in 0..ITEMS {
        producer
            .send(seq, sample(1024, seq), HashMap::new())
            .await
            .unwrap();
    }
    let report = producer.finish().await.unwrap();
    assert_eq!(report.accepted, ITEMS);
    client.report_done("target-0", ITEMS).await.unwrap();

    // A real drafter: two steps of two samples (credit 4), then its training
    // thread hangs holding the next deliveries.
    let work = tempfile::tempdir().unwrap();
    let log_path = work.path().join("drafter.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let drafter = Child(
        std::process::Command::new(&drafter_binary)
            .args(["--broker", &broker.address, "--drafter-id", "stuck"])
            .args(["--model", "synthetic:ms_per_1k_tokens=0", "--device", "cpu"])
            .arg("--output")
            .arg(work.path().join("checkpoints"))
            .args(["--max-step-samples", "2", "--prefetch-samples", "2"])
            .args(["--batch-tokens", "1000000", "--linger", "200ms"])
            .args(["--total-steps", "100", "--stats-interval", "200ms"])
            .arg("--trainer-stall-timeout")
            .arg(format!("{}ms", trainer_stall.as_millis()))
            .env("DFLASH_TEST_HANG_TRAINER_AFTER_STEPS", "2")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let hung = wait_until(Duration::from_secs(60), || async {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let status = broker.status().await;
        log.contains("test hook: the training thread hangs")
            && drafter_status(&status, "stuck")
                .is_some_and(|drafter| drafter.acked_items >= 2 && drafter.leased_items > 0)
    })
    .await;
    assert!(
        hung,
        "the drafter did not take two steps and hang; log:\n{}",
        std::fs::read_to_string(&log_path).unwrap_or_default()
    );

    // Another drafter: it gets the queued items at once and the stuck
    // drafter's leases once they expire; it acks everything.
    let mut rescue = client.consume("rescue", credit(64)).await.unwrap();
    let handle = rescue.handle();
    let mut acked: BTreeMap<u64, u32> = BTreeMap::new();
    let mut redelivered: Vec<u64> = Vec::new();
    let end = loop {
        let event = tokio::time::timeout(Duration::from_secs(60), rescue.next())
            .await
            .expect("a delivery or end-of-stream in time")
            .unwrap();
        match event {
            ConsumerEvent::Delivery(delivery) => {
                assert_eq!(delivery.target_id, "target-0");
                *acked.entry(delivery.seq).or_default() += 1;
                if delivery.delivery_count > 1 {
                    redelivered.push(delivery.seq);
                }
                handle.ack(vec![delivery.delivery_id]);
            }
            ConsumerEvent::EndOfStream(end) => break end,
        }
    };
    assert_eq!(end.status(), proto::RunStatus::Complete, "{end:?}");

    // The leases came back because the drafter stopped extending them, by
    // states rather than a clock: it says so in its log (after its
    // `--trainer-stall-timeout` without progress), and the broker counted
    // each lease it took back from it as expired (a lease timed out, not one
    // released by a dropped stream), with the lifetime cap out of reach.
    // How soon is no property of the rule: a drafter that kept extending
    // would hold them until the cap, and the 60 s waits would fail first.
    let status = broker.status().await;
    let stuck = drafter_status(&status, "stuck").unwrap();
    assert!(stuck.expired_leases > 0, "{stuck:?}");
    assert_eq!(
        redelivered.len() as u64,
        stuck.expired_leases,
        "every lease the stuck drafter lost went to the rescuer: {redelivered:?}"
    );
    // Polled: the drafter keeps saying it while it holds the stale leases;
    // the 60 s only stops a hang.
    assert!(
        wait_until(Duration::from_secs(60), || async {
            std::fs::read_to_string(&log_path)
                .unwrap_or_default()
                .contains("leases are no longer extended")
        })
        .await,
        "the drafter never said it stopped extending; log:\n{}",
        std::fs::read_to_string(&log_path).unwrap_or_default()
    );
    // Accounting by (target, seq): the rescuer acked every item the stuck
    // drafter did not, each once; the broker counted each once.
    assert!(acked.values().all(|&count| count == 1), "{acked:?}");
    assert_eq!(acked.len() as u64 + stuck.acked_items, ITEMS, "{acked:?}");
    assert_eq!(stuck.leased_items, 0, "{stuck:?}");
    assert_eq!(status.acked_items, ITEMS);
    assert_eq!(status.dead_letters, 0);
    drop(drafter);
    broker.stop().await;
}

/// The grace counts from the target's last message, not from the moment
/// keepalive dropped its stream, and this is checked by states, not by our
/// clock. The grace (4 s) is no longer than keepalive needs to notice a
/// frozen peer: at least timeout - interval = 4 s after its last message (a
/// ping sent up to one interval before the freeze goes unanswered for the
/// timeout), usually interval + timeout = 6 s. So when the stream is
/// dropped the grace has already run out, and the broker fails the target
/// at once (the deadline it notes is past, which wakes its ticker). Counted
/// from the drop instead, the target would sit DISCONNECTED for the whole
/// grace. The broker's snapshot of a disconnected target gives, in its own
/// clock, how long ago the stream was dropped (`last_seen_ms_ago`); every
/// snapshot that shows it DISCONNECTED must say less than half the grace.
/// A correct run fails that only if the broker's ticker, already woken,
/// waits 2 s for a core while its status handler runs; one that counts
/// from the drop shows DISCONNECTED for 4 s to polls every 20 ms, passing
/// the half with about 100 polls to see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_target_fails_within_the_grace_after_it_froze() {
    let keepalive_interval = Duration::from_secs(1);
    let keepalive_timeout = Duration::from_secs(5);
    let grace = Duration::from_secs(4);
    let broker = TestBroker::start(BrokerConfig {
        keepalive_interval,
        keepalive_timeout,
        target_grace: grace,
        target_stall_timeout: Duration::from_secs(120),
        on_target_failure: FailurePolicy::Abort,
        ..BrokerConfig::for_targets(1)
    })
    .await;
    let drafter = spawn_drafter(broker.client().await, "drafter-0", Duration::from_secs(120));
    let target = Child(
        std::process::Command::new(workspace_binary("target-server"))
            .args(["--broker", &broker.address, "--target-id", "target-0"])
            .args([
                "--model",
                "synthetic:hidden=16,layers=2,tokens_per_s=2000,samples=100000,seq_len=16",
            ])
            .args(["--max-batch-tokens", "32", "--stats-interval", "100ms"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(
        wait_until(Duration::from_secs(60), || async {
            broker.status().await.accepted_items >= 10
        })
        .await,
        "the target never produced"
    );

    signal(target.0.id(), "STOP");
    let frozen_at = Instant::now();
    let target_of = |status: &proto::StatusSnapshot| {
        status
            .targets
            .iter()
            .find(|target| target.target_id == "target-0")
            .cloned()
            .expect("target-0 in the status")
    };
    // The longest a snapshot saw it disconnected, by the broker's clock.
    let mut longest_disconnected_ms = None;
    let mut failed = None;
    // Only stops a hang: keepalive drops it about 6 s after the freeze.
    let deadline = frozen_at + Duration::from_secs(60);
    while failed.is_none() && Instant::now() < deadline {
        let target = target_of(&broker.status().await);
        match target.state() {
            proto::TargetState::Disconnected => {
                let longest = longest_disconnected_ms.get_or_insert(0);
                *longest = target.last_seen_ms_ago.max(*longest);
            }
            proto::TargetState::Failed => failed = Some((target, frozen_at.elapsed())),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (failed, failed_after) = failed.expect("the frozen target never failed");
    eprintln!(
        "frozen target: failed {failed_after:?} after SIGSTOP, seen disconnected for at most \
         {longest_disconnected_ms:?} ms (keepalive {keepalive_interval:?} + \
         {keepalive_timeout:?}, grace {grace:?})"
    );
    // Failed for the lapsed grace of a dropped stream (keepalive is what
    // drops a frozen peer's stream), not for a stall.
    assert!(
        failed.failure_reason.contains("stream gone")
            && failed.failure_reason.contains("ReportDone"),
        "{failed:?}"
    );
    let half_grace_ms = u64::try_from((grace / 2).as_millis()).unwrap();
    assert!(
        longest_disconnected_ms.is_none_or(|longest| longest < half_grace_ms),
        "disconnected for {longest_disconnected_ms:?} ms before it failed: the grace counted \
         from the drop, not from its last message ({grace:?})"
    );
    // Not before its grace: it was alive until the freeze (its stats came
    // every 100 ms). A lower bound: a loaded machine only makes it later.
    assert!(
        failed_after + Duration::from_millis(500) >= grace,
        "failed {failed_after:?} after the freeze, before its grace {grace:?}"
    );
    let drained = drafter.await.unwrap().unwrap();
    assert_eq!(
        drained.end_of_stream.status(),
        proto::RunStatus::Aborted,
        "{:?}",
        drained.end_of_stream
    );
    assert!(
        drained.end_of_stream.reason.contains("target-0"),
        "{}",
        drained.end_of_stream.reason
    );
    drop(target);
    broker.stop().await;
}
