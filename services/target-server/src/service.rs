//! [`run`]: one target-server from flags to ReportDone.

use crate::batching::PlannedBatch;
use crate::compute::{
    run_compute_thread, run_host_copy_thread, Backend, BackendInfo, ComputeError, ComputedBatch,
    PipelineCounters, ReadyItem, SyntheticBackend,
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
use dflash_client::{BrokerClient, ClientError, ProduceReport};
use dflash_device::{join_within, DeviceWorker, WorkerChannels, WorkerError};
use dflash_model::target_model::{build_target_layer_ids, TargetModel};
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

/// Samples of data kept in flight between threads (batches per channel).
const BATCH_CHANNEL_DEPTH: usize = 2;

/// How long an interrupted run waits for the broker's last answers (at most
/// `--finish-timeout`): a target the broker holds back gets none.
const INTERRUPTED_FINISH_GRACE: Duration = Duration::from_secs(5);

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

/// The compute thread as a device worker: its commands are planned batches
/// (sent by the reader thread), its events computed batches (read by the
/// host-copy thread), its handshake what loaded.
type ComputeWorker = DeviceWorker<
    PlannedBatch,
    ComputedBatch,
    Result<BackendInfo, TargetServerError>,
    Result<(), ComputeError>,
>;

/// The threads of one pipeline, owned so they are always joined.
struct PipelineThreads {
    /// Cancelled before the threads are joined: they stop at their next
    /// batch.
    stop: CancellationToken,
    compute: ComputeWorker,
    reader: Option<std::thread::JoinHandle<Result<ReaderSummary, ReaderError>>>,
    host_copy: Option<std::thread::JoinHandle<Result<(), ComputeError>>>,
}

/// How each thread of a pipeline ended.
struct JoinedThreads {
    reader: Option<Result<Result<ReaderSummary, ReaderError>, WorkerError>>,
    host_copy: Option<Result<Result<(), ComputeError>, WorkerError>>,
    compute: Result<Result<(), ComputeError>, WorkerError>,
}

impl PipelineThreads {
    /// Starts the compute thread, which loads the model (CUDA state stays
    /// on the thread that uses it) while the caller talks to the broker.
    fn start(
        config: &TargetServerConfig,
        device: Device,
        shutdown: &CancellationToken,
    ) -> Result<Self, TargetServerError> {
        let stop = shutdown.child_token();
        let config = config.clone();
        let compute_stop = stop.clone();
        let channels = WorkerChannels {
            commands: BATCH_CHANNEL_DEPTH,
            events: 1,
        };
        let compute = DeviceWorker::spawn("dflash-compute", channels, move |mut side| {
            let backend = match load_backend(&config, device) {
                Ok(backend) => backend,
                Err(error) => {
                    side.ready(Err(error));
                    return Ok(());
                }
            };
            if !side.ready(Ok(backend.info())) {
                return Ok(());
            }
            let (batches, computed) = side.into_channels();
            run_compute_thread(
                backend,
                batches,
                computed,
                compute_stop,
                config.test_hang_compute_after_batches,
            )
        })?;
        Ok(Self {
            stop,
            compute,
            reader: None,
            host_copy: None,
        })
    }

    /// Stops and joins every thread, each within `bound`: the reader, the
    /// host copy, then the compute thread.
    async fn join(self, bound: Duration) -> JoinedThreads {
        self.stop.cancel();
        let reader = match self.reader {
            Some(reader) => Some(join_within("reader", reader, bound).await),
            None => None,
        };
        let host_copy = match self.host_copy {
            Some(host_copy) => Some(join_within("host-copy", host_copy, bound).await),
            None => None,
        };
        let compute = self.compute.finish(bound).await;
        JoinedThreads {
            reader,
            host_copy,
            compute,
        }
    }
}

impl JoinedThreads {
    /// The first failure among the threads (reader, compute, host copy),
    /// else what the reader read.
    fn into_result(self) -> Result<Option<ReaderSummary>, TargetServerError> {
        let reader = match self.reader {
            Some(result) => Some(result??),
            None => None,
        };
        self.compute??;
        if let Some(result) = self.host_copy {
            result??;
        }
        Ok(reader)
    }
}

fn spawn_named<T: Send + 'static>(
    name: &'static str,
    body: impl FnOnce() -> T + Send + 'static,
) -> Result<std::thread::JoinHandle<T>, WorkerError> {
    std::thread::Builder::new()
        .name(format!("dflash-{name}"))
        .spawn(body)
        .map_err(|source| WorkerError::Spawn {
            name: name.to_string(),
            source,
        })
}

