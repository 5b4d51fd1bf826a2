//! One short cross-host run (#26) on the test bed of `scripts/hosts.sh`
//! (network namespaces joined by veth pairs and a bridge): the real broker
//! binary on host 0, a target and a drafter (this test's process) on host 1,
//! whose link is cut while the drafter holds leases, then restored.
//!
//! While host 1 is cut off, the broker's status, read from host 0 with
//! `dflash-ops`, must show the drafter dropped (keepalive) and its leases
//! back in the queue; once the link is back the drafter reconnects, the run
//! completes, and by (target, seq) every item reached the drafter, the ones
//! leased at the cut a second time (delivery count 2), and the broker acked
//! each exactly once.
//!
//! The test builds the bed itself: run outside it, it runs
//! `scripts/hosts.sh run --hosts 2 --on 1 -- <this test>`, which tears the
//! bed down however the run ends. It needs root (network namespaces); without
//! it, or without iproute2, it reports itself skipped (`SKIPPED:`, counted
//! apart by `.ci/run`), and on CI (`CI=true`), where both are there, it fails.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_proto::v1 as proto;
use dflash_testkit::{credit, sample, wait_until, workspace_binary};

const TEST_NAME: &str = "a_drafter_host_cut_off_and_back_loses_nothing";
const ITEMS: u64 = 200;
const BROKER_PORT: u16 = 50051;

fn hosts_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/hosts.sh")
}

