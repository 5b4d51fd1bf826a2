//! The ModelSync service over real gRPC: an in-process broker on
//! 127.0.0.1:0 and raw sync sessions acting as data-parallel drafters that
//! send snapshots (the drafter-server side is tested with the real trainer
//! in dflash-drafter-server), and evaluators.

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

/// Bytes per chunk the test drafters send: small, so every file, its
/// header and its values are split.
const TEST_CHUNK_BYTES: usize = 7;

/// Samples a snapshot of `steps` steps says it trained on.
const SAMPLES_PER_STEP: u64 = 12;

type Named = Vec<(&'static str, Vec<u64>, Vec<f32>)>;

fn initial() -> Named {
    vec![
        ("fc.weight", vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        ("norm.weight", vec![2], vec![1.0, 1.0]),
    ]
}

/// The initial weights, each moved by `by`: what a drafter holds after
/// training.
fn shifted(by: f32) -> Named {
    initial()
        .into_iter()
        .map(|(name, shape, values)| (name, shape, values.iter().map(|value| value + by).collect()))
        .collect()
}

/// `tensors` as (name, values), as a read returns them.
fn as_read(tensors: &Named) -> Vec<(String, Vec<f32>)> {
    tensors
        .iter()
        .map(|(name, _, values)| (name.to_string(), values.clone()))
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

/// `model.safetensors` of `tensors`, as a drafter's checkpoint writer
/// lays it out.
fn weights_file(tensors: &Named) -> Vec<u8> {
    let tensors: Vec<(String, Vec<u64>, Vec<f32>)> = tensors
        .iter()
        .map(|(name, shape, values)| (name.to_string(), shape.clone(), values.clone()))
        .collect();
    dflash_broker::fuzzing::model_files::weights_file(&tensors)
}

/// The file chunks of a snapshot of `tensors`: `config.json`, then the
/// weights, in chunks of [`TEST_CHUNK_BYTES`].
fn chunks_of(tensors: &Named) -> Vec<proto::SyncRequest> {
    file_chunks_of(CONFIG_JSON, weights_file(tensors))
}

fn file_chunks_of(config_json: &str, weights: Vec<u8>) -> Vec<proto::SyncRequest> {
    let mut messages = Vec::new();
    for (name, bytes) in [
        ("config.json", Bytes::from(config_json.as_bytes().to_vec())),
        ("model.safetensors", Bytes::from(weights)),
    ] {
        for chunk in
            dflash_broker::fuzzing::model_files::file_chunks(name, &bytes, TEST_CHUNK_BYTES)
        {
            messages.push(request(proto::sync_request::Kind::FileChunk(chunk)));
        }
    }
    messages
}

fn begin(kind: proto::SyncKind, steps: u64) -> proto::SyncBegin {
    proto::SyncBegin {
        kind: kind as i32,
        steps,
        samples: SAMPLES_PER_STEP * steps,
        tokens: 10 * SAMPLES_PER_STEP * steps,
    }
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

    /// Opens a snapshot (its chunks and commit to follow).
    async fn begin(&self, kind: proto::SyncKind, steps: u64) {
        self.requests
            .send(request(proto::sync_request::Kind::Begin(begin(
                kind, steps,
            ))))
            .await
            .unwrap();
    }

    /// Sends one whole snapshot: `begin`, the file chunks, the commit.
    async fn send_snapshot(&self, begin: proto::SyncBegin, tensors: &Named) {
        self.send_messages(begin, chunks_of(tensors)).await;
    }

    /// Sends `begin`, `chunks`, and a commit of two files.
    async fn send_messages(&self, begin: proto::SyncBegin, chunks: Vec<proto::SyncRequest>) {
        self.requests
            .send(request(proto::sync_request::Kind::Begin(begin)))
            .await
            .unwrap();
        for message in chunks {
            self.requests.send(message).await.unwrap();
        }
        self.requests
            .send(request(proto::sync_request::Kind::Commit(
                proto::SyncCommit { files: 2 },
            )))
            .await
            .unwrap();
    }

    /// One whole snapshot of `steps` committed steps, and its result.
    async fn snapshot(
        &mut self,
        kind: proto::SyncKind,
        steps: u64,
        tensors: &Named,
    ) -> proto::SyncResult {
        self.send_snapshot(begin(kind, steps), tensors).await;
        match self.responses.message().await.unwrap().unwrap().kind {
            Some(proto::sync_response::Kind::Result(result)) => result,
            other => panic!("expected a result, got {other:?}"),
        }
    }
}

fn values(model: &[(String, Vec<f32>)], name: &str) -> Vec<f32> {
    model
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

/// The run's model as a starting drafter reads it (`ReadModel` with its
/// `drafter_id`: nothing kept).
async fn read_as_drafter(
    address: &str,
    drafter_id: &str,
) -> Result<(proto::ModelHeader, Vec<(String, Vec<f32>)>), tonic::Status> {
    read_model_with(
        address,
        proto::ReadModelRequest {
            drafter_id: drafter_id.to_string(),
            ..Default::default()
        },
    )
    .await
}

#[tokio::test]
async fn the_latest_steps_snapshot_is_the_runs_model_and_a_starting_drafter_reads_it() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let refused = read_as_drafter(&broker.address, "drafter-a")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let mut first = TestDrafter::open(&broker.address, "drafter-a").await;
    assert!(!first.welcome.has_model);
    let result = first
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;
    assert!(result.initialised && result.applied);

    // A second drafter starts from the run's model, not its own weights.
    let mut second = TestDrafter::open(&broker.address, "drafter-b").await;
    assert!(second.welcome.has_model);
    let (header, model) = read_as_drafter(&broker.address, "drafter-b").await.unwrap();
    assert_eq!((header.model_version, header.model_samples), (0, 0));
    assert_eq!(header.model_config_json, CONFIG_JSON);
    assert_eq!(model, as_read(&initial()));

    // Rank 0's snapshot of step 2 replaces it; a member behind (step 1)
    // changes nothing.
    let result = first
        .snapshot(proto::SyncKind::Snapshot, 2, &shifted(0.75))
        .await;
    assert!(result.applied);
    assert_eq!((result.model_version, result.model_samples), (2, 24));
    let result = second
        .snapshot(proto::SyncKind::Snapshot, 1, &shifted(0.25))
        .await;
    assert!(!result.applied);
    assert!(result.reason.contains("step 2"), "{}", result.reason);
    let (_, model) = read_as_drafter(&broker.address, "drafter-c").await.unwrap();
    assert_eq!(
        values(&model, "fc.weight"),
        vec![1.75, 2.75, 3.75, 4.75, 5.75, 6.75]
    );

    let status = model_sync_status(&broker).await;
    assert!(status.has_model);
    assert_eq!(status.model_version, 2);
    assert_eq!(status.parameters, 8);
    assert_eq!(status.model_samples, 24);
    assert!(
        status.evaluations_pending.is_empty(),
        "a drafter's read keeps nothing"
    );
    let ids: Vec<&str> = status
        .drafters
        .iter()
        .map(|drafter| drafter.drafter_id.as_str())
        .collect();
    assert_eq!(ids, vec!["drafter-a", "drafter-b"]);
    assert!(status.drafters.iter().all(|drafter| drafter.connected));
    broker.stop().await;
}

#[tokio::test]
async fn a_drafter_killed_mid_upload_neither_corrupts_nor_blocks_the_model() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let mut survivor = TestDrafter::open(&broker.address, "survivor").await;
    survivor
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;

    // The victim dies halfway through uploading a snapshot of a later step.
    let address = broker.address.clone();
    let (half_sent, half_sent_receiver) = tokio::sync::oneshot::channel();
    let victim = tokio::spawn(async move {
        let drafter = TestDrafter::open(&address, "victim").await;
        drafter.begin(proto::SyncKind::Snapshot, 9).await;
        let chunks = chunks_of(&shifted(1000.0));
        for message in &chunks[..chunks.len() / 2] {
            drafter.requests.send(message.clone()).await.unwrap();
        }
        let _ = half_sent.send(());
        // Hold the connection open until killed.
        std::future::pending::<()>().await;
    });
    half_sent_receiver.await.unwrap();
    // While the victim is mid-upload, the survivor's snapshot goes through.
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        survivor.snapshot(proto::SyncKind::Snapshot, 1, &shifted(1.0)),
    )
    .await
    .expect("a half-finished upload blocks nobody");
    assert_eq!(result.model_version, 1);

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
    // The run's model is exactly the survivor's snapshot: nothing of the victim.
    let status = model_sync_status(&broker).await;
    assert_eq!(status.model_version, 1);
    let (_, model) = read_as_drafter(&broker.address, "late").await.unwrap();
    assert_eq!(model, as_read(&shifted(1.0)));
    broker.stop().await;
}

#[tokio::test]
async fn a_refused_snapshot_names_the_problem_and_changes_nothing() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let mut drafter = TestDrafter::open(&broker.address, "d").await;
    drafter
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;
    let wrong = TestDrafter::open(&broker.address, "wrong").await;
    let other_shape: Named = vec![
        ("fc.weight", vec![3, 2], vec![0.0; 6]),
        ("norm.weight", vec![2], vec![0.0; 2]),
    ];
    let mut wrong = wrong;
    wrong
        .send_snapshot(begin(proto::SyncKind::Snapshot, 1), &other_shape)
        .await;
    let status = wrong.responses.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("\"fc.weight\" has shape [3, 2]"),
        "{}",
        status.message()
    );
    assert_eq!(model_sync_status(&broker).await.model_version, 0);

    // A file of another name, a header whose offsets pass the file's end,
    // a value that is not finite, and an old drafter's tensor chunk (its
    // field reserved: it arrives as a message of no kind) are each refused,
    // INVALID_ARGUMENT naming the value, and change nothing.
    let mut header_past_end = weights_file(&shifted(1.0));
    header_past_end.truncate(header_past_end.len() - 4);
    let mut nan = shifted(1.0);
    nan[1].2[1] = f32::NAN;
    let renamed = file_chunks_of(CONFIG_JSON, weights_file(&shifted(1.0)))
        .into_iter()
        .map(|mut message| {
            if let Some(proto::sync_request::Kind::FileChunk(chunk)) = &mut message.kind {
                if chunk.file == "model.safetensors" {
                    chunk.file = "optimizer.safetensors".to_string();
                }
            }
            message
        })
        .collect();
    let old_chunk = vec![proto::SyncRequest { kind: None }];
    for (chunks, expected) in [
        (
            renamed,
            "file \"optimizer.safetensors\" is not one of a snapshot's files",
        ),
        (
            file_chunks_of(CONFIG_JSON, header_past_end),
            "file \"model.safetensors\": header places the tensors' data in bytes",
        ),
        (
            file_chunks_of(CONFIG_JSON, weights_file(&nan)),
            "tensor \"norm.weight\": weights are not finite (NaN at element 1)",
        ),
        (
            old_chunk,
            "a tensor `chunk` (TensorChunk, SyncRequest field 3) is retired",
        ),
    ] {
        let mut sender = TestDrafter::open(&broker.address, "bad").await;
        sender
            .send_messages(begin(proto::SyncKind::Snapshot, 5), chunks)
            .await;
        let status = sender.responses.message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{expected}");
        assert!(
            status.message().contains(expected),
            "{expected}: {}",
            status.message()
        );
    }
    let (_, files) = read_files_with(
        &broker.address,
        proto::ReadModelRequest {
            drafter_id: "reader".to_string(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(model_sync_status(&broker).await.model_version, 0);
    assert_eq!(
        files,
        vec![
            ("config.json".to_string(), CONFIG_JSON.as_bytes().to_vec()),
            ("model.safetensors".to_string(), weights_file(&initial())),
        ]
    );
    broker.stop().await;
}

/// Asynchronous local SGD was retired: a drafter of it (JOIN, UPDATE,
/// FINAL, numbers reserved) is refused on the wire, naming what it sent,
/// and the run goes on as before. (The broker's AdamW, `gradient_step`, is
/// a reserved field now, ignored as unknown: `run_model::tests`.)
#[tokio::test]
async fn a_drafter_of_a_retired_method_is_refused_by_name_and_changes_nothing() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let mut drafter = TestDrafter::open(&broker.address, "d").await;
    drafter
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;
    let retired = |kind: i32| proto::SyncBegin {
        kind,
        ..begin(proto::SyncKind::Snapshot, 1)
    };
    for (refused_begin, name) in [
        (retired(1), "SYNC_KIND_JOIN"),
        (retired(2), "SYNC_KIND_UPDATE"),
        (retired(3), "SYNC_KIND_FINAL"),
    ] {
        let mut old = TestDrafter::open(&broker.address, "old").await;
        // The begin alone: the broker ends the session at it.
        old.requests
            .send(request(proto::sync_request::Kind::Begin(refused_begin)))
            .await
            .unwrap();
        let status = old.responses.message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().starts_with(name),
            "{name}: {}",
            status.message()
        );
    }
    assert_eq!(model_sync_status(&broker).await.model_version, 0);
    let result = drafter
        .snapshot(proto::SyncKind::Snapshot, 1, &shifted(1.0))
        .await;
    assert!(result.applied);
    broker.stop().await;
}

