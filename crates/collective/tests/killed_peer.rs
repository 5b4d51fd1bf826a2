//! A peer process killed with SIGKILL: the survivor's all-reduce returns an
//! error (it does not hang), dropping the broken group returns at once, and
//! the survivor forms a new group on the same store and goes on.
//!
//! The peer is this test binary itself, started with PEER_PORT_VARIABLE set:
//! the same test function then acts as rank 1 instead.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dflash_collective::{
    groups_being_destroyed, CollectiveError, GroupOptions, ProcessGroup, Store,
};
use tch::{Kind, Tensor};

const PEER_PORT_VARIABLE: &str = "DFLASH_COLLECTIVE_TEST_PEER_PORT";
const PEER_READY: &str = "collective-test-peer-ready";
const TEST_NAME: &str = "survivor_errors_drops_at_once_and_regroups_after_a_peer_is_killed";
const GROUP_TIMEOUT: Duration = Duration::from_secs(3);

fn options(port: u16, prefix: &str, rank: usize, world_size: usize) -> GroupOptions {
    GroupOptions {
        store_host: "127.0.0.1".to_string(),
        store_port: port,
        prefix: prefix.to_string(),
        rank,
        world_size,
        interface_host: "127.0.0.1".to_string(),
        timeout: GROUP_TIMEOUT,
        ..GroupOptions::default()
    }
}

/// Rank 1 of "doomed": joins, says so, then waits to be killed (it never
/// takes part in a collective; stdin stays open until the parent kills it).
fn act_as_peer(port: u16) {
    let group = ProcessGroup::new(&options(port, "doomed", 1, 2), None).expect("peer joining");
    println!("{PEER_READY}");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(group);
}

fn wait_until(deadline: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let started = Instant::now();
    while started.elapsed() < deadline {
        if condition() {
            return true;
        }
        std::thread::yield_now();
        std::thread::sleep(Duration::from_millis(5));
    }
    condition()
}

#[test]
fn survivor_errors_drops_at_once_and_regroups_after_a_peer_is_killed() {
    if let Ok(port) = std::env::var(PEER_PORT_VARIABLE) {
        act_as_peer(port.parse().expect("a port number"));
        return;
    }

    let store = Store::host("127.0.0.1", 0, GROUP_TIMEOUT).expect("hosting the store");
    let mut peer = Command::new(std::env::current_exe().expect("this test binary"))
        .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(PEER_PORT_VARIABLE, store.port().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the peer process");

    let group = ProcessGroup::new(&options(store.port(), "doomed", 0, 2), Some(&store))
        .expect("rank 0 joining with its peer");
    let peer_stdout = peer.stdout.take().expect("the peer's stdout");
    let peer_ready = BufReader::new(peer_stdout)
        .lines()
        .map_while(Result::ok)
        .any(|line| line.contains(PEER_READY));
    assert!(peer_ready, "the peer ended before it joined");

    // Rank 0 starts all-reducing (the peer never will), and the peer is killed
    // before or while that call waits on it.
    let started = Instant::now();
    let (finished, all_reduce) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut gradient = Tensor::ones([1 << 20], (Kind::Float, tch::Device::Cpu));
        let result = group.all_reduce_sum(&mut gradient);
        let _ = finished.send((result, group));
    });
    peer.kill().expect("SIGKILL to the peer");
    // A hang is the failure this guards against (GroupOptions' default
    // timeout, were the configured one lost, is 60 s): 60 s stops it.
    let (result, group) = all_reduce
        .recv_timeout(Duration::from_secs(60))
        .expect("all_reduce with a killed peer hung");
    let elapsed = started.elapsed();
    let _ = peer.wait();
    let error = result.expect_err("all_reduce with a killed peer must fail");
    assert!(
        matches!(error, CollectiveError::Collective { .. }),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .starts_with("all_reduce over rank 0 of 2 (prefix doomed): "),
        "{error}"
    );
    // The configured 3 s counts, not the 60 s default: the bound sits
    // halfway, 27 s above the group timeout for a loaded machine.
    assert!(
        elapsed < Duration::from_secs(30),
        "the error took {elapsed:?}, the group timeout is {GROUP_TIMEOUT:?}"
    );
    eprintln!("all_reduce failed after {elapsed:?}: {error}");

    let dropping = Instant::now();
    drop(group);
    let drop_took = dropping.elapsed();
    // Handed to a destroying thread, not destroyed here: destroying a group
    // whose peer is gone can block until its timeout (3 s; the crate's
    // `groups_being_destroyed`), so a drop that took that long may have
    // done the destroy itself. A hand-off takes microseconds: the bound
    // leaves 3 s to a loaded machine.
    assert!(drop_took < GROUP_TIMEOUT, "dropping took {drop_took:?}");

    // The survivor goes on alone, on the same store, under a new prefix.
    let alone = ProcessGroup::new(&options(store.port(), "after-kill", 0, 1), Some(&store))
        .expect("a new group of one");
    let mut values = Tensor::from_slice(&[3.0f32, -4.0, 5.0]);
    alone.all_reduce_sum(&mut values).expect("all_reduce alone");
    assert_eq!(
        Vec::<f32>::try_from(&values).expect("f32"),
        vec![3.0, -4.0, 5.0]
    );
    drop(alone);

    // The broken group's C++ object is gone within its timeout (no thread
    // left destroying it when the process exits).
    assert!(
        wait_until(
            GROUP_TIMEOUT + Duration::from_secs(5),
            || groups_being_destroyed() == 0
        ),
        "{} groups still being destroyed",
        groups_being_destroyed()
    );
}
