//! # dflash-telemetry
//!
//! What every dflash binary shares to be observable: logs (text or JSON),
//! OpenTelemetry traces whose W3C context travels inside each queue item so
//! one sample can be followed from the target that made it to the drafter
//! that trained on it, and a Prometheus text endpoint.
//!
//! # Layout
//! - `init`: [`init`] installs the global `tracing` subscriber (an
//!   `EnvFilter`ed log layer plus, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set,
//!   an OTLP/gRPC span exporter) and returns the [`TelemetryGuard`] that
//!   flushes it, within [`SHUTDOWN_TIMEOUT`]; [`init_with_exporter`] does the
//!   same with any span exporter, for tests. [`LogFormat`] is the
//!   `--log-format` flag.
//! - `resource`: [`ServiceIdentity`] ([`Service`], instance id, version),
//!   the OpenTelemetry resource each process exports under, with
//!   `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` applied over it.
//! - `export`: [`SpanExportStats`] (spans exported, dropped, failed), kept by
//!   the [`CountingProcessor`] and [`CountingExporter`] around the SDK's
//!   batch export, logged once per change of state and added to `/metrics`.
//! - `propagation`: [`inject_current_context`] and [`set_parent_from`], the
//!   two calls that carry a trace through `Item.trace_context` and
//!   `Delivery.trace_context`; [`add_link_from`] for one link.
//! - `sample_traces`: [`SampleTraces`], for a span over many samples (a
//!   drafter's step): parent, one link per distinct producer span, and the
//!   (target, seq) key of every sample in `dflash.sample_keys`.
//! - `exposition`: [`Exposition`], a writer of the Prometheus text format
//!   (0.0.4) for metrics computed at scrape time from a snapshot.
//! - `registry`: [`Registry`] with [`Counter`]s, [`Gauge`]s and the
//!   servers' [`DeviceMemoryGauges`] that code
//!   updates as it goes, rendered through `exposition`.
//! - `http`: [`serve_metrics`], a minimal HTTP/1.1 server for `GET /metrics`,
//!   [`bind_metrics_listener`] (a `--metrics-listen` flag's listener) and
//!   [`MetricsEndpoint`], which a run starts and stops around itself
//!   ([`MetricsEndpoint::during`]).
//!
//! Must not depend on any other dflash crate: the broker and the services
//! depend on this one.

mod export;
mod exposition;
mod http;
mod init;
mod propagation;
mod registry;
mod resource;
mod sample_traces;

pub use export::{
    trace_export_stats, CountingExporter, CountingProcessor, SpanExportCounts, SpanExportStats,
};
pub use exposition::{Exposition, Family, MetricKind};
pub use http::{
    bind_metrics_listener, serve_metrics, MetricsEndpoint, METRICS_CONTENT_TYPE,
    METRICS_STOP_TIMEOUT,
};
pub use init::{
    init, init_with_exporter, LogFormat, TelemetryError, TelemetryGuard, SHUTDOWN_TIMEOUT,
    TRACE_FILTER_ENV,
};
pub use propagation::{
    add_link_from, inject_context_of, inject_current_context, set_parent_from, trace_id_of,
};
pub use registry::{Counter, DeviceMemoryGauges, Gauge, Registry, RegistryError};
pub use resource::{process_instance_id, Service, ServiceIdentity};
pub use sample_traces::{sample_key, SampleTraces, LINK_SAMPLES_ATTRIBUTE, SAMPLE_KEYS_ATTRIBUTE};

/// The `tracing` target of spans that exist for traces rather than logs
/// (`enqueue`, `deliver`, a batch, a step). They are declared at DEBUG level
/// with this target, so the default log filter (`info`) skips them and,
/// with no exporter installed, their callsites are disabled and cost almost
/// nothing; the exporter's own filter enables them.
pub const TRACE_TARGET: &str = "dflash::trace";

/// The SDK's span exporter trait, for [`init_with_exporter`].
pub use opentelemetry_sdk::trace::SpanExporter;

/// In-memory span export for tests (feature `testing`).
#[cfg(feature = "testing")]
pub mod testing {
    pub use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};
}