#[tokio::test]
async fn the_final_model_is_written_after_complete_and_resumed_after_a_restart() {
    let work = tempfile::tempdir().unwrap();
    let output = work.path().join("model");
    let mut config = BrokerConfig::for_targets(1);
    config.model_sync.model_output = Some(output.clone());
    config.model_sync.model_save_every = Duration::ZERO;
    config.model_sync.model_final_sync_timeout = Duration::from_secs(60);
    let broker = TestBroker::start(config.clone()).await;
    let mut drafter = TestDrafter::open(&broker.address, "drafter-0").await;
    drafter
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;
    // A drafter that dies without its final snapshot must not hold the
    // final model for the whole timeout.
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
    // The final snapshot arrives after COMPLETE; the final model is it.
    let result = drafter
        .snapshot(proto::SyncKind::FinalSnapshot, 1, &shifted(0.5))
        .await;
    assert!(result.applied);
    assert!(
        wait_until(Duration::from_secs(10), || async {
            model_sync_status(&broker).await.final_saved
        })
        .await,
        "the final model is written once the connected drafter's final snapshot is in"
    );
    let status = model_sync_status(&broker).await;
    assert_eq!((status.saved_version, status.model_version), (1, 1));

    // The files are the ones the drafter sent, byte for byte (the broker
    // writes them without decoding), in the reference format: config.json
    // as the drafter sent it, every weight in f32 in model.safetensors.
    assert_eq!(
        std::fs::read(output.join("config.json")).unwrap(),
        CONFIG_JSON.as_bytes()
    );
    assert!(
        std::fs::read(output.join("model.safetensors")).unwrap() == weights_file(&shifted(0.5))
    );
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

    // A restarted broker on the same folder resumes that model.
    let restarted = TestBroker::start(config).await;
    let status = model_sync_status(&restarted).await;
    assert!(status.has_model);
    assert_eq!((status.model_version, status.model_samples), (1, 12));
    let rejoined = TestDrafter::open(&restarted.address, "drafter-0").await;
    assert!(rejoined.welcome.has_model);
    let (_, model) = read_as_drafter(&restarted.address, "drafter-0")
        .await
        .unwrap();
    assert_eq!(
        values(&model, "fc.weight"),
        vec![1.5, 2.5, 3.5, 4.5, 5.5, 6.5]
    );
    // It serves the very bytes it was sent before the restart.
    let (_, files) = read_files_with(
        &restarted.address,
        proto::ReadModelRequest {
            drafter_id: "drafter-0".to_string(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        files,
        vec![
            ("config.json".to_string(), CONFIG_JSON.as_bytes().to_vec()),
            ("model.safetensors".to_string(), weights_file(&shifted(0.5))),
        ]
    );
    restarted.stop().await;
}

// ---------------------------------------------------------------- Online evaluation

/// One `ReadModel` of the current model: the header and the run's model
/// (name → values).
async fn read_model(
    address: &str,
    evaluator_id: &str,
) -> Result<(proto::ModelHeader, Vec<(String, Vec<f32>)>), tonic::Status> {
    read_model_with(
        address,
        proto::ReadModelRequest {
            evaluator_id: evaluator_id.to_string(),
            ..Default::default()
        },
    )
    .await
}

/// One `ReadModel` as `request` asks it: the header and the weights
/// (name → values, by name).
async fn read_model_with(
    address: &str,
    request: proto::ReadModelRequest,
) -> Result<(proto::ModelHeader, Vec<(String, Vec<f32>)>), tonic::Status> {
    let (header, files) = read_files_with(address, request).await?;
    let Some((_, weights)) = files.iter().find(|(name, _)| name == "model.safetensors") else {
        return Ok((header, Vec::new()));
    };
    let file = safetensors::SafeTensors::deserialize(weights).unwrap();
    let mut decoded: Vec<(String, Vec<f32>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
            (name, f32_values(view.data()))
        })
        .collect();
    decoded.sort_by(|left, right| left.0.cmp(&right.0));
    Ok((header, decoded))
}

/// One `ReadModel` as `request` asks it: the header and the files (name →
/// bytes) as they arrived, each checked whole and in order.
async fn read_files_with(
    address: &str,
    request: proto::ReadModelRequest,
) -> Result<(proto::ModelHeader, Vec<(String, Vec<u8>)>), tonic::Status> {
    use proto::read_model_response::Kind;
    let mut client = ModelSyncClient::connect(address.to_string())
        .await
        .expect("connect");
    let mut stream = client.read_model(request).await?.into_inner();
    let header = match stream.message().await?.and_then(|message| message.kind) {
        Some(Kind::Header(header)) => header,
        other => panic!("expected the header, got {other:?}"),
    };
    let mut files = dflash_proto::chunks::FileAssembler::default();
    loop {
        match stream.message().await?.and_then(|message| message.kind) {
            Some(Kind::FileChunk(chunk)) => files.push(chunk).unwrap(),
            Some(Kind::Done(done)) => {
                assert_eq!(done.model_version, header.model_version);
                return Ok((header, files.finish(done.files).unwrap()));
            }
            other => panic!("expected file chunks, got {other:?}"),
        }
    }
}

fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|raw| f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
        .collect()
}

