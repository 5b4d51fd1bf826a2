//! One drafter's training loop body, without any queue or thread: feed
//! micro-batches with [`DraftTrainer::accumulate`], then take an optimizer
//! step with [`DraftTrainer::step`]; save and resume checkpoints.
//!
//! Accumulation is exact: each micro-batch back-propagates its *unnormalised*
//! `Σ w·CE`, and the step divides the gradients by the `Σ w` of all its
//! micro-batches, so k micro-batches give the same update as one batch with
//! all of them (up to float summation order).

use std::path::Path;

use rand::rngs::StdRng;
use rand::SeedableRng;
use tch::{Device, Kind};

use super::checkpoint::{
    load_draft_model, load_training_state, save_draft_checkpoint, TrainingProgress,
};
use super::error::{DraftError, SkippedStep};
use super::model::{AttentionImplementation, DraftModel, FrozenTargetHeads};
use super::objective::accuracy_ratios;
use super::objective::{
    compute_objective_backward, overall_accuracy, pack_batch, sample_anchors, DsparkTotals,
    ObjectiveMemory, SelectorTotals, TrainingSequence,
};
use super::optim::{AdamW, AdamWSettings, LearningRateSchedule};

pub mod data_parallel;

/// Hyper-parameters of the objective and the optimizer.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerSettings {
    /// Most anchors (blocks) drawn per sequence.
    pub num_anchors: usize,
    /// Decay γ of the per-position loss weights.
    pub loss_decay_gamma: f64,
    /// Global gradient-norm bound.
    pub max_grad_norm: f64,
    pub adamw: AdamWSettings,
    pub schedule: LearningRateSchedule,
    /// Schedule length in optimizer steps; may be revised while training.
    pub total_steps: u64,
    /// Base seed of anchor sampling; each micro-batch derives its own
    /// generator from it, the step and its index, so a resumed run draws the
    /// same anchors as an uninterrupted one.
    pub seed: u64,
    /// Logits chunking and layer checkpointing (memory, not the result).
    pub memory: ObjectiveMemory,
    /// A step whose gradient norm (before clipping) exceeds this many times
    /// the median norm of the last [`GRAD_NORM_WINDOW`] taken steps is
    /// skipped, once [`GRAD_NORM_WARMUP`] steps were taken; 0 turns the
    /// bound off. Non-finite losses and norms are always skipped.
    pub grad_norm_spike_ratio: f64,
}

/// Default of [`TrainerSettings::grad_norm_spike_ratio`]: far above the
/// step-to-step variation of a healthy run (a few times the median), so only
/// a step that something broke is skipped.
pub const DEFAULT_GRAD_NORM_SPIKE_RATIO: f64 = 100.0;
/// Taken steps whose gradient norms the spike bound's median is over.
pub const GRAD_NORM_WINDOW: usize = 32;
/// Taken steps before the spike bound applies.
pub const GRAD_NORM_WARMUP: usize = 8;

impl TrainerSettings {
    /// The published recipe's defaults for a block size.
    pub fn recipe_defaults(block_size: i64, total_steps: u64) -> Self {
        TrainerSettings {
            num_anchors: 512,
            loss_decay_gamma: super::default_loss_decay_gamma(block_size),
            max_grad_norm: 1.0,
            adamw: AdamWSettings::default(),
            schedule: LearningRateSchedule::default(),
            total_steps,
            seed: 0,
            memory: ObjectiveMemory {
                logits_chunk_blocks: Some(DEFAULT_LOGITS_CHUNK_BLOCKS),
                checkpoint_layers: false,
            },
            grad_norm_spike_ratio: DEFAULT_GRAD_NORM_SPIKE_RATIO,
        }
    }
}

/// Blocks per sequence whose logits exist at once by default: 32 blocks ×
/// 15 positions × vocab 151,936 × 4 bytes is 292 MB per sequence, where all
/// 512 blocks would be 4.7 GB (and as much again for their gradient).
pub const DEFAULT_LOGITS_CHUNK_BLOCKS: i64 = 32;