/// Why the bed cannot be built here, if it cannot.
fn why_no_bed() -> Option<String> {
    let uid = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Some("not root: network namespaces need root".into());
    }
    match Command::new("ip").args(["netns", "list"]).output() {
        Ok(output) if output.status.success() => None,
        Ok(output) => Some(format!(
            "`ip netns list` failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Err(error) => Some(format!("no iproute2 `ip`: {error}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drafter_host_cut_off_and_back_loses_nothing() {
    if std::env::var_os("DFLASH_HOSTS_NAMESPACES").is_some() {
        on_the_bed().await;
        return;
    }
    if let Some(reason) = why_no_bed() {
        dflash_testkit::skip(TEST_NAME, &reason);
        return;
    }
    // Outside the bed: build it and run this test again inside, on host 1.
    let status = Command::new("bash")
        .arg(hosts_script())
        .args(["run", "--hosts", "2", "--tag", "systest", "--on", "1", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads", "1"])
        .status()
        .expect("run scripts/hosts.sh");
    assert!(status.success(), "the run on the bed failed: {status}");
}

/// Kills a child process when the test ends, however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The bed as `scripts/hosts.sh run` describes it.
struct Bed {
    namespaces: Vec<String>,
    addresses: Vec<String>,
    script: String,
}

impl Bed {
    fn from_environment() -> Bed {
        let list = |name: &str| -> Vec<String> {
            std::env::var(name)
                .unwrap()
                .split_whitespace()
                .map(str::to_string)
                .collect()
        };
        Bed {
            namespaces: list("DFLASH_HOSTS_NAMESPACES"),
            addresses: list("DFLASH_HOSTS_ADDRESSES"),
            script: std::env::var("DFLASH_HOSTS_SCRIPT").unwrap(),
        }
    }

    fn set_link(&self, host: usize, state: &str) {
        let status = Command::new("bash")
            .arg(&self.script)
            .args(["link", &host.to_string(), state])
            .status()
            .unwrap();
        assert!(status.success(), "hosts.sh link {host} {state}");
    }

    /// The broker's status read by `dflash-ops` from host 0, which the cut
    /// does not touch.
    fn status_from_host_0(&self, broker: &str) -> Option<serde_json::Value> {
        let output = Command::new("ip")
            .args(["netns", "exec", &self.namespaces[0]])
            .arg(workspace_binary("dflash-ops"))
            .args(["status", "--json", "--broker", broker])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        serde_json::from_slice(&output.stdout).ok()
    }
}

/// What the drafter saw: every delivery's (target, seq) and delivery count,
/// and how many of its streams failed.
#[derive(Default)]
struct DrafterLog {
    deliveries: Mutex<Vec<(String, u64, u32)>>,
    streams_lost: AtomicU64,
}

/// A drafter with a simulated 20 ms step per item that opens a new stream
/// whenever one fails, until end-of-stream.
async fn drafter(client: BrokerClient, log: Arc<DrafterLog>) -> proto::EndOfStream {
    loop {
        let Ok(mut consumer) = client.consume("cut-drafter", credit(8)).await else {
            // The link is down: try again (the wait is a retry's pause).
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let handle = consumer.handle();
        loop {
            match consumer.next().await {
                Ok(ConsumerEvent::Delivery(delivery)) => {
                    log.deliveries.lock().unwrap().push((
                        delivery.target_id.clone(),
                        delivery.seq,
                        delivery.delivery_count,
                    ));
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    handle.ack(vec![delivery.delivery_id]);
                }
                Ok(ConsumerEvent::EndOfStream(end)) => return end,
                Err(_) => {
                    log.streams_lost.fetch_add(1, Ordering::SeqCst);
                    break;
                }
            }
        }
    }
}

async fn on_the_bed() {
    let bed = Bed::from_environment();
    assert!(bed.namespaces.len() >= 2, "the bed needs two hosts");
    let address = format!("{}:{BROKER_PORT}", bed.addresses[0]);
    let broker_url = format!("http://{address}");
    let work = tempfile::tempdir().unwrap();
    let broker_log = std::fs::File::create(work.path().join("broker.log")).unwrap();
    let _broker = Child(
        Command::new("ip")
            .args(["netns", "exec", &bed.namespaces[0]])
            .arg(workspace_binary("broker"))
            .args(["--listen", &address, "--expected-targets", "1"])
            .args(["--keepalive-interval", "500ms", "--keepalive-timeout", "1s"])
            .stdout(Stdio::null())
            .stderr(broker_log)
            .spawn()
            .expect("start the broker on host 0"),
    );
    // This side notices the cut as fast as the broker does.
    let options = ClientOptions {
        keepalive_interval: Duration::from_millis(500),
        keepalive_timeout: Duration::from_secs(1),
        connect_timeout: Duration::from_secs(1),
        ..ClientOptions::default()
    };
    let connect = || BrokerClient::connect(broker_url.clone(), options.clone());
    assert!(
        wait_until(Duration::from_secs(30), || async {
            connect().await.is_ok()
        })
        .await,
        "the broker on host 0 never answered"
    );
    let client = connect().await.unwrap();

    // The target sends everything at once; the drafter's steps set the pace.
    let mut producer = client.produce("target-0").await.unwrap();
    for seq in 0..ITEMS {
        producer
            .send(seq, sample(16 << 10, seq), Default::default())
            .await
            .unwrap();
    }
    assert_eq!(producer.finish().await.unwrap().accepted, ITEMS);
    client.report_done("target-0", ITEMS).await.unwrap();

    let log = Arc::new(DrafterLog::default());
    let drafting = tokio::spawn(drafter(client.clone(), log.clone()));
    let delivered = || log.deliveries.lock().unwrap().len();
    assert!(
        wait_until(Duration::from_secs(30), || async { delivered() >= 40 }).await,
        "the drafter never got going"
    );

    let cut_at = Instant::now();
    bed.set_link(1, "down");
    // Seen from host 0: the broker dropped the drafter and took its leases
    // back, while nothing could reach it.
    let returned = wait_until(Duration::from_secs(20), || async {
        bed.status_from_host_0(&broker_url).is_some_and(|status| {
            let cut_drafter = status["drafters"].as_array().and_then(|drafters| {
                drafters
                    .iter()
                    .find(|drafter| drafter["drafter_id"] == "cut-drafter")
            });
            cut_drafter.is_some_and(|drafter| {
                drafter["connected"] == false && drafter["leased_items"] == 0
            }) && status["leased_items"] == 0
                && status["queued_items"].as_u64().unwrap_or(0) > 0
        })
    })
    .await;
    let dropped_after = cut_at.elapsed();
    assert!(
        returned,
        "the broker never dropped the cut-off drafter and returned its leases"
    );
    assert!(
        wait_until(Duration::from_secs(20), || async {
            log.streams_lost.load(Ordering::SeqCst) >= 1
        })
        .await,
        "the drafter never noticed the cut"
    );
    bed.set_link(1, "up");

    let end = tokio::time::timeout(Duration::from_secs(40), drafting)
        .await
        .expect("no end-of-stream within 40 s of the link's return")
        .unwrap();
    assert_eq!(end.status, proto::RunStatus::Complete as i32);

    let mut by_item: BTreeMap<(String, u64), Vec<u32>> = BTreeMap::new();
    for (target_id, seq, count) in log.deliveries.lock().unwrap().iter() {
        by_item
            .entry((target_id.clone(), *seq))
            .or_default()
            .push(*count);
    }
    let lost: Vec<u64> = (0..ITEMS)
        .filter(|seq| !by_item.contains_key(&("target-0".to_string(), *seq)))
        .collect();
    assert!(lost.is_empty(), "never delivered: {lost:?}");
    let redelivered = by_item
        .values()
        .filter(|counts| counts.iter().any(|&count| count >= 2))
        .count();
    assert!(
        redelivered >= 1,
        "no item leased at the cut came back (delivery count 2)"
    );
    let status = connect().await.unwrap().status().await.unwrap();
    assert_eq!(status.acked_items, ITEMS, "acked once each");
    assert_eq!(status.dead_letters, 0);
    assert!(status.redelivered_items >= redelivered as u64);
    eprintln!(
        "{TEST_NAME}: broker dropped the drafter {:.2} s after the cut; {redelivered} items came back; {} deliveries for {ITEMS} items; {} stream(s) lost",
        dropped_after.as_secs_f64(),
        log.deliveries.lock().unwrap().len(),
        log.streams_lost.load(Ordering::SeqCst)
    );
}
