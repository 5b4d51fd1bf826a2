//! [`Books`]: what a drafter counts of its own run: the totals of every
//! step, the metrics served at `/metrics`, the stats sent to the broker and
//! the run's final report. The pump (`crate::pump`) decides when things
//! happen and acks or nacks; this is what each step does to the books.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dflash_client::ConsumerHandle;
use dflash_model::draft::StepReport;
use dflash_proto::v1::ConsumerStats;
use tracing::info;

use crate::metrics::DrafterMetrics;
use crate::report::{DrafterReport, RunEnd};

/// Counters for stats and the report.
#[derive(Default)]
pub(crate) struct Totals {
    pub(crate) steps: u64,
    pub(crate) samples: u64,
    pub(crate) tokens: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) requeued: u64,
    pub(crate) skipped_steps: u64,
    /// Samples dead-lettered because their hidden states were not finite.
    pub(crate) non_finite_samples: u64,
    /// Skipped steps since the last step taken, and why the last one was.
    pub(crate) consecutive_skipped_steps: u64,
    pub(crate) last_skip_reason: String,
    pub(crate) busy: Duration,
    pub(crate) first_loss: Option<f64>,
    pub(crate) last_loss: Option<f64>,
    pub(crate) last_accuracy: Option<f64>,
    pub(crate) first_delivery_at: Option<Instant>,
    /// Window since the last stats message.
    pub(crate) window_tokens: u64,
    pub(crate) window_busy: Duration,
}

/// The drafter's own accounts of its run.
pub(crate) struct Books {
    pub(crate) totals: Totals,
    /// The device label the trainer reported.
    pub(crate) device: String,
    /// The trainer's step count (resumed steps included).
    pub(crate) steps_done: u64,
    pub(crate) last_checkpoint: Option<PathBuf>,
    /// Updated from the trainer's events; served by the metrics endpoint.
    pub(crate) metrics: DrafterMetrics,
    /// The GPU's memory, read after every step (CUDA with NVML only).
    pub(crate) gpu_memory: Option<dflash_device::GpuMemoryMonitor>,
}

impl Books {
    pub(crate) fn new(
        device: String,
        resumed_step: u64,
        metrics: DrafterMetrics,
        gpu_memory: Option<dflash_device::GpuMemoryMonitor>,
    ) -> Self {
        Books {
            totals: Totals::default(),
            device,
            steps_done: resumed_step,
            last_checkpoint: None,
            metrics,
            gpu_memory,
        }
    }

    /// Sends stats over the window since the last reset; `reset_window`
    /// starts a new one (periodic stats do, per-step updates do not).
    pub(crate) fn send_stats(
        &mut self,
        handle: &ConsumerHandle,
        window: Duration,
        reset_window: bool,
    ) {
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
            trace_export: dflash_telemetry::trace_export_stats(),
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
    pub(crate) fn book_step(
        &mut self,
        report: &StepReport,
        busy: Duration,
        step_compute: Duration,
    ) {
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
                .device_memory
                .set(reading.used_bytes, reading.peak_bytes);
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

    pub(crate) fn report(&self, drafter_id: &str, end: RunEnd) -> DrafterReport {
        let wall = self
            .totals
            .first_delivery_at
            .map(|started| started.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        DrafterReport {
            drafter_id: drafter_id.to_string(),
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