/// What one micro-batch contributed.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroBatchReport {
    pub loss: f64,
    pub samples: usize,
    pub tokens: usize,
}

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Optimizer steps completed, this one included.
    pub step: u64,
    /// `Σ w·CE / Σ w` over the step's micro-batches (DFlash2: unary plus
    /// `α` × selector, see [`SelectorReport`]).
    pub loss: f64,
    pub accuracy: f64,
    /// Accuracy at block positions 1..B−1 (DSpark: slots 0..B−1, the
    /// drafter's argmax against the target's).
    pub accuracy_per_position: Vec<f64>,
    pub learning_rate: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    pub samples: usize,
    pub tokens: usize,
    /// DFlash2's selector figures; `None` for DFlash.
    pub selector: Option<SelectorReport>,
    /// DSpark's figures; `None` for DFlash and DFlash2 (boxed: a step
    /// report travels in events whose other variants are small).
    pub dspark: Option<Box<DsparkReport>>,
}

/// DSpark's part of a step report (speculators 0.9.0's metrics).
#[derive(Debug, Clone, PartialEq)]
pub struct DsparkReport {
    /// `Σ w·KL(target ‖ drafter) / Σ w`.
    pub distillation_loss: f64,
    /// `Σ w·BCE(confidence, 1 − TV) / Σ w`; `None` without a confidence head.
    pub confidence_loss: Option<f64>,
    /// Mean analytical acceptance rate `1 − TV(q, p)` over supervised slots.
    pub accept_rate: f64,
    /// Expected accepted length per block under rejection sampling (the
    /// cumulative product of the acceptance rates, plus the bonus token).
    pub accept_length: f64,
    /// Accepted length per block at temperature 0 (leading run of argmax
    /// matches, plus the bonus token): comparable across the DFlash family.
    pub greedy_accept_length: f64,
    /// Mean `|σ(confidence) − (1 − TV)|`; `None` without a confidence head.
    pub confidence_absolute_error: Option<f64>,
    /// Mean predicted acceptance `σ(confidence)`; `None` without one.
    pub confidence_mean_prediction: Option<f64>,
    /// Mean signed error of the cumulative confidence product against the
    /// cumulative acceptance product (what the verify-length schedule
    /// reads); `None` without a confidence head.
    pub confidence_cumulative_bias: Option<f64>,
}

impl DsparkReport {
    /// The report of a step's summed DSpark totals.
    pub fn from_totals(totals: &DsparkTotals) -> Self {
        let mean = |sum: f64, count: f64| {
            if count > 0.0 {
                sum / count
            } else {
                f64::NAN
            }
        };
        let confidence = |value: f64| totals.has_confidence_head.then_some(value);
        DsparkReport {
            distillation_loss: mean(totals.weighted_distillation, totals.weight_sum),
            confidence_loss: confidence(mean(totals.weighted_confidence, totals.weight_sum)),
            accept_rate: mean(totals.accept_rate_sum, totals.supervised),
            accept_length: mean(totals.accept_length_sum, totals.valid_blocks),
            greedy_accept_length: mean(totals.greedy_accept_length_sum, totals.valid_blocks),
            confidence_absolute_error: confidence(mean(
                totals.confidence_absolute_error_sum,
                totals.supervised,
            )),
            confidence_mean_prediction: confidence(mean(
                totals.confidence_prediction_sum,
                totals.supervised,
            )),
            confidence_cumulative_bias: confidence(mean(
                totals.confidence_cumulative_bias_sum,
                totals.supervised,
            )),
        }
    }
}

