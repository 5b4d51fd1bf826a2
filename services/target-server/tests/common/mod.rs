//! Helpers for the target-server integration tests: tiny model and data
//! files, tensor readers; the broker, the acking test drafter and polling
//! come from `dflash-testkit`.

#![allow(dead_code)]

use anyhow::{Context, Result};
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_proto::v1 as proto;
use dflash_target_server::{DeviceChoice, ModelSource, TargetServerConfig};
use std::path::{Path, PathBuf};

pub use dflash_testkit::{spawn_drafter, TestBroker};

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
    config.stats_interval = std::time::Duration::from_millis(200);
    config.finish_timeout = std::time::Duration::from_secs(30);
    config
}
