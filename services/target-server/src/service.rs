//! [`run`]: one target-server from flags to ReportDone.

use crate::compute::{
    run_compute_thread, run_host_copy_thread, Backend, BackendInfo, ComputeError, PipelineCounters,
    ReadySample, SyntheticBackend,
};
use crate::config::{ModelSource, SyntheticSpec, TargetServerConfig};
use crate::data::{ChatEncoder, Conversation, EncoderError};
use crate::metrics::TargetMetrics;
use crate::reader::{
    count_records, BatchReader, ReaderError, ReaderSettings, ReaderSummary, Record, RecordContent,
    ShardLines,
};
use crate::sender::ResilientProducer;
use crate::shard::{resolve_shard, ShardError, ShardSpec};
use dflash_client::{BrokerClient, ClientError};
use dflash_model::target::{build_target_layer_ids, TargetModel};
use dflash_model::ModelError;
use dflash_proto::v1::ProducerStats;
use dflash_telemetry::{Registry, RegistryError};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
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
    #[error("the {0} thread panicked")]
    ThreadPanicked(&'static str),
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
}

/// Samples of data kept in flight between threads (batches per channel).
const BATCH_CHANNEL_DEPTH: usize = 2;

/// How long the metrics endpoint gets to stop once the run is over.
const METRICS_STOP_TIMEOUT: Duration = Duration::from_secs(3);

/// Loads the backend on the compute thread (CUDA state stays on the thread
/// that uses it) and works out the layer ids.
fn load_backend(config: &TargetServerConfig, device: Device) -> Result<Backend, TargetServerError> {
    match &config.model {
        ModelSource::Synthetic(spec) => {
            if config
                .layer_ids
                .as_ref()
                .is_some_and(|ids| ids.len() != spec.layers)
            {
                return Err(TargetServerError::Config(
                    "--layer-ids has a different count than synthetic layers=".to_string(),
                ));
            }
            Ok(Backend::Synthetic(SyntheticBackend::new(spec.clone())))
        }
        ModelSource::Directory(directory) => {
            let kind = dflash_model::device::kind_for(config.dtype, device);
            let model = TargetModel::load(directory, device, kind)?;
            let num_layers = model.config().num_hidden_layers;
            let layer_ids = match &config.layer_ids {
                Some(ids) => ids.clone(),
                None => build_target_layer_ids(num_layers, config.num_draft_layers),
            };
            if layer_ids.is_empty() {
                return Err(TargetServerError::Config(
                    "no layer ids (--layer-ids or --num-draft-layers)".into(),
                ));
            }
            if let Some(bad) = layer_ids.iter().find(|&&id| id >= num_layers) {
                return Err(TargetServerError::Config(format!(
                    "layer id {bad} out of range: {} has {num_layers} layers",
                    directory.display()
                )));
            }
            Ok(Backend::Target {
                model: Box::new(model),
                layer_ids,
            })
        }
    }
}

/// Generated records for synthetic mode without `--data`.
fn generated_records(
    spec: &SyntheticSpec,
    shard: ShardSpec,
) -> impl Iterator<Item = Result<Record, ReaderError>> {
    let spec = spec.clone();
    (0..spec.samples)
        .filter(move |&index| shard.contains(index))
        .map(move |index| {
            let mut state =
                spec.seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
            let input_ids = (0..spec.seq_len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % spec.vocab as u64) as i64
                })
                .collect();
            // A prompt quarter without loss, like a chat sample.
            let loss_mask = (0..spec.seq_len)
                .map(|position| u8::from(position >= spec.seq_len / 4))
                .collect();
            Ok(Record {
                line_number: 0,
                content: RecordContent::Generated(Conversation::PreTokenized {
                    input_ids,
                    loss_mask,
                }),
            })
        })
}

/// The threads of one pipeline, owned so they are always joined.
struct PipelineThreads {
    reader: Option<std::thread::JoinHandle<Result<ReaderSummary, ReaderError>>>,
    compute: std::thread::JoinHandle<Result<(), ComputeError>>,
    host_copy: Option<std::thread::JoinHandle<Result<(), ComputeError>>>,
}

