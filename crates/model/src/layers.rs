//! Layer primitives shared by the frozen target and the trainable drafter:
//! RMSNorm, rotary position embeddings (default and llama3-scaled), the
//! SwiGLU MLP and grouped-query attention's key/value head repetition.
//!
//! They are free functions over plain `tch::Tensor` weights rather than
//! `nn::Module`s so that the same code runs on frozen weights loaded from
//! safetensors (target) and on `nn::VarStore` variables (drafter, trained).
//! Every function reproduces the numerics of Hugging Face `transformers`
//! (dtype casts included), because the drafter is trained on, and verified
//! against, hidden states that must match the reference implementation.

use tch::{Device, Kind, Tensor};

/// RMSNorm as in HF `Qwen3RMSNorm` / `LlamaRMSNorm`: the statistics are
/// computed in f32 whatever the input dtype, the normalised value is cast back
/// to the input dtype and only then scaled by `weight`.
pub fn rms_norm(hidden: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let input_kind = hidden.kind();
    let hidden_f32 = hidden.to_kind(Kind::Float);
    let variance = hidden_f32.square().mean_dim(-1, true, Kind::Float);
    let normalised = hidden_f32 * (variance + eps).rsqrt();
    weight * normalised.to_kind(input_kind)
}

/// The llama3 frequency scaling of RoPE (`rope_scaling.rope_type ==
/// "llama3"` in a Llama 3.x `config.json`): long wavelengths are divided by
/// `factor`, short ones kept, and the band in between interpolated smoothly.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    /// Divisor applied to the low-frequency (long-wavelength) components.
    pub factor: f64,
    /// Wavelengths longer than `original_max_position_embeddings /
    /// low_freq_factor` are fully scaled.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original_max_position_embeddings /
    /// high_freq_factor` are left untouched.
    pub high_freq_factor: f64,
    /// Context length the model was pre-trained with before extension.
    pub original_max_position_embeddings: f64,
}

/// Rotary embedding parameters of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    /// `rope_theta`: the base of the geometric frequency progression.
    pub theta: f64,
    /// `None` for plain RoPE (Qwen3), `Some` for llama3-scaled RoPE.
    pub scaling: Option<Llama3RopeScaling>,
}

impl RopeParams {
    /// Plain RoPE with the given base.
    pub fn plain(theta: f64) -> Self {
        RopeParams {
            theta,
            scaling: None,
        }
    }
}

/// The `head_dim / 2` inverse frequencies, as an f32 tensor on `device`.
///
/// Computed in f32 with the same operation order as HF
/// (`1 / base ** (arange(0, dim, 2) / dim)`, then the llama3 rule), so the
/// rounding of the reference is reproduced rather than approximated.
pub fn inverse_frequencies(head_dim: i64, rope: &RopeParams, device: Device) -> Tensor {
    let exponents = Tensor::arange_start_step(0, head_dim, 2, (Kind::Int64, device))
        .to_kind(Kind::Float)
        / (head_dim as f64);
    let base = Tensor::from(rope.theta as f32).to_device(device);
    let inverse_frequency = base.pow(&exponents).reciprocal();
    match &rope.scaling {
        None => inverse_frequency,
        Some(scaling) => llama3_scale_frequencies(&inverse_frequency, scaling),
    }
}

/// HF `_compute_llama3_parameters`, step by step on f32 tensors.
fn llama3_scale_frequencies(inverse_frequency: &Tensor, scaling: &Llama3RopeScaling) -> Tensor {
    let old_context_length = scaling.original_max_position_embeddings;
    let low_frequency_wavelength = old_context_length / scaling.low_freq_factor;
    let high_frequency_wavelength = old_context_length / scaling.high_freq_factor;
    let wavelength = inverse_frequency.reciprocal() * (2.0 * std::f64::consts::PI);
    let fully_scaled = inverse_frequency / scaling.factor;
    let beyond_low = wavelength.gt(low_frequency_wavelength);
    let inverse_frequency_llama = fully_scaled.where_self(&beyond_low, inverse_frequency);
    let smooth_factor = ((wavelength.reciprocal() * old_context_length) - scaling.low_freq_factor)
        / (scaling.high_freq_factor - scaling.low_freq_factor);
    let smoothed = (smooth_factor.ones_like() - &smooth_factor) * &inverse_frequency_llama
        / scaling.factor
        + &smooth_factor * &inverse_frequency_llama;
    let below_high = wavelength.lt(high_frequency_wavelength);
    let is_medium = below_high
        .logical_not()
        .logical_and(&beyond_low.logical_not());
    smoothed.where_self(&is_medium, &inverse_frequency_llama)
}

/// Cosine and sine tables for the given positions, shaped `[B, T, head_dim]`
/// (or `[T, head_dim]` for 1-D positions), computed in f32 and returned in
/// `kind`. `positions` is an integer tensor of absolute positions.
pub fn rotary_cos_sin(
    positions: &Tensor,
    head_dim: i64,
    rope: &RopeParams,
    kind: Kind,
    device: Device,
) -> (Tensor, Tensor) {
    let inverse_frequency = inverse_frequencies(head_dim, rope, device);
    let positions_f32 = positions.to_device(device).to_kind(Kind::Float);
    // Outer product [.., T, 1] x [D/2] in f32, like HF's autocast-disabled matmul.
    let frequencies = positions_f32.unsqueeze(-1) * &inverse_frequency;
    let angles = Tensor::cat(&[&frequencies, &frequencies], -1);
    (angles.cos().to_kind(kind), angles.sin().to_kind(kind))
}

