//! The run's model on the wire, without libtorch: its tensors arrive as
//! f32 or bf16 little-endian bytes and are decoded into f32 buffers, and go
//! out to a reader encoded again.

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
    fn bf16_values_are_decoded_exactly_into_f32() {
        // 0x3F80 = 1.0, 0xBF00 = -0.5, 0x3C00 = 2^-7.
        let mut decoded = vec![0.0f32; 3];
        decode_into(
            &mut decoded,
            &bf16_bytes(&[0x3F80, 0xBF00, 0x3C00]),
            WireDtype::Bf16,
        )
        .unwrap();
        assert_eq!(decoded, vec![1.0, -0.5, 1.0 / 128.0]);
    }

    #[test]
    fn lengths_that_do_not_match_are_refused_and_change_nothing() {
        let mut values = vec![1.0f32, 2.0];
        let error = decode_into(&mut values, &[0u8; 6], WireDtype::F32).unwrap_err();
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
}