fn spawn_named<T: Send + 'static>(
    name: &'static str,
    body: impl FnOnce() -> T + Send + 'static,
) -> Result<std::thread::JoinHandle<T>, TargetServerError> {
    std::thread::Builder::new()
        .name(format!("dflash-{name}"))
        .spawn(body)
        .map_err(|error| {
            TargetServerError::Config(format!("cannot start the {name} thread: {error}"))
        })
}

/// Joins a thread without blocking the runtime, within `bound`.
async fn join_thread<T: Send + 'static>(
    name: &'static str,
    handle: std::thread::JoinHandle<T>,
    bound: Duration,
) -> Result<T, TargetServerError> {
    let joined =
        tokio::time::timeout(bound, tokio::task::spawn_blocking(move || handle.join())).await;
    match joined {
        Ok(Ok(Ok(value))) => Ok(value),
        Ok(Ok(Err(_))) | Ok(Err(_)) => Err(TargetServerError::ThreadPanicked(name)),
        Err(_) => {
            tracing::error!(
                thread = name,
                ?bound,
                "thread did not stop in time; leaving it behind"
            );
            Err(TargetServerError::ThreadPanicked(name))
        }
    }
}

/// Runs one target-server until its shard is done (then ReportDone) or
/// `shutdown` is cancelled (then the stream is closed without ReportDone, so
/// a restart resumes where the broker is). When `config.metrics_listen` is
/// set, serves Prometheus metrics there for as long as the run lasts.
pub async fn run(
    config: TargetServerConfig,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
    let metrics_listener = match config.metrics_listen {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .map_err(|source| TargetServerError::MetricsListen { address, source })?,
        ),
        None => None,
    };
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
    let endpoint =
        dflash_telemetry::MetricsEndpoint::start(metrics_listener, registry.clone(), &shutdown);
    let outcome = run_pipeline(config, &registry, shutdown).await;
    endpoint.stop(METRICS_STOP_TIMEOUT).await;
    outcome
}

/// The run itself, updating the instruments it registers in `registry`.
async fn run_pipeline(
    config: TargetServerConfig,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<TargetReport, TargetServerError> {
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
        if !directory
            .join(dflash_model::target::CONFIG_FILE_NAME)
            .is_file()
        {
            return Err(TargetServerError::Model(ModelError::Io {
                path: directory.join(dflash_model::target::CONFIG_FILE_NAME),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no such file (is --model a model directory?)",
                ),
            }));
        }
    }
    let device = dflash_model::device::resolve_device(config.device)
        .map_err(|error| TargetServerError::Config(error.to_string()))?;
    // The label the backend will report, known before the model loads so
    // the metrics exist (at zero) from the first scrape.
    let device_name = match &config.model {
        ModelSource::Synthetic(_) => "synthetic".to_string(),
        ModelSource::Directory(_) => dflash_model::device::device_label(device),
    };
    let metrics = TargetMetrics::register(registry, &config.target_id, &device_name)?;
    // Data first: an empty or missing file should fail before anything loads.
    let record_count = match &config.data {
        Some(path) => {
            let path = path.clone();
            let count = tokio::task::spawn_blocking(move || count_records(&path))
                .await
                .map_err(|_| TargetServerError::ThreadPanicked("record count"))??;
            if count == 0 {
                return Err(ReaderError::EmptyDataFile {
                    path: config.data.clone().unwrap_or_default(),
                }
                .into());
            }
            count
        }
        None => match &config.model {
            ModelSource::Synthetic(spec) => spec.samples,
            ModelSource::Directory(_) => 0,
        },
    };

    // The compute thread loads the model while we talk to the broker.
    let stop = shutdown.child_token();
    let (batch_sender, batch_receiver) = std::sync::mpsc::sync_channel(BATCH_CHANNEL_DEPTH);
    let (computed_sender, computed_receiver) = std::sync::mpsc::sync_channel(1);
    let (loaded_sender, loaded_receiver) =
        tokio::sync::oneshot::channel::<Result<BackendInfo, TargetServerError>>();
    let compute = {
        let config = config.clone();
        let stop = stop.clone();
        spawn_named("compute", move || {
            let backend = match load_backend(&config, device) {
                Ok(backend) => backend,
                Err(error) => {
                    let _ = loaded_sender.send(Err(error));
                    return Ok(());
                }
            };
            if loaded_sender.send(Ok(backend.info())).is_err() {
                return Ok(());
            }
            run_compute_thread(
                backend,
                batch_receiver,
                computed_sender,
                stop,
                config.test_hang_compute_after_batches,
            )
        })?
    };
    let mut threads = PipelineThreads {
        reader: None,
        compute,
        host_copy: None,
    };
    let outcome = run_with_threads(
        &config,
        record_count,
        &stop,
        &shutdown,
        &mut threads,
        batch_sender,
        computed_receiver,
        loaded_receiver,
        &metrics,
    )
    .await;
    stop.cancel();
    let bound = config.finish_timeout;
    let reader_result = match threads.reader.take() {
        Some(reader) => Some(join_thread("reader", reader, bound).await),
        None => None,
    };
    let host_copy_result = match threads.host_copy.take() {
        Some(host_copy) => Some(join_thread("host-copy", host_copy, bound).await),
        None => None,
    };
    let compute_result = join_thread("compute", threads.compute, bound).await;
    let (mut report, client) = outcome?;
    // The pipeline's own failures come first: they explain an early end.
    if let Some(result) = reader_result {
        report.reader = result??;
    }
    compute_result??;
    if let Some(result) = host_copy_result {
        result??;
    }
    if report.completed {
        finish_run(&client, &mut report).await?;
    }
    Ok(report)
}

