//! Real c10d groups of threads in one process, on a loopback store hosted by
//! rank 0: the collectives' results, and a second group on the same store
//! after the first is gone (how the drafters re-form after a member leaves).
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use dflash_collective::{GroupOptions, ProcessGroup, Store};
use tch::{Kind, Tensor};

const TIMEOUT: Duration = Duration::from_secs(20);
const ELEMENTS: usize = 100_003;

fn options(port: u16, prefix: &str, rank: usize, world_size: usize) -> GroupOptions {
    GroupOptions {
        store_host: "127.0.0.1".to_string(),
        store_port: port,
        prefix: prefix.to_string(),
        rank,
        world_size,
        interface_host: "127.0.0.1".to_string(),
        timeout: TIMEOUT,
        ..GroupOptions::default()
    }
}

/// Rank `rank`'s contribution: integer-valued floats, so sums are exact.
fn contribution(rank: usize) -> Vec<f32> {
    (0..ELEMENTS)
        .map(|index| ((index % 1000) * (rank + 1) + rank * 7) as f32)
        .collect()
}

/// The sum of ranks 0..world_size's contributions, element by element.
fn exact_sum(world_size: usize) -> Vec<f32> {
    let contributions: Vec<Vec<f32>> = (0..world_size).map(contribution).collect();
    (0..ELEMENTS)
        .map(|index| contributions.iter().map(|values| values[index]).sum())
        .collect()
}

fn to_vec(tensor: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(tensor).unwrap_or_default()
}

/// Runs `body(rank, group)` on one thread per rank of a new group `prefix`;
/// rank 0 rendezvouses through `store` itself, the others as clients.
fn on_every_rank<T: Send>(
    store: &Store,
    prefix: &str,
    world_size: usize,
    body: impl Fn(usize, ProcessGroup) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world_size)
            .map(|rank| {
                let body = &body;
                scope.spawn(move || {
                    let local_store = (rank == 0).then_some(store);
                    let group = ProcessGroup::new(
                        &options(store.port(), prefix, rank, world_size),
                        local_store,
                    )
                    .unwrap_or_else(|error| panic!("rank {rank} joining {prefix}: {error}"));
                    assert_eq!((group.rank(), group.world_size()), (rank, world_size));
                    body(rank, group)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|rank| match rank.join() {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    })
}

#[test]
fn three_ranks_all_reduce_broadcast_and_barrier() {
    let store = Store::host("127.0.0.1", 0, TIMEOUT).expect("hosting the store");
    assert_ne!(store.port(), 0);
    let expected_sum = exact_sum(3);
    let root_values: Vec<f32> = (0..ELEMENTS).map(|index| (index * 3) as f32).collect();

    let results = on_every_rank(&store, "world3", 3, |rank, group| {
        let mut summed = Tensor::from_slice(&contribution(rank));
        group.all_reduce_sum(&mut summed).expect("all_reduce");

        let mut broadcast = if rank == 1 {
            Tensor::from_slice(&root_values)
        } else {
            Tensor::full([ELEMENTS as i64], -1.0, (Kind::Float, tch::Device::Cpu))
        };
        group.broadcast(&mut broadcast, 1).expect("broadcast");
        group.barrier().expect("barrier");
        (to_vec(&summed), to_vec(&broadcast))
    });

    for (rank, (summed, broadcast)) in results.iter().enumerate() {
        assert!(
            summed == &expected_sum,
            "rank {rank}: all_reduce_sum is not the exact sum"
        );
        assert!(
            broadcast == &root_values,
            "rank {rank}: broadcast is not root 1's values"
        );
    }
}

#[test]
fn a_new_group_on_the_same_store_after_the_first_is_dropped() {
    let store = Store::host("127.0.0.1", 0, TIMEOUT).expect("hosting the store");

    let first = on_every_rank(&store, "q1", 3, |rank, group| {
        let mut tensor = Tensor::from_slice(&[rank as f32 + 1.0]);
        group.all_reduce_sum(&mut tensor).expect("all_reduce in q1");
        to_vec(&tensor)
        // `group` drops here, on its own rank's thread.
    });
    assert!(
        first.iter().all(|values| values == &[6.0]),
        "q1 sums: {first:?}"
    );

    // Rank 2 left: the remaining two form a new group under a new prefix.
    let second = on_every_rank(&store, "q2", 2, |rank, group| {
        let mut summed = Tensor::from_slice(&contribution(rank));
        group.all_reduce_sum(&mut summed).expect("all_reduce in q2");
        let mut broadcast = Tensor::from_slice(&[rank as f32 * 10.0 + 5.0; 4]);
        group.broadcast(&mut broadcast, 0).expect("broadcast in q2");
        (to_vec(&summed), to_vec(&broadcast))
    });
    let expected_sum = exact_sum(2);
    for (rank, (summed, broadcast)) in second.iter().enumerate() {
        assert!(
            summed == &expected_sum,
            "rank {rank}: q2's sum is not exact"
        );
        assert_eq!(broadcast, &[5.0; 4], "rank {rank}: q2's broadcast");
    }
}
