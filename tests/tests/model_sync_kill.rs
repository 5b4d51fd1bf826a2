//! Model sync survives a drafter killed mid-run: real `broker` and
//! `drafter-server` binaries (real draft models of the tiny target, a sync
//! after every step), a producer in the test. One drafter is SIGKILLed once
//! its deltas are reaching the center, wherever it is in its step/exchange
//! cycle (between syncs, or mid-exchange, which an exchange that changes the
//! center only at its commit must make the same). The other drafters keep
//! syncing, the run ends COMPLETE, the final center is written without
//! waiting for the dead drafter, and every value in it is finite.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dflash_broker::model_sync::checkpoint::read_center;
use dflash_client::BrokerClient;
use dflash_proto::v1 as proto;
use dflash_testkit::{
    tiny_drafter_sample, wait_for_exit, wait_until, workspace_binary, BrokerProcess,
};

const DRAFTERS: usize = 3;
const VICTIM: usize = 0;
/// Enough work that the survivors still have many steps after the kill
/// (4 samples a step: 30 steps for the whole run).
const ITEMS: u64 = 120;
/// Bound on each waited-for state; the run itself takes seconds to minutes
/// in a debug build on a loaded machine.
const PHASE_TIMEOUT: Duration = Duration::from_secs(300);

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
        .args(["--max-step-samples", "4", "--prefetch-samples", "2"])
        .args(["--linger", "200ms", "--stats-interval", "200ms"])
        .args([
            "--model-sync",
            "local-sgd",
            "--sync-every",
            "1",
            "--sync-timeout",
            "60s",
            "--save-every",
            "0",
        ])
        .args(["--seed", &index.to_string()])
        // Three trainers share the machine's cores.
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start a drafter-server binary")
}

fn drafter_log(work: &Path, index: usize) -> String {
    std::fs::read_to_string(work.join(format!("{}.log", drafter_id(index)))).unwrap_or_default()
}

async fn sync_status(client: &BrokerClient) -> proto::ModelSyncStatus {
    client
        .status()
        .await
        .ok()
        .and_then(|status| status.model_sync)
        .unwrap_or_default()
}

