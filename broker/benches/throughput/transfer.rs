//! The load generators against a broker: a synthetic target that sends
//! copies of one sample and reports done, and one whole transfer through a
//! fresh broker process with N targets and M drafters, measured as a
//! [`Transfer`] (rate, both processes' counters, how payloads were held).
//!
//! Apart from the sections because the throughput, small-items and
//! write-ahead-log tables all run this same transfer with other sizes and
//! flags, and the seed's scenario reuses its target.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_client::{BrokerClient, ClientOptions, Producer};
use dflash_proto::frames::Copies;
use dflash_proto::v1 as proto;

use crate::drafter::{run_drafter, DrafterLoad};
use crate::processes::{
    peak_rss_mib, scrape_received, start_broker_with_metrics, ProcessCounters, Received,
};

pub(crate) fn sample(bytes: usize) -> proto::Sample {
    proto::Sample {
        tensors: vec![proto::Tensor::from_parts(
            "hidden_states",
            proto::Dtype::U8,
            vec![bytes as u64],
            Bytes::from(vec![7u8; bytes]),
        )],
    }
}

/// One synthetic target: sends `items` copies of `payload` (one every
/// `pace` when given, else as fast as the broker takes them), then
/// finishes and reports done.
pub(crate) async fn run_target(
    client: BrokerClient,
    target_id: String,
    payload: proto::Sample,
    items: u64,
    pace: Option<Duration>,
) {
    let producer = client.produce(&target_id).await.expect("produce");
    send_and_finish(producer, payload, items, pace).await;
    client.report_done(&target_id, items).await.expect("done");
}

/// A synthetic target's sending on a Produce stream already open: `items`
/// copies of `payload`, paced or not, then the stream finished (ReportDone
/// is the caller's, so a caller can time it on its own).
pub(crate) async fn send_and_finish(
    mut producer: Producer,
    payload: proto::Sample,
    items: u64,
    pace: Option<Duration>,
) {
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
}

/// What one transfer measured: bytes per second and the relaying process's
/// counters over the transfer.
pub(crate) struct Transfer {
    pub(crate) bytes_per_second: f64,
    pub(crate) server: ProcessCounters,
    pub(crate) clients: ProcessCounters,
    pub(crate) seconds: f64,
    /// How the consumers' tensors came out (views on a frame, or joined).
    pub(crate) copies: Copies,
    /// How the broker received the large payloads (from its `/metrics`).
    pub(crate) received: Received,
    /// The broker's counters over the second half of the bytes, and the
    /// GiB of that half: the steady state, after the heap grew.
    pub(crate) second_half: Option<(ProcessCounters, f64)>,
    /// The broker's peak RSS (VmHWM); not read for the relay, which has
    /// exited by then.
    pub(crate) peak_rss_mib: f64,
}

/// Moves `items` items of `item_bytes` through a broker process with
/// `producers` targets and `consumers` drafters.
pub(crate) async fn broker_transfer(
    item_bytes: usize,
    items: u64,
    producers: u64,
    consumers: u64,
) -> Transfer {
    broker_transfer_with(item_bytes, items, producers, consumers, &[]).await
}

/// [`broker_transfer`] with extra broker flags.
pub(crate) async fn broker_transfer_with(
    item_bytes: usize,
    items: u64,
    producers: u64,
    consumers: u64,
    extra: &[String],
) -> Transfer {
    let (broker, address, metrics) = start_broker_with_metrics(producers, extra).await;
    let metrics_port = metrics.port();
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
    let load = DrafterLoad {
        credit: 4,
        step: None,
        reconnect: false,
        record_items: false,
    };
    for index in 0..consumers {
        drafters.push(tokio::spawn(run_drafter(
            client.clone(),
            format!("d{index}"),
            load,
            Some(progress.clone()),
        )));
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
        let record = drafter.await.expect("drafter");
        bytes += record.bytes;
        copies.add(record.copies);
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