fn tau_point(version: u64, samples: u64, tau: f64) -> proto::TauPoint {
    proto::TauPoint {
        model_version: version,
        model_samples: samples,
        tau,
        prompts: 8,
        generated_tokens: 320,
        verification_steps: 100,
        eval_seconds: 1.5,
        unix_time_ms: 1_800_000_000_000,
        evaluator_id: "evaluator".to_string(),
        read_unix_time_ms: 0,
    }
}

async fn report_tau(
    address: &str,
    evaluator_id: &str,
    point: Option<proto::TauPoint>,
) -> Result<proto::TauReportResult, tonic::Status> {
    let mut client = ModelSyncClient::connect(address.to_string())
        .await
        .expect("connect");
    client
        .report_tau(proto::TauReport {
            evaluator_id: evaluator_id.to_string(),
            point,
        })
        .await
        .map(tonic::Response::into_inner)
}

/// The status of the run's training alone: without the evaluation's
/// fields, and with each drafter's time since its last sync (a clock) left
/// out.
fn training_status(mut status: proto::ModelSyncStatus) -> proto::ModelSyncStatus {
    status.tau_history.clear();
    status.best_tau = None;
    status.best_path.clear();
    status.best_saved_version = 0;
    status.evaluations_pending.clear();
    for drafter in &mut status.drafters {
        drafter.last_sync_ms_ago = 0;
    }
    status
}

