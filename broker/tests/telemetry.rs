//! The broker's telemetry over real gRPC and HTTP: a sample's trace context
//! travels from a producer's span through `Item.trace_context`, the broker's
//! `enqueue`/`deliver` spans and `Delivery.trace_context` to a consumer's
//! span; the Prometheus endpoint serves the broker's metrics.

// Helpers outside #[test] functions fail the test by panicking, as the tests do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use dflash_broker::{BrokerConfig, ServeError};
use dflash_client::ConsumerEvent;
use dflash_proto::v1 as proto;
use dflash_telemetry::testing::InMemorySpanExporter;
use dflash_telemetry::LogFormat;
use dflash_testkit::{
    credit, http_get, parse_metrics, sample, span_attribute, wait_until, TestBroker,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

async fn next_delivery(consumer: &mut dflash_client::Consumer) -> proto::Delivery {
    match tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("delivery in time")
        .expect("consume stream")
    {
        ConsumerEvent::Delivery(delivery) => delivery,
        ConsumerEvent::EndOfStream(end) => panic!("end of stream before a delivery: {end:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_is_followed_from_the_producer_span_to_the_consumer_span() {
    let exporter = InMemorySpanExporter::default();
    let _telemetry = dflash_telemetry::init_with_exporter(
        "dflash-broker-test",
        LogFormat::Text,
        exporter.clone(),
    )
    .expect("the only subscriber of this test binary");
    let broker = TestBroker::start_with_metrics(BrokerConfig::for_targets(1)).await;
    let client = broker.client().await;
    let mut consumer = client
        .consume("drafter-0", credit(4))
        .await
        .expect("consume");
    let mut producer = client.produce("target-0").await.expect("produce");

    // Target side: the span of the batch that made the sample.
    let batch = tracing::info_span!("target_batch", batch = 0);
    let carrier = batch.in_scope(dflash_telemetry::inject_current_context);
    assert!(carrier.contains_key("traceparent"), "{carrier:?}");
    producer
        .send(0, sample(1024, 0), carrier.clone())
        .await
        .expect("send");
    drop(batch);

    // Drafter side: the step span joins the trace from the delivery.
    let delivery = next_delivery(&mut consumer).await;
    assert_eq!(delivery.trace_context, carrier, "relayed unchanged");
    let step = tracing::info_span!("drafter_step", delivery_id = delivery.delivery_id);
    assert!(dflash_telemetry::set_parent_from(
        &step,
        &delivery.trace_context
    ));
    step.in_scope(|| tracing::info!("trained"));
    drop(step);
    consumer.handle().ack(vec![delivery.delivery_id]);
    producer.finish().await.expect("finish");
    client
        .report_done("target-0", 1)
        .await
        .expect("report done");

    let trace_id = dflash_telemetry::trace_id_of(&carrier).expect("trace id");
    let spans_of_trace = || {
        exporter
            .get_finished_spans()
            .expect("finished spans")
            .into_iter()
            .filter(|span| span.span_context.trace_id().to_string() == trace_id)
            .collect::<Vec<_>>()
    };
    let names = ["target_batch", "enqueue", "deliver", "drafter_step"];
    let all_exported = wait_until(Duration::from_secs(10), || async {
        let spans = spans_of_trace();
        names
            .iter()
            .all(|name| spans.iter().any(|span| span.name == *name))
    })
    .await;
    let spans = spans_of_trace();
    assert!(
        all_exported,
        "spans of trace {trace_id}: {:?}",
        spans.iter().map(|span| &span.name).collect::<Vec<_>>()
    );
    let find = |name: &str| {
        spans
            .iter()
            .find(|span| span.name == name)
            .expect("span exported")
    };
    let batch_span_id = find("target_batch").span_context.span_id();
    assert_ne!(batch_span_id.to_string(), "0".repeat(16));
    for child in ["enqueue", "deliver", "drafter_step"] {
        assert_eq!(
            find(child).parent_span_id,
            batch_span_id,
            "{child} is not a child of the target's batch span"
        );
    }
    let enqueue = find("enqueue");
    assert_eq!(
        span_attribute(enqueue, "outcome").as_deref(),
        Some("accepted")
    );
    assert_eq!(
        span_attribute(enqueue, "target_id").as_deref(),
        Some("target-0")
    );
    let deliver = find("deliver");
    assert_eq!(
        span_attribute(deliver, "drafter_id").as_deref(),
        Some("drafter-0")
    );
    assert_eq!(
        span_attribute(deliver, "delivery_count").as_deref(),
        Some("1")
    );
    let stopped = broker.stop_checked().await;
    assert!(stopped.is_ok(), "{stopped:?}");
}

#[tokio::test]
async fn the_metrics_endpoint_serves_the_broker_metrics() {
    let broker = TestBroker::start_with_metrics(BrokerConfig::for_targets(1)).await;
    let metrics_address = broker.metrics_address.expect("metrics endpoint");
    let client = broker.client().await;
    let mut consumer = client
        .consume("drafter-0", credit(1))
        .await
        .expect("consume");
    consumer.handle().send_stats(proto::ConsumerStats {
        tokens_per_second: 1234.5,
        loss: 3.25,
        busy_fraction: 0.5,
        device: "cpu".to_string(),
        steps: 1,
        samples_trained: 1,
        accuracy: 0.125,
        ..Default::default()
    });
    let mut producer = client.produce("target-0").await.expect("produce");
    producer
        .send_stats(proto::ProducerStats {
            tokens_per_second: 999.0,
            busy_fraction: 0.25,
            device: "cpu".to_string(),
            samples_done: 2,
            samples_total: 2,
            tokens_done: 8,
            trace_export: None,
        })
        .await
        .expect("stats");
    for seq in 0..2 {
        producer
            .send(seq, sample(256, seq), HashMap::new())
            .await
            .expect("send");
    }
    // A sample whose tensor is shorter than its shape says: malformed.
    let mut malformed = sample(256, 9);
    malformed.tensors[0].shape = vec![1000];
    producer
        .send(2, malformed, HashMap::new())
        .await
        .expect("send malformed");
    let report = producer.finish().await.expect("finish");
    assert_eq!((report.accepted, report.rejected.len()), (2, 1));
    let delivery = next_delivery(&mut consumer).await;
    consumer.handle().ack(vec![delivery.delivery_id]);

    // Scrape until the ack and the drafter's stats have reached the broker;
    // the 60 s only stops a hang.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let samples = parse_metrics(&http_get(metrics_address, "/metrics").await);
        let settled = samples.get("dflash_broker_acked_items_total") == Some(&1.0)
            && samples.contains_key(
                "dflash_broker_drafter_loss{drafter_id=\"drafter-0\",device=\"cpu\"}",
            );
        if settled {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{samples:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let answer = http_get(metrics_address, "/metrics").await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(
        answer.contains("Content-Type: text/plain; version=0.0.4"),
        "{answer}"
    );
    let expected = [
        ("dflash_broker_queued_items", 0.0),
        ("dflash_broker_queued_bytes", 0.0),
        ("dflash_broker_leased_items", 1.0),
        ("dflash_broker_delivered_items_total", 2.0),
        ("dflash_broker_redelivered_items_total", 0.0),
        ("dflash_broker_acked_items_total", 1.0),
        ("dflash_broker_dead_letters_total", 0.0),
        ("dflash_broker_accepted_items_total", 2.0),
        (
            "dflash_broker_rejected_items_total{reason=\"malformed\"}",
            1.0,
        ),
        (
            "dflash_broker_rejected_items_total{reason=\"too_large\"}",
            0.0,
        ),
        ("dflash_broker_targets_done", 0.0),
        ("dflash_broker_targets_expected", 1.0),
        ("dflash_broker_state{state=\"running\"}", 1.0),
        (
            "dflash_broker_target_tokens_per_second{target_id=\"target-0\",device=\"cpu\"}",
            999.0,
        ),
        (
            "dflash_broker_target_busy_fraction{target_id=\"target-0\",device=\"cpu\"}",
            0.25,
        ),
        (
            "dflash_broker_drafter_tokens_per_second{drafter_id=\"drafter-0\",device=\"cpu\"}",
            1234.5,
        ),
        (
            "dflash_broker_drafter_busy_fraction{drafter_id=\"drafter-0\",device=\"cpu\"}",
            0.5,
        ),
        (
            "dflash_broker_drafter_loss{drafter_id=\"drafter-0\",device=\"cpu\"}",
            3.25,
        ),
    ];
    let samples = parse_metrics(&answer);
    for (series, value) in expected {
        assert_eq!(samples.get(series), Some(&value), "{series} in {answer}");
    }
    assert!(
        samples.contains_key("dflash_broker_leased_bytes"),
        "{answer}"
    );
    let not_found = http_get(metrics_address, "/").await;
    assert!(not_found.starts_with("HTTP/1.1 404 "), "{not_found}");
    drop(consumer);
    let stopped = broker.stop_checked().await;
    assert!(stopped.is_ok(), "{stopped:?}");
}

#[tokio::test]
async fn a_metrics_address_that_cannot_be_bound_fails_serve() {
    let taken = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mut config = BrokerConfig::for_targets(1);
    config.metrics_listen = Some(taken.local_addr().expect("address"));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind grpc");
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        dflash_broker::serve(listener, config, CancellationToken::new()),
    )
    .await
    .expect("serve returned");
    assert!(
        matches!(result, Err(ServeError::MetricsListen { .. })),
        "{result:?}"
    );
}
