//! Helpers of the drafter-server tests: the tiny target model, producers
//! that stream real hidden states of that model, drafter configurations
//! sized for CPU tests; the broker and polling come from `dflash-testkit`.

#![allow(dead_code)]
// Test helpers: a failure here is a failed test, reported with its message.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use dflash_client::{BrokerClient, ClientOptions};
use dflash_drafter_server::samples::{bf16_bytes, encode_sample};
use dflash_drafter_server::{DrafterServerConfig, ModelMode};
use dflash_model::target_model::TargetModel;
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_proto::v1 as proto;
use rand::rngs::StdRng;
use rand::SeedableRng;
use tch::{Device, Kind, Tensor};

#[allow(unused_imports)] // each test binary uses its own subset
pub use dflash_testkit::{drafter_status, wait_until, TestBroker};

/// The report of a drafter-server run spawned as a task, once it ended
/// within `bound` (a test fails, naming what, when it did not).
pub async fn report_within(
    bound: std::time::Duration,
    drafter: tokio::task::JoinHandle<
        Result<dflash_drafter_server::DrafterReport, dflash_drafter_server::DrafterError>,
    >,
) -> dflash_drafter_server::DrafterReport {
    tokio::time::timeout(bound, drafter)
        .await
        .expect("the drafter-server ended in time")
        .expect("the drafter-server task")
        .expect("the drafter-server run")
}

/// Target layers the test drafters (2 draft layers on the 8-layer tiny target) read.
pub const TEST_TARGET_LAYER_IDS: [usize; 2] = [1, 5];

/// The tiny Qwen3 target, written once per test binary.
pub fn tiny_target_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("dflash-drafter-tests-{}", std::process::id()));
        write_tiny_model(&dir, &TinyModelSpec::default()).expect("write tiny model");
        dir
    })
}

/// Token sequences of `length` over the tiny vocabulary, deterministic in `seed`.
pub fn random_token_sequences(count: usize, length: usize, seed: u64) -> Vec<Vec<i64>> {
    dflash_model::tiny::random_token_sequences(count, length, &mut StdRng::seed_from_u64(seed))
}

/// Samples with the tiny target's real hidden states at [`TEST_TARGET_LAYER_IDS`];
/// the first quarter of each sequence is an unsupervised prompt.
pub fn target_samples(sequences: &[Vec<i64>]) -> Vec<proto::Sample> {
    let target =
        TargetModel::load(tiny_target_dir(), Device::Cpu, Kind::Float).expect("load tiny target");
    sequences
        .iter()
        .map(|tokens| {
            let ids = Tensor::from_slice(tokens).view([1, -1]);
            let hidden = target
                .capture_hidden_states(&ids, &ids.ones_like(), &TEST_TARGET_LAYER_IDS)
                .expect("capture hidden states")
                .get(0);
            let width = hidden.size()[1] as u64;
            let tokens_i32: Vec<i32> = tokens.iter().map(|&token| token as i32).collect();
            let mask: Vec<u8> = (0..tokens.len())
                .map(|position| u8::from(position >= tokens.len() / 4))
                .collect();
            encode_sample(
                &tokens_i32,
                &mask,
                &bf16_bytes(&hidden).expect("bf16 bytes"),
                width,
            )
        })
        .collect()
}

/// Samples of the right token shape but a hidden width of `width`.
pub fn samples_with_width(count: usize, length: usize, width: u64) -> Vec<proto::Sample> {
    (0..count)
        .map(|_| {
            let tokens: Vec<i32> = (0..length as i32).map(|token| token + 3).collect();
            encode_sample(
                &tokens,
                &vec![1; length],
                &vec![0u8; length * width as usize * 2],
                width,
            )
        })
        .collect()
}

/// Streams `samples` as target `target_id`; reports done when `report_done`.
pub async fn produce(
    address: &str,
    target_id: &str,
    samples: Vec<proto::Sample>,
    report_done: bool,
) {
    let client = BrokerClient::connect(address.to_string(), ClientOptions::default())
        .await
        .expect("producer connects");
    let mut producer = client.produce(target_id).await.expect("produce stream");
    let count = samples.len() as u64;
    for (seq, sample) in samples.into_iter().enumerate() {
        producer
            .send(seq as u64, sample, Default::default())
            .await
            .expect("send item");
    }
    let report = producer.finish().await.expect("finish produce stream");
    assert_eq!(report.accepted, count, "rejected: {:?}", report.rejected);
    if report_done {
        client
            .report_done(target_id, count)
            .await
            .expect("report done");
    }
}

/// A drafter configuration sized for CPU tests on the tiny target.
pub fn test_drafter_config(drafter_id: &str, broker: &str, output: PathBuf) -> DrafterServerConfig {
    let mut config = DrafterServerConfig::with_defaults(drafter_id, broker, output);
    config.target_model = Some(tiny_target_dir().to_path_buf());
    config.model = ModelMode::DFlash;
    config.draft_layers = 2;
    config.block_size = 4;
    config.num_anchors = 8;
    config.batch_tokens = 256;
    config.max_step_samples = 4;
    config.prefetch_samples = 2;
    config.linger = std::time::Duration::from_millis(200);
    config.save_every = 2;
    config.stats_interval = std::time::Duration::from_millis(100);
    config.total_steps = Some(50);
    config.learning_rate = 1e-3;
    config.shutdown_timeout = std::time::Duration::from_millis(30_000);
    config.reconnect_timeout = std::time::Duration::from_millis(5_000);
    config
}
