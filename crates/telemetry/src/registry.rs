//! Counters and gauges that code updates as it works (a step's time, the
//! last loss), rendered in the text format on scrape.
//!
//! Updates are single atomic operations, so hot paths (a training step, a
//! batch) never wait on a scrape; the registry's lock is taken only when a
//! metric is registered and when it is rendered.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::exposition::{is_valid_name, Exposition, MetricKind};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("invalid metric name {0:?}: expected [a-zA-Z_:][a-zA-Z0-9_:]*")]
    InvalidName(String),
    #[error("metric {metric:?}: invalid label name {label:?}: expected [a-zA-Z_][a-zA-Z0-9_]*")]
    InvalidLabelName { metric: String, label: String },
    #[error("metric {metric:?} with labels {labels:?} is already registered")]
    Duplicate {
        metric: String,
        labels: Vec<(String, String)>,
    },
    #[error("metric {metric:?} is already registered as a {registered:?}, not a {requested:?}")]
    KindMismatch {
        metric: String,
        registered: MetricKind,
        requested: MetricKind,
    },
}

/// A monotonically increasing count. Cheap to clone; clones share the value.
#[derive(Debug, Clone, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    pub fn increment(&self) {
        self.add(1);
    }

    pub fn add(&self, amount: u64) {
        self.0.fetch_add(amount, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down. Cheap to clone; clones share the value.
#[derive(Debug, Clone, Default)]
pub struct Gauge(Arc<AtomicU64>);

impl Gauge {
    pub fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }

    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

enum Instrument {
    Counter(Counter),
    Gauge(Gauge),
}

struct Series {
    labels: Vec<(String, String)>,
    instrument: Instrument,
}

struct RegisteredFamily {
    name: String,
    help: String,
    kind: MetricKind,
    series: Vec<Series>,
}

/// The GPU memory gauges a device-owning service reports after each unit
/// of work (a drafter's step, a target's batch): what is in use and its
/// peak over the process (NVML; zero on the CPU). Registered alike by both
/// servers: `{prefix}device_memory_used_bytes` and
/// `{prefix}device_memory_peak_bytes`.
#[derive(Clone, Debug)]
pub struct DeviceMemoryGauges {
    pub used_bytes: Gauge,
    pub peak_bytes: Gauge,
}

impl DeviceMemoryGauges {
    /// `after_each` names the unit of work in the help text ("step",
    /// "batch").
    pub fn register(
        registry: &Registry,
        prefix: &str,
        after_each: &str,
        labels: &[(&str, &str)],
    ) -> Result<DeviceMemoryGauges, RegistryError> {
        Ok(DeviceMemoryGauges {
            used_bytes: registry.gauge_with_labels(
                &format!("{prefix}device_memory_used_bytes"),
                &format!("GPU memory in use after the last {after_each} (NVML; 0 on the CPU)."),
                labels,
            )?,
            peak_bytes: registry.gauge_with_labels(
                &format!("{prefix}device_memory_peak_bytes"),
                &format!(
                    "Largest GPU memory in use after any {after_each} of this process (NVML; 0 on the CPU)."
                ),
                labels,
            )?,
        })
    }

    /// Sets both from one reading.
    pub fn set(&self, used_bytes: u64, peak_bytes: u64) {
        self.used_bytes.set(used_bytes as f64);
        self.peak_bytes.set(peak_bytes as f64);
    }
}

/// The metrics of one process, in registration order.
#[derive(Default)]
pub struct Registry {
    families: Mutex<Vec<RegisteredFamily>>,
}

impl Registry {
    pub fn new() -> Self {
        Registry::default()
    }

    pub fn counter(&self, name: &str, help: &str) -> Result<Counter, RegistryError> {
        self.counter_with_labels(name, help, &[])
    }

    /// One series of a labelled counter family (e.g. `reason="malformed"`).
    pub fn counter_with_labels(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Counter, RegistryError> {
        let counter = Counter::default();
        self.register(
            name,
            help,
            MetricKind::Counter,
            labels,
            Instrument::Counter(counter.clone()),
        )?;
        Ok(counter)
    }

    pub fn gauge(&self, name: &str, help: &str) -> Result<Gauge, RegistryError> {
        self.gauge_with_labels(name, help, &[])
    }

    /// One series of a labelled gauge family (e.g. `device="cuda:0"`).
    pub fn gauge_with_labels(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Gauge, RegistryError> {
        let gauge = Gauge::default();
        self.register(
            name,
            help,
            MetricKind::Gauge,
            labels,
            Instrument::Gauge(gauge.clone()),
        )?;
        Ok(gauge)
    }

    fn register(
        &self,
        name: &str,
        help: &str,
        kind: MetricKind,
        labels: &[(&str, &str)],
        instrument: Instrument,
    ) -> Result<(), RegistryError> {
        if !is_valid_name(name, true) {
            return Err(RegistryError::InvalidName(name.to_string()));
        }
        if let Some((label, _)) = labels
            .iter()
            .find(|(label, _)| !is_valid_name(label, false))
        {
            return Err(RegistryError::InvalidLabelName {
                metric: name.to_string(),
                label: label.to_string(),
            });
        }
        let labels: Vec<(String, String)> = labels
            .iter()
            .map(|(label, value)| (label.to_string(), value.to_string()))
            .collect();
        let mut families = self.lock();
        let family = match families.iter_mut().position(|family| family.name == name) {
            Some(index) => &mut families[index],
            None => {
                families.push(RegisteredFamily {
                    name: name.to_string(),
                    help: help.to_string(),
                    kind,
                    series: Vec::new(),
                });
                let last = families.len() - 1;
                &mut families[last]
            }
        };
        if family.kind != kind {
            return Err(RegistryError::KindMismatch {
                metric: name.to_string(),
                registered: family.kind,
                requested: kind,
            });
        }
        if family.series.iter().any(|series| series.labels == labels) {
            return Err(RegistryError::Duplicate {
                metric: name.to_string(),
                labels,
            });
        }
        family.series.push(Series { labels, instrument });
        Ok(())
    }

    /// Writes every registered family into `exposition` (so a binary can put
    /// snapshot-derived metrics and registered ones in one scrape).
    pub fn write_to(&self, exposition: &mut Exposition) {
        for family in self.lock().iter() {
            let mut writer = exposition.family(&family.name, &family.help, family.kind);
            for series in &family.series {
                let labels: Vec<(&str, &str)> = series
                    .labels
                    .iter()
                    .map(|(label, value)| (label.as_str(), value.as_str()))
                    .collect();
                let value = match &series.instrument {
                    Instrument::Counter(counter) => counter.get() as f64,
                    Instrument::Gauge(gauge) => gauge.get(),
                };
                writer.sample(&labels, value);
            }
        }
    }

    /// The text exposition of every registered metric.
    pub fn render(&self) -> String {
        let mut exposition = Exposition::new();
        self.write_to(&mut exposition);
        exposition.finish()
    }

    /// A poisoned lock only means a registration panicked half-way; the list
    /// itself is still consistent, so keep serving it.
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RegisteredFamily>> {
        self.families
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_metrics_render_with_their_current_values() {
        let registry = Registry::new();
        let steps = registry
            .counter("dflash_drafter_steps_total", "Optimizer steps.")
            .unwrap();
        let loss = registry
            .gauge_with_labels("dflash_drafter_loss", "Last loss.", &[("device", "cpu")])
            .unwrap();
        steps.increment();
        steps.add(2);
        loss.set(0.5);
        assert_eq!(
            registry.render(),
            "# HELP dflash_drafter_steps_total Optimizer steps.\n\
             # TYPE dflash_drafter_steps_total counter\n\
             dflash_drafter_steps_total 3\n\
             # HELP dflash_drafter_loss Last loss.\n\
             # TYPE dflash_drafter_loss gauge\n\
             dflash_drafter_loss{device=\"cpu\"} 0.5\n"
        );
    }

    #[test]
    fn series_of_one_family_share_its_help_and_type() {
        let registry = Registry::new();
        let malformed = registry
            .counter_with_labels("rejected_total", "Rejected.", &[("reason", "malformed")])
            .unwrap();
        registry
            .counter_with_labels("rejected_total", "Rejected.", &[("reason", "too_large")])
            .unwrap();
        malformed.increment();
        let text = registry.render();
        assert_eq!(text.matches("# TYPE rejected_total counter").count(), 1);
        assert!(text.contains("rejected_total{reason=\"malformed\"} 1\n"));
        assert!(text.contains("rejected_total{reason=\"too_large\"} 0\n"));
    }

    #[test]
    fn bad_registrations_are_errors() {
        let registry = Registry::new();
        registry.gauge("x", "x").unwrap();
        assert_eq!(
            registry.gauge("x", "x").unwrap_err(),
            RegistryError::Duplicate {
                metric: "x".to_string(),
                labels: Vec::new()
            }
        );
        assert!(matches!(
            registry.counter("x", "x"),
            Err(RegistryError::KindMismatch { .. })
        ));
        assert!(matches!(
            registry.gauge("bad name", "x"),
            Err(RegistryError::InvalidName(_))
        ));
        assert!(matches!(
            registry.gauge_with_labels("y", "y", &[("le:x", "1")]),
            Err(RegistryError::InvalidLabelName { .. })
        ));
    }
}
