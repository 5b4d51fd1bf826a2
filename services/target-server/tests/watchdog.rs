//! A target-server whose compute thread hangs inside a live process (the
//! hidden test hook): the broker fails it after `--target-stall-timeout`
//! (the run ends ABORTED for the drafters under `abort`, COMPLETE with the
//! target among the failed ones under `continue`), and the target-server's
//! own watchdog exits non-zero with the reason.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use dflash_broker::config::OnTargetFailure;
use dflash_broker::BrokerConfig;
use dflash_client::ConsumerEvent;
use dflash_proto::v1 as proto;
use dflash_testkit::{credit, TestBroker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_compute_thread_aborts_the_run_and_exits_non_zero() -> Result<()> {
    let stall = Duration::from_secs(2);
    let watchdog = Duration::from_secs(4);
    let broker = TestBroker::start(BrokerConfig {
        target_stall_timeout: stall,
        on_target_failure: OnTargetFailure::Abort,
        ..BrokerConfig::for_targets(1)
    })
    .await;
    let client = broker.client().await;
    let mut consumer = client.consume("drafter-0", credit(64)).await?;
    let started = Instant::now();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_target-server"))
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
        .arg(format!("{}s", watchdog.as_secs()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;

    // The drafter gets what was computed, then end-of-stream ABORTED.
    let mut received = 0u64;
    let mut last_delivery = Instant::now();
    let end = loop {
        let event = tokio::time::timeout(Duration::from_secs(60), consumer.next())
            .await
            .context("end-of-stream in time")??;
        match event {
            ConsumerEvent::Delivery(delivery) => {
                received += 1;
                last_delivery = Instant::now();
                consumer.handle().ack(vec![delivery.delivery_id]);
            }
            ConsumerEvent::EndOfStream(end) => break end,
        }
    };
    let waited = last_delivery.elapsed();
    ensure!(end.status() == proto::RunStatus::Aborted, "{end:?}");
    ensure!(end.reason.contains("no item accepted"), "{}", end.reason);
    ensure!(received > 0 && received < 100, "received {received}");
    ensure!(
        waited <= stall + Duration::from_secs(3),
        "aborted {waited:?} after the last item, stall timeout {stall:?}"
    );

    // The target-server's watchdog ends it with a non-zero exit and the reason.
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .context("target-server exited in time")??;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.code() == Some(i32::from(dflash_service::Exit::Failed.code())),
        "{:?}\n{stderr}",
        output.status
    );
    ensure!(stderr.contains("watchdog"), "{stderr}");
    ensure!(
        started.elapsed() <= watchdog + Duration::from_secs(30),
        "exited after {:?}",
        started.elapsed()
    );
    broker.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_compute_thread_under_continue_completes_with_the_target_failed() -> Result<()> {
    let stall = Duration::from_secs(2);
    let watchdog = Duration::from_secs(4);
    let broker = TestBroker::start(BrokerConfig {
        target_stall_timeout: stall,
        on_target_failure: OnTargetFailure::Continue,
        ..BrokerConfig::for_targets(1)
    })
    .await;
    let client = broker.client().await;
    let mut consumer = client.consume("drafter-0", credit(64)).await?;
    let started = Instant::now();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_target-server"))
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
        .arg(format!("{}s", watchdog.as_secs()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;

    // The drafter acks what was computed; the run then completes without
    // the stuck target's remaining samples, and says so.
    let mut acked = std::collections::BTreeSet::new();
    let mut last_delivery = Instant::now();
    let end = loop {
        let event = tokio::time::timeout(Duration::from_secs(60), consumer.next())
            .await
            .context("end-of-stream in time")??;
        match event {
            ConsumerEvent::Delivery(delivery) => {
                ensure!(
                    acked.insert((delivery.target_id.clone(), delivery.seq)),
                    "delivered twice: {} {}",
                    delivery.target_id,
                    delivery.seq
                );
                last_delivery = Instant::now();
                consumer.handle().ack(vec![delivery.delivery_id]);
            }
            ConsumerEvent::EndOfStream(end) => break end,
        }
    };
    let waited = last_delivery.elapsed();
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
    ensure!(
        waited <= stall + Duration::from_secs(3),
        "completed {waited:?} after the last item, stall timeout {stall:?}"
    );

    // The target-server's watchdog still ends it non-zero with the reason.
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .context("target-server exited in time")??;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(!output.status.success(), "{:?}\n{stderr}", output.status);
    ensure!(
        started.elapsed() <= watchdog + Duration::from_secs(30),
        "exited after {:?}",
        started.elapsed()
    );
    broker.stop().await;
    Ok(())
}
