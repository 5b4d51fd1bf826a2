//! Progress-based liveness over real gRPC: a target whose stream stays open
//! but sends nothing new (stats only) fails after `--target-stall-timeout`,
//! one that never sends its first item after `--target-load-timeout`; a full
//! queue holding a target back is not a stall; leases are capped by
//! `--max-lease-lifetime` however often they are extended.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dflash_broker::config::FailurePolicy;
use dflash_broker::BrokerConfig;
use dflash_client::ConsumerEvent;
use dflash_proto::v1 as proto;
use dflash_testkit::{credit, drafter_status, sample, wait_until, TestBroker};

fn config(stall: Duration, load: Duration) -> BrokerConfig {
    BrokerConfig {
        target_stall_timeout: stall,
        target_load_timeout: load,
        on_target_failure: FailurePolicy::Abort,
        ..BrokerConfig::for_targets(1)
    }
}

/// Waits for the drafter's end-of-stream, acking what comes before it. The
/// 60 s per event only stops a hang (the timeouts under test are 2 s).
async fn end_of_stream(consumer: &mut dflash_client::Consumer) -> proto::EndOfStream {
    loop {
        match tokio::time::timeout(Duration::from_secs(60), consumer.next())
            .await
            .expect("end-of-stream in time")
            .expect("stream")
        {
            ConsumerEvent::Delivery(delivery) => {
                consumer.handle().ack(vec![delivery.delivery_id]);
            }
            ConsumerEvent::EndOfStream(end) => return end,
        }
    }
}

