//! Helpers for the target-server integration tests: an in-process broker on
//! an ephemeral port, a test drafter that acks everything, tiny model and
//! data files.

#![allow(dead_code)]

use anyhow::{Context, Result};
use dflash_broker::BrokerConfig;
use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_proto::v1 as proto;
use dflash_target_server::{DeviceChoice, ModelSource, TargetServerConfig};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub struct TestBroker {
    pub address: String,
    pub shutdown: CancellationToken,
    handle: JoinHandle<Result<(), dflash_broker::ServeError>>,
}

impl TestBroker {
    pub async fn start(expected_targets: u32) -> Result<TestBroker> {
        TestBroker::start_with_config(BrokerConfig::for_targets(expected_targets)).await
    }

    /// A broker with settings of the test's choosing (a small queue, say).
    pub async fn start_with_config(config: BrokerConfig) -> Result<TestBroker> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = format!("http://{}", listener.local_addr()?);
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(dflash_broker::serve(listener, config, shutdown.clone()));
        Ok(TestBroker {
            address,
            shutdown,
            handle,
        })
    }

    pub async fn client(&self) -> Result<BrokerClient> {
        Ok(BrokerClient::connect(self.address.clone(), ClientOptions::default()).await?)
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), self.handle).await;
    }
}

/// What a test drafter saw.
pub struct Drained {
    pub deliveries: Vec<proto::Delivery>,
    pub end_of_stream: proto::EndOfStream,
    /// Deliveries received before end-of-stream (all of them, if the broker
    /// is right).
    pub delivered_before_end: usize,
}

/// A drafter that acks every delivery and returns everything it saw once
/// end-of-stream arrives (or fails after `timeout`).
pub fn spawn_drafter(
    client: BrokerClient,
    drafter_id: &str,
    timeout: Duration,
) -> JoinHandle<Result<Drained>> {
    let drafter_id = drafter_id.to_string();
    tokio::spawn(async move {
        let credit = proto::Credit {
            items: 64,
            bytes: 0,
        };
        let mut consumer = client.consume(&drafter_id, credit).await?;
        let handle = consumer.handle();
        let mut deliveries = Vec::new();
        let drain = async {
            loop {
                match consumer.next().await? {
                    ConsumerEvent::Delivery(delivery) => {
                        handle.ack(vec![delivery.delivery_id]);
                        deliveries.push(delivery);
                    }
                    ConsumerEvent::EndOfStream(end) => return Ok::<_, anyhow::Error>(end),
                }
            }
        };
        let end_of_stream = tokio::time::timeout(timeout, drain)
            .await
            .context("no end-of-stream in time")??;
        let delivered_before_end = deliveries.len();
        Ok(Drained {
            deliveries,
            end_of_stream,
            delivered_before_end,
        })
    })
}

/// A tensor of a delivered sample by name.
pub fn tensor<'a>(sample: &'a proto::Sample, name: &str) -> Result<&'a proto::Tensor> {
    sample
        .tensors
        .iter()
        .find(|tensor| tensor.name == name)
        .with_context(|| format!("sample has no {name:?}"))
}

pub fn input_ids_of(sample: &proto::Sample) -> Result<Vec<i64>> {
    let tensor = tensor(sample, "input_ids")?;
    Ok(tensor
        .data
        .chunks_exact(4)
        .map(|chunk| i64::from(i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])))
        .collect())
}

pub fn bf16_values(tensor: &proto::Tensor) -> Vec<f32> {
    tensor
        .data
        .chunks_exact(2)
        .map(|pair| f32::from_bits(u32::from(u16::from_le_bytes([pair[0], pair[1]])) << 16))
        .collect()
}

pub fn write_model(directory: &Path) -> Result<PathBuf> {
    let model = directory.join("tiny-qwen3");
    write_tiny_model(&model, &TinyModelSpec::default())?;
    Ok(model)
}

/// A data file with every supported format, blank lines included.
pub fn mixed_data_lines() -> Vec<String> {
    let questions = [
        "What is the capital of France?",
        "How many legs does a spider have?",
        "Write a short poem about the sea.",
        "Please explain what a neural network is.",
        "Count from one to ten.",
    ];
    let mut lines = Vec::new();
    for (index, question) in questions.iter().enumerate() {
        lines.push(
            serde_json::json!({"messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": format!("Answer number {index}: the quick brown fox.")}
            ]})
            .to_string(),
        );
        lines.push(
            serde_json::json!({"conversations": [
                {"from": "system", "value": "You are a helpful assistant."},
                {"from": "human", "value": question},
                {"from": "gpt", "value": "Thank you for asking. ".repeat(index + 1)}
            ]})
            .to_string(),
        );
        let ids: Vec<i64> = (0..(5 + 7 * index as i64))
            .map(|id| (id * 37 + index as i64) % 456)
            .collect();
        let mask: Vec<u8> = ids
            .iter()
            .enumerate()
            .map(|(position, _)| u8::from(position % 3 != 0))
            .collect();
        lines.push(serde_json::json!({"input_ids": ids, "loss_mask": mask}).to_string());
    }
    lines
}

pub fn write_lines(path: &Path, lines: &[String]) -> Result<()> {
    let mut text = String::new();
    for (index, line) in lines.iter().enumerate() {
        text.push_str(line);
        text.push('\n');
        if index == 3 {
            text.push_str("   \n");
        }
    }
    std::fs::write(path, text)?;
    Ok(())
}

/// A CPU target-server config for the tiny model, with fast stats.
pub fn target_config(
    broker: &str,
    target_id: &str,
    model: &Path,
    data: &Path,
) -> TargetServerConfig {
    let mut config = TargetServerConfig::new(
        broker,
        target_id,
        ModelSource::Directory(model.to_path_buf()),
        Some(data.to_path_buf()),
    );
    config.device = DeviceChoice::Cpu;
    config.max_batch_tokens = 256;
    config.sort_window = 4;
    config.stats_interval_seconds = 0.2;
    config.finish_timeout_seconds = 30.0;
    config
}