/// Two drafters' snapshots of six steps, with or without an evaluator
/// reading the run's model between every two of them; the final model's
/// values and the status.
async fn train_with_optional_reads(
    evaluator_reads: bool,
) -> (Vec<(String, Vec<f32>)>, proto::ModelSyncStatus) {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let mut first = TestDrafter::open(&broker.address, "drafter-a").await;
    first
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;
    let mut second = TestDrafter::open(&broker.address, "drafter-b").await;
    for step in 0..6u64 {
        if evaluator_reads {
            let (header, read) = read_model(&broker.address, "evaluator").await.unwrap();
            assert_eq!(
                header.model_version, step,
                "a read sees the run's model as it is"
            );
            assert_eq!(header.model_config_json, CONFIG_JSON);
            assert_eq!(
                read,
                as_read(&shifted(0.125 * step as f32)),
                "a read returns the model's exact values"
            );
        }
        let drafter = if step % 2 == 0 {
            &mut first
        } else {
            &mut second
        };
        let result = drafter
            .snapshot(
                proto::SyncKind::Snapshot,
                step + 1,
                &shifted(0.125 * (step + 1) as f32),
            )
            .await;
        assert!(result.applied);
    }
    let (_, model) = read_as_drafter(&broker.address, "drafter-c").await.unwrap();
    let status = model_sync_status(&broker).await;
    broker.stop().await;
    (model, status)
}

