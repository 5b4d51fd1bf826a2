//! The async end of the pipeline: ready samples from the host-copy thread
//! to the broker over the resilient Produce stream ([`crate::stream`]),
//! progress stats, the watchdog, and the stream's close with the run's
//! report. Apart from [`crate::run`] because it is the one loop of the run.

use crate::compute::{PipelineCounters, ReadyItem};
use crate::error::TargetServerError;
use crate::metrics::TargetMetrics;
use crate::reader::ReaderSummary;
use crate::report::TargetReport;
use crate::settings::PumpSettings;
use crate::shard::ShardSpec;
use crate::stream::ResilientProducer;
use dflash_client::{ClientError, ProduceReport};
use dflash_proto::v1::ProducerStats;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long an interrupted run waits for the broker's last answers (at most
/// `--finish-timeout`): a target the broker holds back gets none.
const INTERRUPTED_FINISH_GRACE: Duration = Duration::from_secs(5);

/// The async end of the pipeline: samples from the host-copy thread to the
/// broker, progress stats, and the watchdog.
pub(crate) struct Pump<'a> {
    pub(crate) settings: PumpSettings,
    pub(crate) target_id: String,
    pub(crate) metrics: &'a TargetMetrics,
    pub(crate) producer: ResilientProducer,
    /// Items the broker held from this target when the run began (the
    /// producer's own count moves on with each reconnect).
    pub(crate) accepted_at_start: u64,
    pub(crate) counters: Arc<PipelineCounters>,
    /// When the pipeline started: the counters' times are relative to it.
    pub(crate) epoch: Instant,
    pub(crate) shard: ShardSpec,
    pub(crate) layer_ids: Vec<usize>,
    pub(crate) device_label: String,
    pub(crate) resume_after_seq: Option<u64>,
    pub(crate) samples_total: u64,
    pub(crate) samples_sent: u64,
    pub(crate) tokens_sent: u64,
    /// Tokens computed at the previous stats message, for the rate.
    pub(crate) tokens_at_last_stats: u64,
    pub(crate) last_stats_at: Instant,
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
    pub(crate) async fn run(
        &mut self,
        shutdown: &CancellationToken,
        mut ready_receiver: tokio::sync::mpsc::Receiver<Vec<ReadyItem>>,
    ) -> Result<bool, TargetServerError> {
        let mut stats_timer = tokio::time::interval(self.settings.stats_period);
        stats_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The watchdog: time since the pipeline last handed over a batch.
        // Sends (which wait on the broker's backpressure) happen in the same
        // loop, so that wait is excluded: the clock restarts after each batch
        // is sent.
        let watchdog = self.settings.watchdog_timeout;
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
                .inspect_err(|error| {
                    if let TargetServerError::Broker(error) = error {
                        count_refused_item(self.metrics, error);
                    }
                })?;
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
                trace_export: dflash_telemetry::trace_export_stats(),
            })
            .await;
    }

    /// Final stats over the whole run, then the end of the Produce stream
    /// (bounded by `--finish-timeout`): the report, `completed` when the
    /// shard was read to its end.
    pub(crate) async fn close(
        mut self,
        completed: bool,
    ) -> Result<TargetReport, TargetServerError> {
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
            self.settings.finish_timeout
        } else {
            self.settings.finish_timeout.min(INTERRUPTED_FINISH_GRACE)
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
            target_id: self.target_id.clone(),
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
