//! [`run`]: one drafter-server from flags to its report, in its steps:
//! register the metrics, prepare `--output`, start the training thread
//! ([`crate::threads`]), consume until the end ([`crate::pump`] over
//! [`crate::stream`]), join the trainer within a bound, report; and the
//! metrics endpoint around it all (`--metrics-listen`).

use std::path::PathBuf;
use std::sync::Arc;

use dflash_model::draft::step_dirs::latest_checkpoint;
use dflash_telemetry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::books::Books;
use crate::config::DrafterServerConfig;
use crate::error::DrafterError;
use crate::metrics::DrafterMetrics;
use crate::pump::Pump;
use crate::report::DrafterReport;
use crate::settings::{DrafterSettings, ModelMode, OutputSettings};
use crate::threads::{start_trainer, TrainerParts, TRAINER_JOIN_BOUND};

/// Runs a drafter-server until end-of-stream or `shutdown`. The flags are
/// checked and split into their typed parts here, once. When
/// `--metrics-listen` is set, serves Prometheus metrics there for as long
/// as the run lasts.
pub async fn run(
    config: DrafterServerConfig,
    shutdown: CancellationToken,
) -> Result<DrafterReport, DrafterError> {
    let settings = config.validate()?;
    let metrics_listener = dflash_telemetry::bind_metrics_listener(settings.metrics_listen)
        .await
        .map_err(|(address, source)| DrafterError::MetricsListen { address, source })?;
    run_with_settings(settings, metrics_listener, shutdown).await
}

/// [`run`] with the metrics endpoint on an already bound listener (tests
/// bind `127.0.0.1:0` to learn the port) instead of `--metrics-listen`,
/// or none. The endpoint is an owned task: it stops when `shutdown` is
/// cancelled or the run returns, whichever comes first.
pub async fn run_with_metrics_listener(
    config: DrafterServerConfig,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<DrafterReport, DrafterError> {
    run_with_settings(config.validate()?, metrics_listener, shutdown).await
}

async fn run_with_settings(
    settings: DrafterSettings,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<DrafterReport, DrafterError> {
    let registry = Arc::new(Registry::new());
    let run = run_to_end(settings, &registry, shutdown.clone());
    dflash_telemetry::MetricsEndpoint::during(metrics_listener, registry.clone(), &shutdown, run)
        .await
}

/// The run itself, updating the instruments it registers in `registry`:
/// start the trainer (the model loads before any credit is granted, so a
/// slow load never holds leases), consume until the end, join the trainer.
async fn run_to_end(
    settings: DrafterSettings,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<DrafterReport, DrafterError> {
    let DrafterSettings {
        connection,
        metrics_listen: _,
        output,
        engine,
        schedule,
        training_loop,
        pump,
        mode,
    } = settings;
    // The label the engine will report, known before the model loads so the
    // metrics exist (at zero) from the first scrape.
    let (device_label, gpu_memory) = match engine.model {
        ModelMode::Synthetic { .. } => ("synthetic".to_string(), None),
        ModelMode::DFlash => {
            let device = engine.resolve_device()?;
            let gpu_memory = match device {
                tch::Device::Cuda(index) => dflash_device::GpuMemoryMonitor::start(index),
                _ => None,
            };
            (dflash_model::device::device_label(device), gpu_memory)
        }
    };
    let metrics = DrafterMetrics::register(registry, &connection.drafter_id, &device_label)?;
    let resume_from = prepare_output(&output)?;
    let mut trainer = start_trainer(
        TrainerParts {
            connection: &connection,
            engine,
            schedule,
            training_loop,
            mode: &mode,
            credit_items: pump.credit_items,
        },
        resume_from,
    )?;
    let (device, resumed_step) = trainer
        .ready()
        .await
        .map_err(|_| DrafterError::TrainerGone)??;
    info!(drafter_id = %connection.drafter_id, device = %device, resumed_step, "trainer ready");
    let mut pump = Pump::new(
        pump,
        connection,
        schedule,
        trainer,
        Books::new(device, resumed_step, metrics, gpu_memory),
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
fn prepare_output(settings: &OutputSettings) -> Result<Option<PathBuf>, DrafterError> {
    let io_error = |source| DrafterError::Io {
        path: settings.output.clone(),
        source,
    };
    std::fs::create_dir_all(&settings.output).map_err(io_error)?;
    if !settings.resume {
        return Ok(None);
    }
    let resume_from = latest_checkpoint(&settings.output).map_err(io_error)?;
    if resume_from.is_none() {
        info!(output = %settings.output.display(), "no checkpoint to resume from; starting fresh");
    }
    Ok(resume_from)
}
