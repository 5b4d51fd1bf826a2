//! [`run`]: one drafter-server from flags to its report, in its steps:
//! register the metrics, prepare `--output`, start the training thread
//! ([`crate::threads`]), consume until the end ([`crate::pump`] over
//! [`crate::stream`]), join the trainer within a bound, report. Also the
//! run's error and report types, and the metrics endpoint around it all
//! (`--metrics-listen`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dflash_model::draft::step_dirs::latest_checkpoint;
use dflash_telemetry::{Registry, RegistryError};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{DrafterServerConfig, ModelMode};
use crate::engine::EngineError;
use crate::metrics::DrafterMetrics;
use crate::pump::Pump;
use crate::schedule::RunClock;
use crate::threads::{start_trainer, TRAINER_JOIN_BOUND};

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
    #[error("data parallelism: {0}")]
    DataParallel(Box<crate::data_parallel::DataParallelError>),
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
    let run = run_to_end(config, &registry, shutdown.clone());
    dflash_telemetry::MetricsEndpoint::during(metrics_listener, registry.clone(), &shutdown, run)
        .await
}

/// The run itself, updating the instruments it registers in `registry`:
/// start the trainer (the model loads before any credit is granted, so a
/// slow load never holds leases), consume until the end, join the trainer.
async fn run_to_end(
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
    // With local SGD the schedule is the run's: the link keeps the clock
    // current with the center, this side with the run's size. A
    // data-parallel member's steps are the run's steps already.
    let run_clock = (config.model_sync.mode() == crate::model_sync::ModelSyncMode::LocalSgd)
        .then(RunClock::new);
    let mut trainer = start_trainer(&config, resume_from, run_clock.clone())?;
    let (device, resumed_step) = trainer
        .ready()
        .await
        .map_err(|_| DrafterError::TrainerGone)??;
    info!(drafter_id = %config.drafter_id, device = %device, resumed_step, "trainer ready");
    let mut pump = Pump::new(
        config,
        trainer,
        device,
        resumed_step,
        metrics,
        run_clock,
        gpu_memory,
    );
    let result = pump.run(&shutdown).await;
    // Closing the command channel ends the training loop if it is still running.
    // A trainer still busy after the bound is left to finish on its own
    // (`join_within` says so); the run's result stands either way.
    if let Err(error) = pump.trainer.finish(TRAINER_JOIN_BOUND).await {
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
