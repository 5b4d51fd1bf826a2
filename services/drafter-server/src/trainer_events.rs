//! The async side's answer to the training thread's events: acks after
//! the step that used a delivery, nacks (dead letters, requeues), the
//! totals and metrics of each step, stats to the broker, and the run's
//! report from those totals. Apart from [`crate::pump`], which decides when
//! things happen; this is what each event does to the books.

use std::time::{Duration, Instant};

use dflash_client::ConsumerHandle;
use dflash_model::draft::StepReport;
use dflash_proto::v1::{ConsumerStats, NackDisposition};
use tracing::{error, info};

use crate::pump::Pump;
use crate::run::{DrafterReport, RunEnd};
use crate::trainer_thread::TrainerEvent;

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

impl Pump {
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

    /// Hands deliveries of the current stream back to the queue (a failed
    /// batch, a skipped step); ids of an older stream are the broker's
    /// already.
    pub(crate) fn requeue(
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
    pub(crate) fn on_event(
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

    pub(crate) fn report(&self, end: RunEnd) -> DrafterReport {
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
