//! What a data-parallel snapshot costs the broker: starts a `broker`
//! binary, sends it snapshots of a synthetic model over one ModelSync
//! session (as rank 0 does every `--snapshot-every` steps: the model's
//! `config.json` and `model.safetensors`, f32, in chunks of
//! `MODEL_SYNC_CHUNK_BYTES`), and prints the broker's CPU time and peak
//! resident memory (`VmHWM`) before and after.
//!
//! `cargo run -p dflash-broker --example snapshot_cost -- BROKER_BINARY
//! PARAMETERS SNAPSHOTS [PORT]` (a Linux `/proc` is needed for the figures).

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;

const CONFIG_JSON: &str = r#"{"architectures": ["DFlashDraftModel"], "hidden_size": 4}"#;

/// The broker's CPU seconds (user + system) and its peak resident KiB.
fn cost(child: &Child) -> (f64, u64) {
    let pid = child.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let peak_kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    (ticks as f64 / 100.0, peak_kib)
}

fn request(kind: proto::sync_request::Kind) -> proto::SyncRequest {
    proto::SyncRequest { kind: Some(kind) }
}

/// Tensors of the synthetic model: the parameters split evenly.
const TENSORS: usize = 16;

/// One tensor of the synthetic model, every value the same: its bytes made
/// only while the safetensors encoder writes them (one tensor at a time).
struct Constant {
    value: [u8; 4],
    shape: Vec<usize>,
}

impl safetensors::tensor::View for Constant {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Owned(self.value.repeat(self.shape[0]))
    }

    fn data_len(&self) -> usize {
        self.shape[0] * 4
    }
}

/// One snapshot of `parameters` f32 values ([`TENSORS`] tensors) at
/// `step`: its two files, as a drafter's checkpoint writer lays them out.
fn snapshot(step: u64, parameters: usize) -> Vec<proto::SyncRequest> {
    let views = (0..TENSORS).map(|index| {
        let elements = parameters / TENSORS + usize::from(index < parameters % TENSORS);
        let value = (step as f32 * 1e-3 + index as f32).to_le_bytes();
        let view = Constant {
            value,
            shape: vec![elements],
        };
        (format!("layers.{index:02}.weight"), view)
    });
    let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let weights = Bytes::from(safetensors::serialize(views, Some(metadata)).unwrap());
    let begin = proto::SyncBegin {
        kind: proto::SyncKind::Snapshot as i32,
        steps: step,
        samples: 64 * step,
        ..Default::default()
    };
    dflash_broker::fuzzing::model_files::snapshot_requests(
        begin,
        CONFIG_JSON,
        weights,
        dflash_proto::transport::MODEL_SYNC_CHUNK_BYTES,
    )
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let binary = args.get(1).expect("the broker binary");
    let parameters: usize = args.get(2).map_or(1 << 26, |text| text.parse().unwrap());
    let snapshots: u64 = args.get(3).map_or(3, |text| text.parse().unwrap());
    let port: u16 = args.get(4).map_or(50_991, |text| text.parse().unwrap());
    let address = format!("127.0.0.1:{port}");
    let mut child = Command::new(binary)
        .args(["--listen", &address, "--expected-targets", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the broker");
    let url = format!("http://{address}");
    let mut client = loop {
        match ModelSyncClient::connect(url.clone()).await {
            Ok(client) => break client,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    .max_decoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES)
    .max_encoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES);
    let (cpu_before, peak_before) = cost(&child);
    let (sender, receiver) = tokio::sync::mpsc::channel(64);
    sender
        .send(request(proto::sync_request::Kind::Hello(
            proto::SyncHello {
                drafter_id: "rank-0".to_string(),
                model_config_json: CONFIG_JSON.to_string(),
            },
        )))
        .await
        .unwrap();
    let mut responses = client
        .session(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    let _welcome = responses.message().await.unwrap();
    let started = Instant::now();
    for step in 1..=snapshots {
        for message in snapshot(step, parameters) {
            sender.send(message).await.unwrap();
        }
        match responses.message().await.unwrap().and_then(|m| m.kind) {
            Some(proto::sync_response::Kind::Result(result)) => {
                assert!(result.applied, "{result:?}")
            }
            other => panic!("expected a result, got {other:?}"),
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let (cpu_after, peak_after) = cost(&child);
    let model_mib = parameters as f64 * 4.0 / (1 << 20) as f64;
    println!(
        "{snapshots} snapshots of {parameters} f32 parameters ({model_mib:.0} MiB each) in {wall:.1} s: \
         broker CPU {:.2} s ({:.2} s per snapshot), peak RSS {:.0} MiB before, {:.0} MiB after \
         ({:.2} model sizes above the idle broker)",
        cpu_after - cpu_before,
        (cpu_after - cpu_before) / snapshots as f64,
        peak_before as f64 / 1024.0,
        peak_after as f64 / 1024.0,
        (peak_after - peak_before) as f64 / 1024.0 / model_mib,
    );
    let _ = child.kill();
    let _ = child.wait();
}
