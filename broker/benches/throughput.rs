//! Broker throughput next to a plain TCP relay, and end-of-stream latency.
//!
//! `cargo bench -p dflash-broker --bench throughput` (add `-- --quick` for a
//! short run). Prints, for 1 MiB and 16 MiB items with 1 and 4 producers and
//! consumers: the broker's GB/s (producer send → drafter ack), a plain TCP
//! relay's GB/s moving the same bytes producer → relay → consumer in the same
//! process, and their ratio; then the end-of-stream latency (last ReportDone
//! is sent → every drafter has end-of-stream), p50 and p99.
//!
//! Everything runs on loopback in one process, so on a 2-core machine the
//! producers, the relay/broker and the consumers share the same cores: the
//! relay is the physical limit of any relaying broker on that machine.
//!
//! Then the write-ahead log's cost: the same broker path without
//! `--state-dir` and with it under each `--fsync` policy, in the same run
//! (`-- --wal-only` runs just that table; the log goes to a temporary
//! directory under `$DFLASH_BENCH_STATE_DIR` or the system's).

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_broker::BrokerConfig;
use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_proto::v1 as proto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Mutex};
use tokio_util::sync::CancellationToken;

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

/// Moves `items` items of `item_bytes` through the broker with `producers`
/// targets and `consumers` drafters; returns bytes per second.
async fn broker_throughput(
    item_bytes: usize,
    items: u64,
    producers: u64,
    consumers: u64,
    wal: Option<dflash_broker::wal::FsyncPolicy>,
) -> f64 {
    let mut config = BrokerConfig::for_targets(producers as u32);
    config.max_queue_bytes = 1 << 30;
    let state_dir = wal.map(|fsync| {
        config.fsync = fsync;
        match std::env::var_os("DFLASH_BENCH_STATE_DIR") {
            Some(parent) => tempfile::tempdir_in(parent),
            None => tempfile::tempdir(),
        }
        .expect("state dir")
    });
    config.state_dir = state_dir.as_ref().map(|dir| dir.path().to_path_buf());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = format!("http://{}", listener.local_addr().expect("address"));
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(dflash_broker::serve(listener, config, shutdown.clone()));
    let client = BrokerClient::connect(address, ClientOptions::default())
        .await
        .expect("connect");
    let payload = sample(item_bytes);

    let mut drafters = Vec::new();
    for index in 0..consumers {
        let client = client.clone();
        drafters.push(tokio::spawn(async move {
            let mut consumer = client
                .consume(&format!("d{index}"), proto::Credit { items: 4, bytes: 0 })
                .await
                .expect("consume");
            let handle = consumer.handle();
            let mut received = 0u64;
            while let Ok(ConsumerEvent::Delivery(delivery)) = consumer.next().await {
                received += delivery.sample.map_or(0, |sample| sample.payload_bytes());
                handle.ack(vec![delivery.delivery_id]);
            }
            received
        }));
    }
    let started = Instant::now();
    let per_producer = items / producers;
    let mut targets = Vec::new();
    for index in 0..producers {
        let client = client.clone();
        let payload = payload.clone();
        targets.push(tokio::spawn(async move {
            let target_id = format!("target-{index}");
            let mut producer = client.produce(&target_id).await.expect("produce");
            for seq in 0..per_producer {
                producer
                    .send(seq, payload.clone(), HashMap::new())
                    .await
                    .expect("send");
            }
            producer.finish().await.expect("finish");
            client
                .report_done(&target_id, per_producer)
                .await
                .expect("done");
        }));
    }
    for target in targets {
        target.await.expect("target");
    }
    let mut bytes = 0;
    for drafter in drafters {
        bytes += drafter.await.expect("drafter");
    }
    let elapsed = started.elapsed().as_secs_f64();
    shutdown.cancel();
    let _ = server.await;
    assert_eq!(
        bytes,
        per_producer * producers * item_bytes as u64,
        "bytes lost"
    );
    bytes as f64 / elapsed
}

/// The same transfer through a plain TCP relay: length-prefixed frames from
/// `producers` connections into one shared queue, out to `consumers`
/// connections. Returns bytes per second.
async fn relay_throughput(item_bytes: usize, items: u64, producers: u64, consumers: u64) -> f64 {
    let inbound = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let outbound = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let inbound_address = inbound.local_addr().expect("address");
    let outbound_address = outbound.local_addr().expect("address");
    let (frames_in, frames_out) = mpsc::channel::<Vec<u8>>(8);
    let frames_out = Arc::new(Mutex::new(frames_out));
    let per_producer = items / producers;

    // Relay: read frames from each producer connection into the queue...
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
    // ...and write them to whichever consumer connection is free.
    let relay_out = tokio::spawn(async move {
        let mut writers = Vec::new();
        for _ in 0..consumers {
            let (mut socket, _) = outbound.accept().await.expect("accept");
            let frames_out = frames_out.clone();
            writers.push(tokio::spawn(async move {
                loop {
                    let frame = frames_out.lock().await.recv().await;
                    let Some(frame) = frame else { break };
                    socket.write_u64(frame.len() as u64).await.expect("write");
                    socket.write_all(&frame).await.expect("write");
                }
                let _ = socket.shutdown().await;
            }));
        }
        for writer in writers {
            let _ = writer.await;
        }
    });

    let mut readers = Vec::new();
    for _ in 0..consumers {
        readers.push(tokio::spawn(async move {
            let mut socket = TcpStream::connect(outbound_address).await.expect("connect");
            socket.set_nodelay(true).expect("nodelay");
            let mut received = 0u64;
            let mut frame = Vec::new();
            while let Ok(length) = socket.read_u64().await {
                frame.resize(length as usize, 0);
                socket.read_exact(&mut frame).await.expect("read");
                received += length;
            }
            received
        }));
    }
    let payload = vec![7u8; item_bytes];
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
    let elapsed = started.elapsed().as_secs_f64();
    let _ = relay_in.await;
    let _ = relay_out.await;
    assert_eq!(
        bytes,
        per_producer * producers * item_bytes as u64,
        "relay lost bytes"
    );
    bytes as f64 / elapsed
}

