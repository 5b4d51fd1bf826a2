//! The end-of-stream section: the latency from the last ReportDone to
//! every drafter's end-of-stream with 4, 64 and 256 drafters on their own
//! connections, with and without their teardown competing for the cores,
//! and the CPU both processes spend in that window.
//!
//! Apart from the transfers because it measures one moment of a run, not a
//! rate: one item, then the fan-out.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_proto::v1 as proto;
use tokio::sync::mpsc;

use crate::processes::{process_cpu, start_broker};
use crate::transfer::sample;

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

pub(crate) fn print_end_of_stream(quick: bool, runtime: &tokio::runtime::Runtime) {
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
