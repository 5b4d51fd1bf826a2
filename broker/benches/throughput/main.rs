//! The broker at wire speed: throughput next to a plain TCP relay, minor
//! page faults and CPU per GiB moved, end-of-stream latency with many
//! drafters, and many small items through one broker.
//!
//! `cargo bench -p dflash-broker --bench throughput` (`make bench`); add
//! `-- --quick` for a short run, `-- --rounds N` for N relay/broker pairs
//! per throughput configuration (medians shown), `-- --only
//! throughput,wal,eos,small,seed,replay` for some sections. Prints:
//! 1. For 1 MiB and 16 MiB items with 1×1 and 4×4 producers × consumers: the
//!    broker's GB/s (first send → last delivery received), a plain TCP
//!    store-and-forward relay's GB/s moving the same bytes, their ratio, and
//!    the relaying process's minor page faults and CPU seconds per GiB.
//! 2. End-of-stream latency (last ReportDone sent → every drafter has
//!    end-of-stream), p50 and p99, with 4, 64 and 256 drafters, each on its
//!    own connection: once with every drafter keeping its stream until all
//!    have their end-of-stream (drafters on their own hosts), once with each
//!    dropping its stream on arrival, so the teardown of the first ones
//!    competes for this machine's two cores with the fan-out to the rest.
//! 3. 64 targets × 64 drafters with 64 KiB items: items/s and CPU µs per
//!    item of the broker process and of the client process, separately.
//! 4. The seed's scenario: 5 synthetic targets × 3 synthetic drafters, with
//!    rates chosen so the drafters are the bottleneck, through the shared
//!    queue and under a static round-robin assignment (target i → drafter
//!    i mod 3, emulated with one broker per drafter): throughput and each
//!    drafter's busy fraction over the time it had data coming.
//! 5. The write-ahead log's cost: GB/s without `--state-dir` and with it
//!    under each `--fsync` policy (`-- --wal-only` runs just this table).
//! 6. The write-ahead log's replay at start, page cache warm and cold
//!    (`-- --only replay`): what the broker's startupProbe allows for.
//! 7. Across hosts (`-- --only hosts`, inside the test bed of
//!    `scripts/hosts.sh`: `make bench-hosts`): per link profile, 4×4 at
//!    1 MiB and 16 MiB and end-of-stream to 16 and 64 drafters on 8 hosts
//!    beside the relay over the same links; the seed's scenario with each
//!    role on its own host; a drafter host cut off and back. Not in the
//!    default run: it needs root and the bed.
//!
//! Fairness: the broker and the relay each run as their own process (the
//! broker binary, and this bench re-executed with `--serve-relay`), and the
//! same client process drives both. The relay is what any relaying broker
//! must at least do: read a length-prefixed item from a producer's socket
//! into a buffer, hold it in a shared FIFO, and write it to whichever
//! consumer socket is free. Its clients do what the broker's clients must:
//! the producer writes each item from memory, the consumer reads each one
//! into a fresh buffer and answers with an 8-byte acknowledgement that the
//! relay reads. What the relay does not do (the broker's price for its
//! guarantees): gRPC framing, HTTP/2 flow control, leases and the ledger.
//!
//! On a 2-core machine the clients and the relaying process share the
//! cores; the ratio is what matters, not the absolute GB/s. The client
//! process's glibc malloc keeps large blocks (`configure_allocator`, as the
//! target-server and drafter-server do), for both sides' clients.
//!
//! # Layout
//! - `main.rs`: the flags and which sections run.
//! - `processes`: the broker binary on a free port, and the counters read
//!   from `/proc` and the broker's `/metrics`.
//! - `transfer`: the load generators: synthetic targets and drafters, one
//!   measured [`transfer::Transfer`] through a broker.
//! - `relay`: the plain TCP relay (`--serve-relay`) and its transfer.
//! - `transfer_tables`: sections 1, 3 and 5 (throughput against the relay,
//!   many small items, the write-ahead log's cost), summed and printed.
//! - `drafter`: the synthetic drafter every section runs.
//! - `end_of_stream`: section 2; `seed_scenario`: section 4; `replay`:
//!   section 6.
//! - `hosts`: section 7, the coordinator on the test bed; `bed`: how it
//!   starts processes on the bed's hosts and reads them; `host_roles`: the
//!   processes it starts there (this bench re-executed with `--host-role`).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod bed;
mod drafter;
mod end_of_stream;
mod host_roles;
mod hosts;
mod processes;
mod relay;
mod replay;
mod seed_scenario;
mod transfer;
mod transfer_tables;

