//! Section 7 (`-- --only hosts`, run inside `scripts/hosts.sh run`, which
//! `make bench-hosts` does): the broker with each role on its own host of
//! the test bed, beside the plain TCP relay over the same links in the same
//! run. For each link profile the bed can apply here: the round trip
//! between two hosts, 4 targets × 4 drafters at 1 MiB and 16 MiB items, and
//! end-of-stream to 16 and 64 drafters spread over 8 hosts. Then, on the
//! bed's unshaped links: the seed's scenario (5 targets × 3 drafters, shared
//! queue against static round-robin, every role on its own host), and a
//! drafter host cut off and back, accounted by (target, seq).
//!
//! This process is the coordinator: it runs in the bed's control host,
//! starts the broker and the relay on host 0 and the roles (`host_roles`)
//! on the others with `ip netns exec`, and reads their lines. Rates and
//! latencies come from the wall-clock moments the roles report, so no
//! process start or pipe is timed.
//!
//! Apart from the loopback sections because it owns the bed's placement of
//! roles; what it runs on each host is theirs (`transfer`, `drafter`,
//! `relay`), and how it starts and talks to them is `bed`'s.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;

use crate::bed::{arguments, drafter_lines, now_nanos, Bed, DrafterLine, Ports};
use crate::seed_scenario::seed_rates;

/// How one host-bed transfer went: bytes over the time from the go to the
/// last item received.
struct Rate {
    bytes: u64,
    seconds: f64,
}

