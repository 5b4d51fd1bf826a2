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
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithTonicConfig as _;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanExporter,
};
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::ParseError;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::export::{
    install_process_stats, CountingExporter, CountingProcessor, SpanExportCounts, SpanExportStats,
};
use crate::resource::{resource_from_env, ServiceIdentity};

/// Environment variable with the `EnvFilter` directives for exported spans.
pub const TRACE_FILTER_ENV: &str = "DFLASH_TRACE_FILTER";

/// Exported spans by default: everything at INFO, the trace-only spans at
/// DEBUG, and nothing from the crates that carry the export itself.
const DEFAULT_TRACE_FILTER: &str = "info,dflash::trace=debug,h2=off,hyper=off,hyper_util=off,\
tonic=off,tower=off,opentelemetry=off,opentelemetry_sdk=off,opentelemetry_otlp=off";

/// Logs by default: INFO, without the OpenTelemetry crates' own lines
/// (one ERROR per failed batch, and more per retry): the export's state is
/// logged once per change by [`crate::export`] and counted in `/metrics`.
const DEFAULT_LOG_FILTER: &str =
    "info,opentelemetry=off,opentelemetry_sdk=off,opentelemetry-otlp=off,opentelemetry_otlp=off";

/// How long dropping the guard may wait for the last spans to leave: a
/// dead or hanging collector must not hold up a pod's exit (the SDK's
/// default is 5 s for the flush plus 5 s for the shutdown). With a working
/// collector the last batch of at most [`DEFAULT_MAX_QUEUED_SPANS`] spans
/// leaves in milliseconds.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(1);

/// How long [`TelemetryGuard::flush`] waits.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// Spans queued for export (or in flight) at most; more are dropped and
/// counted. The SDK's default, and `OTEL_BSP_MAX_QUEUE_SIZE` sets it.
const DEFAULT_MAX_QUEUED_SPANS: usize = 2048;

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
    /// The export's counts (OTLP export only).
    stats: Option<Arc<SpanExportStats>>,
}

impl TelemetryGuard {
    /// Whether spans are being exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// What became of the spans so far (OTLP export only).
    pub fn export_counts(&self) -> Option<SpanExportCounts> {
        self.stats.as_ref().map(|stats| stats.counts())
    }

    /// Sends the spans buffered so far now (e.g. before a long idle wait),
    /// waiting at most a second; skipped while export is failing. Not
    /// needed before exiting: dropping the guard flushes.
    pub fn flush(&self) {
        let Some(provider) = &self.provider else {
            return;
        };
        if self.stats.as_ref().is_some_and(|stats| stats.failing()) {
            return;
        }
        // The SDK's flush waits up to 5 s for a hanging collector and
        // cannot be told less: it runs on a thread of its own that is left
        // to end by itself (within those 5 s) when it takes too long.
        let provider = provider.clone();
        let (sender, receiver) = std::sync::mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("span-flush".to_string())
            .spawn(move || {
                let _ = sender.send(provider.force_flush());
            });
        let outcome = match spawned {
            Err(error) => Err(error.to_string()),
            Ok(_flusher) => match receiver.recv_timeout(FLUSH_TIMEOUT) {
                Ok(result) => result.map_err(|error| error.to_string()),
                Err(_) => Err(format!("no answer within {FLUSH_TIMEOUT:?}")),
            },
        };
        if let Err(error) = outcome {
            tracing::debug!(%error, "span export flush did not finish");
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Bounded: the counting processor writes off (as dropped) and
            // reports whatever could not leave in time.
            let started = std::time::Instant::now();
            let outcome = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT);
            // The process's last line: how long its exit waited on the
            // export, measured here (tests check it against the bound).
            let took_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            match outcome {
                Ok(()) => tracing::info!(took_ms, "span export stopped"),
                Err(error) => tracing::info!(took_ms, %error, "span export stopped"),
            }
        }
    }
}

/// Installs logging and, when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, span export over OTLP/gRPC
/// with the resource of `identity` (see [`crate::resource`]), its outcome
/// counted for `/metrics`. Call once, early in `main`, inside the tokio
/// runtime (the gRPC exporter runs its connection on it).
pub fn init(
    identity: &ServiceIdentity,
    log_format: LogFormat,
) -> Result<TelemetryGuard, TelemetryError> {
    let (provider, stats) = if otlp_configured() {
        // The gRPC channel spawns its connection task on the current
        // runtime; without one it would panic.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(TelemetryError::NoRuntime);
        }
        let endpoint = std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT"))
            .unwrap_or_default();
        // One retry rides out a blip; the SDK's three resend every batch
        // to a collector that is down, for nothing.
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_retry_policy(opentelemetry_otlp::RetryPolicy::recommended().with_max_retries(1))
            .build()
            .map_err(|source| TelemetryError::Exporter {
                endpoint: endpoint.clone(),
                source,
            })?;
        let stats = Arc::new(SpanExportStats::new(endpoint));
        let max_queued = max_queued_spans();
        let batches = BatchSpanProcessor::builder(CountingExporter::new(exporter, stats.clone()))
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(max_queued)
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(CountingProcessor::new(batches, stats.clone(), max_queued))
            .with_resource(resource_from_env(identity))
            .build();
        install_process_stats(stats.clone());
        (Some(provider), Some(stats))
    } else {
        (None, None)
    };
    let subscriber = build_subscriber(
        log_filter()?,
        trace_filter()?,
        log_format,
        provider
            .as_ref()
            .map(|provider| provider.tracer(identity.service.name())),
        false,
    );
    let guard = TelemetryGuard { provider, stats };
    subscriber.try_init()?;
    tracing::debug!(exporting = guard.exporting(), "telemetry installed");
    Ok(guard)
}

/// `OTEL_BSP_MAX_QUEUE_SIZE`, or the SDK's default.
fn max_queued_spans() -> usize {
    std::env::var("OTEL_BSP_MAX_QUEUE_SIZE")
        .ok()
        .and_then(|value| value.trim().parse().ok())
        .filter(|&size: &usize| size > 0)
        .unwrap_or(DEFAULT_MAX_QUEUED_SPANS)
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
        stats: None,
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
    filter_from_env("RUST_LOG", DEFAULT_LOG_FILTER)
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
        assert!(EnvFilter::builder().parse(DEFAULT_LOG_FILTER).is_ok());
    }

    #[test]
    fn log_format_parses_from_flag_values() {
        assert_eq!(LogFormat::from_str("json", true), Ok(LogFormat::Json));
        assert_eq!(LogFormat::from_str("text", true), Ok(LogFormat::Text));
        assert!(LogFormat::from_str("xml", true).is_err());
    }
}
