//! The async loop of a drafter-server: deliveries to the training thread,
//! its events to acks and nacks (`on_event`; the counting in [`crate::books`]), leases
//! extended while it makes progress, stats, the schedule estimate, the
//! linger flush, reconnects and the graceful stop. All compute happens on
//! the training thread ([`crate::trainer_thread`]); this side never blocks.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use dflash_client::{BrokerClient, ConsumerEvent, ConsumerHandle};
use dflash_proto::v1::{Credit, Delivery, EndOfStream, NackDisposition, RunStatus};
use tokio::time::{interval, sleep_until, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::books::Books;
use crate::error::DrafterError;
use crate::report::{DrafterReport, RunEnd};
use crate::schedule::{estimate_total_steps, ScheduleInputs};
use crate::settings::{Connection, PumpSettings, ScheduleSettings};
use crate::stream::ConsumeStream;
use crate::threads::{send_command, TrainerWorker, DELIVERY_SLACK};
use crate::trainer_thread::{TrainerCommand, TrainerEvent};

/// Why the main loop is stopping.
enum Stopping {
    Shutdown,
    EndOfStream(EndOfStream),
}

/// The pump loop's clocks and its stop state (local to one [`Pump::run`]).
struct LoopState {
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

impl LoopState {
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

/// The state of one server run across reconnects: the async end of the
/// training thread, and the books of what it did.
pub(crate) struct Pump {
    pub(crate) settings: PumpSettings,
    /// Who this drafter is and how it reaches the broker.
    pub(crate) connection: Connection,
    /// The schedule's length settings, for the estimate from the broker.
    pub(crate) schedule: ScheduleSettings,
    pub(crate) credit: Credit,
    /// The most items the current stream was ever granted: deliveries the
    /// broker sent before it read a smaller window are not over credit.
    pub(crate) granted_items: u32,
    /// The training thread. Its command channel has room for the credit
    /// window and then some, so a control command (Finish above all) is
    /// never dropped and almost never waited for; deliveries are bounded by
    /// [`Pump::held`] against the credit window before they get there.
    pub(crate) trainer: TrainerWorker,
    /// Deliveries of the current stream handed to the trainer and not yet
    /// acked or nacked.
    pub(crate) held: HashSet<u64>,
    /// Bumped on every new Consume stream.
    pub(crate) generation: u64,
    /// Totals, metrics and the report of this drafter's run.
    pub(crate) books: Books,
    /// The broker's run id from the first welcome: a broker that comes back
    /// with another one lost the run, and this drafter stops instead of
    /// training on as if nothing was lost.
    pub(crate) run_id: Option<String>,
}

impl Pump {
    /// The pump of a trainer that is ready, its books opened on the
    /// trainer's device and resumed step. Its credit window is the settings'.
    pub(crate) fn new(
        settings: PumpSettings,
        connection: Connection,
        schedule: ScheduleSettings,
        trainer: TrainerWorker,
        books: Books,
    ) -> Self {
        Pump {
            credit: Credit {
                items: settings.credit_items,
                bytes: settings.credit_bytes,
            },
            granted_items: settings.credit_items,
            settings,
            connection,
            schedule,
            trainer,
            held: HashSet::new(),
            generation: 0,
            books,
            run_id: None,
        }
    }

    /// Opens a Consume stream (see [`ConsumeStream::open`]), remembering
    /// the broker's run id.
    async fn connect(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<Option<ConsumeStream>, DrafterError> {
        self.granted_items = self.credit.items;
        ConsumeStream::open(&self.connection, self.credit, &mut self.run_id, shutdown).await
    }

    pub(crate) async fn send_command(
        &mut self,
        command: TrainerCommand,
    ) -> Result<(), DrafterError> {
        send_command(&mut self.trainer, command).await
    }

    /// Re-estimates the schedule from the broker's status when
    /// `--total-steps` is not set: this drafter's share of the run.
    async fn refresh_total_steps(&mut self, client: &BrokerClient) {
        if self.schedule.total_steps.is_some() {
            return;
        }
        let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(2), client.status()).await
        else {
            return;
        };
        let summary = status.summary.unwrap_or_default();
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
                steps_done: self.books.steps_done,
                samples_trained: self.books.totals.samples,
                assumed_samples_per_step: self.schedule.samples_per_step,
            },
            self.schedule.fallback_total_steps,
        );
        let _ = self
            .send_command(TrainerCommand::SetTotalSteps(total_steps))
            .await;
    }

    /// Connect, then pump: deliveries to the trainer, its events to acks
    /// and nacks, leases extended while it makes progress, stats, the
    /// linger flush, reconnects, and the graceful stop.
    pub(crate) async fn run(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<DrafterReport, DrafterError> {
        let Some(mut stream) = self.connect(shutdown).await? else {
            return self.stop_without_stream(Stopping::Shutdown).await;
        };
        self.refresh_total_steps(&stream.client).await;
        info!(drafter_id = %self.connection.drafter_id, credit_items = self.credit.items, "consuming");
        let mut stats_ticker = interval(self.settings.stats_period);
        stats_ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut loop_state = LoopState::new();
        loop {
            let linger_at = loop_state.last_delivery_at + self.settings.linger;
            let linger_armed = !self.held.is_empty()
                && !loop_state.flush_requested
                && loop_state.stopping.is_none();
            tokio::select! {
                _ = shutdown.cancelled(), if loop_state.stopping.is_none() => {
                    info!("shutdown requested: finishing the current step, checkpointing, handing back unused deliveries");
                    self.begin_stop(&mut loop_state, Stopping::Shutdown, true).await?;
                }
                next = stream.consumer.next(), if stream.open => match next {
                    Ok(ConsumerEvent::Delivery(delivery)) => self.on_delivery(delivery, &stream, &mut loop_state).await?,
                    Ok(ConsumerEvent::EndOfStream(end)) => self.on_end_of_stream(end, &mut stream, &mut loop_state).await?,
                    Err(stream_error) => self.on_stream_error(stream_error, shutdown, &mut stream, &mut loop_state).await?,
                },
                event = self.trainer.next_event() => {
                    let Some(event) = event else { return Err(DrafterError::TrainerGone) };
                    loop_state.last_trainer_progress = tokio::time::Instant::now();
                    if let Some(end) = self.on_trainer_event(event, &stream, &mut loop_state).await? {
                        return Ok(self.books.report(&self.connection.drafter_id, end));
                    }
                }
                _ = stream.lease_ticker.tick(), if stream.open => self.extend_leases(&stream, &loop_state),
                _ = stats_ticker.tick(), if stream.open => {
                    self.books.send_stats(&stream.handle, loop_state.last_stats_at.elapsed(), true);
                    loop_state.last_stats_at = Instant::now();
                    self.refresh_total_steps(&stream.client).await;
                }
                _ = sleep_until(linger_at), if linger_armed => {
                    loop_state.flush_requested = true;
                    self.send_command(TrainerCommand::Flush).await?;
                }
                _ = sleep_until(loop_state.stop_deadline), if loop_state.stopping.is_some() => {
                    return Err(DrafterError::ShutdownTimedOut(self.settings.shutdown_timeout));
                }
            }
        }
    }

    /// Asks the trainer to finish (stepping what it accumulated when
    /// `step_accumulated`) and starts the `--shutdown-timeout` clock.
    async fn begin_stop(
        &mut self,
        loop_state: &mut LoopState,
        stopping: Stopping,
        step_accumulated: bool,
    ) -> Result<(), DrafterError> {
        loop_state.stopping = Some(stopping);
        loop_state.stop_deadline = tokio::time::Instant::now() + self.settings.shutdown_timeout;
        self.send_command(TrainerCommand::Finish { step_accumulated })
            .await
    }

    /// Hands a delivery to the trainer, or back to the queue when stopping
    /// or beyond the credit window.
    async fn on_delivery(
        &mut self,
        delivery: Delivery,
        stream: &ConsumeStream,
        loop_state: &mut LoopState,
    ) -> Result<(), DrafterError> {
        let delivery_id = delivery.delivery_id;
        if loop_state.stopping.is_some() {
            stream.handle.nack(
                vec![delivery_id],
                "drafter stopping".into(),
                NackDisposition::Requeue,
            );
            self.books.totals.requeued += 1;
            return Ok(());
        }
        self.books
            .totals
            .first_delivery_at
            .get_or_insert_with(Instant::now);
        loop_state.last_delivery_at = tokio::time::Instant::now();
        loop_state.flush_requested = false;
        if self.held.len() as u64 >= u64::from(self.granted_items) + DELIVERY_SLACK {
            warn!(
                delivery_id,
                held = self.held.len(),
                credit_items = self.granted_items,
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
            self.books.totals.dead_lettered += 1;
            self.books.totals.non_finite_samples += 1;
            self.books.metrics.rejected_items.increment();
            return Ok(());
        }
        if self.held.is_empty() {
            loop_state.last_trainer_progress = tokio::time::Instant::now();
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
        loop_state: &mut LoopState,
    ) -> Result<(), DrafterError> {
        stream.open = false;
        let status = RunStatus::try_from(end.status).unwrap_or(RunStatus::Unspecified);
        info!(?status, reason = %end.reason, "end of stream");
        if loop_state.stopping.is_none() {
            self.begin_stop(loop_state, Stopping::EndOfStream(end), true)
                .await
        } else {
            loop_state.stopping = Some(Stopping::EndOfStream(end));
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
        loop_state: &mut LoopState,
    ) -> Result<(), DrafterError> {
        stream.open = false;
        if loop_state.stopping.is_some() {
            warn!(%stream_error, "Consume stream broke while stopping");
            return Ok(());
        }
        warn!(%stream_error, held = self.held.len(), "Consume stream broke; the broker requeues our leases; reconnecting");
        self.generation += 1;
        self.held.clear();
        self.send_command(TrainerCommand::DiscardUnstepped).await?;
        match self.connect(shutdown).await? {
            Some(reopened) => {
                *stream = reopened;
                info!(generation = self.generation, "Consume stream reopened");
                Ok(())
            }
            None => self.begin_stop(loop_state, Stopping::Shutdown, false).await,
        }
    }

    /// Books one trainer event; once the trainer has stopped, hands back
    /// what it did not use and says how the run ended.
    async fn on_trainer_event(
        &mut self,
        event: TrainerEvent,
        stream: &ConsumeStream,
        loop_state: &mut LoopState,
    ) -> Result<Option<RunEnd>, DrafterError> {
        let finished = self.on_event(event, &stream.handle, loop_state.last_stats_at.elapsed());
        let max_skipped = self.settings.max_skipped_steps;
        if max_skipped > 0 && self.books.totals.consecutive_skipped_steps >= max_skipped {
            // The broker requeues what this drafter still holds when its
            // stream goes; nothing of the skipped steps reached the model.
            return Err(DrafterError::SkippedSteps {
                count: self.books.totals.consecutive_skipped_steps,
                last_reason: self.books.totals.last_skip_reason.clone(),
            });
        }
        let Some((unused, checkpoint_error)) = finished else {
            return Ok(None);
        };
        if !unused.is_empty() {
            self.books.totals.requeued += unused.len() as u64;
            stream
                .handle
                .nack(unused, "drafter stopping".into(), NackDisposition::Requeue);
        }
        self.books
            .send_stats(&stream.handle, loop_state.last_stats_at.elapsed(), true);
        if stream.open {
            stream
                .wait_for_leases_released(&self.connection.drafter_id)
                .await;
        } else {
            // The end of the stream came with the last commit (data
            // parallelism acks a step's samples with it): the stats of that
            // step go after it.
            stream
                .wait_for_final_stats(&self.connection.drafter_id, self.books.steps_done)
                .await;
        }
        if let Some(error) = checkpoint_error {
            return Err(DrafterError::FinalCheckpoint(error));
        }
        Ok(Some(match loop_state.stopping.take() {
            Some(Stopping::EndOfStream(end)) if end.status == RunStatus::Aborted as i32 => {
                RunEnd::Aborted { reason: end.reason }
            }
            Some(Stopping::EndOfStream(_)) => RunEnd::Complete,
            Some(Stopping::Shutdown) | None => RunEnd::Shutdown,
        }))
    }

    /// A long step must not lose its leases: renew all of ours, while the
    /// trainer shows progress.
    fn extend_leases(&self, stream: &ConsumeStream, loop_state: &LoopState) {
        if self.held.is_empty() {
            return;
        }
        if loop_state.last_trainer_progress.elapsed() < self.settings.trainer_stall_timeout {
            stream.handle.extend_leases(Vec::new());
        } else {
            warn!(held = self.held.len(), stalled_for = ?loop_state.last_trainer_progress.elapsed(), "the trainer shows no progress; leases are no longer extended");
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
        let deadline = tokio::time::Instant::now() + self.settings.shutdown_timeout;
        loop {
            let event = tokio::time::timeout_at(deadline, self.trainer.next_event())
                .await
                .map_err(|_| DrafterError::ShutdownTimedOut(self.settings.shutdown_timeout))?
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
                self.books.last_checkpoint = final_checkpoint;
                let end = match stopping {
                    Stopping::Shutdown => RunEnd::Shutdown,
                    Stopping::EndOfStream(_) => RunEnd::Complete,
                };
                return Ok(self.books.report(&self.connection.drafter_id, end));
            }
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
        self.books.totals.requeued += current.len() as u64;
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
                    self.books.totals.dead_lettered += 1;
                    self.books.metrics.rejected_items.increment();
                }
            }
            TrainerEvent::Stepped {
                generation,
                delivery_ids,
                report,
                busy,
                step_compute,
            } => {
                self.books.totals.consecutive_skipped_steps = 0;
                self.books.book_step(&report, busy, step_compute);
                // Stats go out before the ack: the ack of the run's last item
                // can end the stream, and the broker's final status should
                // show this step.
                self.books.send_stats(handle, stats_window, false);
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
                self.books.totals.skipped_steps += 1;
                self.books.totals.consecutive_skipped_steps += 1;
                self.books.metrics.skipped_steps.increment();
                self.requeue(handle, generation, delivery_ids, reason.clone());
                self.books.totals.last_skip_reason = reason;
            }
            TrainerEvent::BatchFailed {
                generation,
                delivery_ids,
                reason,
            } => self.requeue(handle, generation, delivery_ids, reason),
            TrainerEvent::Settled {
                generation,
                delivery_ids,
            } => {
                if generation == self.generation {
                    for delivery_id in delivery_ids {
                        self.held.remove(&delivery_id);
                    }
                }
            }
            TrainerEvent::ShareOfStep { max_step_samples } => {
                let items = u32::try_from(max_step_samples)
                    .unwrap_or(u32::MAX)
                    .saturating_add(self.settings.prefetch_items)
                    .max(1);
                if items != self.credit.items {
                    info!(
                        drafter_id = %self.connection.drafter_id,
                        share_of_step = max_step_samples,
                        credit_items = items,
                        "credit window follows this member's share of the step"
                    );
                    self.credit.items = items;
                    self.granted_items = self.granted_items.max(items);
                    handle.set_credit(self.credit);
                }
            }
            TrainerEvent::CheckpointSaved { step, path } => {
                self.books.last_checkpoint = Some(path);
                self.books.steps_done = self.books.steps_done.max(step);
            }
            TrainerEvent::Stopped {
                generation,
                unused_delivery_ids,
                final_checkpoint,
                checkpoint_error,
            } => {
                if let Some(path) = final_checkpoint {
                    self.books.last_checkpoint = Some(path);
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
}
