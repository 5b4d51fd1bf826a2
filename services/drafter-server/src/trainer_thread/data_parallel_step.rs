//! One step of the run's data-parallel trainer, as the training loop takes
//! it (`crate::data_parallel` holds the membership and the collectives).

use std::time::{Duration, Instant};

use tracing::{warn, Span};

use super::{TrainerEvent, TrainingLoop};
use crate::data_parallel::StepOutcome;

impl TrainingLoop {
    /// One step of the run's data-parallel trainer with what this member
    /// accumulated: acked when committed with its samples in it, handed
    /// back to the queue otherwise (`crate::data_parallel`).
    pub(super) fn run_data_parallel_step(&mut self) {
        let (Some(data_parallel), Some(trainer)) =
            (self.data_parallel.as_mut(), self.engine.trainer_mut())
        else {
            return;
        };
        let own_samples = trainer.accumulated_samples();
        let own_tokens = trainer.accumulated_tokens();
        let span = self.step_span.take().unwrap_or_else(Span::none);
        span.record("samples", self.accumulated_ids.len());
        let started = Instant::now();
        let samples: Vec<dflash_proto::v1::StepSample> = self
            .accumulated_ids
            .iter()
            .zip(&self.accumulated_keys)
            .map(
                |(&delivery_id, (target_id, seq))| dflash_proto::v1::StepSample {
                    delivery_id,
                    target_id: target_id.clone(),
                    seq: *seq,
                },
            )
            .collect();
        let outcome = span.in_scope(|| data_parallel.step(trainer, &samples));
        let elapsed = started.elapsed();
        self.busy += elapsed;
        self.awaiting_quorum = matches!(outcome, StepOutcome::NoQuorum);
        match &outcome {
            StepOutcome::NoQuorum => {
                // Too few members: keep what is accumulated (and the span
                // that names it) and ask again (`run_training_loop`).
                self.step_span = Some(span);
                return;
            }
            // The committed step's span names its samples and links their
            // batches; any other outcome's span names none (they go on to
            // another step), and the traces are emptied either way.
            StepOutcome::Committed {
                excluded: None,
                report,
            } => {
                // The run's step, which a heal may have moved since the
                // span opened.
                span.record("step", report.step);
                self.step_samples.apply(&span)
            }
            _ => self.step_samples.apply(&Span::none()),
        }
        drop(span);
        let step_compute = std::mem::take(&mut self.step_compute) + elapsed;
        let delivery_ids = std::mem::take(&mut self.accumulated_ids);
        self.accumulated_keys.clear();
        self.accumulated_micro_batches = 0;
        self.after_data_parallel_step(outcome, delivery_ids, own_samples, own_tokens, step_compute);
    }

    /// Nothing held: takes part in a step the others take meanwhile.
    pub(super) fn idle(&mut self) {
        let (Some(data_parallel), Some(trainer)) =
            (self.data_parallel.as_mut(), self.engine.trainer_mut())
        else {
            return;
        };
        let started = Instant::now();
        if let Some(outcome) = data_parallel.idle(trainer) {
            let elapsed = started.elapsed();
            self.after_data_parallel_step(outcome, Vec::new(), 0, 0, elapsed);
        }
    }

    /// Books the step and tells the pump what became of its samples: those
    /// this member voted with were settled by the broker (acked with a
    /// commit, or returned by an abort), so the pump only lets them go;
    /// those it left out (it gave zeros) it hands back itself.
    fn after_data_parallel_step(
        &mut self,
        outcome: StepOutcome,
        delivery_ids: Vec<u64>,
        own_samples: usize,
        own_tokens: usize,
        step_compute: Duration,
    ) {
        let generation = self.generation;
        match outcome {
            StepOutcome::NoQuorum => {}
            StepOutcome::Committed {
                mut report,
                excluded,
            } => {
                let step = report.step;
                report.samples = if excluded.is_none() { own_samples } else { 0 };
                report.tokens = if excluded.is_none() { own_tokens } else { 0 };
                let busy = std::mem::take(&mut self.busy);
                self.emit(TrainerEvent::Stepped {
                    generation,
                    delivery_ids: Vec::new(),
                    report,
                    busy,
                    step_compute,
                });
                self.hand_back_excluded(excluded, delivery_ids, step);
                self.after_committed_step(step);
            }
            StepOutcome::NotCommitted {
                reason,
                skipped,
                excluded,
            } => {
                warn!(%reason, samples = delivery_ids.len(), "data-parallel step not committed; the broker returned its samples to the queue");
                self.engine.discard();
                let event = match skipped {
                    Some(_) => TrainerEvent::StepSkipped {
                        generation,
                        delivery_ids: Vec::new(),
                        reason: format!("optimizer step skipped: {reason}"),
                    },
                    None => TrainerEvent::BatchFailed {
                        generation,
                        delivery_ids: Vec::new(),
                        reason: format!("data-parallel step not committed: {reason}"),
                    },
                };
                self.emit(event);
                let step = self
                    .engine
                    .trainer()
                    .map_or(0, |trainer| trainer.progress().step);
                self.hand_back_excluded(excluded, delivery_ids, step);
            }
        }
        self.announce_share();
    }

    /// Tells the pump this member's share of the step when the last
    /// quorum changed it (its credit window follows).
    fn announce_share(&mut self) {
        let share = self.step_limits().max_step_samples;
        if share != self.announced_share {
            self.announced_share = share;
            self.emit(TrainerEvent::ShareOfStep {
                max_step_samples: share,
            });
        }
    }

    /// The step's own samples: settled by the broker when this member
    /// voted with them, else (it gave zeros) handed back by the pump.
    fn hand_back_excluded(
        &mut self,
        excluded: Option<dflash_model::draft::Exclusion>,
        delivery_ids: Vec<u64>,
        step: u64,
    ) {
        let generation = self.generation;
        match excluded {
            None => self.emit(TrainerEvent::Settled {
                generation,
                delivery_ids,
            }),
            Some(dflash_model::draft::Exclusion::BadShare(skipped)) => {
                self.emit(TrainerEvent::StepSkipped {
                    generation,
                    delivery_ids,
                    reason: format!("this drafter's share was left out of step {step}: {skipped}"),
                })
            }
            Some(dflash_model::draft::Exclusion::StaleModel) => {
                self.emit(TrainerEvent::BatchFailed {
                    generation,
                    delivery_ids,
                    reason: format!(
                        "trained on a model older than step {step}'s (this drafter healed first)"
                    ),
                })
            }
        }
    }

    /// After a committed data-parallel step: rank 0's snapshot to the
    /// broker every `--snapshot-every` steps, and the periodic checkpoint.
    fn after_committed_step(&mut self, step: u64) {
        if let (Some(data_parallel), Some(sync), Some(trainer)) =
            (&self.data_parallel, &mut self.sync, self.engine.trainer())
        {
            let every = data_parallel.snapshot_every();
            if data_parallel.is_rank_zero() && every > 0 && step.is_multiple_of(every) {
                let samples = trainer.progress().samples_trained;
                sync.snapshot(trainer.model(), step, samples, false);
            }
        }
        if self.settings.save_every > 0 && step.is_multiple_of(self.settings.save_every) {
            if let Err(error) = self.save_checkpoint() {
                warn!(%error, step, "periodic checkpoint failed; training continues");
            }
        }
    }
}