/// DFlash2's part of a step report (speculators' metrics).
#[derive(Debug, Clone, PartialEq)]
pub struct SelectorReport {
    /// Candidates per position (the K of recall@K).
    pub top_k: i64,
    /// The unary (DFlash) loss `Σ w·CE / Σ w`.
    pub unary_loss: f64,
    /// The selector loss `Σ w·CE_selector / Σ w`.
    pub selector_loss: f64,
    /// Supervised positions whose gold token is in the unary top-k.
    pub recall_at_k: f64,
    /// Teacher-forced selector accuracy over the recalled positions.
    pub teacher_forced_selector_accuracy: f64,
}

impl SelectorReport {
    /// The report of a step's summed selector totals and `Σ w`.
    pub fn from_totals(totals: &SelectorTotals, weight_sum: f64) -> Self {
        let per_weight = |sum: f64| {
            if weight_sum > 0.0 {
                sum / weight_sum
            } else {
                f64::NAN
            }
        };
        SelectorReport {
            top_k: totals.top_k,
            unary_loss: per_weight(totals.unary_weighted_cross_entropy),
            selector_loss: per_weight(totals.selector_weighted_cross_entropy),
            recall_at_k: totals.recall_at_k(),
            teacher_forced_selector_accuracy: totals.teacher_forced_selector_accuracy(),
        }
    }
}

/// Sums over the micro-batches of the step in progress.
#[derive(Default)]
struct Accumulation {
    weighted_cross_entropy: f64,
    weight_sum: f64,
    correct_per_position: Vec<f64>,
    supervised_per_position: Vec<f64>,
    samples: usize,
    tokens: usize,
    micro_batches: u64,
    /// DFlash2's selector sums.
    selector: Option<SelectorTotals>,
    /// DSpark's sums.
    dspark: Option<DsparkTotals>,
}

/// The draft model with its optimizer, schedule and progress.
pub struct DraftTrainer {
    model: DraftModel,
    optimizer: AdamW,
    settings: TrainerSettings,
    progress: TrainingProgress,
    accumulation: Accumulation,
    /// Gradient norms of the last taken steps (the spike bound's median).
    recent_grad_norms: std::collections::VecDeque<f64>,
    /// Steps skipped by the guard since this trainer was made.
    skipped_steps: u64,
}

impl DraftTrainer {
    /// A trainer starting at step 0.
    pub fn new(model: DraftModel, settings: TrainerSettings) -> Self {
        let optimizer = AdamW::new(named_trainable_parameters(&model), settings.adamw.clone());
        let progress = TrainingProgress {
            step: 0,
            total_steps: settings.total_steps,
            samples_trained: 0,
            tokens_trained: 0,
            seed: settings.seed,
            learning_rate: 0.0,
            last_loss: f64::NAN,
        };
        DraftTrainer {
            model,
            optimizer,
            settings,
            progress,
            accumulation: Accumulation::default(),
            recent_grad_norms: std::collections::VecDeque::with_capacity(GRAD_NORM_WINDOW),
            skipped_steps: 0,
        }
    }

    /// Continues from a checkpoint written by [`DraftTrainer::save_checkpoint`]:
    /// weights, optimizer moments, step and seed. `settings.total_steps`
    /// wins over the saved one only when it is non-zero.
    pub fn resume(
        checkpoint_dir: &Path,
        frozen: FrozenTargetHeads,
        device: Device,
        compute_kind: Kind,
        mut settings: TrainerSettings,
    ) -> Result<Self, DraftError> {
        let model = load_draft_model(checkpoint_dir, frozen, device, compute_kind)?;
        let (progress, moments) = load_training_state(checkpoint_dir)?;
        settings.seed = progress.seed;
        if settings.total_steps == 0 {
            settings.total_steps = progress.total_steps;
        }
        let mut trainer = DraftTrainer::new(model, settings);
        trainer.optimizer.load_state(&moments, progress.step)?;
        trainer.progress = TrainingProgress {
            total_steps: trainer.settings.total_steps,
            ..progress
        };
        Ok(trainer)
    }

