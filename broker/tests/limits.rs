//! What one client may take from the broker (#25): connections, streams per
//! connection, and the ids one Consume message may name. Each limit is a
//! real broker's, reached with real clients.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use dflash_broker::BrokerConfig;
use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_proto::v1 as proto;
use dflash_proto::v1::broker_client::BrokerClient as RawClient;
use dflash_testkit::{credit, sample, wait_until, TestBroker};
use tokio::io::AsyncReadExt;
use tonic::Code;

async fn produce(client: &BrokerClient, items: u64) {
    let mut producer = client.produce("target-0").await.unwrap();
    for seq in 0..items {
        producer
            .send(seq, sample(1024, seq), HashMap::new())
            .await
            .unwrap();
    }
    assert_eq!(producer.finish().await.unwrap().accepted, items);
}

/// An Ack naming more than 65,536 ids (each a one-byte varint, so the
/// message is well under the 1 MiB control limit) ends that Consume stream
/// with INVALID_ARGUMENT naming both counts; its lease goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_of_too_many_ids_ends_its_stream_and_the_lease_goes_back() {
    let broker = TestBroker::for_targets(1).await;
    let client = broker.client().await;
    produce(&client, 1).await;
    let mut consumer = client.consume("drafter-0", credit(1)).await.unwrap();
    let handle = consumer.handle();
    let Ok(ConsumerEvent::Delivery(_)) = consumer.next().await else {
        panic!("a delivery")
    };
    let limit = dflash_proto::transport::MAX_IDS_PER_MESSAGE;
    handle.ack(vec![1; limit + 1]);
    let ended = tokio::time::timeout(Duration::from_secs(20), consumer.next())
        .await
        .expect("the stream ends");
    match ended {
        Err(error) => {
            let status = error.status().expect("a status");
            assert_eq!(status.code(), Code::InvalidArgument, "{error}");
            assert!(
                status.message().contains(&format!("{}", limit + 1))
                    && status.message().contains(&format!("{limit}")),
                "{error}"
            );
        }
        Ok(event) => panic!("expected the stream to end, got {event:?}"),
    }
    assert!(
        wait_until(Duration::from_secs(20), || async {
            let snapshot = client.status().await.unwrap();
            snapshot.leased_items == 0 && snapshot.queued_items == 1
        })
        .await,
        "{:?}",
        client.status().await
    );
    broker.stop().await;
}

/// With `--max-connections 2` and two clients connected, a third
/// connection is closed as soon as it is accepted; once a client leaves,
/// a new one gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_the_cap_is_closed_and_a_freed_slot_is_reused() {
    let mut config = BrokerConfig::for_targets(1);
    config.max_connections = 2;
    let broker = TestBroker::start(config).await;
    let first = broker.client().await;
    let second = broker.client().await;
    first.status().await.unwrap();
    second.status().await.unwrap();
    let address = broker.address.trim_start_matches("http://").to_string();
    let mut third = tokio::net::TcpStream::connect(&address).await.unwrap();
    let mut buffer = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(20), third.read(&mut buffer))
        .await
        .expect("the broker closes the third connection");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "the third connection was served: {read:?}"
    );
    // The two served clients are unaffected.
    first.status().await.unwrap();
    second.status().await.unwrap();
    drop(second);
    assert!(
        wait_until(Duration::from_secs(20), || async {
            match BrokerClient::connect(broker.address.clone(), ClientOptions::default()).await {
                Ok(client) => client.status().await.is_ok(),
                Err(_) => false,
            }
        })
        .await,
        "no slot freed after a client left"
    );
    broker.stop().await;
}

/// With `--max-concurrent-streams 2`, a third stream on one connection
/// waits until one of the two ends (the client queues it: the broker never
/// serves more than two of this connection's streams at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_has_at_most_its_concurrent_streams() {
    let mut config = BrokerConfig::for_targets(1);
    config.max_concurrent_streams = 2;
    let broker = TestBroker::start(config).await;
    // One HTTP/2 connection (the client library opens one per stream).
    let channel = tonic::transport::Endpoint::from_shared(broker.address.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = RawClient::new(channel);
    let watch = |client: &RawClient<tonic::transport::Channel>| {
        let mut client = client.clone();
        async move {
            let mut stream = client
                .watch_status(proto::WatchStatusRequest { interval_ms: 100 })
                .await?
                .into_inner();
            // Served: its first snapshot arrived.
            stream.message().await?;
            Ok::<_, tonic::Status>(stream)
        }
    };
    let first = watch(&client).await.unwrap();
    let second = watch(&client).await.unwrap();
    let mut third = tokio::spawn(watch(&client));
    // Not served while two are open. (A negative can only be watched for
    // a while: half a second; were the limit broken, the third stream's
    // first snapshot would come in milliseconds.)
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut third)
            .await
            .is_err(),
        "a third stream was served beside two"
    );
    drop(first);
    let third = tokio::time::timeout(Duration::from_secs(20), third)
        .await
        .expect("the third stream is served once the first ended")
        .unwrap()
        .unwrap();
    drop((second, third));
    broker.stop().await;
}

/// Awaits `call`, a stream whose requests never come: it must end with
/// DEADLINE_EXCEEDED naming `--hello-timeout`, no sooner than `timeout`
/// and within 20 s.
async fn ends_for_want_of_a_hello<T: std::fmt::Debug>(
    name: &str,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<T, tonic::Status>>,
) {
    let started = std::time::Instant::now();
    let status = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .unwrap_or_else(|_| panic!("{name} did not end within 20 s"))
        .expect_err("an error");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{name}: {status:?}");
    assert!(
        status.message().contains("--hello-timeout"),
        "{name}: {status:?}"
    );
    assert!(
        started.elapsed() >= timeout,
        "{name} ended before its hello timeout: {:?}",
        started.elapsed()
    );
}

/// A Produce, Consume or ModelSync stream that sends nothing ends with
/// DEADLINE_EXCEEDED naming `--hello-timeout` once that time has passed
/// (here 300 ms; with the 30 s default the 20 s bound fails), so
/// silent streams hold none of the broker's stream slots for long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_sends_no_hello_ends_after_the_hello_timeout() {
    let timeout = Duration::from_millis(300);
    let mut config = BrokerConfig::for_targets(1);
    config.hello_timeout = timeout;
    let broker = TestBroker::start(config).await;
    let channel = tonic::transport::Endpoint::from_shared(broker.address.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raw = RawClient::new(channel.clone());
    let mut sync = dflash_proto::v1::model_sync_client::ModelSyncClient::new(channel);
    ends_for_want_of_a_hello(
        "Produce",
        timeout,
        raw.produce(futures::stream::pending::<proto::ProduceRequest>()),
    )
    .await;
    ends_for_want_of_a_hello(
        "Consume",
        timeout,
        raw.consume(futures::stream::pending::<proto::ConsumeRequest>()),
    )
    .await;
    ends_for_want_of_a_hello(
        "ModelSync.Session",
        timeout,
        sync.session(futures::stream::pending::<proto::SyncRequest>()),
    )
    .await;

    // The broker still serves: the slots are free.
    let client = broker.client().await;
    produce(&client, 1).await;
    broker.stop().await;
}
