//! The target-server's Prometheus metrics: instruments the pipeline updates
//! as it works, served at `/metrics` when `--metrics-listen` is set.
//!
//! Unlike the broker, which renders a snapshot at scrape time, a target's
//! numbers are made on three threads (host copy, the async sender, the
//! stats timer), so they are [`dflash_telemetry`] registry instruments:
//! every update is one relaxed atomic operation and never waits on a scrape.
//! Every series carries `target_id` and `device` labels, so one dashboard
//! can sum or split the targets of a run.

use dflash_telemetry::{Counter, DeviceMemoryGauges, Gauge, Registry, RegistryError};

/// Every metric name starts with this.
pub const PREFIX: &str = "dflash_target_";

/// The instruments of one run. Cheap to clone: clones share the values, so
/// each thread keeps its own copy.
#[derive(Debug, Clone)]
pub struct TargetMetrics {
    /// Batches whose hidden states reached host memory.
    pub batches: Counter,
    /// Items handed to the Produce stream (answered or not).
    pub samples_sent: Counter,
    /// Real (non-padding) tokens of the items sent.
    pub tokens: Counter,
    /// Items the broker rejected; known when the Produce stream closes.
    pub rejected_items: Counter,
    /// Captures with a NaN or an infinity, never sent (`--on-non-finite`).
    pub non_finite_samples: Counter,
    /// Token rate over the last stats interval (over the run at the end).
    pub tokens_per_second: Gauge,
    /// Fraction of the time since the first forward the device was busy.
    pub busy_fraction: Gauge,
    /// Device time of the last batch: its forward and copy to host.
    pub batch_seconds: Gauge,
    /// The GPU's used memory after the last batch, and its peak (NVML: what
    /// libtorch's caching allocator reserved plus the CUDA context); zero on
    /// the CPU.
    pub device_memory: DeviceMemoryGauges,
}

impl TargetMetrics {
    /// Registers every instrument in `registry`, labelled with the target id
    /// and the device (`cpu`, `cuda:0`, `synthetic`).
    pub fn register(
        registry: &Registry,
        target_id: &str,
        device: &str,
    ) -> Result<TargetMetrics, RegistryError> {
        let labels = [("target_id", target_id), ("device", device)];
        let counter = |suffix: &str, help: &str| {
            registry.counter_with_labels(&format!("{PREFIX}{suffix}"), help, &labels)
        };
        let gauge = |suffix: &str, help: &str| {
            registry.gauge_with_labels(&format!("{PREFIX}{suffix}"), help, &labels)
        };
        Ok(TargetMetrics {
            batches: counter(
                "batches_total",
                "Forward batches whose hidden states reached host memory.",
            )?,
            samples_sent: counter(
                "samples_sent_total",
                "Items sent to the broker by this run.",
            )?,
            tokens: counter(
                "tokens_total",
                "Real (non-padding) tokens of the items sent to the broker.",
            )?,
            rejected_items: counter(
                "rejected_items_total",
                "Items the broker rejected (counted when the Produce stream closes).",
            )?,
            non_finite_samples: counter(
                "non_finite_samples_total",
                "Captured samples whose hidden states held a NaN or an infinity; never sent (--on-non-finite).",
            )?,
            tokens_per_second: gauge(
                "tokens_per_second",
                "Tokens computed per second over the last stats interval.",
            )?,
            busy_fraction: gauge(
                "busy_fraction",
                "Fraction of the time since the first forward that the device was busy.",
            )?,
            batch_seconds: gauge(
                "batch_seconds",
                "Device seconds of the last batch (forward and copy to host).",
            )?,
            device_memory: DeviceMemoryGauges::register(registry, PREFIX, "batch", &labels)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_labelled_and_updates_render() {
        let registry = Registry::new();
        let metrics = TargetMetrics::register(&registry, "target-3", "cuda:1").unwrap();
        metrics.samples_sent.add(7);
        metrics.batch_seconds.set(0.25);
        let text = registry.render();
        assert!(
            text.contains(
                "dflash_target_samples_sent_total{target_id=\"target-3\",device=\"cuda:1\"} 7\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "dflash_target_batch_seconds{target_id=\"target-3\",device=\"cuda:1\"} 0.25\n"
            ),
            "{text}"
        );
        assert_eq!(text.matches("# TYPE ").count(), 10, "{text}");
        assert_eq!(text.matches("target_id=\"target-3\"").count(), 10);
        // One run registers once: a second registration is a bug, not a reset.
        assert!(TargetMetrics::register(&registry, "target-3", "cuda:1").is_err());
    }
}
