//! The center's arithmetic on raw little-endian buffers, without libtorch.
//!
//! The center is kept in f32 whatever the drafters send: deltas arrive as
//! bf16 or f32 bytes and are decoded element by element inside the loop
//! that applies them, so no decoded copy of a delta is ever allocated. Each
//! loop is a plain zip over fixed-size chunks (no bounds checks, no
//! branches in the body), which the compiler vectorises in optimised builds
//! (checked: packed `mulps`/`addps` in the bf16 and f32 loop bodies at
//! opt-level 2; debug builds of this crate are not optimised).

/// Element type of tensors on the sync wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireDtype {
    F32,
    Bf16,
}

impl WireDtype {
    pub fn element_bytes(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WireDtype::F32 => "f32",
            WireDtype::Bf16 => "bf16",
        }
    }
}

/// The value of a bf16 bit pattern (exact: bf16 is f32's upper half).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The nearest bf16 (round half to even, as PyTorch and libtorch convert);
/// NaN stays NaN.
#[inline]
pub fn f32_to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        // Keep the sign and force a quiet NaN payload.
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding_bias = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding_bias) >> 16) as u16
}

/// `bytes` does not hold exactly `values.len()` elements of `dtype`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{bytes} bytes of {dtype} for {elements} elements, expected {expected} bytes")]
pub struct LengthMismatch {
    pub bytes: usize,
    pub dtype: &'static str,
    pub elements: usize,
    pub expected: usize,
}

fn check_length(values: usize, bytes: &[u8], dtype: WireDtype) -> Result<(), LengthMismatch> {
    let expected = values * dtype.element_bytes();
    if bytes.len() != expected {
        return Err(LengthMismatch {
            bytes: bytes.len(),
            dtype: dtype.name(),
            elements: values,
            expected,
        });
    }
    Ok(())
}

/// `Σ decode(bytes)[i]²` in f64: NaN or infinity when any value is not
/// finite, so one number tells both the norm and whether the delta is sane.
pub fn squared_sum(bytes: &[u8], dtype: WireDtype) -> f64 {
    match dtype {
        WireDtype::F32 => bytes
            .chunks_exact(4)
            .map(|raw| f64::from(f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]])).powi(2))
            .sum(),
        WireDtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|raw| f64::from(bf16_to_f32(u16::from_le_bytes([raw[0], raw[1]]))).powi(2))
            .sum(),
    }
}

/// `values[i] = decode(bytes)[i]`.
pub fn decode_into(
    values: &mut [f32],
    bytes: &[u8],
    dtype: WireDtype,
) -> Result<(), LengthMismatch> {
    check_length(values.len(), bytes, dtype)?;
    match dtype {
        WireDtype::F32 => {
            for (value, raw) in values.iter_mut().zip(bytes.chunks_exact(4)) {
                *value = f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
            }
        }
        WireDtype::Bf16 => {
            for (value, raw) in values.iter_mut().zip(bytes.chunks_exact(2)) {
                *value = bf16_to_f32(u16::from_le_bytes([raw[0], raw[1]]));
            }
        }
    }
    Ok(())
}

/// `values[i] += scale * decode(bytes)[i]`, and when `sum` is given also
/// `sum[i] += sum_scale * decode(bytes)[i]` in the same pass (the
/// delayed-momentum accumulator).
pub fn add_scaled(
    values: &mut [f32],
    sum: Option<&mut [f32]>,
    bytes: &[u8],
    dtype: WireDtype,
    scale: f32,
    sum_scale: f32,
) -> Result<(), LengthMismatch> {
    check_length(values.len(), bytes, dtype)?;
    if let Some(sum) = &sum {
        assert_eq!(sum.len(), values.len(), "accumulator of another tensor");
    }
    match (dtype, sum) {
        (WireDtype::F32, None) => {
            for (value, raw) in values.iter_mut().zip(bytes.chunks_exact(4)) {
                *value += scale * f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
            }
        }
        (WireDtype::F32, Some(sum)) => {
            for ((value, total), raw) in values
                .iter_mut()
                .zip(sum.iter_mut())
                .zip(bytes.chunks_exact(4))
            {
                let delta = f32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
                *value += scale * delta;
                *total += sum_scale * delta;
            }
        }
        (WireDtype::Bf16, None) => {
            for (value, raw) in values.iter_mut().zip(bytes.chunks_exact(2)) {
                *value += scale * bf16_to_f32(u16::from_le_bytes([raw[0], raw[1]]));
            }
        }
        (WireDtype::Bf16, Some(sum)) => {
            for ((value, total), raw) in values
                .iter_mut()
                .zip(sum.iter_mut())
                .zip(bytes.chunks_exact(2))
            {
                let delta = bf16_to_f32(u16::from_le_bytes([raw[0], raw[1]]));
                *value += scale * delta;
                *total += sum_scale * delta;
            }
        }
    }
    Ok(())
}

