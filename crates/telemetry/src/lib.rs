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
//!   flushes it; [`init_with_exporter`] does the same with any span exporter,
//!   for tests. [`LogFormat`] is the `--log-format` flag.
//! - `propagation`: [`inject_current_context`] and [`set_parent_from`], the
//!   two calls that carry a trace through `Item.trace_context` and
//!   `Delivery.trace_context`; [`add_link_from`] for work over many samples.
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

mod exposition;
mod http;
mod init;
mod propagation;
mod registry;

pub use exposition::{Exposition, Family, MetricKind};
pub use http::{
    bind_metrics_listener, serve_metrics, MetricsEndpoint, METRICS_CONTENT_TYPE,
    METRICS_STOP_TIMEOUT,
};
pub use init::{
    init, init_with_exporter, LogFormat, TelemetryError, TelemetryGuard, TRACE_FILTER_ENV,
};
pub use propagation::{
    add_link_from, inject_context_of, inject_current_context, set_parent_from, trace_id_of,
};
pub use registry::{Counter, DeviceMemoryGauges, Gauge, Registry, RegistryError};

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