/// `[x1, x2] -> [-x2, x1]` on the last dimension (HF `rotate_half`).
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let first = x.narrow(-1, 0, half);
    let second = x.narrow(-1, half, half);
    Tensor::cat(&[&second.neg(), &first], -1)
}

/// Applies RoPE to `x` shaped `[B, heads, T, head_dim]` with `cos`/`sin`
/// shaped `[B, T, head_dim]` (or `[T, head_dim]`, broadcast over the batch).
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (cos, sin) = if cos.dim() == 3 {
        (cos.unsqueeze(1), sin.unsqueeze(1))
    } else {
        (cos.shallow_clone(), sin.shallow_clone())
    };
    x * cos + rotate_half(x) * sin
}

/// `down(silu(gate(x)) * up(x))` with bias-free projections stored as
/// `[out, in]` like `nn.Linear`.
pub fn swiglu_mlp(
    hidden: &Tensor,
    gate_weight: &Tensor,
    up_weight: &Tensor,
    down_weight: &Tensor,
) -> Tensor {
    let gate = hidden.linear::<Tensor>(gate_weight, None).silu();
    let up = hidden.linear::<Tensor>(up_weight, None);
    (gate * up).linear::<Tensor>(down_weight, None)
}

/// HF `repeat_kv`: key/value head `h` serves the `repeats` consecutive query
/// heads `h·repeats .. (h+1)·repeats` (grouped-query attention), on
/// `[batch, heads, length, head_dim]` states.
pub fn repeat_key_value_heads(states: &Tensor, repeats: i64) -> Tensor {
    if repeats == 1 {
        return states.shallow_clone();
    }
    let size = states.size();
    let (batch, key_value_heads, length, head_dim) = (size[0], size[1], size[2], size[3]);
    states
        .unsqueeze(2)
        .expand([batch, key_value_heads, repeats, length, head_dim], false)
        .reshape([batch, key_value_heads * repeats, length, head_dim])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to_vec(tensor: &Tensor) -> Vec<f32> {
        let flat = tensor.to_kind(Kind::Float).flatten(0, -1);
        (0..flat.size()[0])
            .map(|index| flat.double_value(&[index]) as f32)
            .collect()
    }

    #[test]
    fn rms_norm_gives_unit_root_mean_square() {
        let hidden = Tensor::from_slice(&[3.0f32, -4.0, 0.0, 0.0]).view([1, 4]);
        let weight = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let normalised = to_vec(&rms_norm(&hidden, &weight, 0.0));
        // rms of [3, -4, 0, 0] is 2.5
        assert_eq!(normalised, vec![1.2, -1.6, 0.0, 0.0]);
    }

    #[test]
    fn plain_inverse_frequencies_follow_the_geometric_progression() {
        let frequencies = to_vec(&inverse_frequencies(
            8,
            &RopeParams::plain(10_000.0),
            Device::Cpu,
        ));
        let expected = [1.0f32, 0.1, 0.01, 0.001];
        for (actual, expected) in frequencies.iter().zip(expected) {
            assert!((actual - expected).abs() < 1e-6, "{frequencies:?}");
        }
    }

    #[test]
    fn llama3_scaling_divides_long_wavelengths_and_keeps_short_ones() {
        let rope = RopeParams {
            theta: 500_000.0,
            scaling: Some(Llama3RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            }),
        };
        let scaled = to_vec(&inverse_frequencies(128, &rope, Device::Cpu));
        let plain = to_vec(&inverse_frequencies(
            128,
            &RopeParams::plain(500_000.0),
            Device::Cpu,
        ));
        // Highest frequency: wavelength 2π < 2048, untouched.
        assert_eq!(scaled[0], plain[0]);
        // Lowest frequency: wavelength far above 8192, divided by the factor.
        let last = scaled.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-12);
        // Something in the middle band is strictly between the two.
        let medium = (0..scaled.len()).find(|&index| {
            scaled[index] != plain[index] && (scaled[index] - plain[index] / 8.0).abs() > 1e-12
        });
        assert!(medium.is_some(), "no interpolated band in {scaled:?}");
    }

    #[test]
    fn rotary_at_position_zero_is_identity_and_preserves_norm() {
        let positions = Tensor::from_slice(&[0i64, 5]).view([1, 2]);
        let (cos, sin) = rotary_cos_sin(
            &positions,
            4,
            &RopeParams::plain(10_000.0),
            Kind::Float,
            Device::Cpu,
        );
        assert_eq!(cos.size(), vec![1, 2, 4]);
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]).view([1, 1, 2, 4]);
        let rotated = apply_rotary(&x, &cos, &sin);
        let values = to_vec(&rotated);
        assert_eq!(&values[..4], &[1.0, 2.0, 3.0, 4.0]);
        let norm_before: f32 = [1.0f32, 2.0, 3.0, 4.0].iter().map(|v| v * v).sum();
        let norm_after: f32 = values[4..].iter().map(|v| v * v).sum();
        assert!((norm_before - norm_after).abs() < 1e-4);
        assert_ne!(&values[4..], &[1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn swiglu_matches_hand_computation() {
        let hidden = Tensor::from_slice(&[1.0f32, 2.0]).view([1, 2]);
        let gate = Tensor::from_slice(&[1.0f32, 0.0]).view([1, 2]);
        let up = Tensor::from_slice(&[0.0f32, 1.0]).view([1, 2]);
        let down = Tensor::from_slice(&[2.0f32]).view([1, 1]);
        let output = to_vec(&swiglu_mlp(&hidden, &gate, &up, &down));
        let silu_one = 1.0f32 / (1.0 + (-1.0f32).exp());
        assert!((output[0] - 2.0 * silu_one * 2.0).abs() < 1e-6);
    }
}
