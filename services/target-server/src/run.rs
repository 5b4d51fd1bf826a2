//! [`run`]: one target-server from flags to ReportDone, in its steps:
//! check the flags, register the metrics, start the threads
//! ([`crate::threads`]), connect, tell the compute thread what the run
//! captures ([`crate::capture`]), stream the shard ([`crate::pump`] over
//! [`crate::stream`]), join every thread within `--finish-timeout`,
//! then ReportDone. Also the run's error and report types.

use crate::capture::CaptureError;
use crate::compute::{run_host_copy_thread, PipelineCounters, ReadyItem};
use crate::config::TargetServerConfig;
use crate::error::TargetServerError;
use crate::metrics::TargetMetrics;
use crate::pump::Pump;
use crate::reader::{count_records, ReaderError};
use crate::report::TargetReport;
use crate::settings::{Connection, InputSettings, ModelSource, ShardRequest, TargetSettings};
use crate::shard::{resolve_shard, ShardSpec};
use crate::stream::ResilientProducer;
use crate::threads::{blocking, spawn_named, spawn_reader, PipelineThreads, BATCH_CHANNEL_DEPTH};
use dflash_client::BrokerClient;
use dflash_telemetry::Registry;
use std::sync::Arc;
use std::time::Instant;
use tch::Device;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Runs one target-server until its shard is done (then ReportDone) or
/// `shutdown` is cancelled (then the stream is closed without ReportDone, so
/// a restart resumes where the broker is). The flags are checked and split
/// into their typed parts here, once. When `--metrics-listen` is set,
/// serves Prometheus metrics there for as long as the run lasts.
pub async fn run(
    config: TargetServerConfig,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    let settings = config.validate()?;
    let metrics_listener = dflash_telemetry::bind_metrics_listener(settings.metrics_listen)
        .await
        .map_err(|(address, source)| TargetServerError::MetricsListen { address, source })?;
    run_with_settings(
        settings,
        Arc::new(Registry::new()),
        metrics_listener,
        shutdown,
    )
    .await
}

/// [`run`] with the metrics endpoint on an already bound listener (tests
/// bind `127.0.0.1:0` to learn the port) instead of `--metrics-listen`,
/// or none. The endpoint is an owned task: it stops when `shutdown` is
/// cancelled or the run returns, whichever comes first.
pub async fn run_with_metrics_listener(
    config: TargetServerConfig,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    run_with_settings(
        config.validate()?,
        Arc::new(Registry::new()),
        metrics_listener,
        shutdown,
    )
    .await
}

/// [`run_with_metrics_listener`] updating the instruments in `registry`,
/// which the caller keeps: tests read the final values after the run
/// returned, whatever its outcome.
pub async fn run_with_registry(
    config: TargetServerConfig,
    registry: Arc<Registry>,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    run_with_settings(config.validate()?, registry, metrics_listener, shutdown).await
}

async fn run_with_settings(
    settings: TargetSettings,
    registry: Arc<Registry>,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    let run = run_to_end(settings, &registry, shutdown.clone());
    dflash_telemetry::MetricsEndpoint::during(metrics_listener, registry.clone(), &shutdown, run)
        .await
}

/// The run itself, updating the instruments it registers in `registry`:
/// check, start the compute thread, stream the shard, join the threads,
/// report done.
async fn run_to_end(
    settings: TargetSettings,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    let device = dflash_model::device::resolve_device(settings.compute.device)
        .map_err(|error| TargetServerError::Config(error.to_string()))?;
    // The label the backend will report, known before the model loads so
    // the metrics exist (at zero) from the first scrape.
    let device_name = match &settings.compute.model {
        ModelSource::Synthetic(_) => "synthetic".to_string(),
        ModelSource::Directory(_) => dflash_model::device::device_label(device),
    };
    let metrics = TargetMetrics::register(registry, &settings.connection.target_id, &device_name)?;
    let gpu_memory = match (&settings.compute.model, device) {
        (ModelSource::Directory(_), Device::Cuda(index)) => {
            dflash_device::GpuMemoryMonitor::start(index).map(Arc::new)
        }
        _ => None,
    };
    // Data first: an empty or missing file should fail before anything loads.
    let record_count = count_input_records(&settings.input).await?;
    let mut threads = PipelineThreads::start(&settings.compute, device, &shutdown)?;
    let outcome = stream_shard(
        &settings,
        record_count,
        &shutdown,
        &mut threads,
        &metrics,
        gpu_memory.clone(),
    )
    .await;
    let joined = threads.join(settings.pump.finish_timeout).await;
    let (mut report, client) = outcome?;
    // The pipeline's own failures come before a report: they explain an
    // early end.
    if let Some(summary) = joined.into_result()? {
        report.reader = summary;
    }
    report.device_memory_peak_bytes = gpu_memory.map(|monitor| monitor.peak_bytes());
    if report.completed {
        finish_run(&client, &mut report).await?;
    }
    Ok(report)
}

