//! A drafter's `drafter.step` span joins the traces of the samples it
//! trained on: parented to the first sample's producer span and linked to
//! every other one, with the real broker relaying each item's trace context.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::*;
use dflash_broker::BrokerConfig;
use dflash_client::{BrokerClient, ClientOptions};
use dflash_drafter_server::{run, DrafterServerConfig, RunEnd};
use dflash_telemetry::testing::InMemorySpanExporter;
use dflash_telemetry::LogFormat;
use dflash_testkit::span_attribute;
use tokio_util::sync::CancellationToken;

/// One step's worth: the drafter steps once it holds this many samples.
const ITEMS: usize = 4;
const DEADLINE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_span_is_parented_to_its_first_sample_and_linked_to_the_others() -> Result<()> {
    let exporter = InMemorySpanExporter::default();
    let _telemetry =
        dflash_telemetry::init_with_exporter("drafter-test", LogFormat::Text, exporter.clone())?;
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let output = tempfile::tempdir()?;
    let mut config =
        DrafterServerConfig::with_defaults("drafter-traced", &broker.address, output.path().into());
    config.model = "synthetic".parse().map_err(anyhow::Error::msg)?;
    // One step of exactly ITEMS samples: no token budget or linger flush first.
    config.max_step_samples = ITEMS;
    config.batch_tokens = 1 << 20;
    config.linger = std::time::Duration::from_millis(600_000);
    config.total_steps = Some(10);
    let shutdown = CancellationToken::new();
    let drafter = tokio::spawn(run(config, shutdown.clone()));

    // Each item made under its own target batch span: a trace per sample.
    let client = BrokerClient::connect(broker.address.clone(), ClientOptions::default()).await?;
    let mut producer = client.produce("target-0").await?;
    let mut carriers: Vec<HashMap<String, String>> = Vec::new();
    for (seq, sample) in samples_with_width(ITEMS, 16, 8).into_iter().enumerate() {
        let batch = tracing::info_span!("target_batch", seq);
        let carrier = batch.in_scope(dflash_telemetry::inject_current_context);
        ensure!(carrier.contains_key("traceparent"), "{carrier:?}");
        producer.send(seq as u64, sample, carrier.clone()).await?;
        carriers.push(carrier);
    }
    producer.finish().await?;
    client.report_done("target-0", ITEMS as u64).await?;
    let report = tokio::time::timeout(DEADLINE, drafter).await???;
    ensure!(report.end == RunEnd::Complete, "{report:?}");
    ensure!(report.steps == 1, "{report:?}");

    let trace_ids: Vec<String> = carriers
        .iter()
        .map(|carrier| dflash_telemetry::trace_id_of(carrier).context("trace id"))
        .collect::<Result<_>>()?;
    let spans = exporter.get_finished_spans()?;
    let step = spans
        .iter()
        .find(|span| span.name == "drafter.step")
        .context("no drafter.step span exported")?;
    let batch_span_of = |trace_id: &str| {
        spans
            .iter()
            .find(|span| {
                span.name == "target_batch" && span.span_context.trace_id().to_string() == trace_id
            })
            .map(|span| span.span_context.span_id())
    };
    ensure!(
        step.span_context.trace_id().to_string() == trace_ids[0],
        "the step is not in the first sample's trace"
    );
    ensure!(Some(step.parent_span_id) == batch_span_of(&trace_ids[0]));
    let linked: Vec<String> = step
        .links
        .iter()
        .map(|link| link.span_context.trace_id().to_string())
        .collect();
    ensure!(
        linked == trace_ids[1..],
        "links {linked:?}, traces {trace_ids:?}"
    );
    ensure!(span_attribute(step, "samples").as_deref() == Some(&*ITEMS.to_string()));
    ensure!(span_attribute(step, "step").as_deref() == Some("1"));
    // Every sample it trained, by (target, seq).
    let keys = span_attribute(step, dflash_telemetry::SAMPLE_KEYS_ATTRIBUTE).unwrap_or_default();
    for seq in 0..ITEMS as u64 {
        let key = dflash_telemetry::sample_key("target-0", seq);
        ensure!(keys.contains(&key), "{key} not in {keys}");
    }
    broker.stop().await;
    Ok(())
}
