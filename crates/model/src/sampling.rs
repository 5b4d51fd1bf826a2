//! Choosing the next token: greedy, or temperature and nucleus (top-p)
//! sampling with a seeded generator per sequence.
//!
//! The generator is a self-contained SplitMix64 seeded from the run's seed
//! and the sequence's id, so a sequence samples the same tokens whatever it
//! is batched with, and whichever release of `rand` is linked.

use tch::{Kind, Tensor};

use crate::target_model::ModelError;

/// Sampling settings of a generation run.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingOptions {
    /// 0 means greedy (argmax); otherwise logits are divided by it.
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens whose cumulative
    /// probability first reaches `top_p` (1 keeps every token).
    pub top_p: f64,
    pub seed: u64,
}

impl SamplingOptions {
    pub fn greedy() -> Self {
        SamplingOptions {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self) -> Result<(), ModelError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(ModelError::InvalidInput(format!(
                "temperature must be 0 (greedy) or positive, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidInput(format!(
                "top_p must lie in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// SplitMix64 step (Steele, Lea, Flood 2014).
fn split_mix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut mixed = *state;
    mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    mixed ^ (mixed >> 31)
}

/// The sampler of one sequence.
#[derive(Debug, Clone)]
pub struct SequenceSampler {
    state: u64,
    top_p: f64,
}

impl SequenceSampler {
    pub fn new(options: &SamplingOptions, sequence_id: u64) -> Self {
        let mut state = options.seed ^ 0x5DEE_CE66_D1CE_5EED;
        let mixed = split_mix(&mut state) ^ sequence_id.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        SequenceSampler {
            state: mixed,
            top_p: options.top_p,
        }
    }

    /// A uniform draw in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (split_mix(&mut self.state) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Draws a token id from `probabilities` (already softmaxed with the
    /// temperature), restricted to the top-p nucleus and renormalised.
    pub fn sample(&mut self, probabilities: &[f32]) -> i64 {
        let mut order: Vec<usize> = (0..probabilities.len()).collect();
        order.sort_by(|&a, &b| {
            probabilities[b]
                .total_cmp(&probabilities[a])
                .then(a.cmp(&b))
        });
        // The nucleus: the shortest prefix whose mass reaches top_p (HF
        // keeps a token when the mass before it is below top_p).
        let mut kept = 0;
        let mut mass = 0.0f64;
        for &token in &order {
            if kept > 0 && mass >= self.top_p {
                break;
            }
            mass += f64::from(probabilities[token]);
            kept += 1;
        }
        let draw = self.uniform() * mass;
        let mut cumulative = 0.0f64;
        for &token in &order[..kept] {
            cumulative += f64::from(probabilities[token]);
            if draw < cumulative {
                return token as i64;
            }
        }
        order[kept - 1] as i64
    }
}

/// The distribution tokens are drawn from at `options` (not greedy), for
/// each row of `logits` `[.., vocab]`: `softmax(logits / temperature)` in
/// f32, cut to the top-p nucleus (a token is kept when the mass of the more
/// likely ones is below `top_p`, as HF and the reference's
/// `_sampling_probs` keep it) and renormalised. Speculative sampling needs
/// the distributions themselves, not only a draw.
pub fn sampling_probabilities(logits: &Tensor, options: &SamplingOptions) -> Tensor {
    let probabilities =
        (logits.to_kind(Kind::Float) / options.temperature).softmax(-1, Kind::Float);
    if options.top_p >= 1.0 {
        return probabilities;
    }
    let (sorted, order) = probabilities.sort(-1, true);
    let mass_before = sorted.cumsum(-1, Kind::Float) - &sorted;
    let kept = sorted * mass_before.lt(options.top_p).to_kind(Kind::Float);
    let nucleus = probabilities.zeros_like().scatter(-1, &order, &kept);
    let total = nucleus.sum_dim_intlist(-1, true, Kind::Float);
    nucleus / total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(top_p: f64, seed: u64) -> SamplingOptions {
        SamplingOptions {
            temperature: 1.0,
            top_p,
            seed,
        }
    }

    #[test]
    fn nucleus_never_draws_outside_the_top_p_mass() {
        // Sorted mass: 0.5 (id 2), 0.3 (id 0), 0.15 (id 3), 0.05 (id 1).
        let probabilities = [0.3f32, 0.05, 0.5, 0.15];
        let mut sampler = SequenceSampler::new(&options(0.8, 7), 0);
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            counts[sampler.sample(&probabilities) as usize] += 1;
        }
        assert_eq!(counts[1] + counts[3], 0, "{counts:?}");
        // Within the nucleus the draw follows the renormalised mass 5:3;
        // 4000 draws put the share of id 2 at 0.625 ± 0.03 (4 sigma).
        let share = counts[2] as f64 / 4000.0;
        assert!((share - 0.625).abs() < 0.03, "{counts:?}");
    }

    #[test]
    fn same_seed_and_sequence_give_the_same_draws_and_others_differ() {
        let probabilities = vec![1.0f32 / 64.0; 64];
        let draws = |seed, sequence| {
            let mut sampler = SequenceSampler::new(&options(1.0, seed), sequence);
            (0..32)
                .map(|_| sampler.sample(&probabilities))
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(1, 5), draws(1, 5));
        assert_ne!(draws(1, 5), draws(1, 6));
        assert_ne!(draws(1, 5), draws(2, 5));
    }

    #[test]
    fn sampling_probabilities_cut_the_nucleus_and_renormalise() {
        // softmax([ln 5, ln 3, ln 1.5, ln 0.5]) = [0.5, 0.3, 0.15, 0.05].
        let logits = Tensor::from_slice(&[5.0f32, 3.0, 1.5, 0.5]).log();
        let all = sampling_probabilities(&logits, &options(1.0, 0));
        let nucleus = sampling_probabilities(&logits, &options(0.8, 0));
        let all = Vec::<f32>::try_from(&all).unwrap();
        let nucleus = Vec::<f32>::try_from(&nucleus).unwrap();
        // f32 softmax of O(1) values: a few ulps of 1.
        for (got, want) in all.iter().zip([0.5f32, 0.3, 0.15, 0.05]) {
            assert!((got - want).abs() < 1e-6, "{all:?}");
        }
        // Mass before id 2 is 0.8, not below top_p: ids 0 and 1 remain, 5:3.
        for (got, want) in nucleus.iter().zip([0.625f32, 0.375, 0.0, 0.0]) {
            assert!((got - want).abs() < 1e-6, "{nucleus:?}");
        }
        // Temperature 2 flattens: softmax(logits / 2) ∝ sqrt([5, 3, 1.5, 0.5]).
        let warm = SamplingOptions {
            temperature: 2.0,
            ..options(1.0, 0)
        };
        let warm = Vec::<f32>::try_from(&sampling_probabilities(&logits, &warm)).unwrap();
        let roots = [5.0f32, 3.0, 1.5, 0.5].map(f32::sqrt);
        let total: f32 = roots.iter().sum();
        for (got, root) in warm.iter().zip(roots) {
            assert!((got - root / total).abs() < 1e-6, "{warm:?}");
        }
    }

    #[test]
    fn invalid_settings_name_the_value() {
        let error = SamplingOptions {
            temperature: -1.0,
            ..SamplingOptions::greedy()
        }
        .validate()
        .unwrap_err();
        assert!(error.to_string().contains("-1"), "{error}");
        assert!(options(0.0, 0).validate().is_err());
        assert!(options(1.5, 0).validate().is_err());
    }
}
