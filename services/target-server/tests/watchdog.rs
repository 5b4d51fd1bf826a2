//! A target-server whose compute thread hangs inside a live process (the
//! hidden test hook of the cargo feature `test-hooks`, on in `make test`;
//! without it these tests fail saying so): the broker fails it after `--target-stall-timeout`
//! (the run ends ABORTED for the drafters under `abort`, COMPLETE with the
//! target among the failed ones under `continue`), and the target-server's
//! own watchdog exits non-zero with the reason.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use dflash_broker::config::FailurePolicy;
use dflash_broker::BrokerConfig;
use dflash_proto::v1 as proto;
use dflash_testkit::{require_test_hooks, spawn_drafter, Drained, TestBroker};

/// Seconds without an accepted item before the broker fails the target.
const STALL: Duration = Duration::from_secs(2);
/// The target-server's own watchdog.
const WATCHDOG: Duration = Duration::from_secs(4);

/// A broker under `policy` with one acking drafter, and a target-server
/// whose compute thread hangs after three batches.
struct StuckTarget {
    broker: TestBroker,
    drafter: tokio::task::JoinHandle<Result<Drained>>,
    child: tokio::process::Child,
}

async fn start_stuck_target(policy: FailurePolicy) -> Result<StuckTarget> {
    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_target-server"));
    require_test_hooks(binary);
    let broker = TestBroker::start(BrokerConfig {
        target_stall_timeout: STALL,
        on_target_failure: policy,
        ..BrokerConfig::for_targets(1)
    })
    .await;
    let drafter = spawn_drafter(broker.client().await, "drafter-0", Duration::from_secs(60));
    let child = tokio::process::Command::new(binary)
        .args([
            "--broker",
            &broker.address,
            "--target-id",
            "target-0",
            "--model",
            "synthetic:hidden=16,layers=2,tokens_per_s=0,samples=100,seq_len=16",
            "--max-batch-tokens",
            "32",
            "--stats-interval",
            "100ms",
            "--test-hang-compute-after-batches",
            "3",
            "--watchdog-timeout",
        ])
        .arg(format!("{}s", WATCHDOG.as_secs()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    Ok(StuckTarget {
        broker,
        drafter,
        child,
    })
}

/// The target-server's exit status and stderr, once it exited. The 60 s
/// only stops a hang: that it exits because of its watchdog, and not for
/// some other reason, the callers check by its stderr.
async fn wait_for_exit(stuck: StuckTarget) -> Result<(std::process::ExitStatus, String)> {
    let output = tokio::time::timeout(Duration::from_secs(60), stuck.child.wait_with_output())
        .await
        .context("target-server exited in time")??;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    stuck.broker.stop().await;
    Ok((output.status, stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_compute_thread_aborts_the_run_and_exits_non_zero() -> Result<()> {
    let mut stuck = start_stuck_target(FailurePolicy::Abort).await?;

    // The drafter gets what was computed, then end-of-stream ABORTED.
    let drained = (&mut stuck.drafter).await??;
    let end = drained.end_of_stream;
    let received = drained.deliveries.len();
    ensure!(end.status() == proto::RunStatus::Aborted, "{end:?}");
    // The cause, by the broker's own account: the stall timeout, not the
    // target's exit (its watchdog, at 4 s, would end its stream and fail
    // it after the grace instead). How soon after the stall is no property
    // of the rule; the drafter's 60 s only stops a hang.
    ensure!(end.reason.contains("no item accepted"), "{}", end.reason);
    ensure!(received > 0 && received < 100, "received {received}");

    // The target-server's watchdog ends it with a non-zero exit and the reason.
    let (status, stderr) = wait_for_exit(stuck).await?;
    ensure!(
        status.code() == Some(i32::from(dflash_shell::Exit::Failed.code())),
        "{status:?}\n{stderr}"
    );
    ensure!(stderr.contains("watchdog"), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_compute_thread_under_continue_completes_with_the_target_failed() -> Result<()> {
    let mut stuck = start_stuck_target(FailurePolicy::Continue).await?;

    // The drafter acks what was computed; the run then completes without
    // the stuck target's remaining samples, and says so.
    let drained = (&mut stuck.drafter).await??;
    let end = drained.end_of_stream;
    let delivered: Vec<(String, u64)> = drained
        .deliveries
        .iter()
        .map(|delivery| (delivery.target_id.clone(), delivery.seq))
        .collect();
    let acked: std::collections::BTreeSet<(String, u64)> = delivered.iter().cloned().collect();
    ensure!(
        acked.len() == delivered.len(),
        "delivered twice: {delivered:?}"
    );
    ensure!(end.status() == proto::RunStatus::Complete, "{end:?}");
    let summary = end.summary.clone().context("a summary")?;
    ensure!(
        summary.failed_targets == vec!["target-0".to_string()],
        "{summary:?}"
    );
    ensure!(
        !acked.is_empty() && acked.len() < 100,
        "acked {}",
        acked.len()
    );
    ensure!(
        summary.accepted_items == acked.len() as u64 && summary.acked_items == acked.len() as u64,
        "{summary:?}, acked {}",
        acked.len()
    );
    // Failed by the stall timeout (the reason the broker recorded), not by
    // the target's exit: how soon is no property of the rule.
    let status = stuck.broker.status().await;
    let failure_reason = status
        .targets
        .iter()
        .find(|target| target.target_id == "target-0")
        .map(|target| target.failure_reason.clone())
        .unwrap_or_default();
    ensure!(
        failure_reason.contains("no item accepted"),
        "{failure_reason:?}"
    );

    // The target-server's watchdog still ends it non-zero with the reason.
    let (status, stderr) = wait_for_exit(stuck).await?;
    ensure!(!status.success(), "{status:?}\n{stderr}");
    ensure!(stderr.contains("watchdog"), "{stderr}");
    Ok(())
}
