//! AdamW with a linear-warmup cosine schedule and global-norm gradient
//! clipping, written over plain tensors rather than `tch::nn::Optimizer`
//! because libtorch's C optimizer state cannot be read back out, and
//! `--resume` must restore the moment estimates exactly.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use super::error::DraftError;

/// AdamW hyper-parameters (PyTorch's defaults apart from the learning rate).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWSettings {
    pub beta1: f64,
    pub beta2: f64,
    pub epsilon: f64,
    /// Decoupled weight decay, applied to every parameter.
    pub weight_decay: f64,
}

impl Default for AdamWSettings {
    fn default() -> Self {
        AdamWSettings {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Peak learning rate, linear warmup over `warmup_fraction` of the steps,
/// then cosine decay to `min_lr_ratio × peak`.
#[derive(Debug, Clone, PartialEq)]
pub struct LearningRateSchedule {
    pub peak_learning_rate: f64,
    pub warmup_fraction: f64,
    pub min_lr_ratio: f64,
}

impl Default for LearningRateSchedule {
    fn default() -> Self {
        LearningRateSchedule {
            peak_learning_rate: 6e-4,
            warmup_fraction: 0.04,
            min_lr_ratio: 0.0,
        }
    }
}

impl LearningRateSchedule {
    /// Learning rate of the optimizer step with 0-based index `step` out of
    /// `total_steps`. Steps past the end stay at the floor.
    pub fn learning_rate(&self, step: u64, total_steps: u64) -> f64 {
        let total_steps = total_steps.max(1);
        let warmup_steps = ((total_steps as f64) * self.warmup_fraction).ceil() as u64;
        let floor = self.peak_learning_rate * self.min_lr_ratio;
        if step < warmup_steps {
            return self.peak_learning_rate * (step + 1) as f64 / warmup_steps as f64;
        }
        let decay_steps = total_steps.saturating_sub(warmup_steps).max(1);
        let progress = ((step - warmup_steps) as f64 / decay_steps as f64).min(1.0);
        floor
            + (self.peak_learning_rate - floor)
                * 0.5
                * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// AdamW over named parameters; the names key the saved moment estimates.
pub struct AdamW {
    settings: AdamWSettings,
    /// Parameter name → (parameter, first moment, second moment).
    states: BTreeMap<String, (Tensor, Tensor, Tensor)>,
    /// Optimizer steps taken so far (drives the bias correction).
    steps_taken: u64,
}

impl AdamW {
    /// An optimizer over `parameters` (name, tensor requiring grad).
    pub fn new(
        parameters: impl IntoIterator<Item = (String, Tensor)>,
        settings: AdamWSettings,
    ) -> Self {
        let states = parameters
            .into_iter()
            .map(|(name, parameter)| {
                let first_moment = parameter.zeros_like().to_kind(Kind::Float);
                let second_moment = parameter.zeros_like().to_kind(Kind::Float);
                (name, (parameter, first_moment, second_moment))
            })
            .collect();
        AdamW {
            settings,
            states,
            steps_taken: 0,
        }
    }

    pub fn steps_taken(&self) -> u64 {
        self.steps_taken
    }

    /// The hyper-parameters this optimizer was made with.
    pub fn settings(&self) -> &AdamWSettings {
        &self.settings
    }

    /// Sets every parameter's gradient to zero (or leaves it undefined).
    pub fn zero_grad(&mut self) {
        for (parameter, _, _) in self.states.values_mut() {
            parameter.zero_grad();
        }
    }

    /// Multiplies every gradient by `factor` (normalising accumulated sums).
    pub fn scale_gradients(&mut self, factor: f64) {
        let _no_grad = tch::no_grad_guard();
        for (parameter, _, _) in self.states.values() {
            let mut gradient = parameter.grad();
            if gradient.defined() {
                let _ = gradient.g_mul_scalar_(factor);
            }
        }
    }

    /// Scales gradients so their global L2 norm is at most `max_norm`
    /// (PyTorch `clip_grad_norm_`), returning the norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let total_norm = self.gradient_norm();
        self.clip_gradients(max_norm, total_norm);
        total_norm
    }

    /// The global L2 norm of every gradient: one fused reduction on the
    /// device and one read back to the host (not one per parameter). NaN or
    /// infinity when any gradient is not finite.
    pub fn gradient_norm(&self) -> f64 {
        let _no_grad = tch::no_grad_guard();
        let squares: Vec<tch::Tensor> = self
            .states
            .values()
            .filter_map(|(parameter, _, _)| {
                let gradient = parameter.grad();
                gradient
                    .defined()
                    .then(|| gradient.to_kind(Kind::Float).square().sum(Kind::Float))
            })
            .collect();
        if squares.is_empty() {
            return 0.0;
        }
        tch::Tensor::stack(&squares, 0)
            .sum(Kind::Float)
            .double_value(&[])
            .sqrt()
    }

    /// Scales the gradients so their global norm (`total_norm`, from
    /// [`AdamW::gradient_norm`]) is at most `max_norm`.
    pub fn clip_gradients(&mut self, max_norm: f64, total_norm: f64) {
        let _no_grad = tch::no_grad_guard();
        let clip_coefficient = (max_norm / (total_norm + 1e-6)).min(1.0);
        if clip_coefficient < 1.0 {
            for (parameter, _, _) in self.states.values() {
                let mut gradient = parameter.grad();
                if gradient.defined() {
                    let _ = gradient.g_mul_scalar_(clip_coefficient);
                }
            }
        }
    }

    /// One AdamW update at `learning_rate` (PyTorch `AdamW` semantics).
    pub fn step(&mut self, learning_rate: f64) {
        let settings = self.settings.clone();
        self.step_with(learning_rate, &settings, |parameter, _| {
            let gradient = parameter.grad();
            gradient.defined().then_some(gradient)
        });
    }

    /// One AdamW update at `learning_rate` with `settings` (not this
    /// optimizer's own: a data-parallel step's are rank 0's, the same on
    /// every member) whose gradient is `flat`, laid out as
    /// [`AdamW::flat_gradients`] lays it out (a data-parallel trainer's
    /// reduced gradient); the parameters' own gradients are not read.
    pub fn step_flat(
        &mut self,
        learning_rate: f64,
        settings: &AdamWSettings,
        flat: &Tensor,
    ) -> Result<(), DraftError> {
        self.check_flat("gradient", flat, self.parameter_elements())?;
        let mut offset = 0i64;
        self.step_with(learning_rate, settings, |parameter, _| {
            let elements = parameter.numel() as i64;
            let gradient = flat
                .narrow(0, offset, elements)
                .view(parameter.size().as_slice());
            offset += elements;
            Some(gradient)
        });
        Ok(())
    }

    fn step_with(
        &mut self,
        learning_rate: f64,
        settings: &AdamWSettings,
        mut gradient_of: impl FnMut(&Tensor, &str) -> Option<Tensor>,
    ) {
        let _no_grad = tch::no_grad_guard();
        self.steps_taken += 1;
        let bias_correction1 = 1.0 - settings.beta1.powi(self.steps_taken as i32);
        let bias_correction2_sqrt = (1.0 - settings.beta2.powi(self.steps_taken as i32)).sqrt();
        for (name, (parameter, first_moment, second_moment)) in self.states.iter_mut() {
            let Some(gradient) = gradient_of(parameter, name) else {
                continue;
            };
            let gradient = gradient.to_kind(Kind::Float);
            if settings.weight_decay != 0.0 {
                let _ = parameter.g_mul_scalar_(1.0 - learning_rate * settings.weight_decay);
            }
            let _ = first_moment.g_mul_scalar_(settings.beta1);
            let _ = first_moment.g_add_(&(&gradient * (1.0 - settings.beta1)));
            let _ = second_moment.g_mul_scalar_(settings.beta2);
            let _ = second_moment.g_add_(&(gradient.square() * (1.0 - settings.beta2)));
            let denominator = second_moment.sqrt() / bias_correction2_sqrt + settings.epsilon;
            let update = (&*first_moment / denominator) * (learning_rate / bias_correction1);
            let _ = parameter.g_sub_(&update.to_kind(parameter.kind()));
        }
    }

    /// Elements of every parameter together.
    pub fn parameter_elements(&self) -> i64 {
        self.states
            .values()
            .map(|(parameter, _, _)| parameter.numel() as i64)
            .sum()
    }

    /// Every parameter's gradient in name order as one flat f32 tensor on
    /// the parameters' device (zeros where a gradient is undefined): what a
    /// data-parallel member all-reduces.
    pub fn flat_gradients(&self) -> Tensor {
        let _no_grad = tch::no_grad_guard();
        let parts: Vec<Tensor> = self
            .states
            .values()
            .map(|(parameter, _, _)| {
                let gradient = parameter.grad();
                if gradient.defined() {
                    gradient.to_kind(Kind::Float).reshape([-1])
                } else {
                    Tensor::zeros(
                        [parameter.numel() as i64],
                        (Kind::Float, parameter.device()),
                    )
                }
            })
            .collect();
        Tensor::cat(&parts, 0)
    }

    /// Weights, first and second moments, each in name order, as one flat
    /// f32 tensor: the state a joining data-parallel member takes.
    pub fn flat_state(&self) -> Tensor {
        let _no_grad = tch::no_grad_guard();
        let mut parts = Vec::with_capacity(3 * self.states.len());
        for index in 0..3 {
            for (parameter, first_moment, second_moment) in self.states.values() {
                let tensor = [parameter, first_moment, second_moment][index];
                parts.push(tensor.detach().to_kind(Kind::Float).reshape([-1]));
            }
        }
        Tensor::cat(&parts, 0)
    }

    /// Takes weights and moments from `flat` ([`AdamW::flat_state`]'s
    /// layout) and the step count; nothing changes when `flat` has the
    /// wrong size or a value that is not finite.
    pub fn load_flat_state(&mut self, flat: &Tensor, steps_taken: u64) -> Result<(), DraftError> {
        let _no_grad = tch::no_grad_guard();
        let elements = self.parameter_elements();
        self.check_flat("state", flat, 3 * elements)?;
        if !bool::try_from(flat.isfinite().all()).unwrap_or(false) {
            return Err(DraftError::Checkpoint(
                "the state to load has a value that is not finite".to_string(),
            ));
        }
        let mut offset = 0i64;
        for index in 0..3 {
            for (parameter, first_moment, second_moment) in self.states.values_mut() {
                let count = parameter.numel() as i64;
                let source = flat
                    .narrow(0, offset, count)
                    .view(parameter.size().as_slice());
                offset += count;
                let destination = match index {
                    0 => parameter,
                    1 => first_moment,
                    _ => second_moment,
                };
                let kind = destination.kind();
                destination.copy_(&source.to_kind(kind));
            }
        }
        self.steps_taken = steps_taken;
        Ok(())
    }

    /// A checksum of the weights, moments and step count: for each tensor,
    /// the integer sum of its f32 bit patterns each times a weight of its
    /// position (so two values swapped change it, as does any one value),
    /// mixed with the tensor's place. Integer sums wrap, so the result does
    /// not depend on the order the device adds in. Members of a
    /// data-parallel trainer compare it at each quorum.
    pub fn state_checksum(&self) -> u64 {
        let _no_grad = tch::no_grad_guard();
        let mut checksum = splitmix(self.steps_taken);
        for (index, (parameter, first_moment, second_moment)) in self.states.values().enumerate() {
            for (which, tensor) in [parameter, first_moment, second_moment]
                .into_iter()
                .enumerate()
            {
                let bits = positional_bit_sum(tensor);
                checksum = splitmix(checksum ^ bits ^ ((index as u64) << 2 | which as u64));
            }
        }
        checksum
    }

    fn check_flat(&self, what: &str, flat: &Tensor, expected: i64) -> Result<(), DraftError> {
        let size = flat.size();
        if size.len() != 1 || size[0] != expected {
            return Err(DraftError::ShapeMismatch(format!(
                "flat {what} of shape {size:?}, expected [{expected}]"
            )));
        }
        Ok(())
    }

    /// The moment estimates as named tensors (`exp_avg.{name}`,
    /// `exp_avg_sq.{name}`), for the checkpoint.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.states
            .iter()
            .flat_map(|(name, (_, first_moment, second_moment))| {
                [
                    (format!("exp_avg.{name}"), first_moment.shallow_clone()),
                    (format!("exp_avg_sq.{name}"), second_moment.shallow_clone()),
                ]
            })
            .collect()
    }

    /// Restores moment estimates saved by [`AdamW::state_tensors`] and the
    /// step count; every parameter must have both moments with its shape.
    pub fn load_state(
        &mut self,
        saved: &BTreeMap<String, Tensor>,
        steps_taken: u64,
    ) -> Result<(), DraftError> {
        let _no_grad = tch::no_grad_guard();
        for (name, (parameter, first_moment, second_moment)) in self.states.iter_mut() {
            for (prefix, moment) in [("exp_avg", first_moment), ("exp_avg_sq", second_moment)] {
                let key = format!("{prefix}.{name}");
                let stored = saved.get(&key).ok_or_else(|| {
                    DraftError::Checkpoint(format!("optimizer state lacks {key:?}"))
                })?;
                if stored.size() != parameter.size() {
                    return Err(DraftError::Checkpoint(format!(
                        "optimizer state {key:?} has shape {:?}, the parameter has {:?}",
                        stored.size(),
                        parameter.size()
                    )));
                }
                moment.copy_(&stored.to_device(moment.device()).to_kind(Kind::Float));
            }
        }
        self.steps_taken = steps_taken;
        Ok(())
    }
}

/// SplitMix64's finaliser: mixes a checksum's parts.
/// Σ bits(x_i) · (1 + i mod 65521) over a tensor's f32 values, wrapping.
/// Each product is below 2^47, and a swap of x_i and x_j changes the sum by
/// (bits_i − bits_j)(w_i − w_j), which is not 0 unless the values' bits or
/// the weights are equal.
fn positional_bit_sum(tensor: &Tensor) -> u64 {
    const WEIGHT_PERIOD: i64 = 65_521;
    let bits = tensor
        .detach()
        .to_kind(Kind::Float)
        .flatten(0, -1)
        .view_dtype(Kind::Int)
        .to_kind(Kind::Int64);
    let weights = Tensor::arange(bits.numel() as i64, (Kind::Int64, bits.device()))
        .remainder(WEIGHT_PERIOD)
        + 1;
    (bits * weights).sum(Kind::Int64).int64_value(&[]) as u64
}

fn splitmix(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    value = (value ^ (value >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    value ^ (value >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_linearly_then_decays_to_the_floor() {
        let schedule = LearningRateSchedule::default();
        // 100 steps: 4 warmup steps.
        assert!((schedule.learning_rate(0, 100) - 1.5e-4).abs() < 1e-12);
        assert!((schedule.learning_rate(3, 100) - 6e-4).abs() < 1e-12);
        assert!(schedule.learning_rate(50, 100) < 6e-4);
        assert!(schedule.learning_rate(50, 100) > schedule.learning_rate(90, 100));
        assert!(schedule.learning_rate(100, 100).abs() < 1e-12);
    }

    #[test]
    fn adamw_first_step_moves_each_weight_by_the_learning_rate() {
        let parameter = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
        let mut optimizer = AdamW::new(
            [("w".to_string(), parameter.shallow_clone())],
            AdamWSettings::default(),
        );
        let loss = (&parameter * Tensor::from_slice(&[3.0f32, -0.5])).sum(Kind::Float);
        loss.backward();
        optimizer.step(0.1);
        // Bias-corrected first step: update = lr · sign(g).
        let values = Vec::<f32>::try_from(&parameter.detach()).unwrap();
        assert!(
            (values[0] - 0.9).abs() < 1e-5 && (values[1] + 1.9).abs() < 1e-5,
            "{values:?}"
        );
        assert_eq!(optimizer.state_tensors().len(), 2);
    }

    #[test]
    fn clipping_bounds_the_global_norm() {
        let parameter = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        let mut optimizer = AdamW::new(
            [("w".to_string(), parameter.shallow_clone())],
            AdamWSettings::default(),
        );
        (&parameter * Tensor::from_slice(&[3.0f32, 4.0]))
            .sum(Kind::Float)
            .backward();
        let norm = optimizer.clip_grad_norm(1.0);
        assert!((norm - 5.0).abs() < 1e-6);
        let clipped = parameter.grad().norm().double_value(&[]);
        assert!((clipped - 1.0).abs() < 1e-4, "{clipped}");
    }

    fn checksum_of(values: &[f32]) -> u64 {
        let parameter = Tensor::from_slice(values).view([2, values.len() as i64 / 2]);
        AdamW::new([("w".to_string(), parameter)], AdamWSettings::default()).state_checksum()
    }

    #[test]
    fn checksum_sees_a_swap_and_any_one_bit() {
        let values = [1.0f32, -2.0, 0.5, 3.25];
        let reference = checksum_of(&values);
        assert_eq!(
            checksum_of(&values),
            reference,
            "the same state, the same checksum"
        );
        let mut swapped = values;
        swapped.swap(0, 3);
        assert_ne!(checksum_of(&swapped), reference, "two values swapped");
        let mut transposed = values;
        transposed.swap(1, 2);
        assert_ne!(checksum_of(&transposed), reference, "a transposed matrix");
        let mut flipped = values;
        flipped[2] = f32::from_bits(flipped[2].to_bits() ^ 1);
        assert_ne!(
            checksum_of(&flipped),
            reference,
            "the last bit of one value"
        );
    }
}