#[tokio::test]
async fn an_evaluator_reading_the_model_changes_nothing_of_the_run() {
    let (alone, alone_status) = train_with_optional_reads(false).await;
    let (read, read_status) = train_with_optional_reads(true).await;
    let bits = |model: &[(String, Vec<f32>)]| -> Vec<(String, Vec<u32>)> {
        model
            .iter()
            .map(|(name, values)| {
                (
                    name.clone(),
                    values.iter().map(|value| value.to_bits()).collect(),
                )
            })
            .collect()
    };
    assert_eq!(bits(&read), bits(&alone), "the same model, bit for bit");
    // Six versions read, none reported: the last ones the broker keeps.
    assert_eq!(
        read_status.evaluations_pending.len(),
        dflash_broker::run_model::evaluation::DEFAULT_MAX_PENDING_READS as usize,
        "the last versions read are kept for their reports"
    );
    assert_eq!(
        read_status.max_pending_evaluations,
        dflash_broker::run_model::evaluation::DEFAULT_MAX_PENDING_READS
    );
    assert_eq!(training_status(read_status), training_status(alone_status));
}

#[tokio::test]
async fn the_final_model_does_not_wait_for_an_evaluator() {
    let work = tempfile::tempdir().unwrap();
    let mut config = BrokerConfig::for_targets(1);
    config.model_sync.model_output = Some(work.path().join("model"));
    config.model_sync.model_save_every = Duration::ZERO;
    // Were the evaluator waited for, the final model would take an hour.
    config.model_sync.model_final_sync_timeout = Duration::from_secs(3600);
    let broker = TestBroker::start(config).await;
    let mut drafter = TestDrafter::open(&broker.address, "drafter-0").await;
    drafter
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;
    // A read whose stream the evaluator keeps open and never drains.
    let mut client = ModelSyncClient::connect(broker.address.clone())
        .await
        .unwrap();
    let _held = client
        .read_model(proto::ReadModelRequest {
            evaluator_id: "evaluator".to_string(),
            ..Default::default()
        })
        .await
        .unwrap();
    let status = model_sync_status(&broker).await;
    assert_eq!(status.evaluations_pending, vec![0]);
    assert_eq!(
        status.drafters.len(),
        1,
        "an evaluator is no drafter: {:?}",
        status.drafters
    );

    let queue = broker.client().await;
    queue
        .produce("target-0")
        .await
        .unwrap()
        .finish()
        .await
        .unwrap();
    queue.report_done("target-0", 0).await.unwrap();
    drafter
        .snapshot(proto::SyncKind::FinalSnapshot, 1, &shifted(0.5))
        .await;
    assert!(
        wait_until(Duration::from_secs(20), || async {
            model_sync_status(&broker).await.final_saved
        })
        .await,
        "the final model is written once the drafter's final snapshot is in"
    );
    broker.stop().await;
}

