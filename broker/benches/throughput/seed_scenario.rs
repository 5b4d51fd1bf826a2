//! The seed's scenario: 5 paced synthetic targets and 3 synthetic drafters
//! whose training step is the bottleneck, through the shared queue and
//! under a static round-robin assignment (one broker per drafter), with
//! each drafter's busy fraction.
//!
//! Apart from the transfers because its drafters are paced by a simulated
//! step, not by the wire: it measures the queue's sharing, not its speed.

use std::time::{Duration, Instant};

use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_proto::v1 as proto;

use crate::processes::start_broker;
use crate::transfer::{run_target, sample};

/// One synthetic drafter's record: items it processed, the time it spent
/// processing them, and when it finished its last one.
struct DrafterRecord {
    items: u64,
    busy: Duration,
    first_received: Option<Instant>,
    last_done: Instant,
}

/// Busy time over the time the drafter had data coming: from its first
/// delivery to the end of its last step.
fn busy_percent(record: &DrafterRecord) -> f64 {
    let Some(first_received) = record.first_received else {
        return 0.0;
    };
    let window = record.last_done.saturating_duration_since(first_received);
    100.0 * record.busy.as_secs_f64() / window.as_secs_f64().max(1e-9)
}

/// Synthetic targets send `items_per_target` 64 KiB items each at
/// `target_rate` items/s; synthetic drafters take `step` per item (a
/// training step) then ack. `assignment[target]` is the broker (address
/// index) each target sends to; each broker has `drafters_per_broker`.
async fn seed_scenario(
    brokers: usize,
    assignment: &[usize],
    drafters_per_broker: usize,
    items_per_target: u64,
    target_rate: f64,
    step: Duration,
) -> (f64, Vec<f64>) {
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    for broker in 0..brokers {
        let targets = assignment.iter().filter(|&&to| to == broker).count() as u64;
        let (server, address) = start_broker(targets).await;
        servers.push(server);
        clients.push(
            BrokerClient::connect(address, ClientOptions::default())
                .await
                .expect("connect"),
        );
    }
    let started = Instant::now();
    let mut drafters = Vec::new();
    for (broker, client) in clients.iter().enumerate() {
        for index in 0..drafters_per_broker {
            let client = client.clone();
            drafters.push(tokio::spawn(async move {
                let mut consumer = client
                    .consume(
                        &format!("d{broker}-{index}"),
                        proto::Credit { items: 2, bytes: 0 },
                    )
                    .await
                    .expect("consume");
                let handle = consumer.handle();
                let mut record = DrafterRecord {
                    items: 0,
                    busy: Duration::ZERO,
                    first_received: None,
                    last_done: Instant::now(),
                };
                while let Ok(ConsumerEvent::Delivery(delivery)) = consumer.next().await {
                    let step_started = Instant::now();
                    record.first_received.get_or_insert(step_started);
                    tokio::time::sleep(step).await;
                    record.busy += step_started.elapsed();
                    record.items += 1;
                    record.last_done = Instant::now();
                    handle.ack(vec![delivery.delivery_id]);
                }
                record
            }));
        }
    }
    let mut targets = Vec::new();
    for (index, &broker) in assignment.iter().enumerate() {
        let client = clients[broker].clone();
        // Each broker knows its own targets as target-0, target-1, ...
        let position = assignment[..index]
            .iter()
            .filter(|&&to| to == broker)
            .count();
        targets.push(tokio::spawn(run_target(
            client,
            format!("target-{position}"),
            sample(64 << 10),
            items_per_target,
            Some(Duration::from_secs_f64(1.0 / target_rate)),
        )));
    }
    for target in targets {
        target.await.expect("target");
    }
    let mut records = Vec::new();
    for drafter in drafters {
        records.push(drafter.await.expect("drafter"));
    }
    let total: u64 = records.iter().map(|record| record.items).sum();
    assert_eq!(
        total,
        items_per_target * assignment.len() as u64,
        "items lost"
    );
    let finished = records
        .iter()
        .map(|record| record.last_done)
        .max()
        .unwrap_or(started);
    let items_per_second = total as f64 / finished.duration_since(started).as_secs_f64();
    let busy = records.iter().map(busy_percent).collect();
    drop(servers);
    (items_per_second, busy)
}

pub(crate) fn print_seed_scenario(quick: bool, runtime: &tokio::runtime::Runtime) {
    // A synthetic training step of 10 ms; the drafters' real capacity is
    // calibrated (a sleep overshoots under load), then each of the five
    // targets sends at 0.85 of one drafter's capacity: 4.25 drafters' worth
    // for 3 drafters, so the drafters are the bottleneck even when load on
    // the machine shifts their speed, while one target alone cannot keep a
    // drafter busy.
    let step = Duration::from_millis(10);
    let step_seconds = runtime.block_on(async {
        let started = Instant::now();
        for _ in 0..20 {
            tokio::time::sleep(step).await;
        }
        started.elapsed().as_secs_f64() / 20.0
    });
    let target_rate = 0.85 / step_seconds;
    let items_per_target = if quick { 150 } else { 600 };
    runtime.block_on(async {
        let shared = seed_scenario(1, &[0; 5], 3, items_per_target, target_rate, step).await;
        let round_robin = seed_scenario(
            3,
            &[0, 1, 2, 0, 1],
            1,
            items_per_target,
            target_rate,
            step,
        )
        .await;
        println!(
            "seed scenario, 5 targets x 3 drafters (drafter step {:.1} ms measured, so {:.0} items/s each; targets {target_rate:.0} items/s each):",
            step_seconds * 1e3,
            1.0 / step_seconds
        );
        for (name, (items_per_second, busy)) in
            [("shared queue", shared), ("round-robin", round_robin)]
        {
            let fractions: Vec<String> = busy.iter().map(|percent| format!("{percent:.1} %")).collect();
            println!(
                "  {name:<12} {items_per_second:>6.1} items/s; drafter busy {}",
                fractions.join(", ")
            );
        }
    });
}
