//! The dedicated training thread. It owns the engine (and so every libtorch
//! object), runs as a [`dflash_device::DeviceWorker`]: it receives
//! deliveries and control commands over a bounded channel with room for
//! the credit window and the control commands, forms
//! micro-batches by token budget, takes optimizer steps and
//! checkpoints, and reports back over another bounded channel. It never
//! talks to the broker: the async side acks, nacks and sends stats, so all
//! stream state lives in one place.
//!
//! Items are acked only after the optimizer step that used them: a
//! `Stepped` event carries exactly those delivery ids.
//!
//! A step's limits (`--batch-tokens`, `--grad-accumulation`,
//! `--max-step-samples`) are the run's step; a data-parallel member trains
//! its share of them, N the members of its last quorum
//! ([`crate::schedule::share_of_step`]).
//!
//! Each step runs in a `drafter.step` trace span (target
//! [`dflash_telemetry::TRACE_TARGET`], so it is disabled and nearly free
//! without a span exporter) that covers its micro-batches and the update. It
//! is parented to the trace of the step's first sample and linked to the
//! traces of all the others, so a sample can be followed from the target
//! that made it to the step that trained on it.
//!
//! The data-parallel step (quorum, all-reduce, vote, and what follows a
//! commit or a failure) is in the child module `data_parallel_step`.
//!
//! Test hook (cargo feature `test-hooks` only, see [`crate::test_hooks`]):
//! with `DFLASH_TEST_HANG_TRAINER_AFTER_STEPS=N` in the environment the
//! thread stops working for good once N steps are done and a command
//! arrives (as a trainer stuck in a device call would), so tests can check
//! that its leases go to other drafters.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use dflash_model::draft::StepReport;
use dflash_proto::v1::Delivery;
use tokio::sync::mpsc;
use tracing::{info, warn, Span};

use crate::data_parallel::DataParallel;
use crate::engine::{EngineError, PreparedSample, TrainingEngine};
use crate::model_sync::ModelSyncLink;
use crate::schedule::{share_of_step, StepLimits};
use crate::settings::LoopSettings;
use dflash_model::draft::step_dirs::{prune_step_checkpoints, record_latest, step_dir_name};
use dflash_model::draft::DraftError;

mod data_parallel_step;

/// What the async side asks of the training thread.
pub enum TrainerCommand {
    /// A delivery from the Consume stream of `generation` (bumped on every
    /// reconnect: ids of an older stream must not be acked on a newer one).
    Delivery {
        generation: u64,
        delivery: Box<Delivery>,
    },
    /// Nothing arrived for a while: train on what is held now.
    Flush,
    /// Revised schedule length.
    SetTotalSteps(u64),
    /// The stream broke: forget everything not yet stepped (the broker
    /// requeues those items itself).
    DiscardUnstepped,
    /// Stop: step what is already accumulated (when `step_accumulated`),
    /// write the final checkpoint, hand back the ids of unused deliveries.
    Finish { step_accumulated: bool },
}

