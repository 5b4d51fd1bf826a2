//! Measures target-server throughput on the tiny model: an in-process
//! broker, a drafter that acks everything, and one target-server on the CPU
//! over generated pre-tokenized data.
//!
//! `cargo run -p dflash-target-server --example cpu_throughput -- [SAMPLES] [SEQ_LEN] [MAX_BATCH_TOKENS]`

use anyhow::Context;
use dflash_client::{BrokerClient, ClientOptions, ConsumerEvent};
use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use dflash_proto::v1 as proto;
use dflash_target_server::{run, DeviceChoice, ModelSource, TargetServerConfig};
use std::io::Write;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

// One measurement read top to bottom (set up, time, print): long on
// purpose, as splitting it would hide the order of what is timed.
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let arguments: Vec<usize> = std::env::args()
        .skip(1)
        .map(|argument| argument.parse())
        .collect::<Result<_, _>>()
        .context("arguments are numbers: SAMPLES SEQ_LEN MAX_BATCH_TOKENS")?;
    let samples = arguments.first().copied().unwrap_or(256);
    let seq_len = arguments.get(1).copied().unwrap_or(512);
    let max_batch_tokens = arguments.get(2).copied().unwrap_or(8192);

    let scratch = tempfile::tempdir()?;
    let model = scratch.path().join("tiny-qwen3");
    write_tiny_model(&model, &TinyModelSpec::default())?;
    let data = scratch.path().join("train.jsonl");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&data)?);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..samples {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Lengths between half and all of SEQ_LEN, like real data.
        let length = seq_len / 2 + (state as usize % (seq_len / 2 + 1));
        let ids: Vec<u64> = (0..length as u64)
            .map(|position| (position * 31 + state) % 456)
            .collect();
        writeln!(file, "{}", serde_json::json!({ "input_ids": ids }))?;
    }
    file.flush()?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = format!("http://{}", listener.local_addr()?);
    let broker_shutdown = CancellationToken::new();
    let broker = tokio::spawn(dflash_broker::serve(
        listener,
        dflash_broker::BrokerConfig::for_targets(1),
        broker_shutdown.clone(),
    ));
    let client = BrokerClient::connect(address.clone(), ClientOptions::default()).await?;
    let drafter = tokio::spawn(async move {
        let mut consumer = client
            .consume(
                "drafter-0",
                proto::Credit {
                    items: 256,
                    bytes: 0,
                },
            )
            .await?;
        let handle = consumer.handle();
        let mut received = 0u64;
        loop {
            match consumer.next().await? {
                ConsumerEvent::Delivery(delivery) => {
                    handle.ack(vec![delivery.delivery_id]);
                    received += 1;
                }
                ConsumerEvent::EndOfStream(_) => return Ok::<u64, anyhow::Error>(received),
            }
        }
    });

    let mut config = TargetServerConfig::new(
        &address,
        "target-0",
        ModelSource::Directory(model),
        Some(data),
    );
    config.device = DeviceChoice::Cpu;
    config.max_batch_tokens = max_batch_tokens;
    config.stats_interval = std::time::Duration::from_secs(1);
    let started = Instant::now();
    let report = run(config, CancellationToken::new()).await?;
    let wall = started.elapsed();
    let received = drafter.await??;
    broker_shutdown.cancel();
    let _ = broker.await;
    println!(
        "tiny Qwen3 (hidden 64, 8 layers, layers {:?}) on {} with {} torch threads: {} samples, {} tokens, \
         {:.0} tokens/s over the compute window ({:.2} s), {:.0} tokens/s end to end ({:.2} s), device busy {:.0} %, drafter received {}",
        report.layer_ids,
        report.device,
        tch::get_num_threads(),
        report.samples_sent,
        report.tokens_sent,
        report.tokens_per_second,
        report.compute_wall.as_secs_f64(),
        report.tokens_sent as f64 / wall.as_secs_f64(),
        wall.as_secs_f64(),
        report.busy_fraction * 100.0,
        received
    );
    Ok(())
}