/// Runs `work` on the blocking pool (file reading, tokenizer loading).
async fn blocking<T: Send + 'static>(
    name: &'static str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, WorkerError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|_| WorkerError::Panicked {
            name: name.to_string(),
        })
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
    let run = run_pipeline(config, &registry, shutdown.clone());
    dflash_telemetry::MetricsEndpoint::during(metrics_listener, registry.clone(), &shutdown, run)
        .await
}

/// The run itself, updating the instruments it registers in `registry`:
/// check, start the compute thread, stream the shard, join the threads,
/// report done.
async fn run_pipeline(
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
    let (client, shard, window) = connect(config).await?;
    let info = tokio::select! {
        loaded = threads.compute.ready() => loaded??,
        () = shutdown.cancelled() => return Err(TargetServerError::Config("shut down while loading the model".into())),
    };
    let producer = ResilientProducer::open(
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
/// how many targets the run expects); the producer's credit window.
async fn connect(
    config: &TargetServerConfig,
) -> Result<(BrokerClient, ShardSpec, usize), TargetServerError> {
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
    Ok((client, shard, window))
}

/// Starts the reader thread on the shard, past `resume_after_seq`, feeding
/// the compute thread; the tokenizer loads first, on the blocking pool (it
/// can take a second).
async fn spawn_reader(
    config: &TargetServerConfig,
    shard: ShardSpec,
    resume_after_seq: Option<u64>,
    info: &BackendInfo,
    threads: &mut PipelineThreads,
) -> Result<std::thread::JoinHandle<Result<ReaderSummary, ReaderError>>, TargetServerError> {
    let tokenizer_directory: Option<PathBuf> = config.tokenizer.clone().or(match &config.model {
        ModelSource::Directory(directory) => Some(directory.clone()),
        ModelSource::Synthetic(_) => None,
    });
    let max_length = config.max_length;
    let vocab_size = Some(info.vocab_size);
    let encoder = match tokenizer_directory {
        Some(directory) => {
            blocking("tokenizer", move || {
                ChatEncoder::from_directory(&directory, max_length, vocab_size)
            })
            .await??
        }
        None => ChatEncoder::pre_tokenized_only(max_length, vocab_size),
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
    let batch_sender = threads.compute.take_command_sender()?;
    let reader_stop = threads.stop.clone();
    let data_path = config.data.clone();
    let synthetic_spec = match &config.model {
        ModelSource::Synthetic(spec) => Some(spec.clone()),
        ModelSource::Directory(_) => None,
    };
    Ok(spawn_named("reader", move || {
        let records: Box<dyn Iterator<Item = Result<Record, ReaderError>>> =
            match (&data_path, &synthetic_spec) {
                (Some(path), _) => Box::new(ShardLines::open(path, shard)?),
                (None, Some(spec)) => Box::new(generated_records(spec, shard)),
                (None, None) => Box::new(std::iter::empty()),
            };
        let mut reader = BatchReader::new(records, encoder, settings);
        for batch in reader.by_ref() {
            if reader_stop.is_cancelled() || batch_sender.blocking_send(batch?).is_err() {
                break;
            }
        }
        Ok(reader.summary().clone())
    })?)
}

/// The async end of the pipeline: samples from the host-copy thread to the
/// broker, progress stats, and the watchdog.
struct Pump<'a> {
    config: &'a TargetServerConfig,
    metrics: &'a TargetMetrics,
    producer: ResilientProducer,
    /// Items the broker held from this target when the run began (the
    /// producer's own count moves on with each reconnect).
    accepted_at_start: u64,
    counters: Arc<PipelineCounters>,
    /// When the pipeline started: the counters' times are relative to it.
    epoch: Instant,
    shard: ShardSpec,
    layer_ids: Vec<usize>,
    device_label: String,
    resume_after_seq: Option<u64>,
    samples_total: u64,
    samples_sent: u64,
    tokens_sent: u64,
    /// Tokens computed at the previous stats message, for the rate.
    tokens_at_last_stats: u64,
    last_stats_at: Instant,
}

/// The pipeline's progress at one instant.
struct Progress {
    tokens: u64,
    /// Time since the first forward started.
    active: Duration,
    busy_fraction: f64,
    /// Samples the broker holds from this target, over all runs.
    samples_done: u64,
}

impl Pump<'_> {
    /// Sends every ready sample until the host-copy thread is done (false)
    /// or `shutdown` fires (true: interrupted). Fails when the broker
    /// refuses an item or the watchdog sees no batch for
    /// `--watchdog-timeout`.
    async fn run(
        &mut self,
        shutdown: &CancellationToken,
        mut ready_receiver: tokio::sync::mpsc::Receiver<Vec<ReadyItem>>,
    ) -> Result<bool, TargetServerError> {
        let mut stats_timer = tokio::time::interval(self.config.stats_period());
        stats_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The watchdog: time since the pipeline last handed over a batch.
        // Sends (which wait on the broker's backpressure) happen in the same
        // loop, so that wait is excluded: the clock restarts after each batch
        // is sent.
        let watchdog = self.config.watchdog_timeout;
        let mut last_batch_at = Instant::now();
        let mut watchdog_timer = tokio::time::interval(
            (watchdog / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)),
        );
        watchdog_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(true),
                _ = watchdog_timer.tick(), if !watchdog.is_zero() => {
                    if last_batch_at.elapsed() >= watchdog {
                        tracing::error!(seconds = watchdog.as_secs_f64(), samples_sent = self.samples_sent, "watchdog: no batch from the compute pipeline");
                        return Err(TargetServerError::Stalled { seconds: watchdog.as_secs_f64() });
                    }
                }
                // Both sends wait while the broker holds this target back
                // (a full queue, a reconnect's backoff): SIGTERM still ends
                // the wait, and the stream is closed as interrupted.
                _ = stats_timer.tick() => {
                    tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return Ok(true),
                        () = self.send_progress() => {}
                    }
                }
                ready = ready_receiver.recv() => {
                    let Some(items) = ready else { return Ok(false) };
                    tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return Ok(true),
                        sent = self.send_items(items) => sent?,
                    }
                    last_batch_at = Instant::now();
                }
            }
        }
    }

    async fn send_items(&mut self, items: Vec<ReadyItem>) -> Result<(), TargetServerError> {
        for ready in items {
            self.producer
                .send_item(ready.item)
                .await
                .inspect_err(|error| count_refused_item(self.metrics, error))?;
            self.samples_sent += 1;
            self.tokens_sent += ready.tokens;
            self.metrics.samples_sent.increment();
            self.metrics.tokens.add(ready.tokens);
        }
        Ok(())
    }

    fn progress(&self) -> Progress {
        let counters = &self.counters;
        let first_forward =
            Duration::from_nanos(counters.first_forward_nanos.load(Ordering::Relaxed));
        let busy = Duration::from_nanos(counters.busy_nanos.load(Ordering::Relaxed));
        let active = self.epoch.elapsed().saturating_sub(first_forward);
        Progress {
            tokens: counters.tokens_computed.load(Ordering::Relaxed),
            active,
            busy_fraction: if active.is_zero() {
                0.0
            } else {
                (busy.as_secs_f64() / active.as_secs_f64()).min(1.0)
            },
            samples_done: self.accepted_at_start + self.samples_sent,
        }
    }

    /// The periodic stats: rates over the window since the previous ones.
    async fn send_progress(&mut self) {
        let progress = self.progress();
        let window_seconds = self.last_stats_at.elapsed().as_secs_f64();
        let tokens_per_second = if window_seconds > 0.0 {
            (progress.tokens - self.tokens_at_last_stats) as f64 / window_seconds
        } else {
            0.0
        };
        self.tokens_at_last_stats = progress.tokens;
        self.last_stats_at = Instant::now();
        tracing::info!(
            samples_done = progress.samples_done,
            samples_total = self.samples_total,
            tokens_per_second = format!("{tokens_per_second:.0}"),
            busy_fraction = format!("{:.2}", progress.busy_fraction),
            "progress"
        );
        self.send_stats(&progress, tokens_per_second).await;
    }

    async fn send_stats(&mut self, progress: &Progress, tokens_per_second: f64) {
        self.metrics.tokens_per_second.set(tokens_per_second);
        self.metrics.busy_fraction.set(progress.busy_fraction);
        self.producer
            .send_stats(ProducerStats {
                tokens_per_second,
                busy_fraction: progress.busy_fraction,
                device: self.device_label.clone(),
                samples_done: progress.samples_done,
                samples_total: self.samples_total,
                tokens_done: progress.tokens,
            })
            .await;
    }

    /// Final stats over the whole run, then the end of the Produce stream
    /// (bounded by `--finish-timeout`): the report, `completed` when the
    /// shard was read to its end.
    async fn close(mut self, completed: bool) -> Result<TargetReport, TargetServerError> {
        let progress = self.progress();
        let compute_wall = progress.active;
        let tokens_per_second = if compute_wall.is_zero() {
            0.0
        } else {
            progress.tokens as f64 / compute_wall.as_secs_f64()
        };
        // An interrupted run (SIGTERM) may be held back by a full queue that
        // will not answer its last items: it waits a short grace, not the
        // whole finish timeout, and the unanswered items are resent by the
        // next start (the broker's welcome says where it is).
        let finish_timeout = if completed {
            self.config.finish_timeout
        } else {
            self.config.finish_timeout.min(INTERRUPTED_FINISH_GRACE)
        };
        let _ = tokio::time::timeout(
            finish_timeout,
            self.send_stats(&progress, tokens_per_second),
        )
        .await;
        let reconnects = self.producer.reconnects;
        let accepted_before = self.producer.accepted_before();
        let produce_report = match tokio::time::timeout(finish_timeout, self.producer.finish())
            .await
        {
            Ok(finished) => {
                finished.inspect_err(|error| count_refused_item(self.metrics, error))?
            }
            Err(_) if !completed => {
                tracing::warn!(
                    grace = ?finish_timeout,
                    "interrupted while the broker held this target back: the last items are unanswered; a restart resends them"
                );
                ProduceReport::default()
            }
            Err(_) => {
                return Err(TargetServerError::Broker(ClientError::StreamEnded {
                    stream: "Produce",
                    detail: format!("no answer for the last items within {finish_timeout:?}"),
                }))
            }
        };
        self.metrics
            .rejected_items
            .add(produce_report.rejected.len() as u64);
        Ok(TargetReport {
            target_id: self.config.target_id.clone(),
            shard: self.shard,
            completed,
            layer_ids: self.layer_ids,
            device: self.device_label,
            resume_after_seq: self.resume_after_seq,
            samples_sent: self.samples_sent,
            tokens_sent: self.tokens_sent,
            accepted: produce_report.accepted,
            duplicates: produce_report.duplicates,
            rejected: produce_report.rejected,
            total_accepted: accepted_before + produce_report.accepted,
            reported_total: None,
            reader: ReaderSummary::default(),
            reconnects,
            compute_wall,
            tokens_per_second,
            busy_fraction: progress.busy_fraction,
            device_memory_peak_bytes: None,
            non_finite_skipped: self.counters.non_finite_samples.load(Ordering::Relaxed),
        })
    }
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