/// The tensors of a model checkpoint's `model.safetensors`.
fn checkpoint_values(dir: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = file.names();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            (
                name.to_string(),
                f32_values(file.tensor(name).unwrap().data()),
            )
        })
        .collect()
}

fn checkpoint_version(dir: &std::path::Path) -> u64 {
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("center_state.json")).unwrap())
            .unwrap();
    state["version"].as_u64().unwrap()
}

/// An evaluator that measures later than it reads: a header-only read
/// keeps the version (no weights sent), a read of that version later sends
/// exactly its weights though the run's model moved on, and takes nothing new;
/// a version not kept is refused, naming the versions kept.
#[tokio::test]
async fn a_version_kept_by_a_header_only_read_is_read_later_as_it_was() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let mut drafter = TestDrafter::open(&broker.address, "drafter-0").await;
    drafter
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;
    let (_, version_0) = read_model(&broker.address, "evaluator").await.unwrap();
    drafter
        .snapshot(proto::SyncKind::Snapshot, 1, &shifted(0.5))
        .await;
    let request = |header_only, model_version| proto::ReadModelRequest {
        evaluator_id: "evaluator".to_string(),
        header_only,
        model_version,
        ..Default::default()
    };

    let (header, weights) = read_model_with(&broker.address, request(true, None))
        .await
        .unwrap();
    assert_eq!((header.model_version, header.model_samples), (1, 12));
    assert!(weights.is_empty(), "a header-only read sends no weights");
    assert_eq!(
        model_sync_status(&broker).await.evaluations_pending,
        vec![0, 1]
    );

    drafter
        .snapshot(proto::SyncKind::Snapshot, 2, &shifted(0.75))
        .await;
    let (header, version_1) = read_model_with(&broker.address, request(false, Some(1)))
        .await
        .unwrap();
    assert_eq!((header.model_version, header.model_samples), (1, 12));
    let (current, now) = read_model(&broker.address, "evaluator").await.unwrap();
    assert_eq!(current.model_version, 2);
    assert_ne!(version_1, now, "the kept version, not the current one");
    assert_ne!(version_1, version_0);
    let (_, again) = read_model_with(&broker.address, request(false, Some(0)))
        .await
        .unwrap();
    assert_eq!(again, version_0, "version 0 as it was read");
    assert_eq!(
        model_sync_status(&broker).await.evaluations_pending,
        vec![0, 1, 2],
        "each version read is kept once"
    );

    let refused = read_model_with(&broker.address, request(false, Some(7)))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("model version 7 is not kept")
            && refused.message().contains("[0, 1, 2]"),
        "{}",
        refused.message()
    );
    // Reported, a version is no longer kept.
    report_tau(&broker.address, "evaluator", Some(tau_point(1, 12, 1.5)))
        .await
        .unwrap();
    let gone = read_model_with(&broker.address, request(false, Some(1)))
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::FailedPrecondition);
    broker.stop().await;
}