use end_of_stream::print_end_of_stream;
use relay::serve_relay;
use seed_scenario::print_seed_scenario;
use transfer_tables::{print_many_small, print_throughput, print_write_ahead_log};

fn main() {
    let arguments: Vec<String> = std::env::args().collect();
    let relaying = arguments.iter().any(|argument| argument == "--serve-relay");
    let host_role = arguments.iter().any(|argument| argument == "--host-role");
    if !relaying {
        // This process is the clients of both the broker and the relay (or,
        // on the test bed, some of them): glibc malloc set up as the
        // target-server and drafter-server set it up (large blocks kept for
        // reuse), so neither side's clients pay a fresh mapping per
        // received item. The relay stays a plain program on glibc's
        // defaults.
        let allocator = dflash_device::configure_allocator(dflash_device::AllocatorMode::Retained);
        if !host_role {
            eprintln!("bench clients: {allocator}");
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if let Some(position) = arguments
        .iter()
        .position(|argument| argument == "--serve-relay")
    {
        let usage = "--serve-relay IN_PORT OUT_PORT PRODUCERS CONSUMERS [ADDRESS]";
        let number = |offset: usize| -> usize {
            arguments
                .get(position + offset)
                .and_then(|value| value.parse().ok())
                .expect(usage)
        };
        let address = arguments
            .get(position + 5)
            .map_or(Ok(std::net::IpAddr::from([127, 0, 0, 1])), |value| {
                value.parse()
            })
            .expect(usage);
        runtime.block_on(serve_relay(
            address,
            number(1) as u16,
            number(2) as u16,
            number(3),
            number(4),
        ));
        return;
    }
    if let Some(position) = arguments
        .iter()
        .position(|argument| argument == "--host-role")
    {
        runtime.block_on(host_roles::run_role(&arguments[position + 1..]));
        return;
    }
    let quick = arguments.iter().any(|argument| argument == "--quick");
    // `--rounds N`: relay/broker pairs per throughput configuration (the
    // table shows medians); `--only a,b`: just these sections (throughput,
    // wal, eos, small, seed, replay; hosts, which runs only when named).
    let value_of = |flag: &str| {
        arguments
            .iter()
            .position(|argument| argument == flag)
            .and_then(|position| arguments.get(position + 1))
            .cloned()
    };
    let rounds = value_of("--rounds")
        .map(|value| value.parse().expect("--rounds N"))
        .unwrap_or(1);
    let only = value_of("--only").or_else(|| {
        arguments
            .iter()
            .any(|argument| argument == "--wal-only")
            .then(|| "wal".to_string())
    });
    let runs = |section: &str| {
        only.as_ref()
            .is_none_or(|only| only.split(',').any(|name| name == section))
    };
    if runs("throughput") {
        print_throughput(quick, rounds, &runtime);
    }
    if runs("wal") {
        print_write_ahead_log(quick, &runtime);
    }
    if runs("eos") {
        print_end_of_stream(quick, &runtime);
    }
    if runs("small") {
        print_many_small(quick, &runtime);
    }
    if runs("seed") {
        print_seed_scenario(quick, &runtime);
    }
    if runs("replay") {
        replay::print_replay(quick);
    }
    // Only when asked for: it needs the test bed (root, network namespaces).
    if only
        .as_ref()
        .is_some_and(|only| only.split(',').any(|name| name == "hosts"))
    {
        hosts::print_hosts(quick, rounds, &runtime);
    }
}
