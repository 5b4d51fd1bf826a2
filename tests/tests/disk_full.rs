//! The real `broker` binary with its `--state-dir` on a small tmpfs (#25):
//! when the disk fills, the write-ahead log's writes are rolled back and
//! retried, nothing is confirmed that is not written, the Broker service
//! turns NOT_SERVING (readiness), the target is held back; when space
//! returns everything resumes by itself and the run completes with every
//! (target, seq) delivered and acked exactly once.
//!
//! Needs to mount a tmpfs (root, as in CI and the project's containers);
//! where mounting is not allowed the test reports itself skipped
//! (`SKIPPED:`, counted apart by `.ci/run`), and on CI (`CI=true`) it fails.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use dflash_client::ClientOptions;
use dflash_proto::v1 as proto;
use dflash_testkit::{sample, spawn_drafter, wait_until, BrokerProcess};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const ITEMS: u64 = 48;
const ITEM_BYTES: usize = 64 << 10;

/// A tmpfs mounted for the test's life (lazily unmounted on drop).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(path: &Path, size: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(path).map_err(|error| error.to_string())?;
        let output = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .output()
            .map_err(|error| error.to_string())?;
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).trim().to_string());
        }
        Ok(Tmpfs(path.to_path_buf()))
    }

    fn resize(&self, size: &str) {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(status.success(), "remount {} to {size}", self.0.display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

async fn broker_service_status(address: &str) -> Option<i32> {
    let channel = dflash_client::connect_channel(address, &ClientOptions::default())
        .await
        .ok()?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "dflash.v1.Broker".to_string(),
        })
        .await
        .ok()?;
    Some(response.into_inner().status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_disk_holds_the_target_back_and_the_run_resumes_when_space_returns() {
    let work = tempfile::tempdir().unwrap();
    let state_dir = work.path().join("state");
    let tmpfs = match Tmpfs::mount(&state_dir, "1M") {
        Ok(tmpfs) => tmpfs,
        Err(reason) => {
            dflash_testkit::skip(
                "a_full_disk_holds_the_target_back_and_the_run_resumes_when_space_returns",
                &format!("cannot mount a tmpfs here ({reason}); this test needs root"),
            );
            return;
        }
    };
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
    let client = broker.client().await;
    let producer_client = client.clone();
    // 48 items of 64 KiB (3 MiB of records) into a 1 MiB file system.
    let producing = tokio::spawn(async move {
        let mut producer = producer_client.produce("target-0").await.unwrap();
        for seq in 0..ITEMS {
            producer
                .send(seq, sample(ITEM_BYTES, seq), HashMap::new())
                .await
                .unwrap();
        }
        producer.finish().await.unwrap()
    });
    let serving = ServingStatus::Serving as i32;
    let not_serving = ServingStatus::NotServing as i32;
    assert!(
        wait_until(Duration::from_secs(30), || async {
            broker_service_status(&broker.address).await == Some(not_serving)
        })
        .await,
        "the Broker service never turned NOT_SERVING on a full disk; log: {}",
        broker.log()
    );
    // Held back: the target cannot finish while nothing more is written.
    assert!(!producing.is_finished());
    assert!(broker.log().contains("cannot write"), "{}", broker.log());
    let status = client.status().await.unwrap();
    assert!(status.accepted_items < ITEMS, "{status:?}");

    tmpfs.resize("64M");
    assert!(
        wait_until(Duration::from_secs(30), || async {
            broker_service_status(&broker.address).await == Some(serving)
        })
        .await,
        "the Broker service stayed NOT_SERVING after space returned; log: {}",
        broker.log()
    );
    let report = tokio::time::timeout(Duration::from_secs(60), producing)
        .await
        .expect("the target finishes once space returns")
        .unwrap();
    assert!(report.rejected.is_empty(), "{report:?}");
    client.report_done("target-0", ITEMS).await.unwrap();

    let drained = spawn_drafter(client.clone(), "drafter-0", Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    let end = drained.end_of_stream;
    assert_eq!(end.status(), proto::RunStatus::Complete, "{end:?}");
    let mut acked: BTreeMap<(String, u64), u32> = BTreeMap::new();
    for delivery in &drained.deliveries {
        *acked
            .entry((delivery.target_id.clone(), delivery.seq))
            .or_default() += 1;
    }
    let expected: BTreeMap<(String, u64), u32> = (0..ITEMS)
        .map(|seq| (("target-0".to_string(), seq), 1))
        .collect();
    assert_eq!(acked, expected, "each (target, seq) delivered exactly once");

    // And the log holds it all: a restart on the state dir sees the run.
    broker.restart().await;
    let status = broker.client().await.status().await.unwrap();
    assert_eq!(status.accepted_items, ITEMS);
    assert_eq!(status.acked_items, ITEMS);
    drop(broker);
}