/// What the training thread reports.
pub enum TrainerEvent {
    /// A delivery's sample cannot be used by this model: dead-letter it.
    Rejected {
        generation: u64,
        delivery_id: u64,
        reason: String,
    },
    /// An optimizer step finished; these deliveries may now be acked.
    Stepped {
        generation: u64,
        delivery_ids: Vec<u64>,
        report: StepReport,
        /// Time spent computing since the previous event of this kind.
        busy: Duration,
        /// Compute time of this step alone: its micro-batches and the update.
        step_compute: Duration,
    },
    /// The step's loss or gradient was not finite (or spiked): nothing of
    /// it reached the weights; its deliveries go back to the queue (another
    /// delivery may train on them; a sample that breaks every step reaches
    /// the dead letters through the broker's delivery limit).
    StepSkipped {
        generation: u64,
        delivery_ids: Vec<u64>,
        reason: String,
    },
    /// A micro-batch or step failed; its deliveries go back to the queue.
    BatchFailed {
        generation: u64,
        delivery_ids: Vec<u64>,
        reason: String,
    },
    /// Data parallelism: the broker settled these deliveries with the
    /// step's decision (acked with a commit, or returned by an abort): the
    /// drafter lets them go without an ack or a nack.
    Settled {
        generation: u64,
        delivery_ids: Vec<u64>,
    },
    CheckpointSaved {
        step: u64,
        path: PathBuf,
    },
    /// Data parallelism: this member's share of the run's step changed
    /// (its quorums have another number of members): the pump sizes the
    /// credit window to it, so a member never leases a whole step's samples
    /// while the others wait for theirs.
    ShareOfStep {
        max_step_samples: usize,
    },
    /// Answer to `Finish`.
    Stopped {
        generation: u64,
        unused_delivery_ids: Vec<u64>,
        final_checkpoint: Option<PathBuf>,
        checkpoint_error: Option<String>,
    },
}

struct HeldSample {
    delivery_id: u64,
    /// The sample's key, recorded on the step span that trains on it.
    target_id: String,
    seq: u64,
    /// The producer's W3C trace context (`Delivery.trace_context`), so the
    /// step that trains on this sample joins or links its trace.
    trace_context: HashMap<String, String>,
    prepared: PreparedSample,
}

/// The loop's state between commands.
struct TrainingLoop {
    engine: Box<dyn TrainingEngine>,
    settings: LoopSettings,
    events: mpsc::Sender<TrainerEvent>,
    generation: u64,
    /// Samples not yet in a micro-batch.
    pending: Vec<HeldSample>,
    /// Delivery ids of micro-batches accumulated but not yet stepped.
    accumulated_ids: Vec<u64>,
    /// The (target, seq) of each of `accumulated_ids`, in the same order:
    /// a data-parallel vote names both.
    accumulated_keys: Vec<(String, u64)>,
    accumulated_micro_batches: u64,
    /// The span of the step being accumulated: opened with its first
    /// micro-batch, closed when the step is taken or its work is discarded.
    step_span: Option<Span>,
    /// The samples of the step being accumulated, for its span.
    step_samples: dflash_telemetry::SampleTraces,
    /// Compute time of the step being accumulated, for `Stepped`.
    step_compute: Duration,
    /// Compute time not yet reported.
    busy: Duration,
    /// Step of the newest checkpoint written, so the final one is not
    /// written twice.
    last_checkpoint_step: Option<u64>,
    /// The link to the broker's copy of the run's model (`None`:
    /// independent): data parallelism's join and snapshots.
    sync: Option<ModelSyncLink>,
    /// Membership in the run's data-parallel trainer (`None`: an
    /// independent drafter, or a synthetic engine with no model).
    data_parallel: Option<DataParallel>,
    /// The accumulated step found no quorum yet: it is asked for again
    /// whenever no command is waiting, not only when the next delivery
    /// comes (none may come: this member's credit can be all in the step).
    awaiting_quorum: bool,
    /// The share of the step last told to the pump (`ShareOfStep`).
    announced_share: usize,
    started: Instant,
}