    pub fn model(&self) -> &DraftModel {
        &self.model
    }

    /// Switches how the draft layers compute attention (the same function;
    /// see [`AttentionImplementation`]), e.g. the fused kernels on a GPU.
    pub fn set_attention(&mut self, attention: AttentionImplementation) -> Result<(), DraftError> {
        self.model.set_attention(attention)
    }

    pub fn progress(&self) -> &TrainingProgress {
        &self.progress
    }

    pub fn settings(&self) -> &TrainerSettings {
        &self.settings
    }

    /// Revises the schedule length (when it is learned from the broker).
    pub fn set_total_steps(&mut self, total_steps: u64) {
        self.settings.total_steps = total_steps.max(1);
        self.progress.total_steps = self.settings.total_steps;
    }

    /// Micro-batches accumulated since the last step.
    pub fn pending_micro_batches(&self) -> u64 {
        self.accumulation.micro_batches
    }

    /// Forward and backward of one micro-batch; gradients accumulate until
    /// [`DraftTrainer::step`].
    pub fn accumulate(
        &mut self,
        sequences: &[TrainingSequence],
    ) -> Result<MicroBatchReport, DraftError> {
        let mut generator = StdRng::seed_from_u64(anchor_seed(
            self.settings.seed,
            self.progress.step,
            self.accumulation.micro_batches,
        ));
        let anchors: Vec<Vec<i64>> = sequences
            .iter()
            .map(|sequence| {
                sample_anchors(
                    &sequence.loss_mask,
                    self.settings.num_anchors,
                    &mut generator,
                )
            })
            .collect();
        let batch = pack_batch(sequences, &anchors)?;
        let output = compute_objective_backward(
            &self.model,
            &batch,
            self.settings.loss_decay_gamma,
            self.settings.memory,
        )?;
        let loss = output.loss;
        let accumulation = &mut self.accumulation;
        accumulation.weighted_cross_entropy += loss * output.weight_sum;
        accumulation.weight_sum += output.weight_sum;
        add_into(
            &mut accumulation.correct_per_position,
            &output.correct_per_position,
        );
        add_into(
            &mut accumulation.supervised_per_position,
            &output.supervised_per_position,
        );
        if let Some(totals) = &output.selector {
            accumulation
                .selector
                .get_or_insert_with(SelectorTotals::default)
                .add(totals);
        }
        if let Some(totals) = &output.dspark {
            accumulation
                .dspark
                .get_or_insert_with(DsparkTotals::default)
                .add(totals);
        }
        accumulation.samples += sequences.len();
        accumulation.tokens += batch.num_tokens;
        accumulation.micro_batches += 1;
        Ok(MicroBatchReport {
            loss,
            samples: sequences.len(),
            tokens: batch.num_tokens,
        })
    }

    /// Drops the gradients and sums of micro-batches not yet stepped (their
    /// items are being handed back to the broker).
    pub fn discard_accumulation(&mut self) {
        self.accumulation = Accumulation::default();
        self.optimizer.zero_grad();
    }

