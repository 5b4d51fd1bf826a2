//! `dflash evaluate` against the real broker in-process: the τ the
//! evaluator reports for a model version equals `dflash eval` on the
//! checkpoint the broker wrote of that version (`model-best/`), and the
//! broker's history holds it.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::Path;

use dflash_cli::evaluate::{run, EvaluateArgs};
use dflash_model::draft::{
    model_files, save_draft_checkpoint, DraftConfig, DraftModel, DraftOptions, FrozenTargetHeads,
    TargetDimensions,
};
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;
use dflash_testkit::TestBroker;
use tch::{Device, Kind};
use tokio_util::sync::CancellationToken;

const MAX_NEW_TOKENS: usize = 24;

fn request(kind: proto::sync_request::Kind) -> proto::SyncRequest {
    proto::SyncRequest { kind: Some(kind) }
}

/// Initialises the run's model from a drafter checkpoint with one
/// snapshot of step 0, as a data-parallel drafter's first one: the
/// checkpoint's two files as they are, in chunks.
async fn snapshot_from(address: &str, checkpoint: &Path) {
    let config_json = std::fs::read_to_string(checkpoint.join("config.json")).unwrap();
    let weights = std::fs::read(checkpoint.join("model.safetensors")).unwrap();
    let mut messages = vec![
        request(proto::sync_request::Kind::Hello(proto::SyncHello {
            drafter_id: "drafter-0".to_string(),
            model_config_json: config_json.clone(),
        })),
        request(proto::sync_request::Kind::Begin(proto::SyncBegin {
            kind: proto::SyncKind::Snapshot as i32,
            ..Default::default()
        })),
    ];
    for (name, bytes) in [
        ("config.json", bytes::Bytes::from(config_json.into_bytes())),
        ("model.safetensors", bytes::Bytes::from(weights)),
    ] {
        // Chunks of 1000 bytes: values and the header cut across them.
        for start in (0..bytes.len()).step_by(1000) {
            messages.push(request(proto::sync_request::Kind::FileChunk(
                proto::ModelFileChunk {
                    file: name.to_string(),
                    offset: start as u64,
                    data: bytes.slice(start..(start + 1000).min(bytes.len())),
                    file_size: bytes.len() as u64,
                },
            )));
        }
    }
    messages.push(request(proto::sync_request::Kind::Commit(
        proto::SyncCommit { files: 2 },
    )));
    let mut client = ModelSyncClient::connect(address.to_string()).await.unwrap();
    let mut responses = client
        .session(tokio_stream::iter(messages))
        .await
        .unwrap()
        .into_inner();
    loop {
        match responses
            .message()
            .await
            .unwrap()
            .and_then(|message| message.kind)
        {
            Some(proto::sync_response::Kind::Result(result)) => {
                assert!(result.initialised, "{result:?}");
                return;
            }
            Some(proto::sync_response::Kind::Welcome(_)) => {}
            other => panic!("expected the snapshot's result, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reported_tau_equals_dflash_eval_on_the_saved_model() {
    let work = tempfile::tempdir().unwrap();
    let target_dir = work.path().join("target");
    dflash_model::tiny::write_tiny_model(
        &target_dir,
        &dflash_model::tiny::TinyModelSpec::default(),
    )
    .unwrap();
    let (target_config, frozen) =
        FrozenTargetHeads::load(&target_dir, Device::Cpu, Kind::Float).unwrap();
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(4),
        mask_token_id: dflash_model::tokens::mask_token_id(&target_dir).unwrap(),
        target_layer_ids: None,
    };
    let config =
        DraftConfig::for_target(&TargetDimensions::from(&target_config), &options).unwrap();
    let drafter = DraftModel::new(config, frozen, Device::Cpu, Kind::Float, 11).unwrap();
    let initial = work.path().join("initial");
    save_draft_checkpoint(&initial, &drafter, None).unwrap();
    // The drafter's one writer: the files a snapshot sends are the
    // checkpoint's, byte for byte.
    let files = model_files(&drafter).unwrap();
    assert_eq!(
        files.weights,
        std::fs::read(initial.join("model.safetensors")).unwrap()
    );
    assert_eq!(
        files.config_json,
        std::fs::read_to_string(initial.join("config.json")).unwrap()
    );
    let prompts = work.path().join("held_out.jsonl");
    let mut lines = String::new();
    for (index, prompt) in dflash_model::tiny::random_token_sequences(
        6,
        5,
        &mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(5),
    )
    .iter()
    .enumerate()
    {
        assert!(!prompt.is_empty(), "prompt {index}");
        lines.push_str(&serde_json::json!({ "input_ids": prompt }).to_string());
        lines.push('\n');
    }
    std::fs::write(&prompts, lines).unwrap();

    let mut broker_config = dflash_broker::BrokerConfig::for_targets(1);
    broker_config.model_sync.model_output = Some(work.path().join("model"));
    let broker = TestBroker::start(broker_config).await;
    snapshot_from(&broker.address, &initial).await;

    let args = EvaluateArgs {
        broker: broker.address.clone(),
        watch: false,
        target: target_dir.clone(),
        prompts: prompts.clone(),
        max_prompts: 0,
        max_new_tokens: MAX_NEW_TOKENS,
        sampling: dflash_cli::evaluate::SamplingArgs {
            temperature: 0.0,
            top_p: 1.0,
            sampling_seed: 0,
            confidence_threshold: None,
        },
        every_versions: 1,
        backlog: 4,
        every: std::time::Duration::from_secs(60),
        poll: std::time::Duration::from_millis(100),
        device: "cpu".parse().unwrap(),
        threads: 1,
        evaluator_id: "evaluator".to_string(),
        report_file: Some(work.path().join("evaluator.json")),
        security: Default::default(),
    };
    let report = run(args, CancellationToken::new()).await.unwrap();
    assert_eq!(report.points.len(), 1);
    assert!(report.points[0].best, "the first report is the best so far");
    let point = &report.points[0].point;
    assert_eq!(point.model_version, 0);
    assert_eq!(report.refused_reports, 0);

    // The broker wrote the files it was sent, byte for byte, without
    // decoding them (and its counters beside them).
    let best_dir = work.path().join("model-best");
    for file in ["config.json", "model.safetensors"] {
        assert!(
            std::fs::read(best_dir.join(file)).unwrap()
                == std::fs::read(initial.join(file)).unwrap(),
            "{file} differs from the drafter's"
        );
    }
    assert!(best_dir.join("center_state.json").is_file());

    // `dflash eval`'s code on the checkpoint the broker wrote of it.
    let eval_prompts = dflash_cli::demo::read_prompts(&prompts, &target_dir).unwrap();
    let (target, best) = (target_dir.clone(), best_dir.clone());
    let measured = tokio::task::spawn_blocking(move || {
        dflash_model::eval::evaluate(&target, &best, &eval_prompts, MAX_NEW_TOKENS, Device::Cpu)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(point.tau, measured.mean_acceptance_length);
    assert_eq!(point.verification_steps, measured.verification_steps as u64);
    assert_eq!(point.generated_tokens, measured.generated_tokens as u64);

    // And the `dflash eval` command itself (it prints τ to 3 decimals).
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args([
            "eval",
            "--device",
            "cpu",
            "--max-new-tokens",
            &MAX_NEW_TOKENS.to_string(),
        ])
        .arg("--target-model")
        .arg(&target_dir)
        .arg("--drafter")
        .arg(&best_dir)
        .arg("--data")
        .arg(&prompts)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let expected = format!("τ (mean acceptance length) {:.3} over 6 prompts", point.tau);
    assert!(stdout.contains(&expected), "{stdout:?} lacks {expected:?}");

    let status = broker.client().await.status().await.unwrap();
    let sync = status.model_sync.unwrap();
    assert_eq!(sync.tau_history.len(), 1);
    assert_eq!(sync.tau_history[0].tau, point.tau);
    assert_eq!(sync.best_path, best_dir.display().to_string());
    broker.stop().await;
}