/// The delayed Nesterov step over the deltas summed since the last one:
/// `velocity = momentum * velocity + sum / count`,
/// `values += learning_rate * momentum * velocity`, `sum = 0`.
///
/// Written for deltas (local minus base, the negative of DiLoCo's
/// pseudo-gradient), so every sign is a `+`. Together with the immediate
/// `values += learning_rate * delta` of each update this is Nesterov
/// momentum (`θ −= lr·(g + μ·m)`, `m = μ·m + g`) applied to the mean of
/// every `count` deltas; with `count = 1` it is exactly DiLoCo's outer step.
pub fn delayed_nesterov_step(
    values: &mut [f32],
    velocity: &mut [f32],
    sum: &mut [f32],
    count: u32,
    learning_rate: f32,
    momentum: f32,
) {
    assert!(
        velocity.len() == values.len() && sum.len() == values.len(),
        "optimizer state of another tensor"
    );
    let mean_scale = 1.0 / count.max(1) as f32;
    let push = learning_rate * momentum;
    for ((value, speed), total) in values
        .iter_mut()
        .zip(velocity.iter_mut())
        .zip(sum.iter_mut())
    {
        *speed = momentum * *speed + *total * mean_scale;
        *value += push * *speed;
        *total = 0.0;
    }
}

/// The little-endian bytes of `values` as `dtype`.
pub fn encode(values: &[f32], dtype: WireDtype) -> Vec<u8> {
    let mut bytes = vec![0u8; values.len() * dtype.element_bytes()];
    match dtype {
        WireDtype::F32 => {
            for (raw, value) in bytes.chunks_exact_mut(4).zip(values) {
                raw.copy_from_slice(&value.to_le_bytes());
            }
        }
        WireDtype::Bf16 => {
            for (raw, value) in bytes.chunks_exact_mut(2).zip(values) {
                raw.copy_from_slice(&f32_to_bf16(*value).to_le_bytes());
            }
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect()
    }

    fn bf16_bytes(bits: &[u16]) -> Vec<u8> {
        bits.iter().flat_map(|value| value.to_le_bytes()).collect()
    }

    #[test]
    fn bf16_conversion_is_exact_on_representable_values_and_rounds_half_to_even() {
        // 1.0, -2.0, 0.15625 = 0x3E20 and the largest finite bf16 are exact.
        for (value, bits) in [
            (1.0f32, 0x3F80u16),
            (-2.0, 0xC000),
            (0.15625, 0x3E20),
            (f32::from_bits(0x7F7F_0000), 0x7F7F),
        ] {
            assert_eq!(f32_to_bf16(value), bits);
            assert_eq!(bf16_to_f32(bits), value);
        }
        // 1 + 2^-8 lies exactly halfway between 1.0 (even) and 1 + 2^-7.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
        // 1 + 3·2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3F82);
        // Just above halfway rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
    }

    #[test]
    fn f32_deltas_add_exactly_on_dyadic_values() {
        // Every value and product here is a dyadic rational with few bits,
        // so f32 arithmetic is exact and equality is the right check.
        let mut values = vec![1.0f32, -2.0, 0.5, 8.0];
        let delta = f32_bytes(&[0.25, 0.5, -1.0, 0.0]);
        let mut sum = vec![0.0f32; 4];
        add_scaled(
            &mut values,
            Some(&mut sum),
            &delta,
            WireDtype::F32,
            0.5,
            1.0,
        )
        .unwrap();
        assert_eq!(values, vec![1.125, -1.75, 0.0, 8.0]);
        assert_eq!(sum, vec![0.25, 0.5, -1.0, 0.0]);
        add_scaled(&mut values, None, &delta, WireDtype::F32, 1.0, 1.0).unwrap();
        assert_eq!(values, vec![1.375, -1.25, -1.0, 8.0]);
    }

    #[test]
    fn bf16_deltas_are_decoded_exactly_and_accumulated_in_f32() {
        // 0x3F80 = 1.0, 0xBF00 = -0.5, 0x3C00 = 2^-7: a delta far below
        // bf16 resolution at 256 is kept because the center is f32.
        let mut values = vec![256.0f32, 0.0, 256.0];
        let delta = bf16_bytes(&[0x3F80, 0xBF00, 0x3C00]);
        add_scaled(&mut values, None, &delta, WireDtype::Bf16, 1.0, 1.0).unwrap();
        assert_eq!(values, vec![257.0, -0.5, 256.0 + 1.0 / 128.0]);
        let mut decoded = vec![0.0f32; 3];
        decode_into(&mut decoded, &delta, WireDtype::Bf16).unwrap();
        assert_eq!(decoded, vec![1.0, -0.5, 1.0 / 128.0]);
    }

    #[test]
    fn lengths_that_do_not_match_are_refused_and_change_nothing() {
        let mut values = vec![1.0f32, 2.0];
        let error = add_scaled(&mut values, None, &[0u8; 6], WireDtype::F32, 1.0, 1.0).unwrap_err();
        assert_eq!(error.expected, 8);
        assert_eq!(error.bytes, 6);
        assert_eq!(values, vec![1.0, 2.0]);
        assert!(decode_into(&mut values, &[0u8; 2], WireDtype::Bf16).is_err());
    }

    #[test]
    fn encode_round_trips_f32_and_rounds_bf16() {
        let values = [1.0f32, -0.1, 3.5e-3, 65504.0];
        let mut back = [0.0f32; 4];
        decode_into(&mut back, &encode(&values, WireDtype::F32), WireDtype::F32).unwrap();
        assert_eq!(back, values);
        decode_into(
            &mut back,
            &encode(&values, WireDtype::Bf16),
            WireDtype::Bf16,
        )
        .unwrap();
        for (original, rounded) in values.iter().zip(back) {
            // bf16 keeps 8 significant bits: half an ulp is at most 2^-8
            // of the magnitude.
            assert!((original - rounded).abs() <= original.abs() / 256.0);
        }
    }

    #[test]
    fn delayed_nesterov_with_one_update_is_the_nesterov_step() {
        // Two updates with the same delta d, count 1, lr 1, μ 0.5:
        // step 1: immediate +d, velocity = d, push μ·d → θ = d + 0.5d = 1.5d
        // step 2: immediate +d, velocity = 0.5d + d = 1.5d, push 0.75d
        //         → θ = 1.5d + d + 0.75d = 3.25d
        let delta = f32_bytes(&[2.0, -4.0]);
        let mut values = vec![0.0f32; 2];
        let mut velocity = vec![0.0f32; 2];
        let mut sum = vec![0.0f32; 2];
        for _ in 0..2 {
            add_scaled(
                &mut values,
                Some(&mut sum),
                &delta,
                WireDtype::F32,
                1.0,
                1.0,
            )
            .unwrap();
            delayed_nesterov_step(&mut values, &mut velocity, &mut sum, 1, 1.0, 0.5);
        }
        assert_eq!(values, vec![6.5, -13.0]);
        assert_eq!(velocity, vec![3.0, -6.0]);
        assert_eq!(sum, vec![0.0, 0.0]);
    }

    #[test]
    fn delayed_nesterov_uses_the_mean_of_the_delayed_deltas() {
        // Deltas 1 and 3 (mean 2), lr 0.5, μ 0.5, count 2:
        // immediate: 0.5·1 + 0.5·3 = 2; velocity = 2; push 0.25·2 = 0.5.
        let mut values = vec![0.0f32];
        let mut velocity = vec![0.0f32];
        let mut sum = vec![0.0f32];
        for delta in [1.0f32, 3.0] {
            add_scaled(
                &mut values,
                Some(&mut sum),
                &f32_bytes(&[delta]),
                WireDtype::F32,
                0.5,
                1.0,
            )
            .unwrap();
        }
        assert_eq!(values, vec![2.0]);
        delayed_nesterov_step(&mut values, &mut velocity, &mut sum, 2, 0.5, 0.5);
        assert_eq!(values, vec![2.5]);
        assert_eq!(velocity, vec![2.0]);
    }
}
