//! The Produce route's decoding from the received frames, over a real
//! HTTP/2 connection with hand-made request bodies: items arrive whole
//! however the bytes are framed, and malformed input ends the stream with
//! a status naming the bad value while the broker carries on.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashMap;

use bytes::Bytes;
use dflash_broker::BrokerConfig;
use dflash_client::ConsumerEvent;
use dflash_proto::frames::{Direction, MessageReader, PieceBody};
use dflash_proto::v1 as proto;
use dflash_testkit::{credit, sample, TestBroker};
use futures::StreamExt;
use prost::Message;
use tonic::transport::Channel;
use tower::Service;

fn framed(message: &impl Message) -> Vec<u8> {
    let mut bytes = vec![0u8];
    bytes.extend_from_slice(&(message.encoded_len() as u32).to_be_bytes());
    bytes.extend_from_slice(&message.encode_to_vec());
    bytes
}

fn hello(target_id: &str) -> Vec<u8> {
    framed(&proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Hello(proto::ProducerHello {
            target_id: target_id.to_string(),
            run_id: String::new(),
        })),
    })
}

fn item(seq: u64, payload_bytes: usize) -> Vec<u8> {
    framed(&proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Item(proto::Item {
            seq,
            sample: Some(sample(payload_bytes, seq)),
            trace_context: HashMap::new(),
        })),
    })
}

/// What the broker answered on a Produce stream whose body is `chunks`
/// (each its own DATA frame), and `headers`: the messages, then the status.
async fn produce_raw(
    address: &str,
    chunks: Vec<Bytes>,
    headers: &[(&'static str, &'static str)],
) -> (Vec<proto::ProduceResponse>, tonic::Status) {
    let mut channel = Channel::from_shared(address.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let body = PieceBody::request(
        futures::stream::iter(chunks.into_iter().map(Ok::<_, tonic::Status>)),
        |chunk: Bytes| Ok(vec![chunk]),
    );
    let mut request = http::Request::builder()
        .method(http::Method::POST)
        .uri(format!("{address}/dflash.v1.Broker/Produce"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(tonic::body::Body::new(body)).unwrap();
    std::future::poll_fn(|context| {
        Service::<http::Request<tonic::body::Body>>::poll_ready(&mut channel, context)
    })
    .await
    .unwrap();
    let response = channel.call(request).await.unwrap();
    assert_eq!(response.status(), http::StatusCode::OK);
    if let Some(status) = tonic::Status::from_header_map(response.headers()) {
        return (Vec::new(), status);
    }
    let mut reader = MessageReader::new(response.into_body(), Direction::Response, 1 << 20);
    let mut answers = Vec::new();
    while let Some(message) = reader.next().await {
        answers.push(proto::ProduceResponse::decode(message.unwrap()).unwrap());
    }
    let status = tonic::Status::from_header_map(reader.trailers().expect("trailers"))
        .expect("a grpc-status");
    (answers, status)
}

fn accepted(answers: &[proto::ProduceResponse]) -> Vec<u64> {
    answers
        .iter()
        .filter_map(|answer| match &answer.kind {
            Some(proto::produce_response::Kind::Accepted(accepted)) => Some(accepted.seq),
            _ => None,
        })
        .collect()
}

/// Items cut into frames at odd places (prefix split, payload split in
/// three) arrive whole and are delivered byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_cut_anywhere_arrive_whole() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let mut stream = hello("target-0");
    stream.extend(item(0, 100_000));
    stream.extend(item(1, 300_000));
    let bytes = Bytes::from(stream);
    let hello_len = hello("target-0").len();
    let cuts = [
        2,
        hello_len + 3,
        hello_len + 40,
        hello_len + 50_000,
        hello_len + 99_000,
        bytes.len() - 200_000,
        bytes.len() - 1,
    ];
    let mut chunks = Vec::new();
    let mut start = 0;
    for cut in cuts {
        chunks.push(bytes.slice(start..cut));
        start = cut;
    }
    chunks.push(bytes.slice(start..));
    let (answers, status) = produce_raw(&broker.address, chunks, &[]).await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    assert_eq!(accepted(&answers), vec![0, 1]);

    let client = broker.client().await;
    let mut consumer = client.consume("d", credit(2)).await.unwrap();
    for seq in 0..2u64 {
        let ConsumerEvent::Delivery(delivery) = consumer.next().await.unwrap() else {
            panic!("a delivery")
        };
        let expected = sample([100_000, 300_000][seq as usize], seq);
        assert_eq!((delivery.seq, delivery.sample.unwrap()), (seq, expected));
        consumer.handle().ack(vec![delivery.delivery_id]);
    }
    broker.stop().await;
}

/// Each malformed stream ends with a status naming the bad value; the
/// broker goes on serving (a good item afterwards is accepted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_streams_get_statuses_naming_the_bad_value() {
    let mut config = BrokerConfig::for_targets(1);
    config.max_item_bytes = 64 << 10;
    let broker = TestBroker::start(config).await;
    let limit = dflash_proto::transport::message_limit_bytes(64 << 10);

    let mut compressed = item(0, 100);
    compressed[0] = 1;
    let mut bad_flag = item(0, 100);
    bad_flag[0] = 3;
    let huge_prefix = vec![0u8, 0xff, 0xff, 0xff, 0xff];
    let truncated = item(0, 1000)[..600].to_vec();
    // An item field sent as a varint: not a ProduceRequest.
    let not_protobuf = vec![0u8, 0, 0, 0, 2, 0x10, 0x05];
    let cases: Vec<(Vec<u8>, tonic::Code, String)> = vec![
        (
            compressed,
            tonic::Code::Internal,
            "gRPC message 2 has its compressed flag set (1)".into(),
        ),
        (
            bad_flag,
            tonic::Code::Internal,
            "gRPC message 2 has compressed flag 3".into(),
        ),
        (
            huge_prefix,
            tonic::Code::ResourceExhausted,
            format!("declares 4294967295 bytes, the limit is {limit} bytes"),
        ),
        (
            truncated,
            tonic::Code::Internal,
            format!("ended inside gRPC message 2: 595 of its {} bytes", item(0, 1000).len() - 5),
        ),
        (
            not_protobuf,
            tonic::Code::InvalidArgument,
            "Produce message 2 is not a valid ProduceRequest: ProduceRequest.item has wire type Varint".into(),
        ),
    ];
    for (bad, code, expected) in cases {
        let mut stream = hello("target-0");
        stream.extend(bad);
        let (answers, status) = produce_raw(&broker.address, vec![Bytes::from(stream)], &[]).await;
        assert!(accepted(&answers).is_empty());
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(&expected), "{status:?}");
    }

    // Malformed before the hello: refused as the stream's answer.
    let (_, status) = produce_raw(
        &broker.address,
        vec![Bytes::from_static(&[5, 0, 0, 0, 0])],
        &[],
    )
    .await;
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    assert!(status.message().contains("compressed flag 5"), "{status:?}");

    // A compressed stream: UNIMPLEMENTED, naming the encoding.
    let (_, status) = produce_raw(
        &broker.address,
        vec![Bytes::from(hello("target-0"))],
        &[("grpc-encoding", "gzip")],
    )
    .await;
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
    assert!(status.message().contains("\"gzip\""), "{status:?}");

    // Still serving: a good item is accepted.
    let mut stream = hello("target-0");
    stream.extend(item(0, 100));
    let (answers, status) = produce_raw(&broker.address, vec![Bytes::from(stream)], &[]).await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    assert_eq!(accepted(&answers), vec![0]);
    broker.stop().await;
}
