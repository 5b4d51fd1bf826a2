//! The drafter-server's Prometheus metrics: instruments the async side
//! updates as the training thread reports steps and rejections, served at
//! `/metrics` when `--metrics-listen` is set.
//!
//! They are [`dflash_telemetry`] registry instruments, so every update is
//! one relaxed atomic operation and never waits on a scrape. Every series
//! carries `drafter_id` and `device` labels, so one dashboard can sum or
//! split the drafters of a run.

use dflash_telemetry::{Counter, DeviceMemoryGauges, Gauge, Registry, RegistryError};

/// Every metric name starts with this.
pub const PREFIX: &str = "dflash_drafter_";

/// The instruments of one run. Cheap to clone: clones share the values.
#[derive(Debug, Clone)]
pub struct DrafterMetrics {
    /// Optimizer steps taken by this process.
    pub steps: Counter,
    /// Samples used by those steps (each acked after its step).
    pub samples_trained: Counter,
    /// Samples this model cannot use, nacked to the dead letters.
    pub rejected_items: Counter,
    /// Optimizer steps skipped: loss or gradient not finite, or a spike.
    pub skipped_steps: Counter,
    /// Compute time of the last step: its micro-batches and the update.
    pub step_seconds: Gauge,
    /// Loss of the last step.
    pub loss: Gauge,
    /// Draft accuracy of the last step.
    pub accuracy: Gauge,
    /// Trained tokens per second over the last stats interval.
    pub tokens_per_second: Gauge,
    /// Fraction of the last stats interval the device was busy.
    pub busy_fraction: Gauge,
    /// The GPU's used memory after the last step, and its peak (NVML: what
    /// libtorch's caching allocator reserved plus the CUDA context); zero on
    /// the CPU.
    pub device_memory: DeviceMemoryGauges,
}

impl DrafterMetrics {
    /// Registers every instrument in `registry`, labelled with the drafter
    /// id and the device (`cpu`, `cuda:0`, `synthetic`).
    pub fn register(
        registry: &Registry,
        drafter_id: &str,
        device: &str,
    ) -> Result<DrafterMetrics, RegistryError> {
        let labels = [("drafter_id", drafter_id), ("device", device)];
        let counter = |suffix: &str, help: &str| {
            registry.counter_with_labels(&format!("{PREFIX}{suffix}"), help, &labels)
        };
        let gauge = |suffix: &str, help: &str| {
            registry.gauge_with_labels(&format!("{PREFIX}{suffix}"), help, &labels)
        };
        Ok(DrafterMetrics {
            steps: counter("steps_total", "Optimizer steps taken by this process.")?,
            samples_trained: counter(
                "samples_trained_total",
                "Samples used by this process's optimizer steps (acked after the step).",
            )?,
            rejected_items: counter(
                "rejected_items_total",
                "Samples this drafter's model cannot use, nacked to the dead letters.",
            )?,
            skipped_steps: counter(
                "skipped_steps_total",
                "Optimizer steps skipped because their loss or gradient norm was not finite or spiked (nothing of them reached the weights).",
            )?,
            step_seconds: gauge(
                "step_seconds",
                "Compute seconds of the last optimizer step (its micro-batches and the update).",
            )?,
            loss: gauge("loss", "Training loss of the last optimizer step.")?,
            accuracy: gauge(
                "accuracy",
                "Draft token accuracy of the last optimizer step.",
            )?,
            tokens_per_second: gauge(
                "tokens_per_second",
                "Trained tokens per second over the last stats interval.",
            )?,
            busy_fraction: gauge(
                "busy_fraction",
                "Fraction of the last stats interval that the device was computing.",
            )?,
            device_memory: DeviceMemoryGauges::register(registry, PREFIX, "step", &labels)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_labelled_and_updates_render() {
        let registry = Registry::new();
        let metrics = DrafterMetrics::register(&registry, "drafter-2", "cuda:1").unwrap();
        metrics.samples_trained.add(5);
        metrics.loss.set(1.5);
        let text = registry.render();
        assert!(
            text.contains(
                "dflash_drafter_samples_trained_total{drafter_id=\"drafter-2\",device=\"cuda:1\"} 5\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("dflash_drafter_loss{drafter_id=\"drafter-2\",device=\"cuda:1\"} 1.5\n"),
            "{text}"
        );
        assert_eq!(text.matches("# TYPE ").count(), 11, "{text}");
        assert_eq!(text.matches("drafter_id=\"drafter-2\"").count(), 11);
        // One run registers once: a second registration is a bug, not a reset.
        assert!(DrafterMetrics::register(&registry, "drafter-2", "cuda:1").is_err());
    }
}
