//! The `/metrics` endpoint of a running synthetic drafter-server, scraped
//! over real HTTP: every metric is there with its labels, the step and
//! sample counters follow what was trained, and the endpoint goes away with
//! the run.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use common::*;
use dflash_broker::BrokerConfig;
use dflash_drafter_server::{run_with_metrics_listener, DrafterServerConfig, RunEnd};
use tokio_util::sync::CancellationToken;

const DRAFTER_ID: &str = "drafter-metrics";
const ITEMS: u64 = 10;
const DEADLINE: Duration = Duration::from_secs(60);
const POLL_INTERVAL: Duration = Duration::from_millis(20);

const METRIC_NAMES: [&str; 8] = [
    "dflash_drafter_steps_total",
    "dflash_drafter_samples_trained_total",
    "dflash_drafter_rejected_items_total",
    "dflash_drafter_step_seconds",
    "dflash_drafter_loss",
    "dflash_drafter_accuracy",
    "dflash_drafter_tokens_per_second",
    "dflash_drafter_busy_fraction",
];

/// `GET /metrics` with a one-request HTTP/1.1 client over a plain std
/// socket; the body on 200.
fn scrape_blocking(address: SocketAddr) -> Result<String> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("response without a blank line after the head")?;
    ensure!(head.starts_with("HTTP/1.1 200"), "{head}");
    ensure!(
        head.contains("text/plain; version=0.0.4"),
        "not the text exposition format: {head}"
    );
    Ok(body.to_string())
}

/// [`scrape_blocking`] off the async workers.
async fn scrape(address: SocketAddr) -> Result<String> {
    tokio::task::spawn_blocking(move || scrape_blocking(address)).await?
}

/// The value of the one series of `name` that this drafter reports.
fn value_of(text: &str, name: &str) -> Option<f64> {
    let prefix = format!("{name}{{drafter_id=\"{DRAFTER_ID}\",device=\"synthetic\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .and_then(|value| value.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_metrics_follow_the_steps_and_samples_trained() -> Result<()> {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let output = tempfile::tempdir()?;
    let mut config =
        DrafterServerConfig::with_defaults(DRAFTER_ID, &broker.address, output.path().into());
    config.model = "synthetic:ms_per_1k_tokens=1"
        .parse()
        .map_err(anyhow::Error::msg)?;
    config.max_step_samples = 4;
    config.prefetch_samples = 2;
    config.linger = std::time::Duration::from_millis(50);
    config.stats_interval = std::time::Duration::from_millis(50);
    config.total_steps = Some(100);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let metrics_address = listener.local_addr()?;
    let shutdown = CancellationToken::new();
    let drafter = tokio::spawn(run_with_metrics_listener(
        config,
        Some(listener),
        shutdown.clone(),
    ));

    // The metrics exist at zero before any item arrives.
    let text = scrape(metrics_address).await?;
    ensure!(
        value_of(&text, "dflash_drafter_steps_total") == Some(0.0),
        "{text}"
    );

    // No ReportDone: the run stays open (and its endpoint up) once the
    // items are trained, until the shutdown below.
    produce(
        &broker.address,
        "target-0",
        samples_with_width(ITEMS as usize, 16, 8),
        false,
    )
    .await;

    let started = Instant::now();
    let text = loop {
        let text = scrape(metrics_address).await?;
        let steps = value_of(&text, "dflash_drafter_steps_total").unwrap_or_default();
        let samples = value_of(&text, "dflash_drafter_samples_trained_total");
        if steps > 0.0 && samples == Some(ITEMS as f64) {
            break text;
        }
        if started.elapsed() > DEADLINE || drafter.is_finished() {
            bail!("samples_trained never reached {ITEMS}; last scrape:\n{text}");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    };
    for name in METRIC_NAMES {
        ensure!(
            text.contains(&format!("# TYPE {name} ")) && value_of(&text, name).is_some(),
            "{name} missing:\n{text}"
        );
    }
    let steps = value_of(&text, "dflash_drafter_steps_total").unwrap_or_default();
    ensure!(
        (1.0..=ITEMS as f64).contains(&steps),
        "{steps} steps for {ITEMS} items"
    );
    ensure!(value_of(&text, "dflash_drafter_rejected_items_total") == Some(0.0));
    let busy_fraction = value_of(&text, "dflash_drafter_busy_fraction").unwrap_or(-1.0);
    ensure!(
        (0.0..=1.0).contains(&busy_fraction),
        "busy fraction {busy_fraction}"
    );

    shutdown.cancel();
    let report = tokio::time::timeout(DEADLINE, drafter).await???;
    ensure!(report.end == RunEnd::Shutdown, "{report:?}");
    ensure!(report.samples_trained == ITEMS, "{report:?}");
    ensure!(
        report.steps as f64 == steps,
        "{report:?} after {steps} steps"
    );
    // The endpoint is owned by the run: it is gone once the run returns.
    ensure!(
        scrape(metrics_address).await.is_err(),
        "metrics still served after the run returned"
    );
    broker.stop().await;
    Ok(())
}
