//! Span export to a real OTLP/gRPC receiver (the official proto
//! definitions, `opentelemetry-proto`), with the real binaries: a broker,
//! two synthetic targets and two synthetic drafters as processes.
//!
//! With the collector up, every span arrives, each process is told apart by
//! its resource, and one sample's path is found from its (target, seq).
//! With the collector down (a closed port), the run still ends COMPLETE and
//! no process's exit waits on the export longer than its bound.
//!
//! With real data-parallel drafters (draft models of the tiny target,
//! gradients all-reduced over Gloo), each produced (target, seq) is named by
//! exactly one `drafter.step` span, of the step the broker's commit record
//! names for it, and that span links the sample's trace.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dflash_client::{BrokerClient, ClientOptions};
use dflash_proto::v1 as proto;
use dflash_shell::Exit;
use dflash_testkit::{
    committed_samples, data_parallel_status, init_tiny, tiny_drafter_sample, wait_for_exit,
    wait_until, workspace_binary,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;

const TARGETS: usize = 2;
const DRAFTERS: usize = 2;
/// The synthetic data set, split between the targets' shards.
const SAMPLES: u64 = 48;
const RUN_DEADLINE: Duration = Duration::from_secs(180);

/// A span as the receiver got it, with its process's resource.
#[derive(Debug, Clone)]
struct Received {
    resource: HashMap<String, String>,
    span: Span,
}

/// The OTLP trace service: keeps every span it is sent.
#[derive(Clone, Default)]
struct Collector {
    received: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = self.received.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let resource = attributes(
                &resource_spans
                    .resource
                    .map(|resource| resource.attributes)
                    .unwrap_or_default(),
            );
            for scope_spans in resource_spans.scope_spans {
                for span in scope_spans.spans {
                    received.push(Received {
                        resource: resource.clone(),
                        span,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Attributes as text (arrays as their elements joined by newlines).
fn attributes(attributes: &[KeyValue]) -> HashMap<String, String> {
    attributes
        .iter()
        .map(|attribute| {
            (
                attribute.key.clone(),
                attribute.value.as_ref().map(text).unwrap_or_default(),
            )
        })
        .collect()
}

fn text(value: &AnyValue) -> String {
    match &value.value {
        Some(any_value::Value::StringValue(text)) => text.clone(),
        Some(any_value::Value::IntValue(number)) => number.to_string(),
        Some(any_value::Value::DoubleValue(number)) => number.to_string(),
        Some(any_value::Value::BoolValue(flag)) => flag.to_string(),
        Some(any_value::Value::ArrayValue(array)) => {
            array.values.iter().map(text).collect::<Vec<_>>().join("\n")
        }
        _ => String::new(),
    }
}

/// Starts the receiver on an ephemeral port: its endpoint and its spans.
async fn start_collector(
    shutdown: tokio_util::sync::CancellationToken,
) -> (String, Arc<Mutex<Vec<Received>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let collector = Collector::default();
    let received = collector.received.clone();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                shutdown.cancelled_owned(),
            ),
    );
    (endpoint, received)
}

/// Kills a child process when the test ends, however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How one run went.
#[derive(Debug)]
struct RunTimes {
    /// From start to the broker's COMPLETE.
    until_complete: Duration,
    /// From COMPLETE to the last drafter's exit.
    drafters_exit_after_complete: Duration,
    /// From SIGTERM to the broker's exit.
    broker_exit_after_term: Duration,
    /// The broker's status once every child exited.
    final_status: proto::StatusSnapshot,
}

fn command(binary: &str, work: &Path, log: &str, otlp: Option<&str>) -> std::process::Command {
    let mut command = std::process::Command::new(workspace_binary(binary));
    let log = std::fs::File::create(work.join(log)).unwrap();
    command
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .env_remove("RUST_LOG")
        .env_remove("OTEL_SERVICE_NAME")
        .env_remove("OTEL_RESOURCE_ATTRIBUTES")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    match otlp {
        // Batches every 200 ms so a test run's spans leave while it runs.
        Some(endpoint) => command
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "200"),
        None => command.env_remove("OTEL_EXPORTER_OTLP_ENDPOINT"),
    };
    command
}

fn logs(work: &Path) -> String {
    let mut all = String::new();
    for entry in std::fs::read_dir(work).unwrap().flatten() {
        if entry.path().extension().is_some_and(|ext| ext == "log") {
            all += &format!(
                "--- {}\n{}\n",
                entry.path().display(),
                std::fs::read_to_string(entry.path()).unwrap_or_default()
            );
        }
    }
    all
}

/// The broker for `targets` targets, exporting to `otlp`, and its address
/// once it listens (from its ready file).
async fn start_broker(work: &Path, otlp: Option<&str>, targets: usize) -> (Child, String) {
    let ready = work.join("broker.address");
    let broker = Child(
        command("broker", work, "broker.log", otlp)
            .args(["--listen", "127.0.0.1:0", "--expected-targets"])
            .arg(targets.to_string())
            .arg("--ready-file")
            .arg(&ready)
            .spawn()
            .unwrap(),
    );
    assert!(
        wait_until(Duration::from_secs(60), || async { ready.exists() }).await,
        "the broker wrote no ready file\n{}",
        logs(work)
    );
    let address = format!("http://{}", std::fs::read_to_string(&ready).unwrap().trim());
    (broker, address)
}

/// A whole run: broker, targets, drafters; waits for COMPLETE and for every
/// process to exit 0 (the broker after SIGTERM).
async fn run_pipeline(work: &Path, otlp: Option<&str>) -> RunTimes {
    let started = Instant::now();
    let (mut broker, address) = start_broker(work, otlp, TARGETS).await;
    let mut children = Vec::new();
    for target in 0..TARGETS {
        let model =
            format!("synthetic:hidden=16,layers=2,tokens_per_s=20000,samples={SAMPLES},seq_len=16");
        children.push((
            format!("target-{target}"),
            Child(
                command("target-server", work, &format!("target-{target}.log"), otlp)
                    .args([
                        "--broker",
                        &address,
                        "--target-id",
                        &format!("target-{target}"),
                    ])
                    .args(["--model", &model, "--max-batch-tokens", "128"])
                    .spawn()
                    .unwrap(),
            ),
        ));
    }
    for drafter in 0..DRAFTERS {
        children.push((
            format!("drafter-{drafter}"),
            Child(
                command(
                    "drafter-server",
                    work,
                    &format!("drafter-{drafter}.log"),
                    otlp,
                )
                .args([
                    "--broker",
                    &address,
                    "--drafter-id",
                    &format!("drafter-{drafter}"),
                ])
                .args(["--model", "synthetic:ms_per_1k_tokens=0", "--device", "cpu"])
                .arg("--output")
                .arg(work.join(format!("checkpoints-{drafter}")))
                .arg("--report-file")
                .arg(work.join(format!("drafter-{drafter}.json")))
                .spawn()
                .unwrap(),
            ),
        ));
    }
    let client = BrokerClient::connect(address.clone(), ClientOptions::default())
        .await
        .unwrap();
    let mut complete_at = None;
    let mut exited: HashMap<String, Instant> = HashMap::new();
    while exited.len() < children.len() || complete_at.is_none() {
        assert!(
            started.elapsed() < RUN_DEADLINE,
            "the run did not end; exited {exited:?}\n{}",
            logs(work)
        );
        if complete_at.is_none() {
            if let Ok(status) = client.status().await {
                match status.state() {
                    proto::BrokerState::Complete => complete_at = Some(Instant::now()),
                    proto::BrokerState::Aborted => {
                        panic!("run aborted: {status:?}\n{}", logs(work))
                    }
                    _ => {}
                }
            }
        }
        for (name, child) in &mut children {
            if exited.contains_key(name.as_str()) {
                continue;
            }
            if let Some(status) = child.0.try_wait().unwrap() {
                assert_eq!(
                    status.code(),
                    Some(i32::from(Exit::Done.code())),
                    "{name} exited {status}\n{}",
                    logs(work)
                );
                exited.insert(name.clone(), Instant::now());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let complete_at = complete_at.unwrap();
    let last_drafter_exit = exited
        .iter()
        .filter(|(name, _)| name.starts_with("drafter-"))
        .map(|(_, at)| *at)
        .max()
        .unwrap();
    let final_status = client.status().await.unwrap();
    let terminated = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &broker.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let broker_status = loop {
        if let Some(status) = broker.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            terminated.elapsed() < Duration::from_secs(60),
            "the broker did not exit after SIGTERM\n{}",
            logs(work)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let broker_exit_after_term = terminated.elapsed();
    assert!(
        broker_status.success(),
        "broker: {broker_status}\n{}",
        logs(work)
    );
    RunTimes {
        until_complete: complete_at - started,
        drafters_exit_after_complete: last_drafter_exit.saturating_duration_since(complete_at),
        broker_exit_after_term,
        final_status,
    }
}

/// Whether each process reported its span export to the broker (its own
/// status for the broker, the last stats for targets and drafters), and
/// the names of those that reported a dropped or failed span.
fn reported_trace_export(status: &proto::StatusSnapshot) -> (Vec<String>, Vec<String>) {
    let mut reported = Vec::new();
    let mut losing = Vec::new();
    let mut note = |name: &str, stats: Option<&proto::TraceExportStats>| {
        if let Some(stats) = stats {
            reported.push(name.to_string());
            if stats.dropped_spans > 0 || stats.failed_spans > 0 || stats.failing {
                losing.push(name.to_string());
            }
        }
    };
    note("broker", status.trace_export.as_ref());
    for target in &status.targets {
        note(
            &target.target_id,
            target.stats.as_ref().and_then(|s| s.trace_export.as_ref()),
        );
    }
    for drafter in &status.drafters {
        note(
            &drafter.drafter_id,
            drafter.stats.as_ref().and_then(|s| s.trace_export.as_ref()),
        );
    }
    (reported, losing)
}

fn named<'a>(spans: &'a [Received], name: &str) -> Vec<&'a Received> {
    spans
        .iter()
        .filter(|received| received.span.name == name)
        .collect()
}

fn attribute(received: &Received, key: &str) -> Option<String> {
    attributes(&received.span.attributes).remove(key)
}

fn service(received: &Received) -> (String, String) {
    (
        received
            .resource
            .get("service.name")
            .cloned()
            .unwrap_or_default(),
        received
            .resource
            .get("service.instance.id")
            .cloned()
            .unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_span_reaches_a_real_collector_and_a_dead_one_costs_no_exit_time() {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let (endpoint, received) = start_collector(shutdown.clone()).await;

    // 1. Collector up.
    let work = tempfile::tempdir().unwrap();
    let exported = run_pipeline(work.path(), Some(&endpoint)).await;

    // Every process has exited, so every span it will ever send was sent:
    // nothing to wait for.
    let spans = received.lock().unwrap().clone();
    let run_logs = logs(work.path());

    // Each process told apart by its resource, its version set.
    let services: HashSet<(String, String)> = spans.iter().map(service).collect();
    let steps_of = |drafter: usize| -> u64 {
        let report: serde_json::Value = serde_json::from_slice(
            &std::fs::read(work.path().join(format!("drafter-{drafter}.json"))).unwrap(),
        )
        .unwrap();
        report["steps"].as_u64().unwrap()
    };
    // A drafter that took no step has no span to send.
    let drafters_that_stepped: Vec<usize> = (0..DRAFTERS).filter(|&d| steps_of(d) > 0).collect();
    assert!(!drafters_that_stepped.is_empty());
    // Every process told the broker about its exporter (a drafter that took
    // a step sent stats), and none lost a span to a collector that is up:
    // what `dflash top`'s traces line sums.
    let (reported, losing) = reported_trace_export(&exported.final_status);
    let mut must_report = vec!["broker".to_string(), "target-0".into(), "target-1".into()];
    must_report.extend(drafters_that_stepped.iter().map(|d| format!("drafter-{d}")));
    for process in &must_report {
        assert!(
            reported.contains(process),
            "{process} reported no span export: {reported:?}"
        );
    }
    assert!(
        losing.is_empty(),
        "spans lost with the collector up: {losing:?}"
    );
    let mut expected = vec![
        ("dflash-target-server".to_string(), "target-0".to_string()),
        ("dflash-target-server".to_string(), "target-1".to_string()),
    ];
    expected.extend(drafters_that_stepped.iter().map(|drafter| {
        (
            "dflash-drafter-server".to_string(),
            format!("drafter-{drafter}"),
        )
    }));
    for expected in expected {
        assert!(
            services.contains(&expected),
            "{expected:?} not among {services:?}"
        );
    }
    assert!(
        services
            .iter()
            .any(|(name, id)| name == "dflash-broker" && !id.is_empty()),
        "{services:?}"
    );
    assert!(spans.iter().all(|received| received
        .resource
        .get("service.version")
        .is_some_and(|version| !version.is_empty())));

    // Every span arrived once.
    let span_ids: HashSet<&[u8]> = spans
        .iter()
        .map(|received| &received.span.span_id[..])
        .collect();
    assert_eq!(span_ids.len(), spans.len(), "a span arrived twice");
    let samples = SAMPLES;
    let enqueued: HashSet<(String, String)> = named(&spans, "enqueue")
        .into_iter()
        .map(|received| {
            (
                attribute(received, "target_id").unwrap_or_default(),
                attribute(received, "seq").unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        enqueued.len() as u64,
        samples,
        "enqueue spans: {:?}; spans by name {:?}",
        enqueued,
        spans
            .iter()
            .fold(HashMap::<String, usize>::new(), |mut counts, received| {
                *counts
                    .entry(format!("{} {:?}", received.span.name, service(received)))
                    .or_default() += 1;
                counts
            })
    );
    let mut batched_total = 0;
    for target in 0..TARGETS {
        let batched: u64 = named(&spans, "target.batch")
            .into_iter()
            .filter(|received| service(received).1 == format!("target-{target}"))
            .map(|received| {
                attribute(received, "samples")
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
            })
            .sum();
        assert!(batched > 0, "target-{target} sent no batch span");
        batched_total += batched;
    }
    assert_eq!(batched_total, samples, "samples in batch spans");
    // At least one delivery each (more if a lease ran out and it was redelivered).
    assert!(
        named(&spans, "deliver").len() as u64 >= samples,
        "deliver spans"
    );
    let mut trained_keys = HashSet::new();
    for drafter in 0..DRAFTERS {
        let steps: Vec<_> = named(&spans, "drafter.step")
            .into_iter()
            .filter(|received| service(received).1 == format!("drafter-{drafter}"))
            .collect();
        assert_eq!(
            steps.len() as u64,
            steps_of(drafter),
            "drafter-{drafter}'s step spans"
        );
        for step in steps {
            let keys = attribute(step, "dflash.sample_keys").unwrap_or_default();
            trained_keys.extend(keys.lines().map(str::to_string));
        }
    }
    assert_eq!(
        trained_keys.len() as u64,
        samples,
        "samples named by step spans"
    );

    // One sample's path, from its (target, seq) alone.
    let key = ("target-1", "7");
    let enqueue = named(&spans, "enqueue")
        .into_iter()
        .find(|received| {
            attribute(received, "target_id").as_deref() == Some(key.0)
                && attribute(received, "seq").as_deref() == Some(key.1)
        })
        .expect("the sample's enqueue span");
    let trace_id = &enqueue.span.trace_id;
    let batch = named(&spans, "target.batch")
        .into_iter()
        .find(|received| received.span.span_id == enqueue.span.parent_span_id)
        .expect("the enqueue span's parent is its target batch");
    assert_eq!(&batch.span.trace_id, trace_id);
    assert_eq!(service(batch).1, key.0);
    let deliver = named(&spans, "deliver")
        .into_iter()
        .find(|received| {
            attribute(received, "target_id").as_deref() == Some(key.0)
                && attribute(received, "seq").as_deref() == Some(key.1)
        })
        .expect("the sample's deliver span");
    assert_eq!(&deliver.span.trace_id, trace_id);
    let sample_key = format!("{}:{}", key.0, key.1);
    let step = named(&spans, "drafter.step")
        .into_iter()
        .find(|received| {
            attribute(received, "dflash.sample_keys")
                .is_some_and(|keys| keys.lines().any(|line| line == sample_key))
        })
        .expect("the step that trained the sample");
    assert!(
        &step.span.trace_id == trace_id
            || step
                .span
                .links
                .iter()
                .any(|link| &link.trace_id == trace_id),
        "the step that trained {sample_key} neither joins nor links its trace"
    );
    // Links once per producer span, not per sample.
    for step in named(&spans, "drafter.step") {
        let linked: HashSet<&[u8]> = step
            .span
            .links
            .iter()
            .map(|link| &link.span_id[..])
            .collect();
        assert_eq!(linked.len(), step.span.links.len(), "a repeated link");
    }
    assert!(!run_logs.contains("span export failing"), "{run_logs}");

    // 2. No export, then 3. a collector that is down (a port just closed).
    let baseline_work = tempfile::tempdir().unwrap();
    let baseline = run_pipeline(baseline_work.path(), None).await;
    assert_eq!(
        reported_trace_export(&baseline.final_status).0,
        Vec::<String>::new(),
        "no process exports spans without an endpoint"
    );
    // Held closed (bound, never listening) until the run is over.
    let closed = dflash_testkit::ClosedPort::bind();
    let down_work = tempfile::tempdir().unwrap();
    let down = run_pipeline(down_work.path(), Some(&closed.url())).await;
    for (name, times) in [
        ("exported", &exported),
        ("no export", &baseline),
        ("collector down", &down),
    ] {
        eprintln!(
            "{name}: until COMPLETE {:?}, drafters exit after {:?}, broker exit after TERM {:?}",
            times.until_complete, times.drafters_exit_after_complete, times.broker_exit_after_term
        );
    }
    eprintln!(
        "start to COMPLETE: exported {:?}, no export {:?}, collector down {:?}",
        exported.until_complete, baseline.until_complete, down.until_complete
    );
    // A dead collector may cost a process its bounded shutdown
    // (SHUTDOWN_TIMEOUT, 1 s) and no more; a refused connection fails at
    // once, so in practice it costs less. Without the bound each process
    // waited the exporter's own 10 s. Each process logs, as its last line,
    // how long its exit waited on the export, measured around that one
    // call: the test waits for that event in every process's log and
    // checks the figure, so neither the scheduling of the other processes
    // nor a second run's timings enter it. The allowance sits halfway
    // between the bound and the unbounded wait.
    let allowed = dflash_telemetry::SHUTDOWN_TIMEOUT + Duration::from_secs(4);
    for process in ["broker", "target-0", "target-1", "drafter-0", "drafter-1"] {
        let log = std::fs::read_to_string(down_work.path().join(format!("{process}.log"))).unwrap();
        let stopped: Vec<u64> = log
            .lines()
            .filter(|line| line.contains("span export stopped"))
            .map(|line| {
                let took = line.split("took_ms=").nth(1).unwrap_or_default();
                let digits: String = took.chars().take_while(char::is_ascii_digit).collect();
                digits
                    .parse()
                    .unwrap_or_else(|_| panic!("no took_ms in {line:?}"))
            })
            .collect();
        assert_eq!(
            stopped.len(),
            1,
            "{process}: one `span export stopped` line expected\n{log}"
        );
        assert!(
            Duration::from_millis(stopped[0]) <= allowed,
            "{process}: its exit waited {} ms on a dead collector, beyond the bound\n{log}",
            stopped[0]
        );
    }
    // One warning per process, not one per batch.
    let down_logs = logs(down_work.path());
    let warnings = down_logs.matches("span export failing").count();
    assert!(
        (1..=TARGETS + DRAFTERS + 1).contains(&warnings),
        "{warnings} warnings\n{down_logs}"
    );
    shutdown.cancel();
}

/// The W3C trace context the test's producer gives item `seq`: a trace of
/// its own per sample, so a step span's links can be checked sample by
/// sample.
fn sample_trace(seq: u64) -> (String, HashMap<String, String>) {
    let trace_id = format!("{:032x}", 0x5eed_0000_0000_0000_0000_u128 + u128::from(seq));
    let traceparent = format!("00-{trace_id}-{:016x}-01", 0x1000 + seq);
    (
        trace_id,
        HashMap::from([("traceparent".to_string(), traceparent)]),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_step_spans_name_each_sample_in_its_committed_step() {
    const ITEMS: u64 = 30;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let (endpoint, received) = start_collector(shutdown.clone()).await;
    let work = tempfile::tempdir().unwrap();
    let tiny = init_tiny(work.path());
    let (_broker, address) = start_broker(work.path(), Some(&endpoint), 1).await;
    let mut drafters: Vec<Child> = (0..DRAFTERS)
        .map(|drafter| {
            Child(
                command(
                    "drafter-server",
                    work.path(),
                    &format!("drafter-{drafter}.log"),
                    Some(&endpoint),
                )
                .args(["--broker", &address, "--drafter-id"])
                .arg(format!("drafter-{drafter}"))
                .arg("--target-model")
                .arg(&tiny)
                .arg("--output")
                .arg(work.path().join(format!("checkpoints-{drafter}")))
                .args([
                    "--device",
                    "cpu",
                    "--draft-layers",
                    "2",
                    "--block-size",
                    "4",
                ])
                .args(["--num-anchors", "8", "--batch-tokens", "256"])
                .args(["--max-step-samples", "6", "--prefetch-samples", "2"])
                .args(["--linger", "200ms", "--save-every", "0"])
                .env("OMP_NUM_THREADS", "1")
                .env("TORCH_CPP_LOG_LEVEL", "ERROR")
                .spawn()
                .unwrap(),
            )
        })
        .collect();
    let client = BrokerClient::connect(address.clone(), ClientOptions::default())
        .await
        .unwrap();
    let connected = wait_until(RUN_DEADLINE, || async {
        client.status().await.is_ok_and(|status| {
            status
                .drafters
                .iter()
                .filter(|drafter| drafter.connected)
                .count()
                == DRAFTERS
        })
    })
    .await;
    assert!(connected, "the drafters connected\n{}", logs(work.path()));
    let mut producer = client.produce("target-0").await.unwrap();
    for seq in 0..ITEMS {
        producer
            .send(seq, tiny_drafter_sample(seq), sample_trace(seq).1)
            .await
            .unwrap();
    }
    assert_eq!(producer.finish().await.unwrap().accepted, ITEMS);
    client.report_done("target-0", ITEMS).await.unwrap();
    for (drafter, child) in drafters.iter_mut().enumerate() {
        let exit = wait_for_exit(&mut child.0, RUN_DEADLINE).await;
        assert!(
            exit.is_some_and(|status| status.success()),
            "drafter-{drafter} exited {exit:?}\n{}",
            logs(work.path())
        );
    }
    let status = client.status().await.unwrap();
    assert_eq!(status.state(), proto::BrokerState::Complete, "{status:?}");
    let parallel = data_parallel_status(&client).await;
    assert!(parallel.steps_committed > 1, "{parallel:?}");

    // Every drafter has exited, so every span it will send was sent.
    let spans = received.lock().unwrap().clone();
    let mut named_by: HashMap<u64, Vec<&Received>> = HashMap::new();
    for step in named(&spans, "drafter.step") {
        for key in attribute(step, "dflash.sample_keys")
            .unwrap_or_default()
            .lines()
        {
            let (target_id, seq) = key.rsplit_once(':').expect("target:seq");
            assert_eq!(target_id, "target-0", "{key}");
            named_by.entry(seq.parse().unwrap()).or_default().push(step);
        }
    }
    let committed =
        committed_samples(&std::fs::read_to_string(work.path().join("broker.log")).unwrap());
    for seq in 0..ITEMS {
        let steps = named_by.get(&seq).map(Vec::as_slice).unwrap_or_default();
        let [step] = steps else {
            panic!(
                "target-0:{seq} is named by {} step spans, not one",
                steps.len()
            );
        };
        let committed_in = committed
            .get(&("target-0".to_string(), seq))
            .unwrap_or_else(|| {
                panic!("target-0:{seq} in no committed step of the broker's record")
            });
        assert_eq!(
            committed_in.len(),
            1,
            "target-0:{seq} committed in {committed_in:?}"
        );
        assert_eq!(
            attribute(step, "step").as_deref(),
            Some(committed_in[0].to_string().as_str()),
            "target-0:{seq}: the span's step and the broker's record"
        );
        let trace_id = hex_bytes(&sample_trace(seq).0);
        assert!(
            step.span.trace_id == trace_id
                || step.span.links.iter().any(|link| link.trace_id == trace_id),
            "the step that trained target-0:{seq} neither joins nor links its trace"
        );
    }
    assert_eq!(
        named_by.len() as u64,
        ITEMS,
        "step spans name only produced samples"
    );
    shutdown.cancel();
}

fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).unwrap())
        .collect()
}
