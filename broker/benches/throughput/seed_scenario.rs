//! The seed's scenario: 5 paced synthetic targets and 3 synthetic drafters
//! whose training step is the bottleneck, through the shared queue and
//! under a static round-robin assignment (one broker per drafter), with
//! each drafter's busy fraction.
//!
//! Apart from the transfers because its drafters are paced by a simulated
//! step, not by the wire: it measures the queue's sharing, not its speed.

use std::time::{Duration, Instant};

use dflash_client::{BrokerClient, ClientOptions};

use crate::drafter::{run_drafter, DrafterLoad, DrafterRecord};
use crate::processes::start_broker;
use crate::transfer::{run_target, sample};

/// Busy time over the time the drafter had data coming: from its first
/// delivery to the end of its last step.
pub(crate) fn busy_percent(record: &DrafterRecord) -> f64 {
    let (Some(first_received), Some(last_done)) = (record.first_received, record.last_done) else {
        return 0.0;
    };
    let window = last_done.saturating_duration_since(first_received);
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
    let load = DrafterLoad {
        credit: 2,
        step: Some(step),
        reconnect: false,
        record_items: false,
    };
    for (broker, client) in clients.iter().enumerate() {
        for index in 0..drafters_per_broker {
            drafters.push(tokio::spawn(run_drafter(
                client.clone(),
                format!("d{broker}-{index}"),
                load,
                None,
            )));
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
        .filter_map(|record| record.last_done)
        .max()
        .unwrap_or(started);
    let items_per_second = total as f64 / finished.duration_since(started).as_secs_f64();
    let busy = records.iter().map(busy_percent).collect();
    drop(servers);
    (items_per_second, busy)
}

/// The seed scenario's pace: a synthetic training step of 10 ms, with the
/// drafters' real capacity calibrated (a sleep overshoots under load), and
/// each of the five targets sending at 0.85 of one drafter's capacity:
/// 4.25 drafters' worth for 3 drafters, so the drafters are the bottleneck
/// even when load on the machine shifts their speed, while one target alone
/// cannot keep a drafter busy. Returns the step and the targets' items/s.
pub(crate) async fn seed_rates() -> (Duration, f64) {
    let step = Duration::from_millis(10);
    let started = Instant::now();
    for _ in 0..20 {
        tokio::time::sleep(step).await;
    }
    let step_seconds = started.elapsed().as_secs_f64() / 20.0;
    (step, 0.85 / step_seconds)
}

pub(crate) fn print_seed_scenario(quick: bool, runtime: &tokio::runtime::Runtime) {
    let (step, target_rate) = runtime.block_on(seed_rates());
    let step_seconds = 0.85 / target_rate;
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
