//! The sections that time bulk transfers and print them as tables: the
//! broker against the relay (GB/s, page faults, CPU per GiB, medians over
//! rounds), 64 targets x 64 drafters of small items, and the write-ahead
//! log's cost under each `--fsync` policy.
//!
//! Apart from the load generators so that what is measured
//! ([`crate::transfer`], [`crate::relay`]) reads apart from how it is summed
//! and shown.

use dflash_proto::frames::Copies;

use crate::processes::{ProcessCounters, Received};
use crate::relay::relay_transfer;
use crate::transfer::{broker_transfer, broker_transfer_with, Transfer};

/// Sums of a configuration's rounds: GiB moved, and the counters.
#[derive(Default)]
struct Totals {
    gib: f64,
    server: ProcessCounters,
    clients: ProcessCounters,
    copies: Copies,
    received: Received,
    second_half_faults: u64,
    second_half_gib: f64,
    peak_rss_mib: f64,
}

impl Totals {
    fn add(&mut self, transfer: &Transfer) {
        self.gib += transfer.bytes_per_second * transfer.seconds / f64::from(1u32 << 30);
        self.server.minor_faults += transfer.server.minor_faults;
        self.server.cpu_seconds += transfer.server.cpu_seconds;
        self.clients.minor_faults += transfer.clients.minor_faults;
        self.clients.cpu_seconds += transfer.clients.cpu_seconds;
        self.copies.add(transfer.copies);
        self.received.one_frame += transfer.received.one_frame;
        self.received.several_frames += transfer.received.several_frames;
        self.received.slices += transfer.received.slices;
        if let Some((counters, gib)) = transfer.second_half {
            self.second_half_faults += counters.minor_faults;
            self.second_half_gib += gib;
        }
        self.peak_rss_mib = self.peak_rss_mib.max(transfer.peak_rss_mib);
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub(crate) fn print_throughput(quick: bool, rounds: usize, runtime: &tokio::runtime::Runtime) {
    let total_bytes: u64 = if quick { 512 << 20 } else { 2 << 30 };
    println!(
        "throughput: {} MiB per configuration and round over loopback, {rounds} round(s) of relay then broker, medians; each relaying process (broker or relay) on its own, both driven by this process",
        total_bytes >> 20
    );
    println!(
        "{:>7} {:>5} {:>7} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "item",
        "p x c",
        "broker",
        "relay",
        "ratio",
        "faults/",
        "GiB",
        "cpu s/",
        "GiB",
        "client",
        "cpu s/GiB",
        "1-frame",
        "client"
    );
    println!(
        "{:>7} {:>5} {:>7} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "",
        "",
        "GB/s",
        "GB/s",
        "",
        "broker",
        "relay",
        "broker",
        "relay",
        "broker",
        "relay",
        "payloads",
        "joins"
    );
    runtime.block_on(async {
        for item_bytes in [1usize << 20, 16 << 20] {
            for (producers, consumers) in [(1u64, 1u64), (4, 4)] {
                let items = (total_bytes / item_bytes as u64 / producers) * producers;
                // Warm-up runs, then relay and broker alternately, so a
                // burst of load elsewhere on the machine hits both.
                let _ = relay_transfer(item_bytes, producers * 2, producers, consumers).await;
                let _ = broker_transfer(item_bytes, producers * 2, producers, consumers).await;
                let (mut broker_rates, mut relay_rates, mut ratios) =
                    (Vec::new(), Vec::new(), Vec::new());
                let (mut broker_totals, mut relay_totals) = (Totals::default(), Totals::default());
                for _ in 0..rounds.max(1) {
                    let relay = relay_transfer(item_bytes, items, producers, consumers).await;
                    let broker = broker_transfer(item_bytes, items, producers, consumers).await;
                    broker_rates.push(broker.bytes_per_second);
                    relay_rates.push(relay.bytes_per_second);
                    ratios.push(broker.bytes_per_second / relay.bytes_per_second);
                    broker_totals.add(&broker);
                    relay_totals.add(&relay);
                }
                let received = broker_totals.received;
                let large = received.one_frame + received.several_frames;
                let copies = broker_totals.copies;
                let delivered = (copies.sliced + copies.assembled).max(1) as f64;
                println!(
                    "{:>3} MiB {:>5} {:>7.2} {:>7.2} {:>6.2} {:>9.0} {:>9.0} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>7.0}% {:>7.0}%",
                    item_bytes >> 20,
                    format!("{producers}x{consumers}"),
                    median(broker_rates) / 1e9,
                    median(relay_rates) / 1e9,
                    median(ratios),
                    broker_totals.server.minor_faults as f64 / broker_totals.gib,
                    relay_totals.server.minor_faults as f64 / relay_totals.gib,
                    broker_totals.server.cpu_seconds / broker_totals.gib,
                    relay_totals.server.cpu_seconds / relay_totals.gib,
                    broker_totals.clients.cpu_seconds / broker_totals.gib,
                    relay_totals.clients.cpu_seconds / relay_totals.gib,
                    100.0 * received.one_frame / large.max(1.0),
                    100.0 * copies.assembled as f64 / delivered,
                );
                println!(
                    "{:>13} broker: {:.0} faults/GiB over the second half of the bytes (after the heap grew), peak RSS {:.0} MiB{}",
                    "",
                    broker_totals.second_half_faults as f64 / broker_totals.second_half_gib.max(1e-9),
                    broker_totals.peak_rss_mib,
                    if received.several_frames > 0.0 {
                        format!(
                            "; payloads across frames held as {:.1} slices each (not copied)",
                            received.slices / received.several_frames
                        )
                    } else {
                        String::new()
                    }
                );
            }
        }
    });
}

pub(crate) fn print_many_small(quick: bool, runtime: &tokio::runtime::Runtime) {
    let item_bytes = 64 << 10;
    let pairs = 64u64;
    let items = if quick { 64 * 40 } else { 64 * 200 };
    runtime.block_on(async {
        let _ = broker_transfer(item_bytes, pairs, pairs, pairs).await;
        let transfer = broker_transfer(item_bytes, items, pairs, pairs).await;
        let items_per_second = items as f64 / transfer.seconds;
        println!(
            "{pairs} targets x {pairs} drafters, 64 KiB items, {items} items: {:.0} items/s ({:.2} GB/s); \
             CPU per item: broker process {:.1} us, client process {:.1} us",
            items_per_second,
            transfer.bytes_per_second / 1e9,
            transfer.server.cpu_seconds / items as f64 * 1e6,
            transfer.clients.cpu_seconds / items as f64 * 1e6,
        );
    });
}

/// The write-ahead log's cost: the same transfer without `--state-dir` and
/// with it under each `--fsync` policy, in the same run (the log goes to a
/// temporary directory under `$DFLASH_BENCH_STATE_DIR` or the system's).
pub(crate) fn print_write_ahead_log(quick: bool, runtime: &tokio::runtime::Runtime) {
    let total_bytes: u64 = if quick { 256 << 20 } else { 1 << 30 };
    println!(
        "write-ahead log, 16 MiB items, {} MiB per configuration: GB/s",
        total_bytes >> 20
    );
    println!(
        "{:>5} {:>8} {:>8} {:>8} {:>8}",
        "p x c", "no log", "never", "batch", "always"
    );
    runtime.block_on(async {
        for (producers, consumers) in [(1u64, 1u64), (4, 4)] {
            let item_bytes = 16usize << 20;
            let items = (total_bytes / item_bytes as u64 / producers) * producers;
            let mut rates = Vec::new();
            for fsync in [None, Some("never"), Some("batch"), Some("always")] {
                let state_dir = match std::env::var_os("DFLASH_BENCH_STATE_DIR") {
                    Some(parent) => tempfile::tempdir_in(parent),
                    None => tempfile::tempdir(),
                }
                .expect("a state dir");
                let extra: Vec<String> = match fsync {
                    None => Vec::new(),
                    Some(policy) => vec![
                        "--state-dir".into(),
                        state_dir.path().display().to_string(),
                        "--fsync".into(),
                        policy.into(),
                    ],
                };
                let transfer =
                    broker_transfer_with(item_bytes, items, producers, consumers, &extra).await;
                rates.push(transfer.bytes_per_second / 1e9);
            }
            println!(
                "{:>5} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                format!("{producers}x{consumers}"),
                rates[0],
                rates[1],
                rates[2],
                rates[3]
            );
        }
    });
}
