//! The `/metrics` endpoint of a running target-server, scraped over real
//! HTTP: every metric is there with its labels, and the sent-items counter
//! matches what reached the broker.

mod common;

use anyhow::{bail, ensure, Context, Result};
use common::*;
use dflash_broker::BrokerConfig;
use dflash_target_server::{
    run_with_metrics_listener, run_with_registry, DeviceChoice, ModelSource, TargetServerConfig,
};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const SAMPLES: u64 = 8;
const SEQ_LEN: u64 = 32;
const DEADLINE: Duration = Duration::from_secs(60);
const POLL_INTERVAL: Duration = Duration::from_millis(20);

const METRIC_NAMES: [&str; 7] = [
    "dflash_target_batches_total",
    "dflash_target_samples_sent_total",
    "dflash_target_tokens_total",
    "dflash_target_rejected_items_total",
    "dflash_target_tokens_per_second",
    "dflash_target_busy_fraction",
    "dflash_target_batch_seconds",
];

/// `GET /metrics` with a one-request HTTP/1.1 client; the body on 200.
async fn scrape(address: SocketAddr) -> Result<String> {
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("response without a blank line after the head")?;
    ensure!(head.starts_with("HTTP/1.1 200"), "{head}");
    Ok(body.to_string())
}

/// The value of the one series of `name` that this target reports.
fn value_of(text: &str, name: &str) -> Option<f64> {
    let prefix = format!("{name}{{target_id=\"target-0\",device=\"synthetic\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .and_then(|value| value.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_metrics_count_every_item_sent() -> Result<()> {
    // Room for about three items and no drafter yet: the broker stops
    // reading the stream, so the run sends every item (they fit in the
    // producer window) and then waits for answers until a drafter drains
    // the queue. That keeps the run, and its endpoint, up while we scrape.
    let mut broker_config = BrokerConfig::for_targets(1);
    broker_config.max_queue_bytes = 8 * 1024;
    broker_config.max_item_bytes = 8 * 1024;
    let broker = TestBroker::start(broker_config).await;

    let model: ModelSource =
        format!("synthetic:hidden=16,layers=2,tokens_per_s=0,samples={SAMPLES},seq_len={SEQ_LEN}")
            .parse()
            .map_err(anyhow::Error::msg)?;
    let mut config = TargetServerConfig::new(&broker.address, "target-0", model, None);
    config.device = DeviceChoice::Cpu;
    config.max_batch_tokens = 2 * SEQ_LEN as usize;
    config.stats_interval = std::time::Duration::from_secs(3600);
    config.finish_timeout = DEADLINE;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let metrics_address = listener.local_addr()?;
    let shutdown = CancellationToken::new();
    let target = tokio::spawn(run_with_metrics_listener(
        config,
        Some(listener),
        shutdown.clone(),
    ));

    let started = Instant::now();
    let text = loop {
        let text = scrape(metrics_address).await?;
        if value_of(&text, "dflash_target_samples_sent_total") == Some(SAMPLES as f64) {
            break text;
        }
        if started.elapsed() > DEADLINE || target.is_finished() {
            bail!("samples_sent never reached {SAMPLES}; last scrape:\n{text}");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    };
    ensure!(
        !target.is_finished(),
        "the run ended before a drafter drained the queue: the scrape raced its end"
    );
    for name in METRIC_NAMES {
        ensure!(
            text.contains(&format!("# TYPE {name} ")) && value_of(&text, name).is_some(),
            "{name} missing:\n{text}"
        );
    }
    ensure!(value_of(&text, "dflash_target_tokens_total") == Some((SAMPLES * SEQ_LEN) as f64));
    let batches = value_of(&text, "dflash_target_batches_total").unwrap_or_default();
    ensure!(
        (1.0..=SAMPLES as f64).contains(&batches),
        "{batches} batches"
    );
    ensure!(value_of(&text, "dflash_target_rejected_items_total") == Some(0.0));

    let drafter = spawn_drafter(broker.client().await, "drafter-0", DEADLINE);
    let report = target.await??;
    let drained = drafter.await??;
    ensure!(report.completed && report.rejected.is_empty(), "{report:?}");
    ensure!(report.samples_sent == SAMPLES, "{report:?}");
    ensure!(drained.deliveries.len() == SAMPLES as usize);
    // The endpoint is owned by the run: it is gone once the run returns.
    ensure!(
        scrape(metrics_address).await.is_err(),
        "metrics still served after the run returned"
    );
    broker.stop().await;
    Ok(())
}

/// An item over the broker's gRPC message limit: the broker ends the
/// Produce stream with RESOURCE_EXHAUSTED before reading it, so no
/// per-item rejection comes back. The target-server counts it in its own
/// rejected-items metric and ends with that status (not retried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_over_the_message_limit_counts_as_rejected() -> Result<()> {
    // Limit: --max-item-bytes (64 KiB) plus 1 MiB of framing. Each item
    // carries 128 tokens x 2 layers x 4096 x 2 bytes = 2 MiB of hidden states.
    let mut broker_config = BrokerConfig::for_targets(1);
    broker_config.max_item_bytes = 64 << 10;
    let broker = TestBroker::start(broker_config).await;
    let model: ModelSource = "synthetic:hidden=4096,layers=2,tokens_per_s=0,samples=2,seq_len=128"
        .parse()
        .map_err(anyhow::Error::msg)?;
    let mut config = TargetServerConfig::new(&broker.address, "target-0", model, None);
    config.device = DeviceChoice::Cpu;
    config.max_batch_tokens = 128;
    config.finish_timeout = DEADLINE;
    let registry = std::sync::Arc::new(dflash_telemetry::Registry::new());
    let outcome = tokio::time::timeout(
        DEADLINE,
        run_with_registry(config, registry.clone(), None, CancellationToken::new()),
    )
    .await
    .context("the run ended in time")?;
    let error = match outcome {
        Ok(report) => bail!("an oversized item was not refused: {report:?}"),
        Err(error) => error,
    };
    let status = match &error {
        dflash_target_server::TargetServerError::Broker(client_error) => client_error.status(),
        _ => None,
    };
    ensure!(
        status.is_some_and(|status| status.code() == tonic::Code::ResourceExhausted),
        "{error}"
    );
    ensure!(
        error.to_string().contains("--max-item-bytes 65536"),
        "{error}"
    );
    let text = registry.render();
    ensure!(
        value_of(&text, "dflash_target_rejected_items_total") == Some(1.0),
        "{text}"
    );
    let snapshot = broker.status().await;
    ensure!(
        snapshot.accepted_items == 0 && snapshot.rejected_items == 1,
        "{snapshot:?}"
    );
    broker.stop().await;
    Ok(())
}
