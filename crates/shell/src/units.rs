//! Flag values with units. Every duration flag of every binary takes
//! `500ms`/`5s`/`2m`/`1h` (a bare number is seconds) and every size flag
//! `64MiB`/`2GiB` (a bare number is bytes), through these two parsers.

use std::time::Duration;

/// Parses `250ms`, `30s`, `2m`, `1h` or a plain number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit_seconds) = if let Some(number) = text.strip_suffix("ms") {
        (number, 0.001)
    } else if let Some(number) = text.strip_suffix('s') {
        (number, 1.0)
    } else if let Some(number) = text.strip_suffix('m') {
        (number, 60.0)
    } else if let Some(number) = text.strip_suffix('h') {
        (number, 3600.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("invalid duration {text:?}: expected e.g. 250ms, 30s, 2m, 1h"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!(
            "invalid duration {text:?}: must be a finite, non-negative number"
        ));
    }
    Ok(Duration::from_secs_f64(value * unit_seconds))
}

/// Parses a byte size: `1048576`, `64KiB`, `16MiB`, `2GiB` (also KB/MB/GB as powers of 1000).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let units: [(&str, u64); 7] = [
        ("KiB", 1 << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("KB", 1_000),
        ("MB", 1_000_000),
        ("GB", 1_000_000_000),
        ("B", 1),
    ];
    let (number, multiplier) = units
        .iter()
        .find_map(|(suffix, multiplier)| {
            text.strip_suffix(suffix)
                .map(|number| (number, *multiplier))
        })
        .unwrap_or((text, 1));
    let value: u64 = number
        .trim()
        .parse()
        .map_err(|_| format!("invalid byte size {text:?}: expected e.g. 1048576, 16MiB, 2GiB"))?;
    value
        .checked_mul(multiplier)
        .ok_or_else(|| format!("byte size {text:?} overflows 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_every_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration(" 1.5 "), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("soon").unwrap_err().contains("\"soon\""));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("infs").is_err());
    }

    #[test]
    fn sizes_take_binary_and_decimal_units() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_bytes("16MiB"), Ok(16 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("3MB"), Ok(3_000_000));
        assert_eq!(parse_bytes("10B"), Ok(10));
        assert!(parse_bytes("lots").unwrap_err().contains("\"lots\""));
        assert!(parse_bytes("99999999999999GiB")
            .unwrap_err()
            .contains("overflows"));
    }
}