/// Valid records in `--data` (an empty file is an error), or the synthetic
/// sample count.
async fn count_input_records(input: &InputSettings) -> Result<u64, TargetServerError> {
    let Some(path) = input.data.clone() else {
        return Ok(input.synthetic.as_ref().map_or(0, |spec| spec.samples));
    };
    let count = blocking("record count", {
        let path = path.clone();
        move || count_records(&path)
    })
    .await??;
    if count == 0 {
        return Err(ReaderError::EmptyDataFile { path }.into());
    }
    Ok(count)
}

/// Connects, waits for the model, starts the reader and host-copy threads,
/// pumps their samples to the broker and closes the stream: the report
/// (without the reader's summary and ReportDone, which come after the
/// threads are joined) and the client for ReportDone.
async fn stream_shard(
    settings: &TargetSettings,
    record_count: u64,
    shutdown: &CancellationToken,
    threads: &mut PipelineThreads,
    metrics: &TargetMetrics,
    gpu_memory: Option<Arc<dflash_device::GpuMemoryMonitor>>,
) -> Result<(TargetReport, BrokerClient), TargetServerError> {
    let connection = &settings.connection;
    let (client, shard) = connect(connection, settings.shard).await?;
    let info = tokio::select! {
        loaded = threads.compute.ready() => loaded??,
        () = shutdown.cancelled() => return Err(TargetServerError::Config("shut down while loading the model".into())),
    };
    let producer = ResilientProducer::open(
        client.clone(),
        &connection.target_id,
        connection.max_reconnects,
    )
    .await?;
    // The run decides what each sample carries: the compute thread learns it
    // from the welcome before the reader (started below) hands it a batch.
    let capture = producer.capture();
    if capture.last_hidden_states && matches!(settings.compute.model, ModelSource::Synthetic(_)) {
        return Err(CaptureError::SyntheticLastHiddenStates.into());
    }
    threads.set_capture(capture);
    let resume_after_seq = producer.resume_after_seq();
    let samples_total = shard.records_in_shard(record_count);
    tracing::info!(
        target_id = %connection.target_id,
        shard_index = shard.index,
        num_shards = shard.count,
        samples_in_shard = samples_total,
        resume_after_seq = ?resume_after_seq,
        layer_ids = ?info.layer_ids,
        %capture,
        device = %info.device_label,
        "target-server starting"
    );
    threads.reader =
        Some(spawn_reader(&settings.input, shard, resume_after_seq, &info, threads).await?);
    let counters = Arc::new(PipelineCounters::default());
    let epoch = Instant::now();
    let (ready_sender, ready_receiver) =
        tokio::sync::mpsc::channel::<Vec<ReadyItem>>(BATCH_CHANNEL_DEPTH);
    let computed = threads.compute.take_event_receiver()?;
    threads.host_copy = Some({
        let counters = counters.clone();
        let metrics = metrics.clone();
        let on_non_finite = settings.compute.on_non_finite;
        spawn_named("host-copy", move || {
            run_host_copy_thread(
                computed,
                ready_sender,
                counters,
                metrics,
                gpu_memory,
                epoch,
                on_non_finite,
            )
        })?
    });
    let mut pump = Pump {
        settings: settings.pump,
        target_id: connection.target_id.clone(),
        metrics,
        accepted_at_start: producer.accepted_before(),
        producer,
        counters,
        epoch,
        shard,
        layer_ids: info.layer_ids.clone(),
        device_label: info.device_label.clone(),
        resume_after_seq,
        samples_total,
        samples_sent: 0,
        tokens_sent: 0,
        tokens_at_last_stats: 0,
        last_stats_at: Instant::now(),
    };
    let interrupted = pump.run(shutdown, ready_receiver).await?;
    Ok((pump.close(!interrupted).await?, client))
}

/// The broker connection and this target's shard (the broker's status says
/// how many targets the run expects).
async fn connect(
    connection: &Connection,
    shard: ShardRequest,
) -> Result<(BrokerClient, ShardSpec), TargetServerError> {
    let options = connection
        .security
        .client_options()
        .map_err(dflash_client::ClientError::from)?;
    let client = BrokerClient::connect(connection.broker.clone(), options).await?;
    let status = client.status().await?;
    let shard = resolve_shard(
        shard.shard_index,
        shard.num_shards,
        &connection.target_id,
        Some(status.expected_targets),
    )?;
    Ok((client, shard))
}

/// Reports the shard done with the number of samples the reader numbered
/// (not the broker's count, which would make the broker's check vacuous).
async fn finish_run(
    client: &BrokerClient,
    report: &mut TargetReport,
) -> Result<(), TargetServerError> {
    // What the broker must hold: every sample numbered, less the captures
    // this process refused to send (never a sample the broker lost).
    let total_items = report
        .reader
        .samples
        .saturating_sub(report.non_finite_skipped);
    client.report_done(&report.target_id, total_items).await?;
    report.reported_total = Some(total_items);
    tracing::info!(
        target_id = %report.target_id,
        total_items,
        sent = report.samples_sent,
        rejected = report.rejected.len(),
        tokens_per_second = format!("{:.0}", report.tokens_per_second),
        busy_fraction = format!("{:.2}", report.busy_fraction),
        "shard done; reported done"
    );
    Ok(())
}
