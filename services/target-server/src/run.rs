//! [`run`]: one target-server from flags to ReportDone, in its steps:
//! check the flags, register the metrics, start the threads
//! ([`crate::threads`]), connect and stream the shard ([`crate::pump`]
//! over [`crate::stream`]), join every thread within `--finish-timeout`,
//! then ReportDone. Also the run's error and report types.

use crate::compute::{run_host_copy_thread, ComputeError, PipelineCounters, ReadyItem};
use crate::config::{ModelSource, TargetServerConfig};
use crate::metrics::TargetMetrics;
use crate::pump::Pump;
use crate::reader::{count_records, ReaderError, ReaderSummary};
use crate::shard::{resolve_shard, ShardError, ShardSpec};
use crate::stream::ResilientProducer;
use crate::threads::{blocking, spawn_named, spawn_reader, PipelineThreads, BATCH_CHANNEL_DEPTH};
use dflash_client::{BrokerClient, ClientError};
use dflash_device::WorkerError;
use dflash_model::chat::EncoderError;
use dflash_model::ModelError;
use dflash_telemetry::{Registry, RegistryError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::Device;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Why a target-server run failed.
#[derive(Debug, thiserror::Error)]
pub enum TargetServerError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("model: {0}")]
    Model(#[from] ModelError),
    #[error("tokenizer: {0}")]
    Encoder(#[from] EncoderError),
    #[error("data: {0}")]
    Reader(#[from] ReaderError),
    #[error("shard: {0}")]
    Shard(#[from] ShardError),
    #[error("broker: {0}")]
    Broker(#[from] ClientError),
    #[error("compute: {0}")]
    Compute(#[from] ComputeError),
    #[error(transparent)]
    Thread(#[from] WorkerError),
    #[error("watchdog: the compute pipeline produced no batch for {seconds:.0} s (--watchdog-timeout) with the shard not done; a compute thread is stuck")]
    Stalled { seconds: f64 },
    #[error("cannot listen for metrics on {address}: {source}")]
    MetricsListen {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(#[from] RegistryError),
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct TargetReport {
    pub target_id: String,
    pub shard: ShardSpec,
    /// False when shut down before the shard was done (no ReportDone sent).
    pub completed: bool,
    pub layer_ids: Vec<usize>,
    pub device: String,
    /// Where the broker said this target stood when the run began.
    pub resume_after_seq: Option<u64>,
    /// Items sent by this run.
    pub samples_sent: u64,
    /// Real tokens sent by this run.
    pub tokens_sent: u64,
    /// Newly accepted / already present / rejected items of the final stream.
    pub accepted: u64,
    pub duplicates: u64,
    pub rejected: Vec<(u64, String)>,
    /// Items the broker holds from this target over all runs (its own count).
    pub total_accepted: u64,
    /// What ReportDone said: the valid samples this target read from its
    /// shard (every seq it numbered, resumed ones included), counted by the
    /// target itself so the broker's check catches an item it never stored.
    /// None when no ReportDone was sent.
    pub reported_total: Option<u64>,
    pub reader: ReaderSummary,
    pub reconnects: u32,
    /// Wall time from the first forward to the last computed batch.
    pub compute_wall: Duration,
    pub tokens_per_second: f64,
    /// Fraction of `compute_wall` the device was busy.
    pub busy_fraction: f64,
    /// The GPU's peak memory in use after a batch (NVML), on CUDA only.
    pub device_memory_peak_bytes: Option<u64>,
    /// Captures with a NaN or an infinity that were not sent
    /// (`--on-non-finite skip`); ReportDone's total leaves them out.
    pub non_finite_skipped: u64,
}

/// Runs one target-server until its shard is done (then ReportDone) or
/// `shutdown` is cancelled (then the stream is closed without ReportDone, so
/// a restart resumes where the broker is). When `config.metrics_listen` is
/// set, serves Prometheus metrics there for as long as the run lasts.
pub async fn run(
    config: TargetServerConfig,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    let metrics_listener = dflash_telemetry::bind_metrics_listener(config.metrics_listen)
        .await
        .map_err(|(address, source)| TargetServerError::MetricsListen { address, source })?;
    run_with_metrics_listener(config, metrics_listener, shutdown).await
}

/// [`run`] with the metrics endpoint on an already bound listener (tests
/// bind `127.0.0.1:0` to learn the port) instead of `config.metrics_listen`,
/// or none. The endpoint is an owned task: it stops when `shutdown` is
/// cancelled or the run returns, whichever comes first.
pub async fn run_with_metrics_listener(
    config: TargetServerConfig,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    run_with_registry(
        config,
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
    let run = run_to_end(config, &registry, shutdown.clone());
    dflash_telemetry::MetricsEndpoint::during(metrics_listener, registry.clone(), &shutdown, run)
        .await
}

/// The run itself, updating the instruments it registers in `registry`:
/// check, start the compute thread, stream the shard, join the threads,
/// report done.
async fn run_to_end(
    config: TargetServerConfig,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    check_config(&config)?;
    let device = dflash_model::device::resolve_device(config.device)
        .map_err(|error| TargetServerError::Config(error.to_string()))?;
    // The label the backend will report, known before the model loads so
    // the metrics exist (at zero) from the first scrape.
    let device_name = match &config.model {
        ModelSource::Synthetic(_) => "synthetic".to_string(),
        ModelSource::Directory(_) => dflash_model::device::device_label(device),
    };
    let metrics = TargetMetrics::register(registry, &config.target_id, &device_name)?;
    let gpu_memory = match (&config.model, device) {
        (ModelSource::Directory(_), Device::Cuda(index)) => {
            dflash_device::GpuMemoryMonitor::start(index).map(Arc::new)
        }
        _ => None,
    };
    // Data first: an empty or missing file should fail before anything loads.
    let record_count = count_input_records(&config).await?;
    let mut threads = PipelineThreads::start(&config, device, &shutdown)?;
    let outcome = stream_shard(
        &config,
        record_count,
        &shutdown,
        &mut threads,
        &metrics,
        gpu_memory.clone(),
    )
    .await;
    let joined = threads.join(config.finish_timeout).await;
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

/// The checks that need no thread: flags that cannot work together, a
/// model directory without a config.
fn check_config(config: &TargetServerConfig) -> Result<(), TargetServerError> {
    if config.data.is_none() && matches!(config.model, ModelSource::Directory(_)) {
        return Err(TargetServerError::Config(
            "--data is required unless --model is synthetic".into(),
        ));
    }
    if config.max_length == 0 || config.max_batch_tokens == 0 || config.sort_window == 0 {
        return Err(TargetServerError::Config(
            "--max-length, --max-batch-tokens and --sort-window must be positive".into(),
        ));
    }
    if let ModelSource::Directory(directory) = &config.model {
        let config_file = directory.join(dflash_model::target_model::CONFIG_FILE_NAME);
        if !config_file.is_file() {
            return Err(TargetServerError::Model(ModelError::Io {
                path: config_file,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no such file (is --model a model directory?)",
                ),
            }));
        }
    }
    Ok(())
}

/// Valid records in `--data` (an empty file is an error), or the synthetic
/// sample count.
async fn count_input_records(config: &TargetServerConfig) -> Result<u64, TargetServerError> {
    let Some(path) = config.data.clone() else {
        return Ok(match &config.model {
            ModelSource::Synthetic(spec) => spec.samples,
            ModelSource::Directory(_) => 0,
        });
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
    config: &TargetServerConfig,
    record_count: u64,
    shutdown: &CancellationToken,
    threads: &mut PipelineThreads,
    metrics: &TargetMetrics,
    gpu_memory: Option<Arc<dflash_device::GpuMemoryMonitor>>,
) -> Result<(TargetReport, BrokerClient), TargetServerError> {
    let (client, shard) = connect(config).await?;
    let info = tokio::select! {
        loaded = threads.compute.ready() => loaded??,
        () = shutdown.cancelled() => return Err(TargetServerError::Config("shut down while loading the model".into())),
    };
    let producer =
        ResilientProducer::open(client.clone(), &config.target_id, config.max_reconnects).await?;
    let resume_after_seq = producer.resume_after_seq();
    let samples_total = shard.records_in_shard(record_count);
    tracing::info!(
        target_id = %config.target_id,
        shard_index = shard.index,
        num_shards = shard.count,
        samples_in_shard = samples_total,
        resume_after_seq = ?resume_after_seq,
        layer_ids = ?info.layer_ids,
        device = %info.device_label,
        "target-server starting"
    );
    threads.reader = Some(spawn_reader(config, shard, resume_after_seq, &info, threads).await?);
    let counters = Arc::new(PipelineCounters::default());
    let epoch = Instant::now();
    let (ready_sender, ready_receiver) =
        tokio::sync::mpsc::channel::<Vec<ReadyItem>>(BATCH_CHANNEL_DEPTH);
    let computed = threads.compute.take_event_receiver()?;
    threads.host_copy = Some({
        let counters = counters.clone();
        let metrics = metrics.clone();
        let on_non_finite = config.on_non_finite;
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
        config,
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
    config: &TargetServerConfig,
) -> Result<(BrokerClient, ShardSpec), TargetServerError> {
    let options = config
        .security
        .client_options()
        .map_err(dflash_client::ClientError::from)?;
    let client = BrokerClient::connect(config.broker.clone(), options).await?;
    let status = client.status().await?;
    let shard = resolve_shard(
        config.shard_index,
        config.num_shards,
        &config.target_id,
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