#[tokio::test]
async fn the_best_model_is_the_evaluated_version_and_only_a_better_tau_replaces_it() {
    let work = tempfile::tempdir().unwrap();
    let mut config = BrokerConfig::for_targets(1);
    config.model_sync.model_output = Some(work.path().join("model"));
    let broker = TestBroker::start(config).await;
    let best_dir = work.path().join("model-best");
    let mut drafter = TestDrafter::open(&broker.address, "drafter-0").await;
    drafter
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;

    // Version 0 is read, then the run's model moves on twice before its report.
    let (header, version_0) = read_model(&broker.address, "evaluator").await.unwrap();
    assert_eq!((header.model_version, header.model_samples), (0, 0));
    drafter
        .snapshot(proto::SyncKind::Snapshot, 1, &shifted(0.5))
        .await;
    drafter
        .snapshot(proto::SyncKind::Snapshot, 2, &shifted(0.75))
        .await;
    let result = report_tau(&broker.address, "evaluator", Some(tau_point(0, 0, 1.5)))
        .await
        .unwrap();
    assert!(result.best);
    assert_eq!(result.best_path, best_dir.display().to_string());
    assert_eq!(
        checkpoint_values(&best_dir),
        version_0,
        "exactly the version evaluated"
    );
    assert_eq!(checkpoint_version(&best_dir), 0);
    let config_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(best_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config_json,
        serde_json::from_str::<serde_json::Value>(CONFIG_JSON).unwrap()
    );
    let best_bytes = std::fs::read(best_dir.join("model.safetensors")).unwrap();

    // A worse τ of a later version leaves the best model as it was.
    let (header, _) = read_model(&broker.address, "evaluator").await.unwrap();
    assert_eq!((header.model_version, header.model_samples), (2, 24));
    let result = report_tau(&broker.address, "evaluator", Some(tau_point(2, 24, 1.25)))
        .await
        .unwrap();
    assert!(!result.best);
    assert_eq!(
        result.best_point.as_ref().map(|best| best.model_version),
        Some(0)
    );
    assert_eq!(
        std::fs::read(best_dir.join("model.safetensors")).unwrap(),
        best_bytes
    );

    // A better one replaces it with its own version.
    drafter
        .snapshot(proto::SyncKind::Snapshot, 3, &shifted(1.75))
        .await;
    let (header, version_3) = read_model(&broker.address, "evaluator").await.unwrap();
    assert_eq!(header.model_version, 3);
    drafter
        .snapshot(proto::SyncKind::Snapshot, 4, &shifted(2.75))
        .await;
    let result = report_tau(&broker.address, "evaluator", Some(tau_point(3, 36, 2.0)))
        .await
        .unwrap();
    assert!(result.best);
    assert_eq!(checkpoint_values(&best_dir), version_3);
    assert_eq!(checkpoint_version(&best_dir), 3);
    assert_ne!(version_3, version_0);

    let status = model_sync_status(&broker).await;
    let history: Vec<(u64, u64, f64)> = status
        .tau_history
        .iter()
        .map(|point| (point.model_version, point.model_samples, point.tau))
        .collect();
    assert_eq!(history, vec![(0, 0, 1.5), (2, 24, 1.25), (3, 36, 2.0)]);
    assert_eq!(
        status.best_tau.map(|best| (best.model_version, best.tau)),
        Some((3, 2.0))
    );
    assert_eq!(
        (status.best_saved_version, status.best_path),
        (3, best_dir.display().to_string())
    );
    assert_eq!(status.model_version, 4, "the run's model itself went on");
    assert!(status.evaluations_pending.is_empty());
    broker.stop().await;
}

