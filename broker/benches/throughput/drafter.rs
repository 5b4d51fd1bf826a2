//! The synthetic drafter every section drives the broker with: it takes
//! deliveries within its credit, optionally spends a simulated training
//! step on each, acks it, and records what it received until end-of-stream.
//!
//! Apart from the sections because the loopback transfer, the seed's
//! scenario and the roles on the test bed's hosts (`host_roles`) all run
//! this same loop, with other credits, steps and records.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_client::{Backoff, BrokerClient, ConsumerEvent};
use dflash_proto::frames::Copies;
use dflash_proto::v1 as proto;

/// How one synthetic drafter behaves.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DrafterLoad {
    /// Items it may hold leased at once.
    pub(crate) credit: u32,
    /// A simulated training step per item before its ack; none acks at once.
    pub(crate) step: Option<Duration>,
    /// Open a new stream when the old one fails (a cut link), until
    /// end-of-stream; without it a failed stream ends the drafter.
    pub(crate) reconnect: bool,
    /// Keep the (target, seq, delivery count) of every delivery.
    pub(crate) record_items: bool,
}

/// One delivery as the drafter received it.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub(crate) target_id: String,
    pub(crate) seq: u64,
    /// 1 on the item's first delivery, 2 on its first redelivery, ...
    pub(crate) delivery_count: u32,
}

/// What one synthetic drafter did.
#[derive(Debug)]
pub(crate) struct DrafterRecord {
    pub(crate) items: u64,
    pub(crate) bytes: u64,
    /// Time spent in simulated steps.
    pub(crate) busy: Duration,
    pub(crate) first_received: Option<Instant>,
    /// When its last item was done (received, stepped and acked).
    pub(crate) last_done: Option<Instant>,
    /// When end-of-stream arrived; none when the stream failed instead.
    pub(crate) end_of_stream: Option<Instant>,
    /// How its consumers' tensors came out (views on a frame, or joined).
    pub(crate) copies: Copies,
    /// Every delivery, when [`DrafterLoad::record_items`] asked for it.
    pub(crate) received: Vec<Received>,
    /// Streams it opened again after one failed.
    pub(crate) reconnects: u32,
    /// Items it had received when it last opened a stream again: what it
    /// took after that is `items` minus this.
    pub(crate) items_before_reconnect: u64,
}

/// Runs one synthetic drafter on `client` until end-of-stream (or until its
/// stream fails, unless it reconnects). `progress`, when given, counts the
/// payload bytes received by every drafter sharing it.
pub(crate) async fn run_drafter(
    client: BrokerClient,
    drafter_id: String,
    load: DrafterLoad,
    progress: Option<Arc<AtomicU64>>,
) -> DrafterRecord {
    let mut record = DrafterRecord {
        items: 0,
        bytes: 0,
        busy: Duration::ZERO,
        first_received: None,
        last_done: None,
        end_of_stream: None,
        copies: Copies::default(),
        received: Vec::new(),
        reconnects: 0,
        items_before_reconnect: 0,
    };
    let credit = proto::Credit {
        items: load.credit,
        bytes: 0,
    };
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_millis(500));
    loop {
        let mut consumer = match client.consume(&drafter_id, credit).await {
            Ok(consumer) => consumer,
            Err(error) if load.reconnect => {
                tracing::debug!(%error, drafter_id, "consume refused, retrying");
                tokio::time::sleep(backoff.next_delay()).await;
                continue;
            }
            Err(error) => panic!("{drafter_id}: consume: {error}"),
        };
        backoff.reset();
        let handle = consumer.handle();
        let ended = loop {
            match consumer.next().await {
                Ok(ConsumerEvent::Delivery(delivery)) => {
                    let received_at = Instant::now();
                    record.first_received.get_or_insert(received_at);
                    let bytes = delivery
                        .sample
                        .as_ref()
                        .map_or(0, proto::Sample::payload_bytes);
                    if let Some(step) = load.step {
                        tokio::time::sleep(step).await;
                        record.busy += received_at.elapsed();
                    }
                    record.items += 1;
                    record.bytes += bytes;
                    if let Some(progress) = &progress {
                        progress.fetch_add(bytes, Ordering::Relaxed);
                    }
                    if load.record_items {
                        record.received.push(Received {
                            target_id: delivery.target_id.clone(),
                            seq: delivery.seq,
                            delivery_count: delivery.delivery_count,
                        });
                    }
                    handle.ack(vec![delivery.delivery_id]);
                    record.last_done = Some(Instant::now());
                }
                Ok(ConsumerEvent::EndOfStream(_)) => {
                    record.end_of_stream = Some(Instant::now());
                    break true;
                }
                Err(_) => break false,
            }
        };
        record.copies.add(consumer.copies());
        if ended || !load.reconnect {
            return record;
        }
        record.reconnects += 1;
        record.items_before_reconnect = record.items;
    }
}
