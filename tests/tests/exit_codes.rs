//! The exit-code table (`dflash_shell::Exit`, the README's "Flags and exit
//! codes") with the real binaries: every binary exits 2 on a wrong command
//! line, and a drafter-server whose run the broker ends ABORTED exits 3.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use dflash_broker::config::FailurePolicy;
use dflash_broker::BrokerConfig;
use dflash_shell::Exit;
use dflash_testkit::{workspace_binary, TestBroker};

/// Kills a child process when the test ends, however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_binary_exits_with_usage_on_a_wrong_command_line() {
    for binary in ["broker", "target-server", "drafter-server", "dflash"] {
        let output = std::process::Command::new(workspace_binary(binary))
            .arg("--no-such-flag")
            .output()
            .unwrap();
        assert_eq!(
            output.status.code(),
            Some(i32::from(Exit::Usage.code())),
            "{binary}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drafter_whose_run_is_aborted_exits_with_aborted() {
    // One expected target that never connects: under the abort policy the
    // run ends ABORTED once the startup timeout has passed.
    let broker = TestBroker::start(BrokerConfig {
        target_startup_timeout: Duration::from_secs(2),
        on_target_failure: FailurePolicy::Abort,
        ..BrokerConfig::for_targets(1)
    })
    .await;
    let work = tempfile::tempdir().unwrap();
    let log_path = work.path().join("drafter.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut drafter = Child(
        std::process::Command::new(workspace_binary("drafter-server"))
            .args(["--broker", &broker.address, "--drafter-id", "waiting"])
            .args(["--model", "synthetic:ms_per_1k_tokens=0", "--device", "cpu"])
            .arg("--output")
            .arg(work.path().join("checkpoints"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = drafter.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the drafter did not exit after the run was aborted; log:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert_eq!(
        status.code(),
        Some(i32::from(Exit::Aborted.code())),
        "log:\n{log}"
    );
    assert!(log.contains("run aborted by the broker"), "log:\n{log}");
}
