//! The ModelSync service over real gRPC: an in-process broker on
//! 127.0.0.1:0 and raw sync sessions acting as drafters (the drafter-server
//! side is tested with the real trainer in dflash-drafter-server).

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use dflash_broker::BrokerConfig;
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;
use dflash_testkit::{wait_until, TestBroker};
use tokio::sync::mpsc;

const CONFIG_JSON: &str =
    r#"{"architectures": ["DFlashDraftModel"], "hidden_size": 2, "block_size": 4}"#;

/// Bytes per chunk the test drafters send: small, so every tensor is split.
const TEST_CHUNK_BYTES: usize = 8;

type Named = Vec<(&'static str, Vec<u64>, Vec<f32>)>;

fn initial() -> Named {
    vec![
        ("fc.weight", vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        ("norm.weight", vec![2], vec![1.0, 1.0]),
    ]
}

fn scaled(by: f32) -> Named {
    initial()
        .into_iter()
        .map(|(name, shape, values)| (name, shape, values.iter().map(|_| by).collect()))
        .collect()
}

struct TestDrafter {
    requests: mpsc::Sender<proto::SyncRequest>,
    responses: tonic::Streaming<proto::SyncResponse>,
    welcome: proto::SyncWelcome,
}

fn request(kind: proto::sync_request::Kind) -> proto::SyncRequest {
    proto::SyncRequest { kind: Some(kind) }
}

fn chunks_of(tensors: &Named) -> Vec<proto::SyncRequest> {
    let mut messages = Vec::new();
    for (name, shape, values) in tensors {
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect();
        for (index, piece) in bytes.chunks(TEST_CHUNK_BYTES).enumerate() {
            messages.push(request(proto::sync_request::Kind::Chunk(
                proto::TensorChunk {
                    name: name.to_string(),
                    dtype: proto::Dtype::F32 as i32,
                    shape: shape.clone(),
                    offset: (index * TEST_CHUNK_BYTES) as u64,
                    data: Bytes::copy_from_slice(piece),
                },
            )));
        }
    }
    messages
}

impl TestDrafter {
    async fn open(address: &str, drafter_id: &str) -> TestDrafter {
        let mut client = ModelSyncClient::connect(address.to_string())
            .await
            .expect("connect");
        let (requests, receiver) = mpsc::channel(64);
        requests
            .send(request(proto::sync_request::Kind::Hello(
                proto::SyncHello {
                    drafter_id: drafter_id.to_string(),
                    model_config_json: CONFIG_JSON.to_string(),
                },
            )))
            .await
            .unwrap();
        let mut responses = client
            .session(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await
            .expect("open session")
            .into_inner();
        let welcome = match responses.message().await.unwrap().unwrap().kind {
            Some(proto::sync_response::Kind::Welcome(welcome)) => welcome,
            other => panic!("expected a welcome, got {other:?}"),
        };
        TestDrafter {
            requests,
            responses,
            welcome,
        }
    }

    async fn begin(&self, kind: proto::SyncKind, base_version: u64) {
        self.requests
            .send(request(proto::sync_request::Kind::Begin(
                proto::SyncBegin {
                    kind: kind as i32,
                    base_version,
                    steps: 3,
                    samples: 12,
                    tokens: 120,
                    reply_dtype: proto::Dtype::F32 as i32,
                },
            )))
            .await
            .unwrap();
    }

    /// One whole exchange; the center (name → values) when it comes back.
    async fn exchange(
        &mut self,
        kind: proto::SyncKind,
        base_version: u64,
        tensors: &Named,
    ) -> (proto::SyncResult, Option<Vec<(String, Vec<f32>)>>) {
        self.begin(kind, base_version).await;
        for message in chunks_of(tensors) {
            self.requests.send(message).await.unwrap();
        }
        self.requests
            .send(request(proto::sync_request::Kind::Commit(
                proto::SyncCommit {
                    tensors: tensors.len() as u32,
                },
            )))
            .await
            .unwrap();
        let result = match self.responses.message().await.unwrap().unwrap().kind {
            Some(proto::sync_response::Kind::Result(result)) => result,
            other => panic!("expected a result, got {other:?}"),
        };
        if !result.weights_follow {
            return (result, None);
        }
        let mut center: Vec<(String, Vec<u8>)> = Vec::new();
        loop {
            match self.responses.message().await.unwrap().unwrap().kind {
                Some(proto::sync_response::Kind::Chunk(chunk)) => {
                    assert_eq!(chunk.dtype, proto::Dtype::F32 as i32);
                    match center.last_mut() {
                        Some((name, bytes)) if *name == chunk.name => {
                            assert_eq!(chunk.offset, bytes.len() as u64);
                            bytes.extend_from_slice(&chunk.data);
                        }
                        _ => {
                            assert_eq!(chunk.offset, 0);
                            center.push((chunk.name, chunk.data.to_vec()));
                        }
                    }
                }
                Some(proto::sync_response::Kind::Done(done)) => {
                    assert_eq!(done.tensors as usize, center.len());
                    assert_eq!(done.center_version, result.center_version);
                    break;
                }
                other => panic!("expected chunks, got {other:?}"),
            }
        }
        let decoded = center
            .into_iter()
            .map(|(name, bytes)| {
                let values = bytes
                    .chunks_exact(4)
                    .map(|raw| f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
                    .collect();
                (name, values)
            })
            .collect();
        (result, Some(decoded))
    }
}

/// Plain asynchronous local SGD (outer lr 1, no momentum): the center is
/// the sum of the deltas, exact on these values.
fn plain_config() -> BrokerConfig {
    let mut config = BrokerConfig::for_targets(1);
    config.model_sync.outer_momentum = 0.0;
    config
}

fn values(center: &[(String, Vec<f32>)], name: &str) -> Vec<f32> {
    center
        .iter()
        .find(|(tensor, _)| tensor == name)
        .map(|(_, values)| values.clone())
        .unwrap()
}

async fn model_sync_status(broker: &TestBroker) -> proto::ModelSyncStatus {
    broker
        .client()
        .await
        .status()
        .await
        .unwrap()
        .model_sync
        .expect("status carries the model sync")
}

#[tokio::test]
async fn drafters_share_one_center_and_stale_deltas_still_count() {
    let broker = TestBroker::start(plain_config()).await;
    let mut first = TestDrafter::open(&broker.address, "drafter-a").await;
    assert!(!first.welcome.has_center);
    assert!(first.welcome.method.contains("async local SGD"));
    let (result, center) = first.exchange(proto::SyncKind::Join, 0, &initial()).await;
    assert!(result.initialised);
    assert!(center.is_none());

    // A second drafter joins: it starts from the center, not its own weights.
    let mut second = TestDrafter::open(&broker.address, "drafter-b").await;
    assert!(second.welcome.has_center);
    let (result, center) = second.exchange(proto::SyncKind::Join, 0, &vec![]).await;
    assert!(!result.initialised);
    let center = center.expect("the center comes back");
    assert_eq!(values(&center, "fc.weight"), initial()[0].2);

    // Both trained from version 0; a syncs first, b's delta is one update
    // stale and still applied (outer lr 1: the center is the sum).
    let (result, _) = first
        .exchange(proto::SyncKind::Update, 0, &scaled(0.5))
        .await;
    assert_eq!((result.center_version, result.staleness), (1, 0));
    let (result, center) = second
        .exchange(proto::SyncKind::Update, 0, &scaled(0.25))
        .await;
    assert_eq!((result.center_version, result.staleness), (2, 1));
    assert!(result.applied);
    assert_eq!(
        values(&center.unwrap(), "fc.weight"),
        vec![1.75, 2.75, 3.75, 4.75, 5.75, 6.75]
    );

    let status = model_sync_status(&broker).await;
    assert!(status.has_center);
    assert_eq!(status.center_version, 2);
    assert_eq!(status.parameters, 8);
    assert_eq!(status.center_samples, 24);
    let a = status
        .drafters
        .iter()
        .find(|drafter| drafter.drafter_id == "drafter-a")
        .unwrap();
    assert!(a.connected);
    assert_eq!((a.base_version, a.staleness), (1, 1));
    let b = status
        .drafters
        .iter()
        .find(|drafter| drafter.drafter_id == "drafter-b")
        .unwrap();
    assert_eq!(
        (b.base_version, b.staleness, b.last_update_staleness),
        (2, 0, 1)
    );
    broker.stop().await;
}

#[tokio::test]
async fn a_drafter_killed_mid_upload_neither_corrupts_nor_blocks_the_center() {
    let broker = TestBroker::start(plain_config()).await;
    let mut survivor = TestDrafter::open(&broker.address, "survivor").await;
    survivor
        .exchange(proto::SyncKind::Join, 0, &initial())
        .await;

    // The victim joins, then dies halfway through uploading a huge delta.
    let address = broker.address.clone();
    let (half_sent, half_sent_receiver) = tokio::sync::oneshot::channel();
    let victim = tokio::spawn(async move {
        let mut drafter = TestDrafter::open(&address, "victim").await;
        drafter.exchange(proto::SyncKind::Join, 0, &vec![]).await;
        drafter.begin(proto::SyncKind::Update, 0).await;
        let chunks = chunks_of(&scaled(1000.0));
        for message in &chunks[..chunks.len() / 2] {
            drafter.requests.send(message.clone()).await.unwrap();
        }
        let _ = half_sent.send(());
        // Hold the connection open until killed.
        std::future::pending::<()>().await;
    });
    half_sent_receiver.await.unwrap();
    // While the victim is mid-upload, the survivor's exchange goes through.
    let (result, center) = tokio::time::timeout(
        Duration::from_secs(10),
        survivor.exchange(proto::SyncKind::Update, 0, &scaled(1.0)),
    )
    .await
    .expect("a half-finished upload blocks nobody");
    assert_eq!(result.center_version, 1);
    assert_eq!(values(&center.unwrap(), "norm.weight"), vec![2.0, 2.0]);

    // Kill it: the task and its connection go away without a word.
    victim.abort();
    let _ = victim.await;
    assert!(
        wait_until(Duration::from_secs(10), || async {
            let status = model_sync_status(&broker).await;
            status
                .drafters
                .iter()
                .any(|drafter| drafter.drafter_id == "victim" && !drafter.connected)
        })
        .await,
        "the victim's session is seen closed"
    );
    // The center is exactly the survivor's result: nothing of the victim.
    let status = model_sync_status(&broker).await;
    assert_eq!(status.center_version, 1);
    let mut late = TestDrafter::open(&broker.address, "late").await;
    let (_, center) = late.exchange(proto::SyncKind::Join, 0, &vec![]).await;
    let center = center.unwrap();
    assert_eq!(
        values(&center, "fc.weight"),
        vec![2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    );
    assert_eq!(values(&center, "norm.weight"), vec![2.0, 2.0]);
    broker.stop().await;
}

#[tokio::test]
async fn a_refused_exchange_names_the_problem_and_changes_nothing() {
    let broker = TestBroker::start(plain_config()).await;
    let mut drafter = TestDrafter::open(&broker.address, "d").await;
    drafter.exchange(proto::SyncKind::Join, 0, &initial()).await;
    let mut wrong = TestDrafter::open(&broker.address, "wrong").await;
    let other_shape: Named = vec![
        ("fc.weight", vec![3, 2], vec![0.0; 6]),
        ("norm.weight", vec![2], vec![0.0; 2]),
    ];
    wrong.begin(proto::SyncKind::Update, 0).await;
    for message in chunks_of(&other_shape) {
        wrong.requests.send(message).await.unwrap();
    }
    wrong
        .requests
        .send(request(proto::sync_request::Kind::Commit(
            proto::SyncCommit { tensors: 2 },
        )))
        .await
        .unwrap();
    let status = wrong.responses.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("\"fc.weight\" has shape [3, 2]"),
        "{}",
        status.message()
    );
    assert_eq!(model_sync_status(&broker).await.center_version, 0);
    broker.stop().await;
}

#[tokio::test]
async fn the_final_center_is_written_after_complete_and_resumed_after_a_restart() {
    let work = tempfile::tempdir().unwrap();
    let output = work.path().join("center");
    let mut config = plain_config();
    config.model_sync.model_output = Some(output.clone());
    config.model_sync.model_save_every = Duration::ZERO;
    config.model_sync.model_final_sync_timeout = Duration::from_secs(60);
    let broker = TestBroker::start(config.clone()).await;
    let mut drafter = TestDrafter::open(&broker.address, "drafter-0").await;
    drafter.exchange(proto::SyncKind::Join, 0, &initial()).await;
    // A drafter that dies without its final sync must not hold the final
    // center for the whole timeout.
    let killed = TestDrafter::open(&broker.address, "killed").await;
    drop(killed);

    // The run completes (one target with no items).
    let client = broker.client().await;
    let producer = client.produce("target-0").await.unwrap();
    producer.finish().await.unwrap();
    client.report_done("target-0", 0).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || async {
            client.status().await.unwrap().state == proto::BrokerState::Complete as i32
        })
        .await
    );
    // The final delta arrives after COMPLETE; the final center includes it.
    let (result, center) = drafter
        .exchange(proto::SyncKind::Final, 0, &scaled(0.5))
        .await;
    assert!(result.applied);
    assert!(center.is_none());
    assert!(
        wait_until(Duration::from_secs(10), || async {
            model_sync_status(&broker).await.final_saved
        })
        .await,
        "the final center is written once the connected drafter's final sync is in"
    );
    let status = model_sync_status(&broker).await;
    assert_eq!((status.saved_version, status.center_version), (1, 1));

    // The files are the reference format: config.json as the drafter sent
    // it, every weight in f32 in model.safetensors, nothing else in it.
    let config_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(output.join("config.json")).unwrap())
            .unwrap();
    let sent: serde_json::Value = serde_json::from_str(CONFIG_JSON).unwrap();
    assert_eq!(config_json, sent);
    let bytes = std::fs::read(output.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = file.names();
    names.sort();
    assert_eq!(names, vec!["fc.weight", "norm.weight"]);
    let fc = file.tensor("fc.weight").unwrap();
    assert_eq!(fc.dtype(), safetensors::Dtype::F32);
    assert_eq!(fc.shape(), &[2, 3]);
    let fc_values: Vec<f32> = fc
        .data()
        .chunks_exact(4)
        .map(|raw| f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
        .collect();
    assert_eq!(fc_values, vec![1.5, 2.5, 3.5, 4.5, 5.5, 6.5]);
    broker.stop().await;

    // A restarted broker on the same folder resumes that center.
    let restarted = TestBroker::start(config).await;
    let status = model_sync_status(&restarted).await;
    assert!(status.has_center);
    assert_eq!((status.center_version, status.center_samples), (1, 12));
    let mut rejoined = TestDrafter::open(&restarted.address, "drafter-0").await;
    assert!(rejoined.welcome.has_center);
    let (_, center) = rejoined.exchange(proto::SyncKind::Join, 0, &vec![]).await;
    assert_eq!(
        values(&center.unwrap(), "fc.weight"),
        vec![1.5, 2.5, 3.5, 4.5, 5.5, 6.5]
    );
    restarted.stop().await;
}