/// A drafter's Consume stream and a target's Produce stream, after the
/// target's one item was accepted, and an instant taken before that item was
/// sent: the broker's stall clock starts when it accepts the item, so after
/// this instant, whatever the machine's load did to either side.
async fn one_item_then_silence(
    broker: &TestBroker,
) -> (dflash_client::Consumer, dflash_client::Producer, Instant) {
    let client = broker.client().await;
    let consumer = client.consume("drafter-0", credit(4)).await.unwrap();
    let mut producer = client.produce("target-0").await.unwrap();
    let before_the_item = Instant::now();
    producer
        .send(0, sample(256, 0), HashMap::new())
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(60), || async {
            broker.status().await.accepted_items == 1
        })
        .await
    );
    (consumer, producer, before_the_item)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_producer_aborts_the_run_after_the_stall_timeout() {
    let stall = Duration::from_secs(2);
    let broker = TestBroker::start(config(stall, Duration::from_secs(60))).await;
    let (mut consumer, mut producer, silent_since) = one_item_then_silence(&broker).await;
    // Stats keep coming (the process is alive) but no item: not progress.
    let stats = tokio::spawn(async move {
        for _ in 0..100 {
            if producer
                .send_stats(proto::ProducerStats::default())
                .await
                .is_err()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        producer
    });
    let end = end_of_stream(&mut consumer).await;
    let waited = silent_since.elapsed();
    assert_eq!(end.status(), proto::RunStatus::Aborted, "{end:?}");
    assert!(end.reason.contains("no item accepted"), "{}", end.reason);
    assert!(end.reason.contains("target-0"), "{}", end.reason);
    // Not before the stall timeout: our clock started before the item was
    // sent, so before the broker's (it starts on acceptance), and the
    // broker fails the target at `accepted + stall` or later. How long
    // after is no property of the rule (the reason names the stall timeout
    // as the cause): the bound is end_of_stream's, a liveness bound.
    assert!(waited >= stall, "{waited:?}");
    let status = broker.status().await;
    assert_eq!(status.state(), proto::BrokerState::Aborted);
    stats.abort();
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_producer_under_continue_completes_with_the_target_failed() {
    let stall = Duration::from_secs(2);
    let broker = TestBroker::start(BrokerConfig {
        on_target_failure: FailurePolicy::Continue,
        ..config(stall, Duration::from_secs(60))
    })
    .await;
    // The stream stays open and nothing more is sent.
    let (mut consumer, producer, silent_since) = one_item_then_silence(&broker).await;
    let end = end_of_stream(&mut consumer).await;
    let waited = silent_since.elapsed();
    assert_eq!(end.status(), proto::RunStatus::Complete, "{end:?}");
    let summary = end.summary.clone().expect("a summary");
    assert_eq!(
        summary.failed_targets,
        vec!["target-0".to_string()],
        "{end:?}"
    );
    // Not before the stall timeout: our clock started before the item was
    // sent, so before the broker's (it starts on acceptance), and the
    // broker fails the target at `accepted + stall` or later. How long
    // after is no property of the rule (the reason names the stall timeout
    // as the cause): the bound is end_of_stream's, a liveness bound.
    assert!(waited >= stall, "{waited:?}");
    let status = broker.status().await;
    assert_eq!(status.state(), proto::BrokerState::Complete);
    // What it sent before it went silent was delivered and acked.
    assert_eq!((status.accepted_items, status.acked_items), (1, 1));
    drop(producer);
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_that_never_sends_fails_after_the_load_timeout() {
    let load = Duration::from_secs(2);
    let broker = TestBroker::start(config(Duration::from_secs(60), load)).await;
    let client = broker.client().await;
    let mut consumer = client.consume("drafter-0", credit(4)).await.unwrap();
    // Before the hello: the broker's load clock starts when it reads it.
    let before_the_hello = Instant::now();
    let _producer = client.produce("target-0").await.unwrap();
    let end = end_of_stream(&mut consumer).await;
    let waited = before_the_hello.elapsed();
    assert_eq!(end.status(), proto::RunStatus::Aborted, "{end:?}");
    assert!(end.reason.contains("no first item"), "{}", end.reason);
    // Not before the load timeout (our clock started first); after it only
    // as late as end_of_stream waits (a liveness bound: the reason names
    // the load timeout as cause).
    assert!(waited >= load, "{waited:?}");
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backpressure_is_not_a_stall() {
    let stall = Duration::from_secs(1);
    let mut broker_config = config(stall, Duration::from_secs(60));
    broker_config.max_queue_bytes = 64 << 10;
    broker_config.max_item_bytes = 16 << 10;
    let broker = TestBroker::start(broker_config).await;
    let client = broker.client().await;
    let mut producer = client.produce("target-0").await.unwrap();
    // Fills the queue (no drafter yet) and then waits on the broker.
    let sender = tokio::spawn(async move {
        for seq in 0..12u64 {
            producer
                .send(seq, sample(12 << 10, seq), HashMap::new())
                .await
                .unwrap();
        }
        producer.finish().await.unwrap()
    });
    // First the state under test: the broker holds the target back (the
    // queue holds so much that the next item does not fit), whatever the
    // machine's load made that take.
    assert!(
        wait_until(Duration::from_secs(30), || async {
            let status = broker.status().await;
            let per_item = status.queued_bytes / status.accepted_items.max(1);
            status.accepted_items > 0 && status.queued_bytes + per_item > status.max_queue_bytes
        })
        .await,
        "the queue never filled: {:?}",
        broker.status().await
    );
    let held = broker.status().await.accepted_items;
    assert!(held < 12, "{held} accepted: nothing held back");
    // Then the broker's own clock says the target has been silent for three
    // stall timeouts: its `last_seen_ms_ago` (not refreshed while its
    // reader waits for room: no message is read, and a waiter's failed
    // attempt does not wake it). Were the stall clock running while held
    // back, the deadline noted at its last accepted item (one stall after
    // it) would have woken the ticker and aborted the run two stall
    // timeouts before that. Every poll on the way sees it still running
    // and nothing more accepted. The 60 s only stops a hang.
    let target_silence = |status: &proto::StatusSnapshot| {
        status
            .targets
            .iter()
            .find(|target| target.target_id == "target-0")
            .map_or(0, |target| target.last_seen_ms_ago)
    };
    let silent_for_three_stalls = u64::try_from((stall * 3).as_millis()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = broker.status().await;
        assert_eq!(status.state(), proto::BrokerState::Running, "{status:?}");
        assert_eq!(status.accepted_items, held, "{status:?}");
        if target_silence(&status) >= silent_for_three_stalls {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the target's silence never reached three stall timeouts: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A drafter frees room; everything arrives.
    let mut consumer = client.consume("drafter-0", credit(2)).await.unwrap();
    let handle = consumer.handle();
    let mut received = 0;
    while received < 12 {
        let ConsumerEvent::Delivery(delivery) = consumer.next().await.unwrap() else {
            panic!("run ended early: {:?}", broker.status().await.abort_reason)
        };
        handle.ack(vec![delivery.delivery_id]);
        received += 1;
    }
    let report = sender.await.unwrap();
    assert_eq!(report.accepted, 12);
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extensions_cannot_keep_a_lease_past_its_lifetime() {
    let broker = TestBroker::start(BrokerConfig {
        lease_timeout: Duration::from_secs(1),
        max_lease_lifetime: Duration::from_secs(2),
        ..BrokerConfig::for_targets(1)
    })
    .await;
    let client = broker.client().await;
    let mut producer = client.produce("target-0").await.unwrap();
    producer
        .send(0, sample(256, 0), HashMap::new())
        .await
        .unwrap();
    producer.finish().await.unwrap();
    // Before the drafter's hello: the broker leases the item (and starts
    // the lease's lifetime) only once it has read it.
    let before_the_lease = Instant::now();
    let mut consumer = client.consume("drafter-0", credit(1)).await.unwrap();
    let handle = consumer.handle();
    // A stuck trainer's heartbeat: extends forever, never acks. It starts
    // before the delivery is read (an extension of "every lease of this
    // stream" is a no-op until the lease exists), so the lease is renewed
    // ten times per lease timeout from the start, however late this task
    // gets to read the delivery.
    let extender = tokio::spawn(async move {
        loop {
            handle.extend_leases(Vec::new());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let ConsumerEvent::Delivery(first) = consumer.next().await.unwrap() else {
        panic!("expected a delivery")
    };
    assert!(
        wait_until(Duration::from_secs(60), || async {
            let status = broker.status().await;
            drafter_status(&status, "drafter-0").is_some_and(|drafter| drafter.expired_leases == 1)
        })
        .await,
        "the lease outlived its lifetime"
    );
    let taken_back = before_the_lease.elapsed();
    // Not before the lifetime (2 s; our clock started before the lease).
    // No upper bound but the wait's 60 s, which only stops a hang:
    // extended every 100 ms, a lease the cap missed would never expire,
    // so any finite wait tells the two apart.
    assert!(taken_back >= Duration::from_secs(2), "{taken_back:?}");
    assert_eq!(first.delivery_count, 1);
    extender.abort();
    broker.stop().await;
}