/// Runs the loop until `Finish` or until the command channel closes.
pub fn run_training_loop(
    engine: Box<dyn TrainingEngine>,
    settings: LoopSettings,
    mut commands: mpsc::Receiver<TrainerCommand>,
    events: mpsc::Sender<TrainerEvent>,
    sync: Option<ModelSyncLink>,
    data_parallel: Option<DataParallel>,
) {
    let settings_max_step_samples = settings.max_step_samples;
    let mut state = TrainingLoop {
        engine,
        settings,
        events,
        generation: 0,
        pending: Vec::new(),
        accumulated_ids: Vec::new(),
        accumulated_keys: Vec::new(),
        accumulated_micro_batches: 0,
        step_span: None,
        step_samples: dflash_telemetry::SampleTraces::new(),
        step_compute: Duration::ZERO,
        busy: Duration::ZERO,
        last_checkpoint_step: None,
        sync,
        data_parallel,
        awaiting_quorum: false,
        announced_share: settings_max_step_samples,
        started: Instant::now(),
    };
    state.join();
    let hang_after_steps = crate::test_hooks::hang_trainer_after_steps();
    loop {
        // A data-parallel member holding nothing takes part in the others'
        // steps (with zeros) while it waits, so that nobody waits for it; a
        // member whose step found no quorum asks again (the broker holds
        // each ask a moment, so this does not spin).
        let command = if state.data_parallel.is_some()
            && (state.held_samples() == 0 || state.awaiting_quorum)
        {
            match commands.try_recv() {
                Ok(command) => command,
                Err(mpsc::error::TryRecvError::Empty) => {
                    if state.awaiting_quorum {
                        state.run_data_parallel_step();
                    } else {
                        state.idle();
                    }
                    continue;
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
            }
        } else {
            match commands.blocking_recv() {
                Some(command) => command,
                None => break,
            }
        };
        if hang_after_steps.is_some_and(|steps| state.engine.steps_done() >= steps) {
            warn!(
                steps = state.engine.steps_done(),
                "test hook: the training thread hangs"
            );
            loop {
                std::thread::park();
            }
        }
        match command {
            TrainerCommand::Delivery {
                generation,
                delivery,
            } => state.on_delivery(generation, *delivery),
            TrainerCommand::Flush => state.flush(),
            TrainerCommand::SetTotalSteps(total_steps) => state.engine.set_total_steps(total_steps),
            TrainerCommand::DiscardUnstepped => state.discard(),
            TrainerCommand::Finish { step_accumulated } => {
                // Deliveries still queued in the channel were never used either.
                let mut unused: Vec<u64> = Vec::new();
                while let Ok(command) = commands.try_recv() {
                    if let TrainerCommand::Delivery { delivery, .. } = command {
                        unused.push(delivery.delivery_id);
                    }
                }
                state.finish(step_accumulated, unused);
                return;
            }
        }
    }
}

impl TrainingLoop {
    /// Starts from the run's model: the broker's, continuing its step
    /// count, or this drafter's own weights as the run's first.
    fn join(&mut self) {
        let (Some(sync), Some(_)) = (&mut self.sync, &self.data_parallel) else {
            return;
        };
        let Some(model) = self.engine.draft_model() else {
            return;
        };
        let (step, samples) = sync.join_run(model);
        if let Some(trainer) = self.engine.trainer_mut() {
            trainer.continue_run(step, samples);
        }
    }

    fn emit(&self, event: TrainerEvent) {
        // The receiver only disappears when the server is already gone.
        let _ = self.events.blocking_send(event);
    }

    fn held_samples(&self) -> usize {
        self.pending.len() + self.accumulated_ids.len()
    }

    fn on_delivery(&mut self, generation: u64, delivery: Delivery) {
        if generation != self.generation {
            self.discard();
            self.generation = generation;
        }
        let Delivery {
            delivery_id,
            sample,
            trace_context,
            target_id,
            seq,
            ..
        } = delivery;
        let sample = sample.unwrap_or_default();
        match self.engine.prepare(&sample) {
            Err(error) => self.emit(TrainerEvent::Rejected {
                generation,
                delivery_id,
                reason: format!("target {target_id} seq {seq}: {error}"),
            }),
            Ok(prepared) => {
                self.pending.push(HeldSample {
                    delivery_id,
                    target_id,
                    seq,
                    trace_context,
                    prepared,
                });
                self.train_what_is_ready();
            }
        }
    }

    /// Padded tokens of a micro-batch of these samples.
    fn padded_tokens(samples: &[HeldSample]) -> usize {
        samples
            .iter()
            .map(|held| held.prepared.tokens)
            .max()
            .unwrap_or(0)
            * samples.len()
    }

    /// This step's limits: the run's step, or a data-parallel member's
    /// share of it.
    fn step_limits(&self) -> StepLimits {
        let one = StepLimits {
            batch_tokens: self.settings.batch_tokens,
            grad_accumulation: self.settings.grad_accumulation,
            max_step_samples: self.settings.max_step_samples,
        };
        match &self.data_parallel {
            Some(data_parallel) => share_of_step(one, data_parallel.world_size() as f64),
            None => one,
        }
    }

    fn train_what_is_ready(&mut self) {
        let limits = self.step_limits();
        if Self::padded_tokens(&self.pending) >= limits.batch_tokens {
            // Keep the newest sample for the next micro-batch when it is the
            // one that pushed this one over the budget.
            let keep_last = self.pending.len() > 1
                && Self::padded_tokens(&self.pending[..self.pending.len() - 1])
                    < limits.batch_tokens
                && Self::padded_tokens(&self.pending) > limits.batch_tokens;
            let carried = if keep_last { self.pending.pop() } else { None };
            self.run_micro_batch();
            self.pending.extend(carried);
            if self.accumulated_micro_batches >= limits.grad_accumulation {
                self.run_step();
            }
        }
        if self.held_samples() >= limits.max_step_samples {
            self.flush();
        }
    }

    /// Micro-batches whatever is pending and steps whatever is accumulated.
    fn flush(&mut self) {
        if !self.pending.is_empty() {
            self.run_micro_batch();
        }
        if self.accumulated_micro_batches > 0 {
            self.run_step();
        }
    }

    /// The span of the step that `batch` joins, opened when the batch is
    /// the step's first; parented to its first sample, linked once to each
    /// other producer span, naming every sample (`SampleTraces`).
    fn step_span_for(&mut self, batch: &[HeldSample]) -> Span {
        let span = match &self.step_span {
            Some(span) => span.clone(),
            None => {
                let span = tracing::debug_span!(
                    target: dflash_telemetry::TRACE_TARGET,
                    "drafter.step",
                    samples = tracing::field::Empty,
                    step = self.engine.steps_done() + 1,
                );
                self.step_span = Some(span.clone());
                span
            }
        };
        for held in batch {
            self.step_samples
                .add(&span, &held.target_id, held.seq, &held.trace_context);
        }
        span
    }

    fn run_micro_batch(&mut self) {
        let batch = std::mem::take(&mut self.pending);
        let span = self.step_span_for(&batch);
        let delivery_ids: Vec<u64> = batch.iter().map(|held| held.delivery_id).collect();
        let keys: Vec<(String, u64)> = batch
            .iter()
            .map(|held| (held.target_id.clone(), held.seq))
            .collect();
        let started = Instant::now();
        let result = span.in_scope(|| {
            self.engine
                .accumulate(batch.into_iter().map(|held| held.prepared).collect())
        });
        let elapsed = started.elapsed();
        self.busy += elapsed;
        self.step_compute += elapsed;
        match result {
            Ok(()) => {
                self.accumulated_ids.extend(delivery_ids);
                self.accumulated_keys.extend(keys);
                self.accumulated_micro_batches += 1;
            }
            Err(error) => {
                warn!(%error, samples = delivery_ids.len(), "micro-batch failed; its items and the unstepped ones go back to the queue");
                let mut failed = std::mem::take(&mut self.accumulated_ids);
                self.awaiting_quorum = false;
                self.accumulated_keys.clear();
                failed.extend(delivery_ids);
                self.accumulated_micro_batches = 0;
                self.end_step_span();
                self.engine.discard();
                self.emit(TrainerEvent::BatchFailed {
                    generation: self.generation,
                    delivery_ids: failed,
                    reason: error.to_string(),
                });
            }
        }
    }

    fn run_step(&mut self) {
        if self.data_parallel.is_some() {
            self.run_data_parallel_step();
            return;
        }
        let span = self.step_span.take().unwrap_or_else(Span::none);
        span.record("samples", self.accumulated_ids.len());
        self.step_samples.apply(&span);
        let started = Instant::now();
        let result = span.in_scope(|| self.engine.step());
        drop(span);
        let elapsed = started.elapsed();
        self.busy += elapsed;
        let step_compute = std::mem::take(&mut self.step_compute) + elapsed;
        let delivery_ids = std::mem::take(&mut self.accumulated_ids);
        self.accumulated_keys.clear();
        self.accumulated_micro_batches = 0;
        match result {
            Ok(report) => {
                let step = report.step;
                let busy = std::mem::take(&mut self.busy);
                self.emit(TrainerEvent::Stepped {
                    generation: self.generation,
                    delivery_ids,
                    report,
                    busy,
                    step_compute,
                });
                if self.settings.save_every > 0 && step % self.settings.save_every == 0 {
                    if let Err(error) = self.save_checkpoint() {
                        warn!(%error, step, "periodic checkpoint failed; training continues");
                    }
                }
            }
            Err(EngineError::Draft(DraftError::StepSkipped(skipped))) => {
                warn!(reason = %skipped, samples = delivery_ids.len(), "optimizer step skipped; its items go back to the queue");
                self.engine.discard();
                self.emit(TrainerEvent::StepSkipped {
                    generation: self.generation,
                    delivery_ids,
                    reason: format!("optimizer step skipped: {skipped}"),
                });
            }
            Err(error) => {
                self.engine.discard();
                self.emit(TrainerEvent::BatchFailed {
                    generation: self.generation,
                    delivery_ids,
                    reason: error.to_string(),
                });
            }
        }
    }

    fn discard(&mut self) {
        self.awaiting_quorum = false;
        self.pending.clear();
        self.accumulated_ids.clear();
        self.accumulated_keys.clear();
        self.accumulated_micro_batches = 0;
        self.end_step_span();
        self.engine.discard();
    }

    /// Forgets the step being accumulated: its span ends without a step.
    fn end_step_span(&mut self) {
        self.step_span = None;
        self.step_samples = dflash_telemetry::SampleTraces::new();
        self.step_compute = Duration::ZERO;
    }

    fn save_checkpoint(&mut self) -> Result<PathBuf, String> {
        let step = self.engine.steps_done();
        let name = step_dir_name(step);
        let dir = self.settings.output.join(&name);
        if self.last_checkpoint_step == Some(step) && dir.is_dir() {
            return Ok(dir);
        }
        let started = Instant::now();
        std::fs::create_dir_all(&self.settings.output)
            .map_err(|error| format!("{}: {error}", self.settings.output.display()))?;
        self.engine
            .save_checkpoint(&dir)
            .map_err(|error| error.to_string())?;
        record_latest(&self.settings.output, &name)
            .map_err(|error| format!("{}: {error}", dir.display()))?;
        if let Err(error) =
            prune_step_checkpoints(&self.settings.output, self.settings.keep_checkpoints)
        {
            warn!(%error, "pruning old checkpoints failed");
        }
        self.busy += started.elapsed();
        self.last_checkpoint_step = Some(step);
        info!(step, path = %dir.display(), seconds = started.elapsed().as_secs_f64(), "checkpoint saved");
        self.emit(TrainerEvent::CheckpointSaved {
            step,
            path: dir.clone(),
        });
        Ok(dir)
    }

    fn finish(&mut self, step_accumulated: bool, mut unused: Vec<u64>) {
        if step_accumulated && self.accumulated_micro_batches > 0 {
            self.run_step();
        }
        unused.extend(self.pending.drain(..).map(|held| held.delivery_id));
        unused.append(&mut self.accumulated_ids);
        self.accumulated_keys.clear();
        self.accumulated_micro_batches = 0;
        self.end_step_span();
        self.engine.discard();
        if let (Some(data_parallel), Some(sync), Some(trainer)) = (
            &mut self.data_parallel,
            &mut self.sync,
            self.engine.trainer(),
        ) {
            // Out of the membership first, so nobody waits for this drafter,
            // then its model to the broker (kept if no member is further).
            data_parallel.leave(trainer);
            let totals = &data_parallel.totals;
            info!(
                steps_committed = totals.steps_committed,
                steps_not_committed = totals.steps_not_committed,
                heals = totals.heals,
                zero_contributions = totals.zero_contributions,
                seconds_in_quorum = totals.time_in_quorum.as_secs_f64(),
                seconds_in_collectives = totals.time_in_collectives.as_secs_f64(),
                last_world_size = totals.last_world_size,
                "data parallelism totals"
            );
            let progress = trainer.progress();
            sync.snapshot(
                trainer.model(),
                progress.step,
                progress.samples_trained,
                true,
            );
            let wall = self.started.elapsed().as_secs_f64().max(1e-9);
            info!(
                snapshots = sync.totals.snapshots,
                failures = sync.totals.failures,
                model_version = sync.totals.model_version,
                seconds_in_sync = sync.totals.time_in_sync.as_secs_f64(),
                sync_fraction = sync.totals.time_in_sync.as_secs_f64() / wall,
                "model sync totals"
            );
        }
        let (final_checkpoint, checkpoint_error) = match self.save_checkpoint() {
            Ok(path) => (Some(path), None),
            Err(error) => (None, Some(error)),
        };
        self.emit(TrainerEvent::Stopped {
            generation: self.generation,
            unused_delivery_ids: unused,
            final_checkpoint,
            checkpoint_error,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SyntheticEngine;

    /// The samples of each step a loop takes over `deliveries` deliveries
    /// with `max_step_samples` (no data parallelism: one drafter's steps),
    /// and the deliveries it hands back unused when it stops.
    fn step_sizes(max_step_samples: usize, deliveries: u64) -> (Vec<usize>, usize) {
        let output = tempfile::tempdir().unwrap();
        let settings = LoopSettings {
            batch_tokens: usize::MAX,
            grad_accumulation: 1,
            max_step_samples,
            save_every: 0,
            keep_checkpoints: 1,
            output: output.path().to_path_buf(),
        };
        let room = deliveries as usize + 8;
        let (commands, receiver) = mpsc::channel(room);
        let (events, mut reports) = mpsc::channel(room);
        for delivery_id in 0..deliveries {
            let delivery = Delivery {
                delivery_id,
                sample: Some(dflash_testkit::sample(64, delivery_id)),
                ..Default::default()
            };
            commands
                .try_send(TrainerCommand::Delivery {
                    generation: 0,
                    delivery: Box::new(delivery),
                })
                .unwrap();
        }
        commands
            .try_send(TrainerCommand::Finish {
                step_accumulated: true,
            })
            .unwrap();
        run_training_loop(
            Box::new(SyntheticEngine::new(0.0)),
            settings,
            receiver,
            events,
            None,
            None,
        );
        let mut sizes = Vec::new();
        let mut unused = 0;
        while let Ok(event) = reports.try_recv() {
            match event {
                TrainerEvent::Stepped { delivery_ids, .. } => sizes.push(delivery_ids.len()),
                TrainerEvent::Stopped {
                    unused_delivery_ids,
                    ..
                } => unused = unused_delivery_ids.len(),
                TrainerEvent::Rejected { reason, .. } => panic!("rejected: {reason}"),
                _ => {}
            }
        }
        (sizes, unused)
    }

    #[test]
    fn an_independent_drafter_steps_at_max_step_samples_and_hands_back_the_rest() {
        assert_eq!(step_sizes(16, 32), (vec![16, 16], 0));
        // Four held, never micro-batched (the token budget is unbounded):
        // back to the queue when the drafter stops.
        assert_eq!(step_sizes(16, 20), (vec![16], 4));
    }
}
