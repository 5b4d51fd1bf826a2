//! One member of a data-parallel trainer: N drafters train one model, each
//! its share of every optimizer step. This module only packs and unpacks
//! what the members exchange; the collectives that move it (c10d) and the
//! quorum that decides who takes part are the drafter-server's.
//!
//! A step, as every member runs it:
//! 1. [`DraftTrainer::contribution`]: this member's unnormalised gradient
//!    `Σ w·∇CE` as one flat f32 tensor, and its sums (`Σ w`, `Σ w·CE`,
//!    samples, tokens, per-position counts) as one f64 tensor. A member
//!    with nothing to give (no samples, a bad share, a stale model)
//!    contributes zeros.
//! 2. Both are all-reduced (summed) over the members.
//! 3. [`DraftTrainer::check_reduced`]: the reduced gradient divided by the
//!    reduced `Σ w` is exactly the gradient one trainer would have over all
//!    the members' samples (up to float summation order); its norm is
//!    checked by the same guards as a single trainer's step. Every member
//!    holds the same reduced values, so every member decides the same.
//! 4. Only if every member's check passed (the broker's commit vote):
//!    [`DraftTrainer::apply_reduced`] clips and takes the AdamW step, the
//!    same on every member, so weights and moments stay identical;
//!    otherwise [`DraftTrainer::discard_accumulation`].
//!
//! What a member decides alone must not differ between members, or their
//! weights drift apart while every vote says yes: the learning rate, the
//! clipping bound and AdamW's hyper-parameters are rank 0's. They travel in
//! the sums (the other members put 0 in their slots), so members whose
//! schedule lengths or flags differ still take the same step; the clip
//! coefficient is computed from the reduced norm, the same on every member.

use tch::{Device, Kind, Tensor};

use super::{DraftTrainer, StepReport};
use crate::draft::error::{DraftError, SkippedStep};
use crate::draft::objective::{accuracy_ratios, overall_accuracy};
use crate::draft::optim::AdamWSettings;

/// Slots of the sums tensor before the per-position counts.
const WEIGHT_SUM: usize = 0;
const WEIGHTED_CROSS_ENTROPY: usize = 1;
const SAMPLES: usize = 2;
const TOKENS: usize = 3;
const LEARNING_RATE: usize = 4;
/// Members that contributed zeros for a reason (a bad share, a stale model).
const EXCLUDED: usize = 5;
/// Rank 0's `--max-grad-norm` and AdamW hyper-parameters.
const MAX_GRAD_NORM: usize = 6;
const BETA1: usize = 7;
const BETA2: usize = 8;
const EPSILON: usize = 9;
const WEIGHT_DECAY: usize = 10;
const FIXED_SLOTS: usize = 11;

/// Why a member gives zeros instead of its share.
#[derive(Debug, Clone, PartialEq)]
pub enum Exclusion {
    /// Its own share failed a guard (the reason); its samples go back.
    BadShare(SkippedStep),
    /// Its model was not the quorum's when it trained (it was healed).
    StaleModel,
}

/// A member's contribution to one step.
pub struct Contribution {
    /// `Σ w·∇CE` over this member's samples, flat, f32.
    pub gradient: Tensor,
    /// The step's sums, f64, on the CPU.
    pub sums: Tensor,
}

/// A reduced step that passed the checks, ready to apply once committed.
pub struct ReducedStep {
    /// The normalised gradient (divided by the reduced `Σ w`).
    gradient: Tensor,
    grad_norm: f64,
    loss: f64,
    learning_rate: f64,
    /// Rank 0's clipping bound and AdamW hyper-parameters.
    max_grad_norm: f64,
    adamw: AdamWSettings,
    samples: usize,
    tokens: usize,
    correct_per_position: Vec<f64>,
    supervised_per_position: Vec<f64>,
}

impl ReducedStep {
    pub fn samples(&self) -> usize {
        self.samples
    }

    pub fn grad_norm(&self) -> f64 {
        self.grad_norm
    }
}

impl DraftTrainer {
    /// Block positions whose counts the sums carry (B − 1).
    fn positions(&self) -> usize {
        (self.model.config().block_size.max(1) - 1) as usize
    }

    /// Length of the sums tensor of this model.
    pub fn sums_len(&self) -> usize {
        FIXED_SLOTS + 2 * self.positions()
    }

    /// Elements of the flat gradient (every trainable parameter).
    pub fn gradient_len(&self) -> i64 {
        self.optimizer.parameter_elements()
    }

    /// The learning rate this trainer's next step is scheduled at.
    pub fn scheduled_learning_rate(&self) -> f64 {
        self.settings
            .schedule
            .learning_rate(self.progress.step, self.settings.total_steps)
    }

    /// Samples accumulated for the step in progress.
    pub fn accumulated_samples(&self) -> usize {
        self.accumulation.samples
    }

