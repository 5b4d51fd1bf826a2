//! The Prometheus text exposition format, version 0.0.4.
//!
//! Metrics here are mostly computed at scrape time from a snapshot (the
//! broker's queue state), so the writer takes values rather than owning
//! instruments. Names come from code, label values from peers (target and
//! drafter ids), so names are sanitized and label values escaped: a scrape
//! must never break because a drafter chose an odd id.

use std::fmt::Write as _;

/// The metric types this writer emits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up (resets on restart); name it `..._total`.
    Counter,
    /// Goes up and down.
    Gauge,
}

impl MetricKind {
    fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
        }
    }
}

/// A text exposition being written: families of samples, each family
/// introduced by its `# HELP` and `# TYPE` lines.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
}

/// The samples of one family, written with [`Family::sample`].
pub struct Family<'a> {
    text: &'a mut String,
    name: String,
}

impl Exposition {
    pub fn new() -> Self {
        Exposition::default()
    }

    /// Starts a family: writes its HELP and TYPE lines. Its samples follow
    /// through the returned writer; a family with no samples is valid.
    pub fn family(&mut self, name: &str, help: &str, kind: MetricKind) -> Family<'_> {
        let name = sanitize_name(name, true);
        let _ = writeln!(self.text, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.text, "# TYPE {name} {}", kind.as_str());
        Family {
            text: &mut self.text,
            name,
        }
    }

    /// A counter family with one unlabelled sample.
    pub fn counter(&mut self, name: &str, help: &str, value: f64) {
        self.family(name, help, MetricKind::Counter)
            .sample(&[], value);
    }

    /// A gauge family with one unlabelled sample.
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.family(name, help, MetricKind::Gauge)
            .sample(&[], value);
    }

    /// The exposition text, ending with a newline.
    pub fn finish(self) -> String {
        self.text
    }
}

impl Family<'_> {
    /// One sample: `name{label="value",...} value`.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.text.push_str(&self.name);
        if !labels.is_empty() {
            self.text.push('{');
            for (index, (label, label_value)) in labels.iter().enumerate() {
                if index > 0 {
                    self.text.push(',');
                }
                self.text.push_str(&sanitize_name(label, false));
                self.text.push_str("=\"");
                escape_label_value_into(self.text, label_value);
                self.text.push('"');
            }
            self.text.push('}');
        }
        self.text.push(' ');
        self.text.push_str(&format_value(value));
        self.text.push('\n');
        self
    }
}

/// A valid metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) or label name (the same
/// without `:`): other characters become `_`, a leading digit gets a `_`.
pub(crate) fn sanitize_name(name: &str, allow_colon: bool) -> String {
    let mut sanitized = String::with_capacity(name.len() + 1);
    for (index, character) in name.chars().enumerate() {
        let valid = character.is_ascii_alphabetic()
            || character == '_'
            || (allow_colon && character == ':')
            || (index > 0 && character.is_ascii_digit());
        if index == 0 && character.is_ascii_digit() {
            sanitized.push('_');
            sanitized.push(character);
        } else {
            sanitized.push(if valid { character } else { '_' });
        }
    }
    if sanitized.is_empty() {
        sanitized.push('_');
    }
    sanitized
}

/// Whether `name` is already a valid metric (or label) name.
pub(crate) fn is_valid_name(name: &str, allow_colon: bool) -> bool {
    !name.is_empty() && sanitize_name(name, allow_colon) == name
}

/// HELP text escapes backslash and newline.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Label values escape backslash, double quote and newline.
fn escape_label_value_into(out: &mut String, value: &str) {
    for character in value.chars() {
        match character {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            other => out.push(other),
        }
    }
}

/// Go's float syntax as Prometheus parses it: `NaN`, `+Inf`, `-Inf`, and
/// plain decimals otherwise (integers without a fraction).
pub(crate) fn format_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_string()
    } else if value == f64::INFINITY {
        "+Inf".to_string()
    } else if value == f64::NEG_INFINITY {
        "-Inf".to_string()
    } else {
        format!("{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_have_help_and_type_lines_then_samples() {
        let mut exposition = Exposition::new();
        exposition.gauge("dflash_queued_items", "Items waiting.", 3.0);
        exposition
            .family(
                "dflash_rejected_items_total",
                "Rejected items by reason.",
                MetricKind::Counter,
            )
            .sample(&[("reason", "malformed")], 2.0)
            .sample(&[("reason", "too_large")], 0.0);
        assert_eq!(
            exposition.finish(),
            "# HELP dflash_queued_items Items waiting.\n\
             # TYPE dflash_queued_items gauge\n\
             dflash_queued_items 3\n\
             # HELP dflash_rejected_items_total Rejected items by reason.\n\
             # TYPE dflash_rejected_items_total counter\n\
             dflash_rejected_items_total{reason=\"malformed\"} 2\n\
             dflash_rejected_items_total{reason=\"too_large\"} 0\n"
        );
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let mut exposition = Exposition::new();
        exposition
            .family("m", "line one\nback\\slash", MetricKind::Gauge)
            .sample(&[("drafter_id", "a\"b\\c\nd"), ("device", "cuda:0")], 1.5);
        let text = exposition.finish();
        assert!(
            text.contains("# HELP m line one\\nback\\\\slash\n"),
            "{text}"
        );
        assert!(
            text.contains("m{drafter_id=\"a\\\"b\\\\c\\nd\",device=\"cuda:0\"} 1.5\n"),
            "{text}"
        );
        // Every line is a comment or a sample: the escaping kept one per line.
        assert_eq!(text.lines().count(), 3);
    }

    #[test]
    fn names_are_sanitized() {
        assert_eq!(sanitize_name("dflash_ok:sub", true), "dflash_ok:sub");
        assert_eq!(sanitize_name("bad-name.x", true), "bad_name_x");
        assert_eq!(sanitize_name("9lives", true), "_9lives");
        assert_eq!(sanitize_name("a:b", false), "a_b");
        assert_eq!(sanitize_name("", true), "_");
        assert!(is_valid_name("dflash_x_total", true));
        assert!(!is_valid_name("x y", true));
        let mut exposition = Exposition::new();
        exposition
            .family("weird name", "h", MetricKind::Gauge)
            .sample(&[("bad label", "v")], 1.0);
        assert!(exposition
            .finish()
            .contains("weird_name{bad_label=\"v\"} 1\n"));
    }

    #[test]
    fn special_values_use_prometheus_spelling() {
        assert_eq!(format_value(f64::NAN), "NaN");
        assert_eq!(format_value(f64::INFINITY), "+Inf");
        assert_eq!(format_value(f64::NEG_INFINITY), "-Inf");
        assert_eq!(format_value(42.0), "42");
        assert_eq!(format_value(0.25), "0.25");
        assert_eq!(format_value(-1.0), "-1");
    }
}
