//! The async side of a drafter-server: the Consume stream, the credit
//! window, acks after steps, nacks, lease extension, stats, the schedule
//! estimate, reconnects and the graceful stop. All compute happens on the
//! training thread ([`crate::trainer_thread`]); this side never blocks.
//! It also owns the metrics endpoint (`--metrics-listen`) and updates the
//! [`DrafterMetrics`] from the trainer's events.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_client::{BrokerClient, Consumer, ConsumerEvent, ConsumerHandle};
use dflash_device::{DeviceWorker, WorkerChannels, WorkerError};
use dflash_proto::v1::{ConsumerStats, Credit, Delivery, EndOfStream, NackDisposition, RunStatus};
use dflash_telemetry::{Registry, RegistryError};
use tokio::net::TcpListener;
use tokio::time::{interval, sleep_until, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::checkpoints::latest_checkpoint;
use crate::config::{DrafterServerConfig, ModelMode};
use crate::engine::RunSchedule;
use crate::engine::{build_engine, EngineError};
use crate::metrics::DrafterMetrics;
use crate::schedule::{estimate_total_steps, RunClock, ScheduleInputs};
use crate::trainer_thread::{run_training_loop, LoopSettings, TrainerCommand, TrainerEvent};
use dflash_model::draft::StepReport;

/// Errors that stop a drafter-server.
#[derive(Debug, thiserror::Error)]
pub enum DrafterError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("loading the model: {0}")]
    Engine(#[from] EngineError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("broker at {address} unreachable for {seconds:.0} s: {detail}")]
    BrokerUnavailable {
        address: String,
        seconds: f64,
        detail: String,
    },
    #[error("the broker refused this drafter (not retried): {0}")]
    BrokerRefused(String),
    #[error("the training thread stopped unexpectedly")]
    TrainerGone,
    #[error("the finite check of a delivery failed: {0}")]
    FiniteCheck(String),
    #[error("graceful stop did not finish within {0:?}")]
    ShutdownTimedOut(Duration),
    #[error("final checkpoint failed: {0}")]
    FinalCheckpoint(String),
    #[error("{count} optimizer steps in a row were skipped (--max-skipped-steps); the last: {last_reason}; this drafter's model or device is broken, stopping it")]
    SkippedSteps { count: u64, last_reason: String },
    #[error("cannot listen for metrics on {address}: {source}")]
    MetricsListen {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(#[from] RegistryError),
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// The broker sent end-of-stream COMPLETE.
    Complete,
    /// The broker sent end-of-stream ABORTED (the process should exit non-zero).
    Aborted { reason: String },
    /// The shutdown token fired (SIGTERM): step finished, checkpoint written,
    /// unused deliveries handed back.
    Shutdown,
}

/// What a drafter-server did.
#[derive(Debug, Clone)]
pub struct DrafterReport {
    pub drafter_id: String,
    pub end: RunEnd,
    pub steps: u64,
    pub samples_trained: u64,
    pub tokens_trained: u64,
    /// Deliveries nacked to the dead letters (unusable samples).
    pub dead_lettered: u64,
    /// Deliveries handed back to the queue (failed batches, shutdown).
    pub requeued: u64,
    /// Optimizer steps skipped because their loss or gradient was not
    /// finite or spiked (weights, moments and step count unchanged).
    pub skipped_steps: u64,
    /// Samples dead-lettered because their hidden states held a NaN or an
    /// infinity (also in `dead_lettered`).
    pub non_finite_samples: u64,
    pub final_checkpoint: Option<PathBuf>,
    /// Loss of the first and the last optimizer step of this process.
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub last_accuracy: Option<f64>,
    /// Trained tokens per second from the first delivery to the end.
    pub tokens_per_second: f64,
    /// Compute time over wall time from the first delivery to the end.
    pub busy_fraction: f64,
    pub device: String,
    /// The GPU's peak memory in use after a step (NVML), on CUDA only.
    pub device_memory_peak_bytes: Option<u64>,
}

impl DrafterReport {
    /// How the process exits (the table in `dflash_shell::exit`): done
    /// for COMPLETE and for a graceful stop (everything unused was handed
    /// back, nothing is owed), aborted for ABORTED.
    pub fn exit(&self) -> dflash_shell::Exit {
        match self.end {
            RunEnd::Complete | RunEnd::Shutdown => dflash_shell::Exit::Done,
            RunEnd::Aborted { .. } => dflash_shell::Exit::Aborted,
        }
    }
}

/// Why the main loop is stopping.
enum Stopping {
    Shutdown,
    EndOfStream(EndOfStream),
}

/// Counters for stats and the report.
#[derive(Default)]
struct Totals {
    steps: u64,
    samples: u64,
    tokens: u64,
    dead_lettered: u64,
    requeued: u64,
    skipped_steps: u64,
    /// Samples dead-lettered because their hidden states were not finite.
    non_finite_samples: u64,
    /// Skipped steps since the last step taken, and why the last one was.
    consecutive_skipped_steps: u64,
    last_skip_reason: String,
    busy: Duration,
    first_loss: Option<f64>,
    last_loss: Option<f64>,
    last_accuracy: Option<f64>,
    first_delivery_at: Option<Instant>,
    /// Window since the last stats message.
    window_tokens: u64,
    window_busy: Duration,
}

/// Deliveries a drafter accepts beyond its credit window before it nacks:
/// the broker keeps within the window, so this only guards memory against
/// a peer that does not.
const DELIVERY_SLACK: u64 = 16;

/// Control commands (Flush, SetTotalSteps, DiscardUnstepped, Finish) the
/// trainer's command channel holds beyond a full credit window of
/// deliveries before [`send_command`] waits for room: only a trainer busy
/// for that many stats periods in one step makes the async side wait, and
/// even then nothing is dropped.
const CONTROL_COMMAND_ROOM: usize = 64;

/// Events the training thread may report before the async side reads them.
const TRAINER_EVENT_CAPACITY: usize = 256;

/// How long the training thread gets to end once the server has stopped.
const TRAINER_JOIN_BOUND: Duration = Duration::from_secs(5);

/// The training thread as a device worker: its handshake is the loaded
/// engine's device and resumed step.
type TrainerWorker =
    DeviceWorker<TrainerCommand, TrainerEvent, Result<(String, u64), EngineError>, ()>;

/// The trainer's channels: room for every delivery the credit window allows
/// (deliveries beyond it are nacked before they get here) plus
/// [`CONTROL_COMMAND_ROOM`].
fn trainer_channels(credit_items: u32) -> WorkerChannels {
    WorkerChannels {
        commands: credit_items as usize + DELIVERY_SLACK as usize + CONTROL_COMMAND_ROOM,
        events: TRAINER_EVENT_CAPACITY,
    }
}

/// Queues a command for the training thread. Never drops one: a full
/// channel makes it wait (reading the trainer's events meanwhile, see
/// [`DeviceWorker::send`]), so a Finish or SetTotalSteps sent while the
/// trainer is busy is still seen. Fails only when the training thread is
/// gone.
async fn send_command<Ready: Send + 'static, Output: Send + 'static>(
    trainer: &mut DeviceWorker<TrainerCommand, TrainerEvent, Ready, Output>,
    command: TrainerCommand,
) -> Result<(), DrafterError> {
    trainer
        .send(command)
        .await
        .map_err(|_| DrafterError::TrainerGone)
}

/// Runs a drafter-server until end-of-stream or `shutdown`. When
/// `config.metrics_listen` is set, serves Prometheus metrics there for as
/// long as the run lasts.
pub async fn run(
    config: DrafterServerConfig,
    shutdown: CancellationToken,
) -> Result<DrafterReport, DrafterError> {
    config.validate()?;
    let metrics_listener = dflash_telemetry::bind_metrics_listener(config.metrics_listen)
        .await
        .map_err(|(address, source)| DrafterError::MetricsListen { address, source })?;
    run_with_metrics_listener(config, metrics_listener, shutdown).await
}

/// [`run`] with the metrics endpoint on an already bound listener (tests
/// bind `127.0.0.1:0` to learn the port) instead of `config.metrics_listen`,
/// or none. The endpoint is an owned task: it stops when `shutdown` is
/// cancelled or the run returns, whichever comes first.
pub async fn run_with_metrics_listener(
    config: DrafterServerConfig,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<DrafterReport, DrafterError> {
    let registry = Arc::new(Registry::new());
    let run = run_session(config, &registry, shutdown.clone());
    dflash_telemetry::MetricsEndpoint::during(metrics_listener, registry.clone(), &shutdown, run)
        .await
}

/// The run itself, updating the instruments it registers in `registry`:
/// start the trainer (the model loads before any credit is granted, so a
/// slow load never holds leases), consume until the end, join the trainer.
async fn run_session(
    config: DrafterServerConfig,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<DrafterReport, DrafterError> {
    config.validate()?;
    // The label the engine will report, known before the model loads so the
    // metrics exist (at zero) from the first scrape.
    let (device_label, gpu_memory) = match config.model {
        ModelMode::Synthetic { .. } => ("synthetic".to_string(), None),
        ModelMode::DFlash => {
            let device = config.resolve_device()?;
            let gpu_memory = match device {
                tch::Device::Cuda(index) => dflash_device::GpuMemoryMonitor::start(index),
                _ => None,
            };
            (dflash_model::device::device_label(device), gpu_memory)
        }
    };
    let metrics = DrafterMetrics::register(registry, &config.drafter_id, &device_label)?;
    let resume_from = prepare_output(&config)?;
    // With model sync the schedule is the run's: the link keeps the clock
    // current with the center, this side with the run's size.
    let run_clock = (config.model_sync.sync_every > 0).then(RunClock::new);
    let mut trainer = start_trainer(&config, resume_from, run_clock.clone())?;
    let (device, resumed_step) = trainer
        .ready()
        .await
        .map_err(|_| DrafterError::TrainerGone)??;
    info!(drafter_id = %config.drafter_id, device = %device, resumed_step, "trainer ready");
    let mut session = Session {
        credit: Credit {
            items: config.credit_items(),
            bytes: config.credit_bytes,
        },
        config,
        trainer,
        held: HashSet::new(),
        generation: 0,
        totals: Totals::default(),
        device,
        steps_done: resumed_step,
        last_checkpoint: None,
        metrics,
        run_id: std::sync::Mutex::new(None),
        run_clock,
        gpu_memory,
    };
    let result = session.drive(&shutdown).await;
    // Closing the command channel ends the training loop if it is still running.
    // A trainer still busy after the bound is left to finish on its own
    // (`join_within` says so); the run's result stands either way.
    if let Err(error) = session.trainer.finish(TRAINER_JOIN_BOUND).await {
        warn!(%error, "the training thread did not end cleanly after the server stopped");
    }
    result
}

/// Creates `--output` and finds the checkpoint to resume from (`--resume`).
fn prepare_output(config: &DrafterServerConfig) -> Result<Option<PathBuf>, DrafterError> {
    let io_error = |source| DrafterError::Io {
        path: config.output.clone(),
        source,
    };
    std::fs::create_dir_all(&config.output).map_err(io_error)?;
    if !config.resume {
        return Ok(None);
    }
    let resume_from = latest_checkpoint(&config.output).map_err(io_error)?;
    if resume_from.is_none() {
        info!(output = %config.output.display(), "no checkpoint to resume from; starting fresh");
    }
    Ok(resume_from)
}

/// Starts the training thread: it builds the engine (the handshake says on
/// which device, from which step), joins model sync when configured, then
/// runs the training loop.
fn start_trainer(
    config: &DrafterServerConfig,
    resume_from: Option<PathBuf>,
    run_clock: Option<RunClock>,
) -> Result<TrainerWorker, DrafterError> {
    let loop_settings = LoopSettings {
        batch_tokens: config.batch_tokens,
        grad_accumulation: config.grad_accumulation,
        max_step_samples: config.max_step_samples,
        save_every: config.save_every,
        keep_checkpoints: config.keep_checkpoints,
        output: config.output.clone(),
    };
    let model_sync = crate::model_sync::ModelSyncLink::new(
        tokio::runtime::Handle::current(),
        &config.broker,
        &config.drafter_id,
        &config.model_sync,
    )
    .map(|link| link.with_security(config.security.clone()))
    .map(|link| match &run_clock {
        Some(clock) => link.with_run_clock(clock.clone()),
        None => link,
    });
    let run_schedule = run_clock.map(|clock| RunSchedule::for_config(config, clock));
    let initial_total_steps = config.total_steps.unwrap_or(config.fallback_total_steps);
    let engine_config = config.clone();
    let channels = trainer_channels(config.credit_items());
    let name = format!("trainer-{}", config.drafter_id);
    DeviceWorker::spawn(name, channels, move |mut side| {
        match build_engine(&engine_config, resume_from.as_deref(), initial_total_steps) {
            Ok(mut engine) => {
                if let Some(schedule) = run_schedule {
                    engine.follow_run_schedule(schedule);
                }
                side.ready(Ok((engine.device_name(), engine.steps_done())));
                let (commands, events) = side.into_channels();
                run_training_loop(engine, loop_settings, commands, events, model_sync);
            }
            Err(error) => {
                side.ready(Err(error));
            }
        }
    })
    .map_err(|error| match error {
        WorkerError::Spawn { source, .. } => DrafterError::Io {
            path: PathBuf::from("<trainer thread>"),
            source,
        },
        _ => DrafterError::TrainerGone,
    })
}

/// One Consume stream (replaced by a new one after a break).
struct ConsumeStream {
    client: BrokerClient,
    consumer: Consumer,
    handle: ConsumerHandle,
    /// False once it ended or broke.
    open: bool,
    /// A third of the broker's lease timeout: leases are renewed on it.
    lease_ticker: tokio::time::Interval,
}

impl ConsumeStream {
    fn new(client: BrokerClient, consumer: Consumer) -> Self {
        let handle = consumer.handle();
        let lease_timeout = Duration::from_millis(consumer.welcome().lease_timeout_ms.max(300));
        let mut lease_ticker = interval(lease_timeout / 3);
        lease_ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Self {
            client,
            consumer,
            handle,
            open: true,
            lease_ticker,
        }
    }
}

/// The pump's clocks and its stop state.
struct PumpState {
    last_stats_at: Instant,
    last_delivery_at: tokio::time::Instant,
    /// The trainer's last sign of progress (an event, or new work handed to
    /// an idle trainer): leases are extended only while it is recent.
    last_trainer_progress: tokio::time::Instant,
    /// A Flush was sent since the last delivery.
    flush_requested: bool,
    stopping: Option<Stopping>,
    /// When a stop that began must be over (`--shutdown-timeout`).
    stop_deadline: tokio::time::Instant,
}

impl PumpState {
    fn new() -> Self {
        let now = tokio::time::Instant::now();
        Self {
            last_stats_at: Instant::now(),
            last_delivery_at: now,
            last_trainer_progress: now,
            flush_requested: false,
            stopping: None,
            stop_deadline: now + Duration::from_secs(u32::MAX as u64),
        }
    }
}

/// The state of one server run across reconnects.
struct Session {
    config: DrafterServerConfig,
    credit: Credit,
    /// The training thread. Its command channel has room for the credit
    /// window and then some, so a control command (Finish above all) is
    /// never dropped and almost never waited for; deliveries are bounded by
    /// [`Session::held`] against the credit window before they get there.
    trainer: TrainerWorker,
    /// Deliveries of the current stream handed to the trainer and not yet
    /// acked or nacked.
    held: HashSet<u64>,
    /// Bumped on every new Consume stream.
    generation: u64,
    totals: Totals,
    device: String,
    steps_done: u64,
    last_checkpoint: Option<PathBuf>,
    /// Updated from the trainer's events; served by the metrics endpoint.
    metrics: DrafterMetrics,
    /// The broker's run id from the first welcome: a broker that comes back
    /// with another one lost the run, and this drafter stops instead of
    /// training on as if nothing was lost.
    run_id: std::sync::Mutex<Option<String>>,
    /// The run-wide schedule's clock (model sync on), which learns the run's
    /// size here; `None`: this drafter's own schedule.
    run_clock: Option<RunClock>,
    /// The GPU's memory, read after every step (CUDA with NVML only).
    gpu_memory: Option<dflash_device::GpuMemoryMonitor>,
}

impl Session {
    async fn connect(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<Option<(BrokerClient, Consumer)>, DrafterError> {
        let deadline = Instant::now() + self.config.reconnect_timeout;
        let mut backoff = Duration::from_millis(100);
        loop {
            let remembered = self
                .run_id
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            let attempt = async {
                let options = self.config.security.client_options()?;
                let client = BrokerClient::connect(self.config.broker.clone(), options)
                    .await?
                    .remembering_run(remembered);
                let consumer = client.consume(&self.config.drafter_id, self.credit).await?;
                Ok::<_, dflash_client::ClientError>((client, consumer))
            };
            let outcome = tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                outcome = attempt => outcome,
            };
            match outcome {
                Ok(connected) => {
                    *self
                        .run_id
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = connected.0.run_id();
                    return Ok(Some(connected));
                }
                Err(error) if !error.is_retryable() => {
                    error!(%error, "the broker refused the Consume stream; not retrying");
                    return Err(DrafterError::BrokerRefused(error.to_string()));
                }
                Err(error) if Instant::now() + backoff < deadline => {
                    warn!(%error, retry_in_ms = backoff.as_millis() as u64, "cannot open the Consume stream; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(error) => {
                    return Err(DrafterError::BrokerUnavailable {
                        address: self.config.broker.clone(),
                        seconds: self.config.reconnect_timeout.as_secs_f64(),
                        detail: error.to_string(),
                    })
                }
            }
        }
    }

    async fn send_command(&mut self, command: TrainerCommand) -> Result<(), DrafterError> {
        send_command(&mut self.trainer, command).await
    }

    /// Re-estimates the schedule from the broker's status when
    /// `--total-steps` is not set: this drafter's share of the run, or, on
    /// the run-wide schedule (model sync), the run's size.
    async fn refresh_total_steps(&mut self, client: &BrokerClient) {
        if self.config.total_steps.is_some() {
            return;
        }
        let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(2), client.status()).await
        else {
            return;
        };
        let summary = status.summary.unwrap_or_default();
        if let Some(clock) = &self.run_clock {
            clock.set_run_samples_total(summary.expected_items);
            return;
        }
        let connected_drafters = status
            .drafters
            .iter()
            .filter(|drafter| drafter.connected)
            .count() as u32;
        let total_steps = estimate_total_steps(
            ScheduleInputs {
                expected_items: summary.expected_items,
                finished_items: summary.acked_items + summary.dead_letters,
                connected_drafters: connected_drafters.max(1),
                steps_done: self.steps_done,
                samples_trained: self.totals.samples,
                assumed_samples_per_step: self.config.max_step_samples as u64,
            },
            self.config.fallback_total_steps,
        );
        let _ = self
            .send_command(TrainerCommand::SetTotalSteps(total_steps))
            .await;
    }

    /// Sends stats over the window since the last reset; `reset_window`
    /// starts a new one (periodic stats do, per-step updates do not).
    fn send_stats(&mut self, handle: &ConsumerHandle, window: Duration, reset_window: bool) {
        let seconds = window.as_secs_f64().max(1e-9);
        let stats = ConsumerStats {
            tokens_per_second: self.totals.window_tokens as f64 / seconds,
            loss: self.totals.last_loss.unwrap_or(0.0),
            busy_fraction: (self.totals.window_busy.as_secs_f64() / seconds).min(1.0),
            device: self.device.clone(),
            steps: self.steps_done,
            samples_trained: self.totals.samples,
            accuracy: self.totals.last_accuracy.unwrap_or(0.0),
            skipped_steps: self.totals.skipped_steps,
            non_finite_samples: self.totals.non_finite_samples,
        };
        if reset_window {
            // Whole intervals only: a window just begun gives wild rates.
            self.metrics.tokens_per_second.set(stats.tokens_per_second);
            self.metrics.busy_fraction.set(stats.busy_fraction);
        }
        handle.send_stats(stats);
        if reset_window {
            self.totals.window_tokens = 0;
            self.totals.window_busy = Duration::ZERO;
        }
    }

    /// Metrics, totals and the occasional log line of one optimizer step.
    fn book_step(&mut self, report: &StepReport, busy: Duration, step_compute: Duration) {
        self.metrics.steps.increment();
        self.metrics.samples_trained.add(report.samples as u64);
        self.metrics.step_seconds.set(step_compute.as_secs_f64());
        self.metrics.loss.set(report.loss);
        self.metrics.accuracy.set(report.accuracy);
        self.steps_done = report.step;
        self.totals.steps += 1;
        self.totals.samples += report.samples as u64;
        self.totals.tokens += report.tokens as u64;
        self.totals.window_tokens += report.tokens as u64;
        self.totals.busy += busy;
        self.totals.window_busy += busy;
        if report.loss.is_finite() {
            self.totals.first_loss.get_or_insert(report.loss);
            self.totals.last_loss = Some(report.loss);
        }
        self.totals.last_accuracy = Some(report.accuracy);
        if let Some(reading) = self
            .gpu_memory
            .as_ref()
            .and_then(|monitor| monitor.sample())
        {
            self.metrics
                .device_memory_used_bytes
                .set(reading.used_bytes as f64);
            self.metrics
                .device_memory_peak_bytes
                .set(reading.peak_bytes as f64);
        }
        if report.step.is_power_of_two() || report.step.is_multiple_of(100) {
            info!(
                step = report.step,
                loss = report.loss,
                accuracy = report.accuracy,
                learning_rate = report.learning_rate,
                samples = report.samples,
                tokens = report.tokens,
                "optimizer step"
            );
        }
    }

    /// Hands deliveries of the current stream back to the queue (a failed
    /// batch, a skipped step); ids of an older stream are the broker's
    /// already.
    fn requeue(
        &mut self,
        handle: &ConsumerHandle,
        generation: u64,
        delivery_ids: Vec<u64>,
        reason: String,
    ) {
        if generation != self.generation {
            return;
        }
        let current: Vec<u64> = delivery_ids
            .into_iter()
            .filter(|id| self.held.remove(id))
            .collect();
        self.totals.requeued += current.len() as u64;
        handle.nack(current, reason, NackDisposition::Requeue);
    }

    /// Acks, nacks and bookkeeping for one event of the training thread.
    /// Returns the trainer's final answer when it has stopped.
    fn on_event(
        &mut self,
        event: TrainerEvent,
        handle: &ConsumerHandle,
        stats_window: Duration,
    ) -> Option<(Vec<u64>, Option<String>)> {
        match event {
            TrainerEvent::Rejected {
                generation,
                delivery_id,
                reason,
            } => {
                error!(delivery_id, %reason, "sample unusable by this model; dead-lettering it");
                if generation == self.generation && self.held.remove(&delivery_id) {
                    handle.nack(vec![delivery_id], reason, NackDisposition::DeadLetter);
                    self.totals.dead_lettered += 1;
                    self.metrics.rejected_items.increment();
                }
            }
            TrainerEvent::Stepped {
                generation,
                delivery_ids,
                report,
                busy,
                step_compute,
            } => {
                self.totals.consecutive_skipped_steps = 0;
                self.book_step(&report, busy, step_compute);
                // Stats go out before the ack: the ack of the run's last item
                // can end the stream, and the broker's final status should
                // show this step.
                self.send_stats(handle, stats_window, false);
                if generation == self.generation {
                    let current: Vec<u64> = delivery_ids
                        .into_iter()
                        .filter(|id| self.held.remove(id))
                        .collect();
                    handle.ack(current);
                }
            }
            TrainerEvent::StepSkipped {
                generation,
                delivery_ids,
                reason,
            } => {
                self.totals.skipped_steps += 1;
                self.totals.consecutive_skipped_steps += 1;
                self.metrics.skipped_steps.increment();
                self.requeue(handle, generation, delivery_ids, reason.clone());
                self.totals.last_skip_reason = reason;
            }
            TrainerEvent::BatchFailed {
                generation,
                delivery_ids,
                reason,
            } => self.requeue(handle, generation, delivery_ids, reason),
            TrainerEvent::CheckpointSaved { step, path } => {
                self.last_checkpoint = Some(path);
                self.steps_done = self.steps_done.max(step);
            }
            TrainerEvent::Stopped {
                generation,
                unused_delivery_ids,
                final_checkpoint,
                checkpoint_error,
            } => {
                if let Some(path) = final_checkpoint {
                    self.last_checkpoint = Some(path);
                }
                let unused: Vec<u64> = if generation == self.generation {
                    unused_delivery_ids
                        .into_iter()
                        .filter(|id| self.held.remove(id))
                        .collect()
                } else {
                    Vec::new()
                };
                return Some((unused, checkpoint_error));
            }
        }
        None
    }

    /// Connect, then pump: deliveries to the trainer, its events to acks
    /// and nacks, leases extended while it makes progress, stats, the
    /// linger flush, reconnects, and the graceful stop.
    async fn drive(&mut self, shutdown: &CancellationToken) -> Result<DrafterReport, DrafterError> {
        let Some((client, consumer)) = self.connect(shutdown).await? else {
            return self.stop_without_stream(Stopping::Shutdown).await;
        };
        let mut stream = ConsumeStream::new(client, consumer);
        self.refresh_total_steps(&stream.client).await;
        info!(drafter_id = %self.config.drafter_id, credit_items = self.credit.items, "consuming");
        let mut stats_ticker = interval(self.config.stats_period());
        stats_ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut pump = PumpState::new();
        loop {
            let linger_at = pump.last_delivery_at + self.config.linger;
            let linger_armed =
                !self.held.is_empty() && !pump.flush_requested && pump.stopping.is_none();
            tokio::select! {
                _ = shutdown.cancelled(), if pump.stopping.is_none() => {
                    info!("shutdown requested: finishing the current step, checkpointing, handing back unused deliveries");
                    self.begin_stop(&mut pump, Stopping::Shutdown, true).await?;
                }
                next = stream.consumer.next(), if stream.open => match next {
                    Ok(ConsumerEvent::Delivery(delivery)) => self.on_delivery(delivery, &stream, &mut pump).await?,
                    Ok(ConsumerEvent::EndOfStream(end)) => self.on_end_of_stream(end, &mut stream, &mut pump).await?,
                    Err(stream_error) => self.on_stream_error(stream_error, shutdown, &mut stream, &mut pump).await?,
                },
                event = self.trainer.next_event() => {
                    let Some(event) = event else { return Err(DrafterError::TrainerGone) };
                    pump.last_trainer_progress = tokio::time::Instant::now();
                    if let Some(end) = self.on_trainer_event(event, &stream, &mut pump).await? {
                        return Ok(self.report(end));
                    }
                }
                _ = stream.lease_ticker.tick(), if stream.open => self.extend_leases(&stream, &pump),
                _ = stats_ticker.tick(), if stream.open => {
                    self.send_stats(&stream.handle, pump.last_stats_at.elapsed(), true);
                    pump.last_stats_at = Instant::now();
                    self.refresh_total_steps(&stream.client).await;
                }
                _ = sleep_until(linger_at), if linger_armed => {
                    pump.flush_requested = true;
                    self.send_command(TrainerCommand::Flush).await?;
                }
                _ = sleep_until(pump.stop_deadline), if pump.stopping.is_some() => {
                    return Err(DrafterError::ShutdownTimedOut(self.config.shutdown_timeout));
                }
            }
        }
    }

    /// Asks the trainer to finish (stepping what it accumulated when
    /// `step_accumulated`) and starts the `--shutdown-timeout` clock.
    async fn begin_stop(
        &mut self,
        pump: &mut PumpState,
        stopping: Stopping,
        step_accumulated: bool,
    ) -> Result<(), DrafterError> {
        pump.stopping = Some(stopping);
        pump.stop_deadline = tokio::time::Instant::now() + self.config.shutdown_timeout;
        self.send_command(TrainerCommand::Finish { step_accumulated })
            .await
    }

    /// Hands a delivery to the trainer, or back to the queue when stopping
    /// or beyond the credit window.
    async fn on_delivery(
        &mut self,
        delivery: Delivery,
        stream: &ConsumeStream,
        pump: &mut PumpState,
    ) -> Result<(), DrafterError> {
        let delivery_id = delivery.delivery_id;
        if pump.stopping.is_some() {
            stream.handle.nack(
                vec![delivery_id],
                "drafter stopping".into(),
                NackDisposition::Requeue,
            );
            self.totals.requeued += 1;
            return Ok(());
        }
        self.totals
            .first_delivery_at
            .get_or_insert_with(Instant::now);
        pump.last_delivery_at = tokio::time::Instant::now();
        pump.flush_requested = false;
        if self.held.len() as u64 >= u64::from(self.credit.items) + DELIVERY_SLACK {
            warn!(
                delivery_id,
                held = self.held.len(),
                credit_items = self.credit.items,
                "more deliveries than credit; requeueing"
            );
            stream.handle.nack(
                vec![delivery_id],
                "drafter holds more than its credit".into(),
                NackDisposition::Requeue,
            );
            return Ok(());
        }
        // The finite check runs here, beside the training thread (which may
        // be stepping on the device meanwhile), not in it.
        let (delivery, verdict) = tokio::task::spawn_blocking(move || {
            let verdict = delivery
                .sample
                .as_ref()
                .map_or(Ok(()), crate::samples::check_finite);
            (delivery, verdict)
        })
        .await
        .map_err(|error| DrafterError::FiniteCheck(error.to_string()))?;
        if let Err(error) = verdict {
            let reason = format!(
                "target {} seq {}: {error}",
                delivery.target_id, delivery.seq
            );
            error!(delivery_id, %reason, "sample not finite; dead-lettering it");
            stream
                .handle
                .nack(vec![delivery_id], reason, NackDisposition::DeadLetter);
            self.totals.dead_lettered += 1;
            self.totals.non_finite_samples += 1;
            self.metrics.rejected_items.increment();
            return Ok(());
        }
        if self.held.is_empty() {
            pump.last_trainer_progress = tokio::time::Instant::now();
        }
        self.held.insert(delivery_id);
        self.send_command(TrainerCommand::Delivery {
            generation: self.generation,
            delivery: Box::new(delivery),
        })
        .await
    }

    async fn on_end_of_stream(
        &mut self,
        end: EndOfStream,
        stream: &mut ConsumeStream,
        pump: &mut PumpState,
    ) -> Result<(), DrafterError> {
        stream.open = false;
        let status = RunStatus::try_from(end.status).unwrap_or(RunStatus::Unspecified);
        info!(?status, reason = %end.reason, "end of stream");
        if pump.stopping.is_none() {
            self.begin_stop(pump, Stopping::EndOfStream(end), true)
                .await
        } else {
            pump.stopping = Some(Stopping::EndOfStream(end));
            Ok(())
        }
    }

    /// The stream broke: the broker requeues our leases; everything held
    /// is forgotten and the stream reopened (or, on shutdown meanwhile, the
    /// trainer finishes without stepping).
    async fn on_stream_error(
        &mut self,
        stream_error: dflash_client::ClientError,
        shutdown: &CancellationToken,
        stream: &mut ConsumeStream,
        pump: &mut PumpState,
    ) -> Result<(), DrafterError> {
        stream.open = false;
        if pump.stopping.is_some() {
            warn!(%stream_error, "Consume stream broke while stopping");
            return Ok(());
        }
        warn!(%stream_error, held = self.held.len(), "Consume stream broke; the broker requeues our leases; reconnecting");
        self.generation += 1;
        self.held.clear();
        self.send_command(TrainerCommand::DiscardUnstepped).await?;
        match self.connect(shutdown).await? {
            Some((client, consumer)) => {
                *stream = ConsumeStream::new(client, consumer);
                info!(generation = self.generation, "Consume stream reopened");
                Ok(())
            }
            None => self.begin_stop(pump, Stopping::Shutdown, false).await,
        }
    }

    /// Books one trainer event; once the trainer has stopped, hands back
    /// what it did not use and says how the run ended.
    async fn on_trainer_event(
        &mut self,
        event: TrainerEvent,
        stream: &ConsumeStream,
        pump: &mut PumpState,
    ) -> Result<Option<RunEnd>, DrafterError> {
        let finished = self.on_event(event, &stream.handle, pump.last_stats_at.elapsed());
        let max_skipped = self.config.max_skipped_steps;
        if max_skipped > 0 && self.totals.consecutive_skipped_steps >= max_skipped {
            // The broker requeues what this drafter still holds when its
            // stream goes; nothing of the skipped steps reached the model.
            return Err(DrafterError::SkippedSteps {
                count: self.totals.consecutive_skipped_steps,
                last_reason: self.totals.last_skip_reason.clone(),
            });
        }
        let Some((unused, checkpoint_error)) = finished else {
            return Ok(None);
        };
        if !unused.is_empty() {
            self.totals.requeued += unused.len() as u64;
            stream
                .handle
                .nack(unused, "drafter stopping".into(), NackDisposition::Requeue);
        }
        self.send_stats(&stream.handle, pump.last_stats_at.elapsed(), true);
        if stream.open {
            self.wait_for_leases_released(&stream.client).await;
        }
        if let Some(error) = checkpoint_error {
            return Err(DrafterError::FinalCheckpoint(error));
        }
        Ok(Some(match pump.stopping.take() {
            Some(Stopping::EndOfStream(end)) if end.status == RunStatus::Aborted as i32 => {
                RunEnd::Aborted { reason: end.reason }
            }
            Some(Stopping::EndOfStream(_)) => RunEnd::Complete,
            Some(Stopping::Shutdown) | None => RunEnd::Shutdown,
        }))
    }

    /// A long step must not lose its leases: renew all of ours, while the
    /// trainer shows progress.
    fn extend_leases(&self, stream: &ConsumeStream, pump: &PumpState) {
        if self.held.is_empty() {
            return;
        }
        if pump.last_trainer_progress.elapsed() < self.config.trainer_stall_timeout {
            stream.handle.extend_leases(Vec::new());
        } else {
            warn!(held = self.held.len(), stalled_for = ?pump.last_trainer_progress.elapsed(), "the trainer shows no progress; leases are no longer extended");
        }
    }

    /// Stop when no stream could be opened (shutdown during the first connect).
    async fn stop_without_stream(
        &mut self,
        stopping: Stopping,
    ) -> Result<DrafterReport, DrafterError> {
        self.send_command(TrainerCommand::Finish {
            step_accumulated: false,
        })
        .await?;
        let deadline = tokio::time::Instant::now() + self.config.shutdown_timeout;
        loop {
            let event = tokio::time::timeout_at(deadline, self.trainer.next_event())
                .await
                .map_err(|_| DrafterError::ShutdownTimedOut(self.config.shutdown_timeout))?
                .ok_or(DrafterError::TrainerGone)?;
            if let TrainerEvent::Stopped {
                final_checkpoint,
                checkpoint_error,
                ..
            } = event
            {
                if let Some(error) = checkpoint_error {
                    return Err(DrafterError::FinalCheckpoint(error));
                }
                self.last_checkpoint = final_checkpoint;
                let end = match stopping {
                    Stopping::Shutdown => RunEnd::Shutdown,
                    Stopping::EndOfStream(_) => RunEnd::Complete,
                };
                return Ok(self.report(end));
            }
        }
    }

    /// Waits (bounded) until the broker has processed our final acks and
    /// nacks, i.e. holds no lease of ours, so closing the stream cannot race
    /// them; the broker would requeue the leases anyway, this only avoids
    /// needless redeliveries.
    async fn wait_for_leases_released(&self, client: &BrokerClient) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let Ok(Ok(status)) =
                tokio::time::timeout(Duration::from_secs(1), client.status()).await
            else {
                return;
            };
            let leased = status
                .drafters
                .iter()
                .find(|drafter| drafter.drafter_id == self.config.drafter_id && drafter.connected)
                .map_or(0, |drafter| drafter.leased_items);
            if leased == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn report(&self, end: RunEnd) -> DrafterReport {
        let wall = self
            .totals
            .first_delivery_at
            .map(|started| started.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        DrafterReport {
            drafter_id: self.config.drafter_id.clone(),
            end,
            steps: self.steps_done,
            samples_trained: self.totals.samples,
            tokens_trained: self.totals.tokens,
            dead_lettered: self.totals.dead_lettered,
            requeued: self.totals.requeued,
            skipped_steps: self.totals.skipped_steps,
            non_finite_samples: self.totals.non_finite_samples,
            final_checkpoint: self.last_checkpoint.clone(),
            first_loss: self.totals.first_loss,
            last_loss: self.totals.last_loss,
            last_accuracy: self.totals.last_accuracy,
            tokens_per_second: if wall > 0.0 {
                self.totals.tokens as f64 / wall
            } else {
                0.0
            },
            busy_fraction: if wall > 0.0 {
                (self.totals.busy.as_secs_f64() / wall).min(1.0)
            } else {
                0.0
            },
            device: self.device.clone(),
            device_memory_peak_bytes: self.gpu_memory.as_ref().map(|monitor| monitor.peak_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    /// What a trainer stand-in received, in order.
    #[derive(Debug, Default, PartialEq)]
    struct Received {
        deliveries: u64,
        schedule_updates: u64,
        finished_last: bool,
    }

    /// A busy trainer (nothing read until `gate` opens) with a full credit
    /// window queued and a pile of schedule updates must still get the
    /// Finish sent after them: a bounded channel with `try_send` dropped it
    /// silently (SIGTERM then ended in a shutdown timeout without the final
    /// checkpoint). More control commands than the channel has room for
    /// are sent: the sender waits for the trainer instead of dropping any.
    #[tokio::test]
    async fn control_commands_are_never_dropped_while_the_trainer_is_busy(
    ) -> Result<(), DrafterError> {
        let credit_items = 8u32;
        let gate = Arc::new(Barrier::new(2));
        let trainer_gate = gate.clone();
        let spawned = DeviceWorker::<TrainerCommand, TrainerEvent, (), Received>::spawn(
            "busy-trainer",
            trainer_channels(credit_items),
            move |mut side| {
                trainer_gate.wait();
                let mut received = Received::default();
                while let Some(command) = side.recv() {
                    received.finished_last = false;
                    match command {
                        TrainerCommand::Delivery { .. } => received.deliveries += 1,
                        TrainerCommand::SetTotalSteps(_) => received.schedule_updates += 1,
                        TrainerCommand::Finish { .. } => received.finished_last = true,
                        TrainerCommand::Flush | TrainerCommand::DiscardUnstepped => {}
                    }
                }
                received
            },
        );
        let Ok(mut trainer) = spawned else {
            return Err(DrafterError::TrainerGone);
        };
        let window = u64::from(credit_items) + DELIVERY_SLACK;
        for delivery_id in 0..window {
            let delivery = Delivery {
                delivery_id,
                ..Default::default()
            };
            let command = TrainerCommand::Delivery {
                generation: 0,
                delivery: Box::new(delivery),
            };
            send_command(&mut trainer, command).await?;
        }
        // Room for the control commands is there while the trainer is busy.
        for total_steps in 0..CONTROL_COMMAND_ROOM as u64 {
            send_command(&mut trainer, TrainerCommand::SetTotalSteps(total_steps)).await?;
        }
        // More than that waits for the trainer, which gets going now.
        let opener = std::thread::spawn(move || gate.wait());
        for total_steps in CONTROL_COMMAND_ROOM as u64..100 {
            send_command(&mut trainer, TrainerCommand::SetTotalSteps(total_steps)).await?;
        }
        let finish = TrainerCommand::Finish {
            step_accumulated: true,
        };
        send_command(&mut trainer, finish).await?;
        assert!(opener.join().is_ok());
        trainer.close_commands();
        assert!(matches!(
            send_command(&mut trainer, TrainerCommand::Flush).await,
            Err(DrafterError::TrainerGone)
        ));
        let received = trainer
            .finish(Duration::from_secs(60))
            .await
            .map_err(|_| DrafterError::TrainerGone)?;
        assert_eq!(
            received,
            Received {
                deliveries: window,
                schedule_updates: 100,
                finished_last: true,
            },
            "a command was dropped"
        );
        Ok(())
    }
}