#[allow(clippy::too_many_arguments)]
async fn run_with_threads(
    config: &TargetServerConfig,
    record_count: u64,
    stop: &CancellationToken,
    shutdown: &CancellationToken,
    threads: &mut PipelineThreads,
    batch_sender: std::sync::mpsc::SyncSender<crate::batching::PlannedBatch>,
    computed_receiver: std::sync::mpsc::Receiver<crate::compute::ComputedBatch>,
    loaded_receiver: tokio::sync::oneshot::Receiver<Result<BackendInfo, TargetServerError>>,
    metrics: &TargetMetrics,
) -> Result<(TargetReport, BrokerClient), TargetServerError> {
    let options = config
        .security
        .client_options()
        .map_err(dflash_client::ClientError::from)?;
    let window = options.producer_window_items;
    let client = BrokerClient::connect(config.broker.clone(), options).await?;
    let status = client.status().await?;
    let shard = resolve_shard(
        config.shard_index,
        config.num_shards,
        &config.target_id,
        Some(status.expected_targets),
    )?;
    let info = tokio::select! {
        loaded = loaded_receiver => loaded.map_err(|_| TargetServerError::ThreadPanicked("compute"))??,
        () = shutdown.cancelled() => return Err(TargetServerError::Config("shut down while loading the model".into())),
    };
    let mut producer = ResilientProducer::open(
        client.clone(),
        &config.target_id,
        window,
        config.max_reconnects,
    )
    .await?;
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

    // Reader thread: the tokenizer loads there too (it can take a second).
    let tokenizer_directory: Option<PathBuf> = config.tokenizer.clone().or(match &config.model {
        ModelSource::Directory(directory) => Some(directory.clone()),
        ModelSource::Synthetic(_) => None,
    });
    let encoder = match &tokenizer_directory {
        Some(directory) => {
            let directory = directory.clone();
            let max_length = config.max_length;
            let vocab_size = Some(info.vocab_size);
            tokio::task::spawn_blocking(move || {
                ChatEncoder::from_directory(&directory, max_length, vocab_size)
            })
            .await
            .map_err(|_| TargetServerError::ThreadPanicked("tokenizer"))??
        }
        None => ChatEncoder::pre_tokenized_only(config.max_length, Some(info.vocab_size)),
    };
    let settings = ReaderSettings {
        window_size: config.sort_window,
        max_batch_tokens: config.max_batch_tokens,
        resume_after_seq,
        max_bad_lines: config.max_bad_lines,
        data_path: config
            .data
            .clone()
            .unwrap_or_else(|| PathBuf::from("(generated)")),
    };
    let reader_stop = stop.clone();
    let data_path = config.data.clone();
    let synthetic_spec = match &config.model {
        ModelSource::Synthetic(spec) => Some(spec.clone()),
        ModelSource::Directory(_) => None,
    };
    threads.reader = Some(spawn_named("reader", move || {
        let records: Box<dyn Iterator<Item = Result<Record, ReaderError>>> =
            match (&data_path, &synthetic_spec) {
                (Some(path), _) => Box::new(ShardLines::open(path, shard)?),
                (None, Some(spec)) => Box::new(generated_records(spec, shard)),
                (None, None) => Box::new(std::iter::empty()),
            };
        let mut reader = BatchReader::new(records, encoder, settings);
        for batch in reader.by_ref() {
            if reader_stop.is_cancelled() || batch_sender.send(batch?).is_err() {
                break;
            }
        }
        Ok(reader.summary().clone())
    })?);

    let counters = Arc::new(PipelineCounters::default());
    let epoch = Instant::now();
    let (ready_sender, mut ready_receiver) =
        tokio::sync::mpsc::channel::<Vec<ReadySample>>(BATCH_CHANNEL_DEPTH);
    {
        let counters = counters.clone();
        let metrics = metrics.clone();
        threads.host_copy = Some(spawn_named("host-copy", move || {
            run_host_copy_thread(computed_receiver, ready_sender, counters, metrics, epoch)
        })?);
    }

    let stats_of = |samples_done: u64| {
        let elapsed = epoch.elapsed();
        let first_forward =
            Duration::from_nanos(counters.first_forward_nanos.load(Ordering::Relaxed));
        let busy = Duration::from_nanos(counters.busy_nanos.load(Ordering::Relaxed));
        let active = elapsed.saturating_sub(first_forward);
        let tokens = counters.tokens_computed.load(Ordering::Relaxed);
        (
            tokens,
            active,
            if active.is_zero() {
                0.0
            } else {
                (busy.as_secs_f64() / active.as_secs_f64()).min(1.0)
            },
            samples_done,
        )
    };
    let accepted_before = producer.accepted_before();
    let mut samples_sent = 0u64;
    let mut tokens_sent = 0u64;
    let mut interrupted = false;
    let mut stats_timer = tokio::time::interval(config.stats_period());
    stats_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tokens_at_last_stats = 0u64;
    let mut last_stats_at = Instant::now();
    // The watchdog: time since the pipeline last handed over a batch. Sends
    // (which wait on the broker's backpressure) happen in the same loop, so
    // that wait is excluded: the clock restarts after each batch is sent.
    let watchdog = config.watchdog_timeout;
    let mut last_batch_at = Instant::now();
    let mut watchdog_timer = tokio::time::interval(
        (watchdog / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)),
    );
    watchdog_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => {
                interrupted = true;
                break;
            }
            _ = watchdog_timer.tick(), if !watchdog.is_zero() => {
                if last_batch_at.elapsed() >= watchdog {
                    tracing::error!(seconds = watchdog.as_secs_f64(), samples_sent, "watchdog: no batch from the compute pipeline");
                    return Err(TargetServerError::Stalled { seconds: watchdog.as_secs_f64() });
                }
            }
            _ = stats_timer.tick() => {
                let (tokens, _, busy_fraction, samples_done) = stats_of(accepted_before + samples_sent);
                let window_seconds = last_stats_at.elapsed().as_secs_f64();
                let tokens_per_second = if window_seconds > 0.0 { (tokens - tokens_at_last_stats) as f64 / window_seconds } else { 0.0 };
                tokens_at_last_stats = tokens;
                last_stats_at = Instant::now();
                metrics.tokens_per_second.set(tokens_per_second);
                metrics.busy_fraction.set(busy_fraction);
                tracing::info!(samples_done, samples_total, tokens_per_second = format!("{tokens_per_second:.0}"), busy_fraction = format!("{busy_fraction:.2}"), "progress");
                producer.send_stats(ProducerStats {
                    tokens_per_second,
                    busy_fraction,
                    device: info.device_label.clone(),
                    samples_done,
                    samples_total,
                    tokens_done: tokens,
                }).await;
            }
            ready = ready_receiver.recv() => {
                let Some(samples) = ready else { break };
                for ready_sample in samples {
                    producer
                        .send(ready_sample.seq, ready_sample.sample, ready_sample.trace_context)
                        .await
                        .inspect_err(|error| count_refused_item(metrics, error))?;
                    samples_sent += 1;
                    tokens_sent += ready_sample.tokens;
                    metrics.samples_sent.increment();
                    metrics.tokens.add(ready_sample.tokens);
                }
                last_batch_at = Instant::now();
            }
        }
    }
    drop(ready_receiver);
    let (tokens, compute_wall, busy_fraction, samples_done) =
        stats_of(accepted_before + samples_sent);
    let tokens_per_second = if compute_wall.is_zero() {
        0.0
    } else {
        tokens as f64 / compute_wall.as_secs_f64()
    };
    metrics.tokens_per_second.set(tokens_per_second);
    metrics.busy_fraction.set(busy_fraction);
    producer
        .send_stats(ProducerStats {
            tokens_per_second,
            busy_fraction,
            device: info.device_label.clone(),
            samples_done,
            samples_total,
            tokens_done: tokens,
        })
        .await;
    let reconnects = producer.reconnects;
    let accepted_before = producer.accepted_before();
    let finished = tokio::time::timeout(config.finish_timeout, producer.finish()).await;
    let produce_report = match finished {
        Ok(report) => {
            let report = report.inspect_err(|error| count_refused_item(metrics, error))?;
            metrics.rejected_items.add(report.rejected.len() as u64);
            report
        }
        Err(_) => {
            return Err(TargetServerError::Broker(ClientError::StreamEnded {
                stream: "Produce",
                detail: format!(
                    "no answer for the last items within {:?}",
                    config.finish_timeout
                ),
            }))
        }
    };
    let report = TargetReport {
        target_id: config.target_id.clone(),
        shard,
        completed: !interrupted,
        layer_ids: info.layer_ids.clone(),
        device: info.device_label.clone(),
        resume_after_seq,
        samples_sent,
        tokens_sent,
        accepted: produce_report.accepted,
        duplicates: produce_report.duplicates,
        rejected: produce_report.rejected,
        total_accepted: accepted_before + produce_report.accepted,
        reported_total: None,
        reader: ReaderSummary::default(),
        reconnects,
        compute_wall,
        tokens_per_second,
        busy_fraction,
    };
    Ok((report, client))
}

/// An item over the broker's gRPC message limit ends the Produce stream
/// with RESOURCE_EXHAUSTED before the broker reads it, so no per-item
/// rejection comes back: it is counted here as a rejected item (the
/// `rejected_items_total` metric) and the broker's reason is logged. The
/// error itself is not retryable and ends the run.
fn count_refused_item(metrics: &TargetMetrics, error: &ClientError) {
    let Some(status) = error.status() else {
        return;
    };
    if status.code() == tonic::Code::ResourceExhausted {
        metrics.rejected_items.increment();
        tracing::error!(reason = %status.message(), "the broker refused an item over its message limit (RESOURCE_EXHAUSTED); raise the broker's --max-item-bytes or lower --max-length");
    }
}

/// Reports the shard done with the number of samples the reader numbered
/// (not the broker's count, which would make the broker's check vacuous).
async fn finish_run(
    client: &BrokerClient,
    report: &mut TargetReport,
) -> Result<(), TargetServerError> {
    let total_items = report.reader.samples;
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
