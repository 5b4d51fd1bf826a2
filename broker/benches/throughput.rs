//! The broker at wire speed: throughput next to a plain TCP relay, minor
//! page faults and CPU per GiB moved, end-of-stream latency with many
//! drafters, and many small items through one broker.
//!
//! `cargo bench -p dflash-broker --bench throughput` (`make bench`); add
//! `-- --quick` for a short run, `-- --rounds N` for N relay/broker pairs
//! per throughput configuration (medians shown), `-- --only
//! throughput,wal,eos,small,seed` for some sections. Prints:
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

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_proto::frames::Copies;
use dflash_proto::v1 as proto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Mutex};

/// Linux reports CPU time in /proc in units of USER_HZ, which the kernel ABI
/// fixes at 100 per second on every architecture Rust targets here.
const USER_HZ: f64 = 100.0;

fn sample(bytes: usize) -> proto::Sample {
    proto::Sample {
        tensors: vec![proto::Tensor::from_parts(
            "hidden_states",
            proto::Dtype::U8,
            vec![bytes as u64],
            Bytes::from(vec![7u8; bytes]),
        )],
    }
}

/// Minor page faults and CPU seconds (user + system) of a process so far.
#[derive(Debug, Clone, Copy, Default)]
struct ProcessCounters {
    minor_faults: u64,
    cpu_seconds: f64,
}

impl ProcessCounters {
    /// Reads `/proc/<pid>/stat` (`self` for this process). The command name
    /// (field 2) may hold spaces, so fields are counted after its `)`.
    fn read(pid: &str) -> ProcessCounters {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        // After the name: state is field 3, so field N is fields[N - 3].
        let field = |number: usize| -> u64 {
            fields
                .get(number - 3)
                .and_then(|value| value.parse().ok())
                .unwrap_or(0)
        };
        ProcessCounters {
            minor_faults: field(10),
            cpu_seconds: (field(14) + field(15)) as f64 / USER_HZ,
        }
    }

    fn since(self, earlier: ProcessCounters) -> ProcessCounters {
        ProcessCounters {
            minor_faults: self.minor_faults.saturating_sub(earlier.minor_faults),
            cpu_seconds: (self.cpu_seconds - earlier.cpu_seconds).max(0.0),
        }
    }
}

/// CPU time a process's threads have run so far, from each thread's
/// `schedstat` (nanoseconds, unlike `stat`'s 10 ms ticks, so a fan-out of a
/// few milliseconds is measured, not sampled).
fn process_cpu(pid: &str) -> Duration {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Duration::ZERO;
    };
    threads
        .filter_map(Result::ok)
        .filter_map(|thread| std::fs::read_to_string(thread.path().join("schedstat")).ok())
        .filter_map(|line| line.split_whitespace().next()?.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .sum()
}

/// A relaying process (the broker binary or the relay), killed on drop.
struct Server {
    child: Child,
    pid: String,
}

