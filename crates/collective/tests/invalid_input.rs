//! Bad input gives errors, not panics, aborts or hangs.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::net::TcpListener;
use std::time::{Duration, Instant};

use dflash_collective::{Backend, CollectiveError, GroupOptions, Operation, ProcessGroup, Store};
use tch::{Kind, Tensor};

fn options(port: u16, prefix: &str, rank: usize, world_size: usize) -> GroupOptions {
    GroupOptions {
        store_host: "127.0.0.1".to_string(),
        store_port: port,
        prefix: prefix.to_string(),
        rank,
        world_size,
        interface_host: "127.0.0.1".to_string(),
        timeout: Duration::from_secs(5),
        ..GroupOptions::default()
    }
}

#[test]
fn world_size_zero_is_refused() {
    let error = ProcessGroup::new(&options(1, "zero", 0, 0), None).expect_err("world size 0");
    assert!(
        matches!(error, CollectiveError::InvalidOptions { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("world size 0"), "{error}");
}

#[test]
fn rank_at_or_above_world_size_is_refused() {
    for rank in [3, 4, usize::MAX] {
        let error =
            ProcessGroup::new(&options(1, "rank", rank, 3), None).expect_err("rank too big");
        assert!(
            matches!(error, CollectiveError::InvalidOptions { .. }),
            "{error:?}"
        );
        assert!(
            error.to_string().contains(&format!("rank {rank}")),
            "{error}"
        );
    }
}

#[test]
fn zero_timeout_and_nul_bytes_are_refused() {
    let zero_timeout = GroupOptions {
        timeout: Duration::ZERO,
        ..options(1, "timeout", 0, 1)
    };
    let error = ProcessGroup::new(&zero_timeout, None).expect_err("zero timeout");
    assert!(
        matches!(error, CollectiveError::InvalidOptions { .. }),
        "{error:?}"
    );

    let error = ProcessGroup::new(&options(1, "nul\0prefix", 0, 1), None).expect_err("nul byte");
    assert!(error.to_string().contains("holds a nul byte"), "{error}");
}

#[test]
fn unreachable_store_fails_within_its_timeout() {
    // A port bound and never listening, held for the test: it refuses
    // every connection (a port bound and dropped could be taken again,
    // even by the client's own source port, which then connects to itself).
    let closed = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
    closed
        .bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind 127.0.0.1:0");
    let closed_port = closed.local_addr().expect("its address").port();
    let unreachable = GroupOptions {
        timeout: Duration::from_secs(1),
        ..options(closed_port, "nobody", 1, 2)
    };
    let started = Instant::now();
    let error = ProcessGroup::new(&unreachable, None).expect_err("no store there");
    let elapsed = started.elapsed();
    assert!(matches!(error, CollectiveError::Join { .. }), "{error:?}");
    assert!(
        error
            .to_string()
            .contains(&format!("127.0.0.1:{closed_port}")),
        "{error}"
    );
    // The configured 1 s counts, not GroupOptions' default 60 s: the bound
    // sits halfway, 29 s above the configured timeout for a loaded
    // machine and 30 s below what a lost option would take.
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
}

#[test]
fn store_on_a_busy_port_or_bad_host_is_an_error() {
    let busy = TcpListener::bind("127.0.0.1:0").expect("a port");
    let busy_port = busy.local_addr().expect("its address").port();
    let error = Store::host("127.0.0.1", busy_port, Duration::from_secs(1)).expect_err("busy port");
    assert!(
        matches!(error, CollectiveError::StoreHost { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains(&busy_port.to_string()),
        "{error}"
    );

    let error = Store::host("192.0.2.1", 0, Duration::from_secs(1))
        .expect_err("an address not on this machine");
    assert!(error.to_string().contains("192.0.2.1"), "{error}");
}

#[test]
fn nccl_is_refused_without_the_feature() {
    if cfg!(feature = "nccl") {
        return;
    }
    let nccl = GroupOptions {
        backend: Backend::Nccl,
        ..options(1, "nccl", 0, 1)
    };
    let error = ProcessGroup::new(&nccl, None).expect_err("nccl without the feature");
    assert!(
        matches!(error, CollectiveError::NcclUnavailable { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("built without feature nccl"),
        "{error}"
    );
}

#[test]
fn bad_tensors_and_roots_are_refused_by_a_live_group() {
    let store = Store::host("127.0.0.1", 0, Duration::from_secs(5)).expect("a store");
    let group = ProcessGroup::new(&options(store.port(), "alone", 0, 1), Some(&store))
        .expect("a world of one");

    let mut transposed = Tensor::ones([4, 3], (Kind::Float, tch::Device::Cpu)).transpose(0, 1);
    let error = group
        .all_reduce_sum(&mut transposed)
        .expect_err("not contiguous");
    assert!(
        matches!(
            error,
            CollectiveError::InvalidArgument {
                operation: Operation::AllReduce,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .starts_with("all_reduce over rank 0 of 1 (prefix alone)"),
        "{error}"
    );

    let mut values = Tensor::from_slice(&[1.0f32, 2.0]);
    let error = group
        .broadcast(&mut values, 1)
        .expect_err("root outside the world");
    assert!(error.to_string().contains("root 1"), "{error}");

    // A dtype Gloo cannot reduce is c10d's error, returned, not thrown.
    let mut booleans = Tensor::from_slice(&[true, false]);
    match group.all_reduce_sum(&mut booleans) {
        Ok(()) => {}
        Err(error) => assert!(
            matches!(error, CollectiveError::Collective { .. }),
            "{error:?}"
        ),
    }

    // The group still works after refusing.
    group
        .all_reduce_sum(&mut values)
        .expect("all_reduce in a world of one");
    assert_eq!(Vec::<f32>::try_from(&values).expect("f32"), vec![1.0, 2.0]);
}

#[test]
fn a_group_whose_peers_never_come_fails_at_the_group_timeout() {
    // The store's own timeout is long: the group's must be the one that counts.
    let store = Store::host("127.0.0.1", 0, Duration::from_secs(60)).expect("a store");
    let lonely = GroupOptions {
        timeout: Duration::from_secs(1),
        ..options(store.port(), "stragglers", 0, 2)
    };
    let started = Instant::now();
    let error = ProcessGroup::new(&lonely, Some(&store)).expect_err("rank 1 never joins");
    let elapsed = started.elapsed();
    assert!(matches!(error, CollectiveError::Join { .. }), "{error:?}");
    // The group's 1 s counts, not the store's 60 s: the bound sits halfway,
    // 29 s above the configured timeout for a loaded machine and 30 s
    // below the store's.
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
    eprintln!("no peer: failed after {elapsed:?}: {error}");
}
