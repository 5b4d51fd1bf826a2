//! The center's one AdamW over the drafters' gradients (drafters started
//! with `--sync-gradients`): data parallelism through the broker.
//!
//! Such a drafter's step moves its weights by minus its gradient, so the
//! delta it sends is that gradient (negated), with the AdamW settings a
//! single drafter would step with ([`GradientStep`]). Each gradient is
//! added to the round's sum, weighted by its samples; once the round holds
//! one drafter's step of samples (`step_samples`) the mean gradient takes
//! one AdamW step on the center, clipped by its global norm: the step one
//! drafter would take on those samples. No drafter waits for a round: each
//! gets the center back as it is when its gradient lands.
//!
//! Apart from [`super::ModelSyncState`] because this is the method, not
//! the bookkeeping; the loops over the raw buffers are in
//! [`crate::model_sync::arith`].

use dflash_proto::v1 as proto;

use super::outer::MAGNITUDE_LIMIT;
use super::{Center, SyncError, Upload};
use crate::model_sync::arith::{self, AdamWStep};

/// The AdamW settings a gradient comes with (the drafter's own flags), and
/// the samples of one step. Checked when the exchange begins.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradientStep {
    pub learning_rate: f64,
    /// Global gradient-norm bound of the mean gradient (0: none).
    pub max_grad_norm: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub epsilon: f64,
    pub weight_decay: f64,
    pub step_samples: u64,
}

impl GradientStep {
    /// The settings sent, each checked: a value out of its range is refused
    /// naming it, and changes nothing.
    pub fn from_proto(step: &proto::GradientStep) -> Result<Self, SyncError> {
        let require = |name: &str, value: f64, valid: bool, range: &str| {
            if valid {
                Ok(())
            } else {
                Err(SyncError::GradientStep(format!(
                    "{name} {value} is not {range}"
                )))
            }
        };
        let finite_non_negative = |value: f64| value.is_finite() && value >= 0.0;
        require(
            "learning_rate",
            step.learning_rate,
            finite_non_negative(step.learning_rate),
            "finite and >= 0",
        )?;
        require(
            "max_grad_norm",
            step.max_grad_norm,
            finite_non_negative(step.max_grad_norm),
            "finite and >= 0",
        )?;
        for (name, value) in [("beta1", step.beta1), ("beta2", step.beta2)] {
            require(name, value, (0.0..1.0).contains(&value), "in [0, 1)")?;
        }
        require(
            "epsilon",
            step.epsilon,
            step.epsilon.is_finite() && step.epsilon > 0.0,
            "finite and > 0",
        )?;
        require(
            "weight_decay",
            step.weight_decay,
            finite_non_negative(step.weight_decay) && step.learning_rate * step.weight_decay <= 1.0,
            "finite, >= 0 and at most 1 / learning_rate",
        )?;
        if step.step_samples == 0 {
            return Err(SyncError::GradientStep(
                "step_samples 0 is not >= 1".to_string(),
            ));
        }
        Ok(GradientStep {
            learning_rate: step.learning_rate,
            max_grad_norm: step.max_grad_norm,
            beta1: step.beta1,
            beta2: step.beta2,
            epsilon: step.epsilon,
            weight_decay: step.weight_decay,
            step_samples: step.step_samples,
        })
    }
}

/// The center's AdamW: its moments, the round being gathered and the
/// steps taken. Buffers follow the center's tensors by index. Lives in
/// memory only: a restarted broker starts the moments again.
#[derive(Debug)]
pub struct CenterAdamW {
    first_moment: Vec<Vec<f32>>,
    second_moment: Vec<Vec<f32>>,
    /// Σ samples × gradient over the round's gradients.
    gradient_sum: Vec<Vec<f32>>,
    /// A bound on the largest magnitude in `gradient_sum` (no element of a
    /// gradient exceeds its L2 norm).
    sum_bound: f64,
    /// Samples (as weights) and gradients in the round so far, and the
    /// drafters they came from.
    pub round_samples: u64,
    pub round_gradients: u64,
    pub contributors: std::collections::BTreeSet<String>,
    pub steps_taken: u64,
    /// Rounds ended, stepped or dropped: a drafter whose gradient is in
    /// round `r` gets its reply once this reaches `r`.
    pub rounds_ended: u64,
    /// The settings of the round's latest gradient: the step's.
    pub pending_step: Option<GradientStep>,
}

impl CenterAdamW {
    pub fn new(center: &Center) -> Self {
        let zeros = || {
            center
                .tensors
                .iter()
                .map(|tensor| vec![0.0f32; tensor.values.len()])
                .collect::<Vec<_>>()
        };
        CenterAdamW {
            first_moment: zeros(),
            second_moment: zeros(),
            gradient_sum: zeros(),
            sum_bound: 0.0,
            round_samples: 0,
            round_gradients: 0,
            contributors: std::collections::BTreeSet::new(),
            steps_taken: 0,
            rounds_ended: 0,
            pending_step: None,
        }
    }