impl Server {
    fn counters(&self) -> ProcessCounters {
        ProcessCounters::read(&self.pid)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nobody listens on right now. The bench starts its
/// servers on such ports and retries the connection until they listen.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

async fn wait_listening(address: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(address).await.is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {address}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts the broker binary for `targets` targets on a fresh port, with
/// `extra` flags.
async fn start_broker_with(targets: u64, extra: &[String]) -> (Server, String) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_broker"))
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--expected-targets",
            &targets.to_string(),
            "--max-queue-bytes",
            "1GiB",
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the broker binary");
    let pid = child.id().to_string();
    wait_listening(SocketAddr::from(([127, 0, 0, 1], port))).await;
    (Server { child, pid }, format!("http://127.0.0.1:{port}"))
}

async fn start_broker(targets: u64) -> (Server, String) {
    start_broker_with(targets, &[]).await
}

/// One synthetic target: sends `items` copies of `payload` (one every
/// `pace` when given, else as fast as the broker takes them), then
/// finishes and reports done.
async fn run_target(
    client: BrokerClient,
    target_id: String,
    payload: proto::Sample,
    items: u64,
    pace: Option<Duration>,
) {
    let mut producer = client.produce(&target_id).await.expect("produce");
    let mut ticks = pace.map(|period| {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks
    });
    for seq in 0..items {
        if let Some(ticks) = ticks.as_mut() {
            ticks.tick().await;
        }
        producer
            .send(seq, payload.clone(), HashMap::new())
            .await
            .expect("send");
    }
    producer.finish().await.expect("finish");
    client.report_done(&target_id, items).await.expect("done");
}

/// What one transfer measured: bytes per second and the relaying process's
/// counters over the transfer.
struct Transfer {
    bytes_per_second: f64,
    server: ProcessCounters,
    clients: ProcessCounters,
    seconds: f64,
    /// How the consumers' tensors came out (views on a frame, or joined).
    copies: Copies,
    /// How the broker received the large payloads (from its `/metrics`).
    received: Received,
    /// The broker's counters over the second half of the bytes, and the
    /// GiB of that half: the steady state, after the heap grew.
    second_half: Option<(ProcessCounters, f64)>,
    /// The broker's peak RSS (VmHWM); not read for the relay, which has
    /// exited by then.
    peak_rss_mib: f64,
}

/// A process's peak resident set (VmHWM) in MiB.
fn peak_rss_mib(pid: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The broker's `dflash_broker_received_payloads_total` by frames.
#[derive(Debug, Clone, Copy, Default)]
struct Received {
    one_frame: f64,
    several_frames: f64,
    slices: f64,
}

/// GET `/metrics` from the broker's metrics port and read the counters of
/// how payloads arrived.
fn scrape_received(metrics_port: u16) -> Received {
    use std::io::{Read, Write};
    let mut text = String::new();
    if let Ok(mut socket) = std::net::TcpStream::connect(("127.0.0.1", metrics_port)) {
        let _ = socket.write_all(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n");
        let _ = socket.read_to_string(&mut text);
    }
    let value = |prefix: &str| -> f64 {
        text.lines()
            .find(|line| line.starts_with(prefix))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse().ok())
            .unwrap_or(0.0)
    };
    Received {
        one_frame: value("dflash_broker_received_payloads_total{frames=\"one\"}"),
        several_frames: value("dflash_broker_received_payloads_total{frames=\"several\"}"),
        slices: value("dflash_broker_received_payload_slices_total"),
    }
}

/// Moves `items` items of `item_bytes` through a broker process with
/// `producers` targets and `consumers` drafters.
async fn broker_transfer(
    item_bytes: usize,
    items: u64,
    producers: u64,
    consumers: u64,
) -> Transfer {
    broker_transfer_with(item_bytes, items, producers, consumers, &[]).await
}

/// [`broker_transfer`] with extra broker flags.
async fn broker_transfer_with(
    item_bytes: usize,
    items: u64,
    producers: u64,
    consumers: u64,
    extra: &[String],
) -> Transfer {
    let metrics_port = free_port();
    let mut flags = vec![
        "--metrics-listen".to_string(),
        format!("127.0.0.1:{metrics_port}"),
    ];
    flags.extend_from_slice(extra);
    let (broker, address) = start_broker_with(producers, &flags).await;
    let client = BrokerClient::connect(address, ClientOptions::default())
        .await
        .expect("connect");
    let payload = sample(item_bytes);
    let per_producer = items / producers;

    // Bytes received so far by all drafters: the broker's counters are
    // read again once half the bytes arrived, so the second half shows the
    // steady state (the first includes growing the heap to its peak).
    let progress = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut drafters = Vec::new();
    for index in 0..consumers {
        let client = client.clone();
        let progress = progress.clone();
        drafters.push(tokio::spawn(async move {
            let mut consumer = client
                .consume(&format!("d{index}"), proto::Credit { items: 4, bytes: 0 })
                .await
                .expect("consume");
            let handle = consumer.handle();
            let mut received = 0u64;
            while let Ok(ConsumerEvent::Delivery(delivery)) = consumer.next().await {
                let bytes = delivery.sample.map_or(0, |sample| sample.payload_bytes());
                received += bytes;
                progress.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                handle.ack(vec![delivery.delivery_id]);
            }
            (received, consumer.copies())
        }));
    }
    let server_before = broker.counters();
    let clients_before = ProcessCounters::read("self");
    let started = Instant::now();
    let mut targets = Vec::new();
    for index in 0..producers {
        let client = client.clone();
        let payload = payload.clone();
        targets.push(tokio::spawn(run_target(
            client,
            format!("target-{index}"),
            payload,
            per_producer,
            None,
        )));
    }
    let total = per_producer * producers * item_bytes as u64;
    let halfway = {
        let progress = progress.clone();
        let pid = broker.pid.clone();
        tokio::spawn(async move {
            while progress.load(std::sync::atomic::Ordering::Relaxed) < total / 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (
                ProcessCounters::read(&pid),
                progress.load(std::sync::atomic::Ordering::Relaxed),
            )
        })
    };
    for target in targets {
        target.await.expect("target");
    }
    let mut bytes = 0;
    let mut copies = Copies::default();
    for drafter in drafters {
        let (received, drafter_copies) = drafter.await.expect("drafter");
        bytes += received;
        copies.add(drafter_copies);
    }
    let seconds = started.elapsed().as_secs_f64();
    let server_after = broker.counters();
    let server = server_after.since(server_before);
    let clients = ProcessCounters::read("self").since(clients_before);
    assert_eq!(
        bytes,
        per_producer * producers * item_bytes as u64,
        "bytes lost"
    );
    let (server_halfway, bytes_halfway) = halfway.await.expect("halfway");
    Transfer {
        bytes_per_second: bytes as f64 / seconds,
        server,
        clients,
        seconds,
        copies,
        received: scrape_received(metrics_port),
        second_half: Some((
            server_after.since(server_halfway),
            (bytes - bytes_halfway) as f64 / f64::from(1u32 << 30),
        )),
        peak_rss_mib: peak_rss_mib(&broker.pid),
    }
}

/// The relay process: `--serve-relay IN_PORT OUT_PORT PRODUCERS CONSUMERS`.
/// Accepts `producers` connections on IN_PORT and `consumers` on OUT_PORT,
/// relays length-prefixed items through one FIFO of 8, reads each 8-byte
/// acknowledgement back, and exits when every producer has closed and every
/// item went out.
async fn serve_relay(inbound_port: u16, outbound_port: u16, producers: usize, consumers: usize) {
    let inbound = TcpListener::bind(("127.0.0.1", inbound_port))
        .await
        .expect("bind");
    let outbound = TcpListener::bind(("127.0.0.1", outbound_port))
        .await
        .expect("bind");
    let (frames_in, frames_out) = mpsc::channel::<Vec<u8>>(8);
    let frames_out = Arc::new(Mutex::new(frames_out));
    let relay_in = tokio::spawn(async move {
        let mut readers = Vec::new();
        for _ in 0..producers {
            let (mut socket, _) = inbound.accept().await.expect("accept");
            let frames_in = frames_in.clone();
            readers.push(tokio::spawn(async move {
                while let Ok(length) = socket.read_u64().await {
                    let mut frame = vec![0u8; length as usize];
                    socket.read_exact(&mut frame).await.expect("read frame");
                    if frames_in.send(frame).await.is_err() {
                        break;
                    }
                }
            }));
        }
        drop(frames_in);
        for reader in readers {
            let _ = reader.await;
        }
    });
    let mut writers = Vec::new();
    for _ in 0..consumers {
        let (socket, _) = outbound.accept().await.expect("accept");
        let frames_out = frames_out.clone();
        writers.push(tokio::spawn(async move {
            let (mut reading, mut writing) = socket.into_split();
            let acks = tokio::spawn(async move { while reading.read_u64().await.is_ok() {} });
            loop {
                let frame = frames_out.lock().await.recv().await;
                let Some(frame) = frame else { break };
                writing.write_u64(frame.len() as u64).await.expect("write");
                writing.write_all(&frame).await.expect("write");
            }
            let _ = writing.shutdown().await;
            let _ = acks.await;
        }));
    }
    for writer in writers {
        let _ = writer.await;
    }
    let _ = relay_in.await;
}

/// The same transfer through the relay process.
async fn relay_transfer(item_bytes: usize, items: u64, producers: u64, consumers: u64) -> Transfer {
    let (inbound_port, outbound_port) = (free_port(), free_port());
    let child = Command::new(std::env::current_exe().expect("this bench's path"))
        .args([
            "--serve-relay",
            &inbound_port.to_string(),
            &outbound_port.to_string(),
            &producers.to_string(),
            &consumers.to_string(),
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("start the relay");
    let relay = Server {
        pid: child.id().to_string(),
        child,
    };
    let inbound_address = SocketAddr::from(([127, 0, 0, 1], inbound_port));
    let outbound_address = SocketAddr::from(([127, 0, 0, 1], outbound_port));
    // Polling with a connection would take a producer's or consumer's slot:
    // wait until the process has bound both ports instead.
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpListener::bind(outbound_address).is_ok()
        || std::net::TcpListener::bind(inbound_address).is_ok()
    {
        assert!(Instant::now() < deadline, "the relay never listened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let per_producer = items / producers;

    let mut readers = Vec::new();
    for _ in 0..consumers {
        let socket = TcpStream::connect(outbound_address).await.expect("connect");
        socket.set_nodelay(true).expect("nodelay");
        readers.push(tokio::spawn(async move {
            let (mut reading, mut writing) = socket.into_split();
            let mut received = 0u64;
            let mut acked = 0u64;
            while let Ok(length) = reading.read_u64().await {
                // A fresh buffer per item, as a gRPC client decodes one.
                let mut frame = vec![0u8; length as usize];
                reading.read_exact(&mut frame).await.expect("read");
                received += frame.len() as u64;
                acked += 1;
                writing.write_u64(acked).await.expect("ack");
            }
            received
        }));
    }
    let payload = Arc::new(vec![7u8; item_bytes]);
    let server_before = relay.counters();
    let clients_before = ProcessCounters::read("self");
    let started = Instant::now();
    let mut writers = Vec::new();
    for _ in 0..producers {
        let payload = payload.clone();
        writers.push(tokio::spawn(async move {
            let mut socket = TcpStream::connect(inbound_address).await.expect("connect");
            socket.set_nodelay(true).expect("nodelay");
            for _ in 0..per_producer {
                socket.write_u64(payload.len() as u64).await.expect("write");
                socket.write_all(&payload).await.expect("write");
            }
            let _ = socket.shutdown().await;
        }));
    }
    for writer in writers {
        writer.await.expect("writer");
    }
    let mut bytes = 0;
    for reader in readers {
        bytes += reader.await.expect("reader");
    }
    let seconds = started.elapsed().as_secs_f64();
    let server = relay.counters().since(server_before);
    let clients = ProcessCounters::read("self").since(clients_before);
    assert_eq!(
        bytes,
        per_producer * producers * item_bytes as u64,
        "relay lost bytes"
    );
    Transfer {
        bytes_per_second: bytes as f64 / seconds,
        server,
        clients,
        seconds,
        copies: Copies::default(),
        received: Received::default(),
        second_half: None,
        peak_rss_mib: 0.0,
    }
}

/// When a synthetic drafter lets go of its stream after end-of-stream.
#[derive(Clone, Copy, PartialEq)]
enum Teardown {
    /// Each drafter keeps its stream and connection until every drafter has
    /// its end-of-stream, as drafters on their own hosts do: their teardown
    /// does not run on the cores the fan-out to the others needs.
    AfterAll,
    /// Each drafter drops its stream on arrival: the close of the first
    /// drafters' connections (here and in the broker) runs on the same two
    /// cores during the fan-out to the rest.
    OnArrival,
}

/// What one end-of-stream configuration measured over its runs.
struct EndOfStream {
    /// From the last ReportDone being sent until every drafter has its
    /// end-of-stream, sorted.
    latencies: Vec<Duration>,
    /// CPU time over those same windows, summed over the runs: the broker
    /// process's, and this (the clients') process's.
    broker_cpu: Duration,
    clients_cpu: Duration,
}

/// End-of-stream to `drafters` over `runs` fresh broker processes. Each
/// drafter has its own connection, as `BrokerClient::consume` opens.
async fn end_of_stream_latencies(runs: usize, drafters: usize, teardown: Teardown) -> EndOfStream {
    let mut latencies = Vec::new();
    let (mut broker_cpu, mut clients_cpu) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..runs {
        let (broker, address) = start_broker(1).await;
        let client = BrokerClient::connect(address, ClientOptions::default())
            .await
            .expect("connect");
        let (ended_sender, mut ended) = mpsc::unbounded_channel();
        for index in 0..drafters {
            let mut consumer = client
                .consume(&format!("d{index}"), proto::Credit { items: 1, bytes: 0 })
                .await
                .expect("consume");
            let ended_sender = ended_sender.clone();
            tokio::spawn(async move {
                loop {
                    match consumer.next().await {
                        Ok(ConsumerEvent::Delivery(delivery)) => {
                            consumer.handle().ack(vec![delivery.delivery_id]);
                        }
                        Ok(ConsumerEvent::EndOfStream(_)) | Err(_) => {
                            let arrived = Instant::now();
                            let kept = (teardown == Teardown::AfterAll).then_some(consumer);
                            let _ = ended_sender.send((arrived, kept));
                            return;
                        }
                    }
                }
            });
        }
        let mut producer = client.produce("target-0").await.expect("produce");
        producer
            .send(0, sample(1024), HashMap::new())
            .await
            .expect("send");
        producer.finish().await.expect("finish");
        while client.status().await.expect("status").acked_items < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The clock starts when ReportDone is sent: the latency covers the
        // call itself and the fan-out of end-of-stream to every drafter.
        let (broker_before, clients_before) = (process_cpu(&broker.pid), process_cpu("self"));
        let reported = Instant::now();
        client.report_done("target-0", 1).await.expect("done");
        let mut last = reported;
        let mut kept = Vec::with_capacity(drafters);
        for _ in 0..drafters {
            let (arrived, consumer) = ended.recv().await.expect("end-of-stream");
            last = last.max(arrived);
            kept.push(consumer);
        }
        latencies.push(last.saturating_duration_since(reported));
        broker_cpu += process_cpu(&broker.pid).saturating_sub(broker_before);
        clients_cpu += process_cpu("self").saturating_sub(clients_before);
        drop(kept);
    }
    latencies.sort();
    EndOfStream {
        latencies,
        broker_cpu,
        clients_cpu,
    }
}

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

fn print_throughput(quick: bool, rounds: usize, runtime: &tokio::runtime::Runtime) {
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

fn print_end_of_stream(quick: bool, runtime: &tokio::runtime::Runtime) {
    runtime.block_on(async {
        for drafters in [4usize, 64, 256] {
            let runs = match (quick, drafters) {
                (true, 256) => 5,
                (true, _) => 20,
                (false, 256) => 20,
                (false, _) => 100,
            };
            for (teardown, label) in [
                (Teardown::AfterAll, "drafters keep their streams"),
                (Teardown::OnArrival, "each drops its stream on arrival"),
            ] {
                let measured = end_of_stream_latencies(runs, drafters, teardown).await;
                let latencies = &measured.latencies;
                let percentile = |fraction: f64| {
                    latencies[((latencies.len() - 1) as f64 * fraction).round() as usize]
                };
                let per_drafter_us =
                    |cpu: Duration| cpu.as_secs_f64() * 1e6 / (runs * drafters) as f64;
                println!(
                    "end-of-stream latency, {drafters:>3} drafters, {runs:>3} runs: p50 {:>7.2} ms, p99 {:>7.2} ms; \
                     CPU per drafter in the window: broker {:>5.1} us, clients {:>5.1} us ({label})",
                    percentile(0.50).as_secs_f64() * 1e3,
                    percentile(0.99).as_secs_f64() * 1e3,
                    per_drafter_us(measured.broker_cpu),
                    per_drafter_us(measured.clients_cpu),
                );
            }
        }
    });
}

fn print_many_small(quick: bool, runtime: &tokio::runtime::Runtime) {
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

fn print_seed_scenario(quick: bool, runtime: &tokio::runtime::Runtime) {
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

/// The write-ahead log's cost: the same transfer without `--state-dir` and
/// with it under each `--fsync` policy, in the same run (the log goes to a
/// temporary directory under `$DFLASH_BENCH_STATE_DIR` or the system's).
fn print_write_ahead_log(quick: bool, runtime: &tokio::runtime::Runtime) {
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

fn main() {
    let arguments: Vec<String> = std::env::args().collect();
    if !arguments.iter().any(|argument| argument == "--serve-relay") {
        // This process is the clients of both the broker and the relay:
        // glibc malloc set up as the target-server and drafter-server set
        // it up (large blocks kept for reuse), so neither side's clients
        // pay a fresh mapping per received item. The relay stays a plain
        // program on glibc's defaults.
        let allocator = dflash_device::configure_allocator(dflash_device::AllocatorMode::Retained);
        eprintln!("bench clients: {allocator}");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if let Some(position) = arguments
        .iter()
        .position(|argument| argument == "--serve-relay")
    {
        let number = |offset: usize| -> usize {
            arguments
                .get(position + offset)
                .and_then(|value| value.parse().ok())
                .expect("--serve-relay IN_PORT OUT_PORT PRODUCERS CONSUMERS")
        };
        runtime.block_on(serve_relay(
            number(1) as u16,
            number(2) as u16,
            number(3),
            number(4),
        ));
        return;
    }
    let quick = arguments.iter().any(|argument| argument == "--quick");
    // `--rounds N`: relay/broker pairs per throughput configuration (the
    // table shows medians); `--only a,b`: just these sections (throughput,
    // wal, eos, small, seed).
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
}