    /// Tokens accumulated for the step in progress.
    pub fn accumulated_tokens(&self) -> usize {
        self.accumulation.tokens
    }

    /// The guard on this member's own share before it is all-reduced: a
    /// non-finite loss or gradient, or a gradient norm (normalised by its
    /// own `Σ w`) over the spike bound. `None`: the share may go in.
    pub fn own_share_guard(&self) -> Option<SkippedStep> {
        let accumulation = &self.accumulation;
        if accumulation.micro_batches == 0 || accumulation.weight_sum <= 0.0 {
            return None;
        }
        let loss = accumulation.weighted_cross_entropy / accumulation.weight_sum;
        let grad_norm = self.optimizer.gradient_norm() / accumulation.weight_sum;
        self.step_guard(loss, grad_norm)
    }

    /// This member's contribution: its share, or zeros when `exclusion`
    /// says why it gives none (or it has no samples). `rank_zero` puts the
    /// scheduled learning rate in its slot.
    pub fn contribution(&self, rank_zero: bool, exclusion: Option<&Exclusion>) -> Contribution {
        let _no_grad = tch::no_grad_guard();
        let positions = self.positions();
        let mut sums = vec![0.0f64; self.sums_len()];
        let accumulation = &self.accumulation;
        let contributes = exclusion.is_none() && accumulation.micro_batches > 0;
        let gradient = if contributes {
            sums[WEIGHT_SUM] = accumulation.weight_sum;
            sums[WEIGHTED_CROSS_ENTROPY] = accumulation.weighted_cross_entropy;
            sums[SAMPLES] = accumulation.samples as f64;
            sums[TOKENS] = accumulation.tokens as f64;
            for (slot, value) in sums[FIXED_SLOTS..FIXED_SLOTS + positions]
                .iter_mut()
                .zip(&accumulation.correct_per_position)
            {
                *slot = *value;
            }
            for (slot, value) in sums[FIXED_SLOTS + positions..]
                .iter_mut()
                .zip(&accumulation.supervised_per_position)
            {
                *slot = *value;
            }
            self.optimizer.flat_gradients()
        } else {
            Tensor::zeros([self.gradient_len()], (Kind::Float, self.device()))
        };
        if exclusion.is_some() {
            sums[EXCLUDED] = 1.0;
        }
        if rank_zero {
            sums[LEARNING_RATE] = self.scheduled_learning_rate();
            sums[MAX_GRAD_NORM] = self.settings.max_grad_norm;
            let adamw = self.optimizer.settings();
            sums[BETA1] = adamw.beta1;
            sums[BETA2] = adamw.beta2;
            sums[EPSILON] = adamw.epsilon;
            sums[WEIGHT_DECAY] = adamw.weight_decay;
        }
        Contribution {
            gradient,
            sums: Tensor::from_slice(&sums),
        }
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    /// Checks the all-reduced contribution as a single trainer checks its
    /// step: `Err` when the step must not be taken (every member gets the
    /// same answer from the same values).
    pub fn check_reduced(&self, reduced: Contribution) -> Result<ReducedStep, SkippedStep> {
        let _no_grad = tch::no_grad_guard();
        let sums: Vec<f64> = Vec::try_from(&reduced.sums.to_kind(Kind::Double)).unwrap_or_default();
        if sums.len() != self.sums_len() {
            return Err(SkippedStep::InconsistentReduction {
                what: format!("{} sums, this model has {}", sums.len(), self.sums_len()),
            });
        }
        let weight_sum = sums[WEIGHT_SUM];
        let loss = if weight_sum > 0.0 {
            sums[WEIGHTED_CROSS_ENTROPY] / weight_sum
        } else {
            f64::NAN
        };
        let gradient = if weight_sum > 0.0 {
            reduced.gradient * (1.0 / weight_sum)
        } else {
            reduced.gradient
        };
        let grad_norm = gradient.square().sum(Kind::Double).double_value(&[]).sqrt();
        if let Some(skipped) = self.step_guard(loss, grad_norm) {
            return Err(skipped);
        }
        let adamw = AdamWSettings {
            beta1: sums[BETA1],
            beta2: sums[BETA2],
            epsilon: sums[EPSILON],
            weight_decay: sums[WEIGHT_DECAY],
        };
        let max_grad_norm = sums[MAX_GRAD_NORM];
        let one_rank_zero = sums[EXCLUDED..FIXED_SLOTS]
            .iter()
            .all(|value| value.is_finite())
            && max_grad_norm > 0.0
            && (0.0..1.0).contains(&adamw.beta1)
            && (0.0..1.0).contains(&adamw.beta2)
            && adamw.epsilon > 0.0;
        if !one_rank_zero {
            // Two members of rank 0 (or none) in one group: the slots hold
            // a sum, not one member's values.
            return Err(SkippedStep::InconsistentReduction {
                what: format!(
                    "rank 0's hyper-parameters read max-grad-norm {max_grad_norm}, {adamw:?}"
                ),
            });
        }
        let positions = self.positions();
        Ok(ReducedStep {
            gradient,
            grad_norm,
            loss,
            learning_rate: sums[LEARNING_RATE],
            max_grad_norm,
            adamw,
            samples: sums[SAMPLES].round() as usize,
            tokens: sums[TOKENS].round() as usize,
            correct_per_position: sums[FIXED_SLOTS..FIXED_SLOTS + positions].to_vec(),
            supervised_per_position: sums[FIXED_SLOTS + positions..].to_vec(),
        })
    }

    /// Takes a committed reduced step: clips the gradient to rank 0's
    /// global norm bound, one AdamW step with rank 0's learning rate and
    /// hyper-parameters, and forgets this member's accumulation.
    pub fn apply_reduced(&mut self, step: ReducedStep) -> Result<StepReport, DraftError> {
        let ReducedStep {
            mut gradient,
            grad_norm,
            loss,
            learning_rate,
            max_grad_norm,
            adamw,
            samples,
            tokens,
            correct_per_position,
            supervised_per_position,
        } = step;
        let clip_coefficient = (max_grad_norm / (grad_norm + 1e-6)).min(1.0);
        if clip_coefficient < 1.0 {
            let _no_grad = tch::no_grad_guard();
            let _ = gradient.g_mul_scalar_(clip_coefficient);
        }
        self.optimizer.step_flat(learning_rate, &adamw, &gradient)?;
        self.discard_accumulation();
        self.remember_grad_norm(grad_norm);
        self.progress.step += 1;
        self.progress.samples_trained += samples as u64;
        self.progress.tokens_trained += tokens as u64;
        self.progress.learning_rate = learning_rate;
        self.progress.last_loss = loss;
        Ok(StepReport {
            step: self.progress.step,
            loss,
            accuracy: overall_accuracy(&correct_per_position, &supervised_per_position),
            accuracy_per_position: accuracy_ratios(&correct_per_position, &supervised_per_position),
            learning_rate,
            grad_norm,
            samples,
            tokens,
            // DFlash2's selector and DSpark's figures are not reduced over
            // the members.
            selector: None,
            dspark: None,
        })
    }

    /// The whole training state for a member that heals from this one:
    /// weights and moments (f32, flat) and the counts (i64 on the CPU:
    /// optimizer steps, trainer steps, samples, tokens).
    pub fn heal_state(&self) -> (Tensor, Tensor) {
        let counts = [
            self.optimizer.steps_taken() as i64,
            self.progress.step as i64,
            self.progress.samples_trained as i64,
            self.progress.tokens_trained as i64,
        ];
        (self.optimizer.flat_state(), Tensor::from_slice(&counts))
    }

    /// An empty state of the right sizes, on this model's device, for a
    /// broadcast to fill.
    pub fn empty_heal_state(&self) -> (Tensor, Tensor) {
        (
            Tensor::zeros([3 * self.gradient_len()], (Kind::Float, self.device())),
            Tensor::zeros([4], (Kind::Int64, Device::Cpu)),
        )
    }

    /// Takes the state [`DraftTrainer::heal_state`] gave; nothing changes
    /// when it does not fit this model or is not finite.
    pub fn load_heal_state(&mut self, state: &Tensor, counts: &Tensor) -> Result<(), DraftError> {
        let counts: Vec<i64> = Vec::try_from(counts).map_err(DraftError::Torch)?;
        let [optimizer_steps, step, samples, tokens] = counts[..] else {
            return Err(DraftError::ShapeMismatch(format!(
                "heal counts {counts:?}, expected 4"
            )));
        };
        if counts.iter().any(|count| *count < 0) {
            return Err(DraftError::Checkpoint(format!(
                "heal counts {counts:?} are negative"
            )));
        }
        self.optimizer
            .load_flat_state(state, optimizer_steps as u64)?;
        self.progress.step = step as u64;
        self.progress.samples_trained = samples as u64;
        self.progress.tokens_trained = tokens as u64;
        Ok(())
    }

    /// Continues the counts of a run whose model this trainer took (the
    /// broker's, after every member had stopped): the schedule goes on from
    /// `step`; the moments start afresh, as the model carries none.
    pub fn continue_run(&mut self, step: u64, samples: u64) {
        self.progress.step = self.progress.step.max(step);
        self.progress.samples_trained = self.progress.samples_trained.max(samples);
    }

    /// Checksum of weights, moments and the optimizer's step count.
    pub fn state_checksum(&self) -> u64 {
        self.optimizer.state_checksum() ^ self.progress.step.rotate_left(32)
    }
}