fn drafter_sync(sync: &proto::ModelSyncStatus, index: usize) -> Option<&proto::DrafterSyncStatus> {
    let id = drafter_id(index);
    sync.drafters
        .iter()
        .find(|drafter| drafter.drafter_id == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drafter_killed_while_syncing_neither_corrupts_nor_blocks_the_center() {
    let work = tempfile::tempdir().unwrap();
    let tiny: PathBuf = work.path().join("tiny");
    let init = Command::new(workspace_binary("dflash"))
        .arg("init-tiny")
        .arg(&tiny)
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");
    let center_dir = work.path().join("center");
    let center_arg = center_dir.to_str().unwrap().to_string();
    // The final center waits for open sync sessions for up to 10 minutes:
    // if the dead drafter's session were still counted, the final write
    // would not happen within the test's bound.
    let broker = BrokerProcess::start(
        &[
            "--expected-targets",
            "1",
            "--model-output",
            &center_arg,
            "--model-final-sync-timeout",
            "10m",
            "--lease-timeout",
            "60s",
        ],
        work.path().join("broker.log"),
    )
    .await;
    let client = broker.client().await;
    let mut drafters: Vec<Child> = (0..DRAFTERS)
        .map(|index| spawn_drafter(work.path(), &broker.address, &tiny, index))
        .collect();
    let joined = wait_until(PHASE_TIMEOUT, || async {
        let sync = sync_status(&client).await;
        (0..DRAFTERS).all(|index| drafter_sync(&sync, index).is_some_and(|d| d.connected))
    })
    .await;
    assert!(
        joined,
        "every drafter joined; log: {}",
        drafter_log(work.path(), 0)
    );

    // The whole run is queued at once (the broker holds it all).
    let mut producer = client.produce("target-0").await.unwrap();
    producer
        .send_stats(proto::ProducerStats {
            samples_total: ITEMS,
            ..Default::default()
        })
        .await
        .unwrap();
    for seq in 0..ITEMS {
        producer
            .send(seq, tiny_drafter_sample(seq), Default::default())
            .await
            .unwrap();
    }
    let produced = producer.finish().await.unwrap();
    assert_eq!(produced.accepted, ITEMS, "{produced:?}");
    client.report_done("target-0", ITEMS).await.unwrap();

    // The victim dies once two of its deltas are in the center.
    let victim_synced = wait_until(PHASE_TIMEOUT, || async {
        drafter_sync(&sync_status(&client).await, VICTIM)
            .is_some_and(|drafter| drafter.updates_applied >= 2)
    })
    .await;
    assert!(
        victim_synced,
        "the victim synced; log: {}",
        drafter_log(work.path(), VICTIM)
    );
    drafters[VICTIM].kill().unwrap();
    drafters[VICTIM].wait().unwrap();
    let at_kill = sync_status(&client).await;
    let applied_at_kill: Vec<u64> = (0..DRAFTERS)
        .map(|index| drafter_sync(&at_kill, index).map_or(0, |d| d.updates_applied))
        .collect();
    let victim_at_kill = drafter_sync(&at_kill, VICTIM).unwrap().clone();
    assert!(
        at_kill.center_samples < ITEMS,
        "killed mid-run: {at_kill:?}"
    );

    // The others keep syncing: more of their deltas reach the center.
    let survivors: Vec<usize> = (0..DRAFTERS).filter(|&index| index != VICTIM).collect();
    let kept_syncing = wait_until(PHASE_TIMEOUT, || async {
        let sync = sync_status(&client).await;
        survivors.iter().all(|&index| {
            drafter_sync(&sync, index)
                .is_some_and(|drafter| drafter.updates_applied > applied_at_kill[index])
        })
    })
    .await;
    assert!(
        kept_syncing,
        "{:?}; broker log: {}",
        sync_status(&client).await,
        broker.log()
    );

    // The run ends COMPLETE: the victim's leases went back to the queue and
    // the survivors trained them, then saw end-of-stream and exited 0.
    for &index in &survivors {
        let exit = wait_for_exit(&mut drafters[index], PHASE_TIMEOUT).await;
        assert!(
            exit.is_some_and(|status| status.success()),
            "{} exited {exit:?}; log: {}",
            drafter_id(index),
            drafter_log(work.path(), index)
        );
    }
    let status = client.status().await.unwrap();
    assert_eq!(status.state, proto::BrokerState::Complete as i32);
    assert_eq!(
        status.summary.clone().unwrap_or_default().acked_items,
        ITEMS
    );

    // The final center is written without waiting out the 10 minutes for
    // the dead drafter's session.
    let final_saved = wait_until(Duration::from_secs(60), || async {
        sync_status(&client).await.final_saved
    })
    .await;
    assert!(final_saved, "final center written; log: {}", broker.log());
    let sync = sync_status(&client).await;
    assert_eq!(sync.saved_version, sync.center_version);
    let victim = drafter_sync(&sync, VICTIM).unwrap();
    assert!(!victim.connected && !victim.finished, "{victim:?}");
    // Nothing of the victim changed the center after its death.
    assert_eq!(victim.updates_applied, victim_at_kill.updates_applied);
    assert_eq!(victim.samples, victim_at_kill.samples);
    // Every sample in the center came through exactly one applied delta,
    // and none twice: at most the run's items (the victim's steps since its
    // last sync were acked but never reached the center).
    let per_drafter: u64 = sync.drafters.iter().map(|drafter| drafter.samples).sum();
    assert_eq!(sync.center_samples, per_drafter);
    assert!(sync.center_samples <= ITEMS, "{sync:?}");
    assert_eq!(
        sync.updates_applied,
        sync.drafters
            .iter()
            .map(|drafter| drafter.updates_applied)
            .sum::<u64>()
    );
    for &index in &survivors {
        assert!(drafter_sync(&sync, index).unwrap().finished);
    }

    // The written center is whole and finite.
    let center = read_center(&center_dir, true)
        .unwrap()
        .expect("a center on disk");
    assert_eq!(center.version, sync.center_version);
    assert!(!center.tensors.is_empty());
    for tensor in &center.tensors {
        let elements = tensor.shape.iter().product::<u64>() as usize;
        assert_eq!(tensor.values.len(), elements, "{}", tensor.name);
        assert!(
            tensor.values.iter().all(|value| value.is_finite()),
            "{} has a non-finite value",
            tensor.name
        );
        assert!(
            tensor.velocity.iter().all(|value| value.is_finite()),
            "{} has a non-finite velocity",
            tensor.name
        );
    }
}