/// Seconds from the last ReportDone returning until every one of `drafters`
/// has its end-of-stream, over `runs` fresh runs.
async fn end_of_stream_latencies(runs: usize, drafters: usize) -> Vec<Duration> {
    let mut latencies = Vec::new();
    for _ in 0..runs {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = format!("http://{}", listener.local_addr().expect("address"));
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(dflash_broker::serve(
            listener,
            BrokerConfig::for_targets(1),
            shutdown.clone(),
        ));
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
                            let _ = ended_sender.send(Instant::now());
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
            tokio::task::yield_now().await;
        }
        // The clock starts when ReportDone is sent: the latency covers the
        // call itself and the fan-out of end-of-stream to every drafter.
        let reported = Instant::now();
        client.report_done("target-0", 1).await.expect("done");
        let mut last = reported;
        for _ in 0..drafters {
            last = last.max(ended.recv().await.expect("end-of-stream"));
        }
        latencies.push(last.saturating_duration_since(reported));
        shutdown.cancel();
        let _ = server.await;
    }
    latencies.sort();
    latencies
}

fn gigabytes(bytes_per_second: f64) -> f64 {
    bytes_per_second / 1e9
}

fn main() {
    let quick = std::env::args().any(|argument| argument == "--quick");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let total_bytes: u64 = if quick { 256 << 20 } else { 2 << 30 };
    println!(
        "dflash broker benchmark: {} MiB per configuration, loopback, one process",
        total_bytes >> 20
    );
    println!(
        "{:>9} {:>9} {:>9} {:>13} {:>13} {:>7}",
        "item", "producers", "consumers", "broker GB/s", "relay GB/s", "ratio"
    );
    let wal_only = std::env::args().any(|argument| argument == "--wal-only");
    runtime.block_on(async {
        for item_bytes in [1usize << 20, 16 << 20] {
            if wal_only {
                break;
            }
            for (producers, consumers) in [(1u64, 1u64), (4, 4)] {
                let items = (total_bytes / item_bytes as u64 / producers) * producers;
                // Warm up both paths once so allocation and connection setup
                // don't count.
                let _ = relay_throughput(item_bytes, producers * 2, producers, consumers).await;
                let _ = broker_throughput(item_bytes, producers * 2, producers, consumers, None).await;
                let relay = relay_throughput(item_bytes, items, producers, consumers).await;
                let broker = broker_throughput(item_bytes, items, producers, consumers, None).await;
                println!(
                    "{:>6} MiB {:>9} {:>9} {:>13.2} {:>13.2} {:>7.2}",
                    item_bytes >> 20,
                    producers,
                    consumers,
                    gigabytes(broker),
                    gigabytes(relay),
                    broker / relay
                );
            }
        }
        use dflash_broker::wal::FsyncPolicy;
        println!(
            "{:>9} {:>9} {:>9} {:>13} {:>13} {:>13} {:>13}",
            "item", "producers", "consumers", "no log GB/s", "never GB/s", "batch GB/s", "always GB/s"
        );
        for (producers, consumers) in [(1u64, 1u64), (4, 4)] {
            let item_bytes = 16usize << 20;
            let items = (total_bytes / item_bytes as u64 / producers) * producers;
            let _ = broker_throughput(item_bytes, producers * 2, producers, consumers, Some(FsyncPolicy::Never)).await;
            let mut rates = Vec::new();
            for wal in [None, Some(FsyncPolicy::Never), Some(FsyncPolicy::Batch), Some(FsyncPolicy::Always)] {
                rates.push(gigabytes(broker_throughput(item_bytes, items, producers, consumers, wal).await));
            }
            println!(
                "{:>6} MiB {:>9} {:>9} {:>13.2} {:>13.2} {:>13.2} {:>13.2}",
                item_bytes >> 20, producers, consumers, rates[0], rates[1], rates[2], rates[3]
            );
        }
        if wal_only {
            return;
        }
        let runs = if quick { 20 } else { 100 };
        let drafters = 4;
        let latencies = end_of_stream_latencies(runs, drafters).await;
        let percentile = |fraction: f64| latencies[((latencies.len() - 1) as f64 * fraction).round() as usize];
        println!(
            "end-of-stream latency (last ReportDone sent -> all {drafters} drafters have it), {runs} runs: p50 {:.2} ms, p99 {:.2} ms",
            percentile(0.50).as_secs_f64() * 1e3,
            percentile(0.99).as_secs_f64() * 1e3
        );
    });
}