impl Rate {
    fn gigabytes_per_second(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
}

/// The throughput placement: broker (or relay) on h0, target i on h(1+i),
/// drafter i on h(1+pairs+i), one each.
async fn broker_rate(
    bed: &Bed,
    ports: &mut Ports,
    pairs: usize,
    item_bytes: usize,
    items_per_target: u64,
) -> Rate {
    let (broker, address) = bed.start_broker(0, ports.next(), pairs, &[]).await;
    let mut drafters = Vec::new();
    for index in 0..pairs {
        drafters.push(bed.spawn_role(
            1 + pairs + index,
            "drafters",
            &arguments(
                &[
                    ("broker", address.clone()),
                    ("first", index.to_string()),
                    ("count", "1".into()),
                    ("credit", "4".into()),
                ],
                &[],
            ),
        ));
    }
    broker.wait_connected_drafters(pairs).await;
    let mut targets = Vec::new();
    for index in 0..pairs {
        let mut target = bed.spawn_role(
            1 + index,
            "targets",
            &arguments(
                &[
                    ("broker", address.clone()),
                    ("first", index.to_string()),
                    ("count", "1".into()),
                    ("item-bytes", item_bytes.to_string()),
                    ("items", items_per_target.to_string()),
                ],
                &[],
            ),
        );
        target.expect("ready").await;
        targets.push(target);
    }
    let started = now_nanos();
    for target in &mut targets {
        target.say("go").await;
    }
    for target in targets {
        target.finish().await;
    }
    let mut bytes = 0;
    let mut last = started;
    for drafter in drafters {
        for line in drafter_lines(&drafter.finish().await) {
            bytes += line.bytes;
            last = last.max(line.last_ns);
        }
    }
    assert_eq!(
        bytes,
        pairs as u64 * items_per_target * item_bytes as u64,
        "bytes lost"
    );
    Rate {
        bytes,
        seconds: (last - started) as f64 / 1e9,
    }
}

async fn relay_rate(
    bed: &Bed,
    ports: &mut Ports,
    pairs: usize,
    item_bytes: usize,
    items_per_producer: u64,
) -> Rate {
    let (relay, inbound, outbound) = bed.start_relay(0, ports.next(), pairs, pairs).await;
    let mut consumers = Vec::new();
    for index in 0..pairs {
        let mut consumer = bed.spawn_role(
            1 + pairs + index,
            "relay-consumers",
            &arguments(&[("relay", outbound.clone()), ("count", "1".into())], &[]),
        );
        consumer.expect("ready").await;
        consumers.push(consumer);
    }
    let mut producers = Vec::new();
    for index in 0..pairs {
        let mut producer = bed.spawn_role(
            1 + index,
            "relay-producers",
            &arguments(
                &[
                    ("relay", inbound.clone()),
                    ("count", "1".into()),
                    ("item-bytes", item_bytes.to_string()),
                    ("items", items_per_producer.to_string()),
                ],
                &[],
            ),
        );
        producer.expect("ready").await;
        producers.push(producer);
    }
    let started = now_nanos();
    for producer in &mut producers {
        producer.say("go").await;
    }
    for producer in producers {
        producer.finish().await;
    }
    let mut bytes = 0;
    let mut last = started;
    for consumer in consumers {
        for line in consumer.finish().await {
            let fields: Vec<&str> = line.split_whitespace().collect();
            bytes += fields[2].parse::<u64>().expect("bytes");
            last = last.max(fields[3].parse().expect("last"));
        }
    }
    relay.finish().await;
    assert_eq!(
        bytes,
        pairs as u64 * items_per_producer * item_bytes as u64,
        "relay lost bytes"
    );
    Rate {
        bytes,
        seconds: (last - started) as f64 / 1e9,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// End-of-stream to `drafters` drafters spread evenly over hosts 1..=8
/// (each host's drafters in one process, each on its own connection), the
/// target on host 1: from ReportDone sent to the last drafter's
/// end-of-stream, per run, sorted.
async fn broker_end_of_stream(
    bed: &Bed,
    ports: &mut Ports,
    drafters: usize,
    hosts: usize,
    runs: usize,
) -> Vec<Duration> {
    let mut latencies = Vec::new();
    for _ in 0..runs {
        let (broker, address) = bed.start_broker(0, ports.next(), 1, &[]).await;
        let mut groups = Vec::new();
        for host in 0..hosts {
            groups.push(bed.spawn_role(
                1 + host,
                "drafters",
                &arguments(
                    &[
                        ("broker", address.clone()),
                        ("first", (host * drafters / hosts).to_string()),
                        ("count", (drafters / hosts).to_string()),
                        ("credit", "1".into()),
                    ],
                    &[],
                ),
            ));
        }
        broker.wait_connected_drafters(drafters).await;
        let mut target = bed.spawn_role(
            1,
            "targets",
            &arguments(
                &[
                    ("broker", address.clone()),
                    ("first", "0".into()),
                    ("count", "1".into()),
                    ("item-bytes", "1024".into()),
                    ("items", "1".into()),
                ],
                &["hold-report"],
            ),
        );
        target.expect("ready").await;
        target.say("go").await;
        target.expect("finished").await;
        broker
            .wait_until("the item's ack", Duration::from_secs(30), |status| {
                status.acked_items >= 1
            })
            .await;
        target.say("report").await;
        let reported: u128 = target
            .expect_value("reported")
            .await
            .parse()
            .expect("a time");
        target.finish().await;
        let mut last = reported;
        for group in groups {
            for line in drafter_lines(&group.finish().await) {
                assert!(line.end_of_stream_ns > 0, "a drafter had no end-of-stream");
                last = last.max(line.end_of_stream_ns);
            }
        }
        latencies.push(Duration::from_nanos((last - reported) as u64));
    }
    latencies.sort();
    latencies
}

/// The relay's end-of-stream: its producer closes, and the relay closes
/// every consumer's socket; from the producer's close to the last
/// consumer's end of file.
async fn relay_end_of_stream(
    bed: &Bed,
    ports: &mut Ports,
    consumers: usize,
    hosts: usize,
    runs: usize,
) -> Vec<Duration> {
    let mut latencies = Vec::new();
    for _ in 0..runs {
        let (relay, inbound, outbound) = bed.start_relay(0, ports.next(), 1, consumers).await;
        let mut groups = Vec::new();
        for host in 0..hosts {
            let mut group = bed.spawn_role(
                1 + host,
                "relay-consumers",
                &arguments(
                    &[
                        ("relay", outbound.clone()),
                        ("count", (consumers / hosts).to_string()),
                    ],
                    &[],
                ),
            );
            group.expect("ready").await;
            groups.push(group);
        }
        let mut producer = bed.spawn_role(
            1,
            "relay-producers",
            &arguments(
                &[
                    ("relay", inbound.clone()),
                    ("count", "1".into()),
                    ("item-bytes", "1024".into()),
                    ("items", "0".into()),
                ],
                &["hold-report"],
            ),
        );
        producer.expect("ready").await;
        producer.say("go").await;
        producer.expect("finished").await;
        producer.say("report").await;
        let reported: u128 = producer
            .expect_value("reported")
            .await
            .parse()
            .expect("a time");
        producer.finish().await;
        let mut last = reported;
        for group in groups {
            for line in group.finish().await {
                let closed: u128 = line
                    .split_whitespace()
                    .nth(4)
                    .and_then(|value| value.parse().ok())
                    .expect("a close time");
                last = last.max(closed);
            }
        }
        relay.finish().await;
        latencies.push(Duration::from_nanos((last - reported) as u64));
    }
    latencies.sort();
    latencies
}

fn percentile(sorted: &[Duration], fraction: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * fraction).round() as usize].as_secs_f64() * 1e3
}

/// The round trip between two hosts (h1 to h0), median and p99 in µs.
async fn round_trip(bed: &Bed) -> String {
    let mut probe = bed.spawn_role(
        1,
        "rtt",
        &arguments(
            &[
                ("to", format!("{}:9", bed.addresses[0])),
                ("count", "200".into()),
            ],
            &[],
        ),
    );
    let value = probe.expect_value("rtt").await;
    probe.finish().await;
    let fields: Vec<&str> = value.split_whitespace().collect();
    format!("p50 {} us, p99 {} us", fields[0], fields[1])
}

pub(crate) fn print_hosts(quick: bool, rounds: usize, runtime: &tokio::runtime::Runtime) {
    let Some(bed) = Bed::from_environment() else {
        println!(
            "hosts: not inside the test bed (run `make bench-hosts`, or `scripts/hosts.sh run -- <this bench> --only hosts`): skipped"
        );
        return;
    };
    assert!(
        bed.namespaces.len() >= 9,
        "the hosts section needs 9 hosts (scripts/hosts.sh run --hosts 9)"
    );
    let total_bytes: u64 = if quick { 256 << 20 } else { 1 << 30 };
    let eos_runs = if quick { 5 } else { 20 };
    let mut ports = Ports(20000);
    println!(
        "7. Across hosts: {} network namespaces on one bridge (scripts/hosts.sh), broker or relay on h0; {} MiB per throughput configuration, {rounds} round(s) of relay then broker, medians",
        bed.namespaces.len(),
        total_bytes >> 20
    );
    for skipped in &bed.skipped {
        let (name, reason) = skipped.split_once(':').unwrap_or((skipped, "?"));
        println!(
            "   profile {name}: not run here ({})",
            reason.replace('-', " ")
        );
    }
    runtime.block_on(async {
        for profile in &bed.profiles {
            bed.apply_profile(profile);
            println!(
                "   profile {profile}: round trip h1 -> h0 {}",
                round_trip(&bed).await
            );
            println!(
                "   {:>7} {:>5} {:>8} {:>8} {:>6}",
                "item", "p x c", "broker", "relay", "ratio"
            );
            for item_bytes in [1usize << 20, 16 << 20] {
                let pairs = 4usize;
                let per_target = total_bytes / item_bytes as u64 / pairs as u64;
                // A warm-up pair first (page cache, the binaries' pages).
                let _ = relay_rate(&bed, &mut ports, pairs, item_bytes, 2).await;
                let _ = broker_rate(&bed, &mut ports, pairs, item_bytes, 2).await;
                let (mut broker_rates, mut relay_rates, mut ratios) =
                    (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..rounds.max(1) {
                    let relay = relay_rate(&bed, &mut ports, pairs, item_bytes, per_target).await;
                    let broker = broker_rate(&bed, &mut ports, pairs, item_bytes, per_target).await;
                    broker_rates.push(broker.gigabytes_per_second());
                    relay_rates.push(relay.gigabytes_per_second());
                    ratios.push(broker.gigabytes_per_second() / relay.gigabytes_per_second());
                }
                println!(
                    "   {:>3} MiB {:>5} {:>5.3} GB/s {:>5.3} GB/s {:>6.2}",
                    item_bytes >> 20,
                    format!("{pairs}x{pairs}"),
                    median(broker_rates),
                    median(relay_rates),
                    median(ratios)
                );
            }
            for drafters in [16usize, 64] {
                let broker = broker_end_of_stream(&bed, &mut ports, drafters, 8, eos_runs).await;
                let relay = relay_end_of_stream(&bed, &mut ports, drafters, 8, eos_runs).await;
                println!(
                    "   end-of-stream, {drafters:>2} drafters on 8 hosts, {eos_runs} runs: broker p50 {:.2} ms, p99 {:.2} ms; relay (closing every consumer's socket) p50 {:.2} ms, p99 {:.2} ms",
                    percentile(&broker, 0.5),
                    percentile(&broker, 0.99),
                    percentile(&relay, 0.5),
                    percentile(&relay, 0.99),
                );
            }
        }
        bed.apply_profile("native");
        print_seed_on_hosts(&bed, &mut ports, quick).await;
        print_link_cut(&bed, &mut ports).await;
    });
}

/// The seed's scenario with every role on its own host: the shared queue
/// (broker on h0, targets on h1..h5, drafters on h6..h8) against static
/// round-robin (target i sends to drafter i mod 3, through a broker on that
/// drafter's own host, as the seed's targets streamed to their drafter).
async fn print_seed_on_hosts(bed: &Bed, ports: &mut Ports, quick: bool) {
    let (step, target_rate) = seed_rates().await;
    let items_per_target = if quick { 150 } else { 600 };
    let pace_us = (1e6 / target_rate) as u64;
    let mut results = Vec::new();
    for round_robin in [false, true] {
        // Broker per drafter host under round-robin, else one on h0.
        let broker_hosts: Vec<usize> = if round_robin { vec![6, 7, 8] } else { vec![0] };
        let assignment: Vec<usize> = (0..5)
            .map(|target| if round_robin { target % 3 } else { 0 })
            .collect();
        let mut brokers = Vec::new();
        for (index, &host) in broker_hosts.iter().enumerate() {
            let targets = assignment.iter().filter(|&&to| to == index).count();
            brokers.push(bed.start_broker(host, ports.next(), targets, &[]).await);
        }
        let mut drafters = Vec::new();
        for drafter in 0..3 {
            let (broker, address) = &brokers[if round_robin { drafter } else { 0 }];
            drafters.push(bed.spawn_role(
                6 + drafter,
                "drafters",
                &arguments(
                    &[
                        ("broker", address.clone()),
                        ("first", drafter.to_string()),
                        ("count", "1".into()),
                        ("credit", "2".into()),
                        ("step-us", step.as_micros().to_string()),
                    ],
                    &[],
                ),
            ));
            if round_robin {
                broker.wait_connected_drafters(1).await;
            }
        }
        if !round_robin {
            brokers[0].0.wait_connected_drafters(3).await;
        }
        let mut targets = Vec::new();
        for (target, &broker) in assignment.iter().enumerate() {
            // Each broker knows its own targets as target-0, target-1, ...
            let position = assignment[..target]
                .iter()
                .filter(|&&to| to == broker)
                .count();
            let mut process = bed.spawn_role(
                1 + target,
                "targets",
                &arguments(
                    &[
                        ("broker", brokers[broker].1.clone()),
                        ("first", position.to_string()),
                        ("count", "1".into()),
                        ("item-bytes", (64 << 10).to_string()),
                        ("items", items_per_target.to_string()),
                        ("pace-us", pace_us.to_string()),
                    ],
                    &[],
                ),
            );
            process.expect("ready").await;
            targets.push(process);
        }
        let started = now_nanos();
        for target in &mut targets {
            target.say("go").await;
        }
        for target in targets {
            target.finish().await;
        }
        let mut lines = Vec::new();
        for drafter in drafters {
            lines.extend(drafter_lines(&drafter.finish().await));
        }
        let total: u64 = lines.iter().map(|line| line.items).sum();
        assert_eq!(total, items_per_target * 5, "items lost");
        let finished = lines
            .iter()
            .map(|line| line.last_ns)
            .max()
            .unwrap_or(started);
        let items_per_second = total as f64 / ((finished - started) as f64 / 1e9);
        let busy: Vec<String> = lines
            .iter()
            .map(|line| {
                let window = line.last_ns.saturating_sub(line.first_ns) as f64 / 1e3;
                format!("{:.1} %", 100.0 * line.busy_us as f64 / window.max(1.0))
            })
            .collect();
        results.push((round_robin, items_per_second, busy));
    }
    println!(
        "   seed scenario across hosts, 5 targets (h1..h5) x 3 drafters (h6..h8), drafter step {:.1} ms ({:.1} ms measured, so {:.0} items/s each), targets {target_rate:.0} items/s each, 64 KiB items:",
        step.as_secs_f64() * 1e3,
        0.85 / target_rate * 1e3,
        target_rate / 0.85
    );
    for (round_robin, items_per_second, busy) in results {
        println!(
            "     {:<34} {items_per_second:>6.1} items/s; drafter busy {}",
            if round_robin {
                "round-robin (a broker per drafter)"
            } else {
                "shared queue (broker on h0)"
            },
            busy.join(", ")
        );
    }
}

/// A drafter host cut off (its switch port down) while it holds leases,
/// and back: broker on h0, 2 targets on h1, drafters on h2 and h3, h3 cut.
/// Every (target, seq) must reach a drafter and be acked once by the
/// broker; the cut drafter's leases go back to the queue when the broker's
/// keepalive drops its connection, and it takes items again once its link
/// is back.
async fn print_link_cut(bed: &Bed, ports: &mut Ports) {
    // 100 items/s per target for 6 s: long enough that the run is still
    // going when the link comes back (the cut and its detection take about
    // two seconds), whatever --quick says.
    let items_per_target: u64 = 600;
    let (broker, address) = bed
        .start_broker(
            0,
            ports.next(),
            2,
            &["--keepalive-interval", "500ms", "--keepalive-timeout", "1s"],
        )
        .await;
    let mut drafters = Vec::new();
    for (index, host) in [2usize, 3].into_iter().enumerate() {
        drafters.push(bed.spawn_role(
            host,
            "drafters",
            &arguments(
                &[
                    ("broker", address.clone()),
                    ("first", index.to_string()),
                    ("count", "1".into()),
                    ("credit", "8".into()),
                    ("step-us", "2000".into()),
                    ("keepalive-ms", "500".into()),
                ],
                &["reconnect", "record-items"],
            ),
        ));
    }
    broker.wait_connected_drafters(2).await;
    let mut targets = bed.spawn_role(
        1,
        "targets",
        &arguments(
            &[
                ("broker", address.clone()),
                ("first", "0".into()),
                ("count", "2".into()),
                ("item-bytes", (256 << 10).to_string()),
                ("items", items_per_target.to_string()),
                ("pace-us", "10000".into()),
            ],
            &[],
        ),
    );
    targets.expect("ready").await;
    targets.say("go").await;
    let cut_drafter = |status: &proto::StatusSnapshot| {
        status
            .drafters
            .iter()
            .find(|drafter| drafter.drafter_id == "d-1")
            .cloned()
    };
    let before = broker
        .wait_until(
            "the h3 drafter to hold leases",
            Duration::from_secs(60),
            |status| {
                status.acked_items >= items_per_target / 4
                    && cut_drafter(status).is_some_and(|drafter| drafter.leased_items > 0)
            },
        )
        .await;
    let leased_at_cut = cut_drafter(&before).map_or(0, |drafter| drafter.leased_items);
    let cut_at = Instant::now();
    bed.set_link(3, false);
    let dropped = broker
        .wait_until(
            "the broker to drop h3's stream",
            Duration::from_secs(30),
            |status| {
                cut_drafter(status)
                    .is_some_and(|drafter| !drafter.connected && drafter.leased_items == 0)
            },
        )
        .await;
    let detected = cut_at.elapsed();
    // The other drafter carries on meanwhile.
    let acked_while_cut = broker
        .wait_until("h2 to carry on", Duration::from_secs(60), |status| {
            status.acked_items >= dropped.acked_items + 50
        })
        .await
        .acked_items
        - dropped.acked_items;
    bed.set_link(3, true);
    let back_at = Instant::now();
    broker
        .wait_until(
            "h3's drafter to reconnect",
            Duration::from_secs(30),
            |status| cut_drafter(status).is_some_and(|drafter| drafter.connected),
        )
        .await;
    let reconnected = back_at.elapsed();
    targets.finish().await;
    let mut lines = Vec::new();
    for drafter in drafters {
        lines.extend(drafter.finish().await);
    }
    let status = broker.status().await;
    let records = drafter_lines(&lines);
    let mut deliveries: BTreeMap<(String, u64), Vec<(String, u32)>> = BTreeMap::new();
    for line in &lines {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.first() == Some(&"item") {
            deliveries
                .entry((fields[2].to_string(), fields[3].parse().expect("seq")))
                .or_default()
                .push((fields[1].to_string(), fields[4].parse().expect("count")));
        }
    }
    let expected: Vec<(String, u64)> = (0..2)
        .flat_map(|target| (0..items_per_target).map(move |seq| (format!("target-{target}"), seq)))
        .collect();
    let lost: Vec<&(String, u64)> = expected
        .iter()
        .filter(|key| !deliveries.contains_key(*key))
        .collect();
    let delivered_twice = deliveries
        .values()
        .filter(|received| received.len() > 1)
        .count();
    let redelivered = deliveries
        .values()
        .filter(|received| received.iter().any(|(_, count)| *count > 1))
        .count();
    let per_drafter: HashMap<&str, &DrafterLine> = records
        .iter()
        .map(|record| (record.drafter_id.as_str(), record))
        .collect();
    let cut = per_drafter.get("d-1").expect("d-1's line");
    let other = per_drafter.get("d-0").expect("d-0's line");
    println!(
        "   drafter host cut (h3's switch port down) and back, 2 targets x {items_per_target} items of 256 KiB, broker keepalive 500ms + 1s:"
    );
    println!(
        "     cut while d-1 held leases ({leased_at_cut} in the status read just before); the broker dropped its stream and took its leases back after {:.2} s; d-0 (h2) acked {acked_while_cut} more meanwhile; link back: d-1 reconnected after {:.2} s",
        detected.as_secs_f64(),
        reconnected.as_secs_f64()
    );
    println!(
        "     by (target, seq): {} expected, {} delivered, {} lost; {} delivered twice ({} with delivery count > 1); deliveries d-0 {}, d-1 {} ({} of them after its {} reconnect(s)); broker: state {:?}, accepted {}, acked {}, redelivered {}, dead letters {}",
        expected.len(),
        deliveries.len(),
        lost.len(),
        delivered_twice,
        redelivered,
        other.items,
        cut.items,
        cut.items - cut.items_before_reconnect,
        cut.reconnects,
        proto::BrokerState::try_from(status.state).unwrap_or_default(),
        status.accepted_items,
        status.acked_items,
        status.redelivered_items,
        status.dead_letters,
    );
    assert!(lost.is_empty(), "items lost: {lost:?}");
    assert_eq!(status.acked_items, expected.len() as u64, "acked once each");
    assert_eq!(status.dead_letters, 0, "dead letters");
    assert!(cut.reconnects >= 1, "d-1 never reconnected");
}
