//! The `drafter-server` binary: SIGTERM while it holds deliveries makes it
//! finish, checkpoint, hand the unused items back and exit 0.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use dflash_broker::BrokerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_checkpoints_hands_back_items_and_exits_zero() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let output = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_drafter-server"))
        .args(["--broker", &broker.address, "--drafter-id", "drafter-bin"])
        .arg("--target-model")
        .arg(tiny_target_dir())
        .arg("--output")
        .arg(output.path())
        .args([
            "--draft-layers",
            "2",
            "--block-size",
            "4",
            "--num-anchors",
            "8",
        ])
        .args([
            "--max-step-samples",
            "4",
            "--batch-tokens",
            "1000000",
            "--linger",
            "10m",
        ])
        .args(["--total-steps", "10", "--stats-interval", "100ms"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    produce(
        &broker.address,
        "target-0",
        target_samples(&random_token_sequences(6, 16, 9)),
        false,
    )
    .await;
    let holding = wait_until(Duration::from_secs(60), || async {
        let status = broker.status().await;
        drafter_status(&status, "drafter-bin")
            .is_some_and(|drafter| drafter.acked_items == 4 && drafter.leased_items == 2)
    })
    .await;
    assert!(
        holding,
        "the drafter did not take one step and hold two items"
    );

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            Instant::now() < deadline,
            "drafter-server did not exit within 30 s of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(exit.success(), "exit status {exit:?}");
    assert!(output
        .path()
        .join("step-00000001")
        .join("model.safetensors")
        .is_file());
    let returned = wait_until(Duration::from_secs(10), || async {
        let status = broker.status().await;
        status.queued_items == 2 && status.leased_items == 0
    })
    .await;
    assert!(
        returned,
        "unused items not back in the queue: {:?}",
        broker.status().await
    );
    broker.stop().await;
}
