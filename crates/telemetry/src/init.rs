//! Installing the process-wide `tracing` subscriber: a log layer and, when
//! asked for, an OpenTelemetry layer that exports spans.
//!
//! The two layers have separate filters. Logs follow `RUST_LOG` (default
//! `info`); spans for export follow `DFLASH_TRACE_FILTER` (default: `info`
//! plus the DEBUG-level spans of [`crate::TRACE_TARGET`], minus the gRPC and
//! OpenTelemetry crates so exporting a span never makes more spans). With no
//! exporter the trace-only spans are disabled for every layer, which keeps
//! per-item spans in the broker almost free.

use std::io::IsTerminal;
use std::time::Duration;

use clap::ValueEnum;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanExporter};
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::ParseError;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// Environment variable with the `EnvFilter` directives for exported spans.
pub const TRACE_FILTER_ENV: &str = "DFLASH_TRACE_FILTER";

/// Exported spans by default: everything at INFO, the trace-only spans at
/// DEBUG, and nothing from the crates that carry the export itself.
const DEFAULT_TRACE_FILTER: &str = "info,dflash::trace=debug,h2=off,hyper=off,hyper_util=off,\
tonic=off,tower=off,opentelemetry=off,opentelemetry_sdk=off,opentelemetry_otlp=off";

/// How long dropping the guard may wait for the last spans to leave.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// How log lines are written (to stderr): `--log-format text|json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid {variable} filter {value:?}: {source}")]
    Filter {
        variable: &'static str,
        value: String,
        source: ParseError,
    },
    #[error(
        "cannot build the OTLP span exporter (OTEL_EXPORTER_OTLP_ENDPOINT {endpoint:?}): {source}"
    )]
    Exporter {
        endpoint: String,
        source: opentelemetry_otlp::ExporterBuildError,
    },
    #[error("span export over OTLP/gRPC needs a tokio runtime: call init inside one (e.g. in #[tokio::main])")]
    NoRuntime,
    #[error("a global tracing subscriber is already installed: {0}")]
    AlreadyInstalled(#[from] tracing_subscriber::util::TryInitError),
}

/// Keeps span export alive; dropping it flushes the spans still buffered
/// and shuts the exporter down (bounded in time), so the last spans of a
/// process that exits are not lost. Hold it in `main` until the end.
#[must_use = "dropping the guard stops span export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether spans are being exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans buffered so far now (e.g. before a long idle wait).
    pub fn flush(&self) {
        if let Some(provider) = &self.provider {
            if let Err(error) = provider.force_flush() {
                tracing::warn!(%error, "span export flush failed");
            }
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(error) = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
                tracing::warn!(%error, "span exporter did not shut down cleanly");
            }
        }
    }
}

/// Installs logging and, when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, span export over OTLP/gRPC
/// with `service.name` = `service_name`. Call once, early in `main`, inside
/// the tokio runtime (the gRPC exporter runs its connection on it).
pub fn init(service_name: &str, log_format: LogFormat) -> Result<TelemetryGuard, TelemetryError> {
    let provider = if otlp_configured() {
        // The gRPC channel spawns its connection task on the current
        // runtime; without one it would panic.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(TelemetryError::NoRuntime);
        }
        let endpoint = std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT"))
            .unwrap_or_default();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|source| TelemetryError::Exporter { endpoint, source })?;
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource(service_name))
                .build(),
        )
    } else {
        None
    };
    let subscriber = build_subscriber(
        log_filter()?,
        trace_filter()?,
        log_format,
        provider
            .as_ref()
            .map(|provider| provider.tracer(service_name.to_string())),
        false,
    );
    let guard = TelemetryGuard { provider };
    subscriber.try_init()?;
    tracing::debug!(exporting = guard.exporting(), "telemetry installed");
    Ok(guard)
}

/// Like [`init`], but exports every span to `exporter` the moment it ends
/// (no batching, so a test can poll for it) and writes logs through the test
/// harness's capture. For tests, with e.g. the SDK's `InMemorySpanExporter`
/// (feature `testing`). Global: once per test binary.
pub fn init_with_exporter<E: SpanExporter + 'static>(
    service_name: &str,
    log_format: LogFormat,
    exporter: E,
) -> Result<TelemetryGuard, TelemetryError> {
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter)
        .with_resource(resource(service_name))
        .build();
    let subscriber = build_subscriber(
        log_filter()?,
        trace_filter()?,
        log_format,
        Some(provider.tracer(service_name.to_string())),
        true,
    );
    let guard = TelemetryGuard {
        provider: Some(provider),
    };
    subscriber.try_init()?;
    Ok(guard)
}

/// The subscriber: a filtered log layer and an optional, separately
/// filtered OpenTelemetry layer.
pub(crate) fn build_subscriber(
    log_filter: EnvFilter,
    trace_filter: EnvFilter,
    log_format: LogFormat,
    tracer: Option<opentelemetry_sdk::trace::Tracer>,
    test_writer: bool,
) -> impl tracing::Subscriber + Send + Sync + 'static {
    // Colours only on a terminal: escape codes in a log file or a
    // collector's input are noise.
    let ansi = !test_writer && std::io::stderr().is_terminal();
    let log_layer = match (log_format, test_writer) {
        (LogFormat::Text, false) => tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .boxed(),
        (LogFormat::Json, false) => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
        (LogFormat::Text, true) => tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_test_writer()
            .boxed(),
        (LogFormat::Json, true) => tracing_subscriber::fmt::layer()
            .json()
            .with_test_writer()
            .boxed(),
    };
    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> =
        vec![log_layer.with_filter(log_filter).boxed()];
    if let Some(tracer) = tracer {
        layers.push(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(trace_filter)
                .boxed(),
        );
    }
    tracing_subscriber::registry().with(layers)
}

fn resource(service_name: &str) -> Resource {
    Resource::builder()
        .with_service_name(service_name.to_string())
        .build()
}

/// Span export is on when an OTLP endpoint is configured and the SDK is not
/// disabled by `OTEL_SDK_DISABLED=true`.
fn otlp_configured() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|value| !value.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED")
        .is_ok_and(|value| value.trim().eq_ignore_ascii_case("true"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

fn log_filter() -> Result<EnvFilter, TelemetryError> {
    filter_from_env("RUST_LOG", "info")
}

fn trace_filter() -> Result<EnvFilter, TelemetryError> {
    filter_from_env(TRACE_FILTER_ENV, DEFAULT_TRACE_FILTER)
}

/// The variable's directives, or `default` when it is unset or empty. An
/// invalid value is an error rather than a silent fallback, so a typo in
/// `RUST_LOG` does not hide the logs someone asked for.
fn filter_from_env(variable: &'static str, default: &str) -> Result<EnvFilter, TelemetryError> {
    let value = std::env::var(variable).unwrap_or_default();
    let directives = if value.trim().is_empty() {
        default
    } else {
        value.as_str()
    };
    EnvFilter::builder()
        .parse(directives)
        .map_err(|source| TelemetryError::Filter {
            variable,
            value: directives.to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_filters_parse() {
        assert!(EnvFilter::builder().parse(DEFAULT_TRACE_FILTER).is_ok());
        assert!(EnvFilter::builder().parse("info").is_ok());
    }

    #[test]
    fn log_format_parses_from_flag_values() {
        assert_eq!(LogFormat::from_str("json", true), Ok(LogFormat::Json));
        assert_eq!(LogFormat::from_str("text", true), Ok(LogFormat::Text));
        assert!(LogFormat::from_str("xml", true).is_err());
    }
}