#[tokio::test]
async fn bad_tau_reports_are_refused_naming_the_value_and_change_nothing() {
    let work = tempfile::tempdir().unwrap();
    let mut config = BrokerConfig::for_targets(1);
    config.model_sync.model_output = Some(work.path().join("model"));
    let broker = TestBroker::start(config).await;
    let best_dir = work.path().join("model-best");
    let address = broker.address.clone();

    // Before any drafter: there is no model to read.
    let refused = read_model(&address, "evaluator").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("no model yet"),
        "{}",
        refused.message()
    );

    let mut drafter = TestDrafter::open(&address, "drafter-0").await;
    drafter
        .snapshot(proto::SyncKind::Snapshot, 0, &initial())
        .await;
    read_model(&address, "evaluator").await.unwrap();
    report_tau(&address, "evaluator", Some(tau_point(0, 0, 1.5)))
        .await
        .unwrap();
    drafter
        .snapshot(proto::SyncKind::Snapshot, 1, &shifted(0.5))
        .await;
    read_model(&address, "evaluator").await.unwrap();
    let before = model_sync_status(&broker).await;
    let best_bytes = std::fs::read(best_dir.join("model.safetensors")).unwrap();

    let mut no_prompts = tau_point(1, 12, 2.0);
    no_prompts.prompts = 0;
    let mut other_evaluator = tau_point(1, 12, 2.0);
    other_evaluator.evaluator_id = "someone-else".to_string();
    let cases: Vec<(&str, Option<proto::TauPoint>, tonic::Code, &str)> = vec![
        (
            "evaluator",
            Some(tau_point(1, 12, f64::NAN)),
            tonic::Code::InvalidArgument,
            "τ NaN is not finite",
        ),
        (
            "evaluator",
            Some(tau_point(1, 12, f64::INFINITY)),
            tonic::Code::InvalidArgument,
            "τ inf is not finite",
        ),
        (
            "evaluator",
            Some(tau_point(1, 12, 0.25)),
            tonic::Code::InvalidArgument,
            "τ 0.25 is below 1",
        ),
        (
            "evaluator",
            Some(tau_point(1, 12, 9.0)),
            tonic::Code::InvalidArgument,
            "τ 9 exceeds the drafter's block size 4",
        ),
        (
            "evaluator",
            Some(no_prompts),
            tonic::Code::InvalidArgument,
            "prompts is 0",
        ),
        (
            "evaluator",
            Some(tau_point(1, 13, 2.0)),
            tonic::Code::InvalidArgument,
            "model_samples 13 is not the served version 1's 12",
        ),
        (
            "evaluator",
            Some(tau_point(7, 12, 2.0)),
            tonic::Code::FailedPrecondition,
            "model version 7 was not served",
        ),
        (
            "evaluator",
            Some(tau_point(0, 0, 2.0)),
            tonic::Code::FailedPrecondition,
            "model version 0 is already reported (τ 1.5)",
        ),
        (
            "evaluator",
            None,
            tonic::Code::InvalidArgument,
            "carries no point",
        ),
        (
            "",
            Some(tau_point(1, 12, 2.0)),
            tonic::Code::InvalidArgument,
            "evaluator_id is empty",
        ),
        (
            "evaluator",
            Some(other_evaluator),
            tonic::Code::InvalidArgument,
            "\"someone-else\" is not the report's \"evaluator\"",
        ),
    ];
    for (evaluator_id, point, code, message) in cases {
        let refused = report_tau(&address, evaluator_id, point).await.unwrap_err();
        assert_eq!(refused.code(), code, "{}", refused.message());
        assert!(
            refused.message().contains(message),
            "{:?} lacks {message:?}",
            refused.message()
        );
    }
    let after = model_sync_status(&broker).await;
    assert_eq!(after.tau_history, before.tau_history);
    assert_eq!(after.best_tau, before.best_tau);
    assert_eq!(after.evaluations_pending, before.evaluations_pending);
    assert_eq!(training_status(after), training_status(before));
    assert_eq!(
        std::fs::read(best_dir.join("model.safetensors")).unwrap(),
        best_bytes
    );

    // The refused reports left the version's report possible.
    let result = report_tau(&address, "evaluator", Some(tau_point(1, 12, 2.0)))
        .await
        .unwrap();
    assert!(result.best);
    broker.stop().await;
}