    /// Normalises the accumulated gradients, clips them, applies AdamW at
    /// the scheduled learning rate and clears them.
    pub fn step(&mut self) -> Result<StepReport, DraftError> {
        let accumulation = std::mem::take(&mut self.accumulation);
        if accumulation.micro_batches == 0 {
            return Err(DraftError::ShapeMismatch(
                "optimizer step without any micro-batch".to_string(),
            ));
        }
        let learning_rate = self
            .settings
            .schedule
            .learning_rate(self.progress.step, self.settings.total_steps);
        let loss = if accumulation.weight_sum > 0.0 {
            accumulation.weighted_cross_entropy / accumulation.weight_sum
        } else {
            f64::NAN
        };
        let mut grad_norm = 0.0;
        if accumulation.weight_sum > 0.0 {
            self.optimizer
                .scale_gradients(1.0 / accumulation.weight_sum);
            grad_norm = self.optimizer.gradient_norm();
            if let Some(skipped) = self.step_guard(loss, grad_norm) {
                // Nothing of this step reaches the weights or the moments.
                self.optimizer.zero_grad();
                self.skipped_steps += 1;
                return Err(DraftError::StepSkipped(skipped));
            }
            self.optimizer
                .clip_gradients(self.settings.max_grad_norm, grad_norm);
            self.optimizer.step(learning_rate);
            self.remember_grad_norm(grad_norm);
        }
        self.optimizer.zero_grad();
        self.progress.step += 1;
        self.progress.samples_trained += accumulation.samples as u64;
        self.progress.tokens_trained += accumulation.tokens as u64;
        self.progress.learning_rate = learning_rate;
        self.progress.last_loss = loss;
        Ok(StepReport {
            step: self.progress.step,
            loss,
            accuracy: overall_accuracy(
                &accumulation.correct_per_position,
                &accumulation.supervised_per_position,
            ),
            accuracy_per_position: accuracy_ratios(
                &accumulation.correct_per_position,
                &accumulation.supervised_per_position,
            ),
            learning_rate,
            grad_norm,
            samples: accumulation.samples,
            tokens: accumulation.tokens,
            selector: accumulation
                .selector
                .as_ref()
                .map(|totals| SelectorReport::from_totals(totals, accumulation.weight_sum)),
            dspark: accumulation
                .dspark
                .as_ref()
                .map(|totals| Box::new(DsparkReport::from_totals(totals))),
        })
    }

    /// Keeps a taken step's gradient norm for the spike bound's median.
    fn remember_grad_norm(&mut self, grad_norm: f64) {
        if self.recent_grad_norms.len() == GRAD_NORM_WINDOW {
            self.recent_grad_norms.pop_front();
        }
        self.recent_grad_norms.push_back(grad_norm);
    }

    /// Why the step with this loss and gradient norm must not be taken, if
    /// it must not: a non-finite loss or norm, or a norm over the spike bound.
    fn step_guard(&self, loss: f64, grad_norm: f64) -> Option<SkippedStep> {
        if !loss.is_finite() {
            return Some(SkippedStep::NonFiniteLoss { loss });
        }
        if !grad_norm.is_finite() {
            return Some(SkippedStep::NonFiniteGradient { grad_norm });
        }
        let ratio = self.settings.grad_norm_spike_ratio;
        if ratio > 0.0 && self.recent_grad_norms.len() >= GRAD_NORM_WARMUP {
            let mut norms: Vec<f64> = self.recent_grad_norms.iter().copied().collect();
            norms.sort_by(f64::total_cmp);
            let median = norms[norms.len() / 2];
            if grad_norm > ratio * median {
                return Some(SkippedStep::GradientSpike {
                    grad_norm,
                    median,
                    ratio,
                });
            }
        }
        None
    }

    /// Steps the guard skipped (see [`SkippedStep`]).
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Writes weights, config, optimizer moments and progress atomically.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<(), DraftError> {
        save_draft_checkpoint(dir, &self.model, Some((&self.optimizer, &self.progress)))
    }
}

fn named_trainable_parameters(model: &DraftModel) -> Vec<(String, tch::Tensor)> {
    model.var_store().variables().into_iter().collect()
}

fn add_into(sums: &mut Vec<f64>, values: &[f64]) {
    if sums.len() < values.len() {
        sums.resize(values.len(), 0.0);
    }
    for (sum, value) in sums.iter_mut().zip(values) {
        *sum += value;
    }
}

/// A well-mixed seed for the anchors of one micro-batch (SplitMix64 finaliser).
fn anchor_seed(base_seed: u64, step: u64, micro_batch: u64) -> u64 {
    let mut mixed = base_seed
        ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ micro_batch.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    mixed ^ (mixed >> 31)
}