    /// Adds one upload's gradient (minus its tensors), weighted by
    /// `weight` samples, to the round; refused (nothing changed) when the
    /// sum could pass [`MAGNITUDE_LIMIT`]. `norm` is the upload's L2 norm.
    pub fn add(
        &mut self,
        drafter_id: &str,
        center: &Center,
        upload: &Upload,
        norm: f64,
        weight: u64,
        step: GradientStep,
    ) -> Result<(), String> {
        let bound = self.sum_bound + weight as f64 * norm;
        if bound.is_nan() || bound > MAGNITUDE_LIMIT {
            return Err(format!(
                "gradient norm {norm:.4e} x {weight} samples could take the round's sum past half of f32's range"
            ));
        }
        for uploaded in &upload.tensors {
            let sum = &mut self.gradient_sum[center.by_name[&uploaded.name]];
            uploaded
                .for_each_chunk(|range, chunk| {
                    arith::accumulate_scaled(
                        &mut sum[range],
                        chunk,
                        uploaded.dtype,
                        -(weight as f32),
                    )
                })
                .map_err(|error| error.to_string())?;
        }
        self.sum_bound = bound;
        self.round_samples += weight;
        self.round_gradients += 1;
        self.contributors.insert(drafter_id.to_string());
        self.pending_step = Some(step);
        Ok(())
    }

    /// The round holds one step's samples.
    pub fn round_complete(&self) -> bool {
        self.pending_step
            .is_some_and(|step| self.round_samples >= step.step_samples)
    }

    /// Takes the AdamW step with the round's mean gradient (when it holds
    /// any) and starts the next round. Returns the mean gradient's norm
    /// before clipping; refused (the round dropped, the center and moments
    /// unchanged) when the step could leave a value past
    /// [`MAGNITUDE_LIMIT`] or not finite.
    pub fn step(&mut self, center: &mut Center) -> Result<Option<f64>, String> {
        let Some(step) = self.pending_step.take() else {
            return Ok(None);
        };
        self.rounds_ended += 1;
        if self.round_samples == 0 {
            self.clear_round();
            return Ok(None);
        }
        let mean_scale = 1.0 / self.round_samples as f64;
        let norm = self
            .gradient_sum
            .iter()
            .map(|sum| arith::squared_norm(sum))
            .sum::<f64>()
            .sqrt()
            * mean_scale;
        let clip = if step.max_grad_norm > 0.0 {
            (step.max_grad_norm / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        let t = (self.steps_taken + 1).min(i32::MAX as u64) as i32;
        let constants = AdamWStep {
            gradient_scale: (mean_scale * clip) as f32,
            learning_rate: step.learning_rate as f32,
            beta1: step.beta1 as f32,
            beta2: step.beta2 as f32,
            epsilon: step.epsilon as f32,
            decay: (1.0 - step.learning_rate * step.weight_decay) as f32,
            bias_correction1: (1.0 - step.beta1.powi(t)) as f32,
            bias_correction2_sqrt: (1.0 - step.beta2.powi(t)).sqrt() as f32,
        };
        let mut largest = [0.0f64; 3];
        for (index, tensor) in center.tensors.iter().enumerate() {
            let bounds = constants.bounds(
                &tensor.values,
                &self.first_moment[index],
                &self.second_moment[index],
                &self.gradient_sum[index],
            );
            for (large, bound) in largest.iter_mut().zip(bounds) {
                *large = large.max(bound);
            }
        }
        if largest.iter().any(|&bound| bound > MAGNITUDE_LIMIT) {
            self.clear_round();
            return Err(format!(
                "the AdamW step of gradient norm {norm:.4e} could take the center past half of f32's range; its round is dropped"
            ));
        }
        for (index, tensor) in center.tensors.iter_mut().enumerate() {
            // Copies a buffer only while a snapshot (a save in progress) holds it.
            let values = std::sync::Arc::make_mut(&mut tensor.values);
            constants.take(
                values,
                &mut self.first_moment[index],
                &mut self.second_moment[index],
                &mut self.gradient_sum[index],
            );
        }
        center.magnitudes.values = largest[0];
        self.steps_taken += 1;
        self.sum_bound = 0.0;
        self.round_samples = 0;
        self.round_gradients = 0;
        self.contributors.clear();
        Ok(Some(norm))
    }

    fn clear_round(&mut self) {
        for sum in &mut self.gradient_sum {
            sum.fill(0.0);
        }
        self.sum_bound = 0.0;
        self.round_samples = 0;
        self.round_gradients = 0;
        self.contributors.clear();
        self.pending_step = None;
    }
}
