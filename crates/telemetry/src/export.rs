//! What became of the spans a process ended: exported, dropped or failed,
//! counted for `/metrics`, with one log line when export starts failing
//! (and one when it recovers) instead of one per batch.
//!
//! Two thin wrappers around the SDK's batch export do the counting:
//! [`CountingProcessor`] admits a span into the batch processor only while
//! fewer than `max_pending` spans are waiting or being exported (so the
//! batch processor's own queue, as large, never drops one unseen) and counts
//! the rest as dropped; [`CountingExporter`] counts each batch's outcome.
//! Spans still pending when the bounded shutdown gives up are dropped too.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;

use crate::exposition::Exposition;

/// The counts of one process's span export.
#[derive(Debug, Default)]
pub struct SpanExportStats {
    /// Spans admitted and not yet through an export (queued or in flight).
    pending: AtomicU64,
    exported: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
    /// Whether the last export failed: a warning is logged on the change.
    failing: AtomicBool,
    /// Where spans go, for the warning.
    endpoint: String,
}

/// A snapshot of [`SpanExportStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpanExportCounts {
    /// Accepted by the collector.
    pub exported: u64,
    /// Never sent: the export queue was full, or they were still queued
    /// when the bounded shutdown ended.
    pub dropped: u64,
    /// Sent and refused, or not sent because the collector could not be
    /// reached (after the exporter's retry).
    pub failed: u64,
}

impl SpanExportStats {
    pub fn new(endpoint: impl Into<String>) -> Self {
        SpanExportStats {
            endpoint: endpoint.into(),
            ..SpanExportStats::default()
        }
    }

    pub fn counts(&self) -> SpanExportCounts {
        SpanExportCounts {
            exported: self.exported.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }

    /// Whether the last export failed.
    pub fn failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }

    /// Takes one pending slot when fewer than `max_pending` are taken.
    fn admit(&self, max_pending: u64) -> bool {
        self.pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |pending| {
                (pending < max_pending).then_some(pending + 1)
            })
            .is_ok()
    }

    fn release(&self, spans: u64) {
        // Saturating: a batch may end after shutdown already wrote the
        // pending spans off as dropped.
        let _ = self
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |pending| {
                Some(pending.saturating_sub(spans))
            });
    }

    fn record_export(&self, spans: u64, result: &OTelSdkResult) {
        self.release(spans);
        match result {
            Ok(()) => {
                self.exported.fetch_add(spans, Ordering::Relaxed);
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(
                        endpoint = %self.endpoint,
                        failed_spans = self.failed.load(Ordering::Relaxed),
                        "span export recovered"
                    );
                }
            }
            Err(error) => {
                self.failed.fetch_add(spans, Ordering::Relaxed);
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        endpoint = %self.endpoint,
                        %error,
                        "span export failing: the OTLP collector cannot be reached or refuses spans; \
                         they are counted in dflash_trace_spans_failed_total until it recovers"
                    );
                }
            }
        }
    }

    /// At shutdown: what is still pending will not leave any more.
    fn write_off_pending(&self) -> u64 {
        let lost = self.pending.swap(0, Ordering::AcqRel);
        self.dropped.fetch_add(lost, Ordering::Relaxed);
        lost
    }

    /// The export's metrics, in the text format.
    pub fn write_to(&self, exposition: &mut Exposition) {
        let counts = self.counts();
        exposition.counter(
            "dflash_trace_spans_exported_total",
            "Spans the OTLP collector accepted.",
            counts.exported as f64,
        );
        exposition.counter(
            "dflash_trace_spans_dropped_total",
            "Spans never sent: the export queue was full, or they were still queued when the bounded shutdown ended.",
            counts.dropped as f64,
        );
        exposition.counter(
            "dflash_trace_spans_failed_total",
            "Spans whose export failed (collector unreachable, timed out or refusing).",
            counts.failed as f64,
        );
        exposition.gauge(
            "dflash_trace_export_failing",
            "1 while the last span export failed, else 0.",
            if self.failing() { 1.0 } else { 0.0 },
        );
    }
}

/// The process's export counts, once [`crate::init`] installed an exporter:
/// `/metrics` ([`crate::serve_metrics`]) adds them to every scrape.
static PROCESS_STATS: OnceLock<Arc<SpanExportStats>> = OnceLock::new();

pub(crate) fn install_process_stats(stats: Arc<SpanExportStats>) {
    // Once per process, like the subscriber itself; a second init fails
    // there, so a second set here never matters.
    let _ = PROCESS_STATS.set(stats);
}

/// This process's span export counts as the broker's status carries them
/// (in the target's and drafter's stats, and the broker's own snapshot):
/// `None` when it exports no spans.
pub fn trace_export_stats() -> Option<dflash_proto::v1::TraceExportStats> {
    PROCESS_STATS.get().map(|stats| {
        let counts = stats.counts();
        dflash_proto::v1::TraceExportStats {
            exported_spans: counts.exported,
            dropped_spans: counts.dropped,
            failed_spans: counts.failed,
            failing: stats.failing(),
        }
    })
}

/// The text of the export metrics, empty when nothing is exported.
pub(crate) fn process_export_metrics() -> String {
    match PROCESS_STATS.get() {
        None => String::new(),
        Some(stats) => {
            let mut exposition = Exposition::new();
            stats.write_to(&mut exposition);
            exposition.finish()
        }
    }
}

/// A span exporter that counts each batch's outcome.
#[derive(Debug)]
pub struct CountingExporter<E> {
    inner: E,
    stats: Arc<SpanExportStats>,
}

impl<E> CountingExporter<E> {
    pub fn new(inner: E, stats: Arc<SpanExportStats>) -> Self {
        CountingExporter { inner, stats }
    }
}

impl<E: SpanExporter> SpanExporter for CountingExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.inner.export(batch).await;
        self.stats.record_export(spans, &result);
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// A span processor in front of a batch processor: admits at most
/// `max_pending` spans not yet through an export and counts the others as
/// dropped. The batch processor's queue must hold `max_pending` spans.
#[derive(Debug)]
pub struct CountingProcessor<P> {
    inner: P,
    stats: Arc<SpanExportStats>,
    max_pending: u64,
}

impl<P> CountingProcessor<P> {
    pub fn new(inner: P, stats: Arc<SpanExportStats>, max_pending: usize) -> Self {
        CountingProcessor {
            inner,
            stats,
            max_pending: max_pending as u64,
        }
    }
}

impl<P: SpanProcessor> SpanProcessor for CountingProcessor<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.stats.admit(self.max_pending) {
            self.inner.on_end(span);
        } else {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let result = self.inner.shutdown_with_timeout(timeout);
        let lost = self.stats.write_off_pending();
        let counts = self.stats.counts();
        if lost > 0 || counts.dropped > 0 || counts.failed > 0 {
            tracing::warn!(
                endpoint = %self.stats.endpoint,
                exported = counts.exported,
                dropped = counts.dropped,
                failed = counts.failed,
                still_queued_at_exit = lost,
                "spans were lost"
            );
        }
        result
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_sdk::error::OTelSdkError;
    use opentelemetry_sdk::trace::InMemorySpanExporter;
    use std::sync::Mutex;

    /// A processor that keeps what it is given, as a batch processor's
    /// queue would, until `export_all`.
    #[derive(Debug, Default)]
    struct Holding(Mutex<Vec<SpanData>>);

    impl SpanProcessor for Holding {
        fn on_start(&self, _span: &mut Span, _cx: &Context) {}
        fn on_end(&self, span: SpanData) {
            self.0.lock().unwrap().push(span);
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    #[derive(Debug)]
    struct Failing;

    impl SpanExporter for Failing {
        async fn export(&self, _batch: Vec<SpanData>) -> OTelSdkResult {
            Err(OTelSdkError::InternalFailure("connection refused".into()))
        }
    }

    fn span_data() -> SpanData {
        // The in-memory exporter's spans come from a real tracer.
        use opentelemetry::trace::{Tracer as _, TracerProvider as _};
        let exporter = InMemorySpanExporter::default();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        provider.tracer("test").in_span("span", |_| {});
        exporter.get_finished_spans().unwrap().remove(0)
    }

    #[test]
    fn a_full_queue_drops_and_exports_release_room() {
        let stats = Arc::new(SpanExportStats::new("http://collector:4317"));
        let processor = CountingProcessor::new(Holding::default(), stats.clone(), 2);
        for _ in 0..5 {
            processor.on_end(span_data());
        }
        assert_eq!(processor.inner.0.lock().unwrap().len(), 2);
        assert_eq!(stats.counts().dropped, 3);

        let exporter = CountingExporter::new(InMemorySpanExporter::default(), stats.clone());
        let queued = std::mem::take(&mut *processor.inner.0.lock().unwrap());
        futures_executor_block_on(exporter.export(queued)).unwrap();
        assert_eq!(
            stats.counts(),
            SpanExportCounts {
                exported: 2,
                dropped: 3,
                failed: 0
            }
        );
        // Room again once exported.
        processor.on_end(span_data());
        assert_eq!(processor.inner.0.lock().unwrap().len(), 1);
        assert!(processor
            .shutdown_with_timeout(Duration::from_millis(10))
            .is_ok());
        // The one still queued at shutdown is written off.
        assert_eq!(stats.counts().dropped, 4);
        let mut exposition = Exposition::new();
        stats.write_to(&mut exposition);
        let text = exposition.finish();
        assert!(
            text.contains("dflash_trace_spans_exported_total 2\n"),
            "{text}"
        );
        assert!(
            text.contains("dflash_trace_spans_dropped_total 4\n"),
            "{text}"
        );
        assert!(text.contains("dflash_trace_export_failing 0\n"), "{text}");
    }

    #[test]
    fn failures_are_counted_and_flip_the_failing_state_once() {
        let stats = Arc::new(SpanExportStats::new("http://collector:4317"));
        let failing = CountingExporter::new(Failing, stats.clone());
        assert!(stats.admit(10) && stats.admit(10) && stats.admit(10));
        assert!(futures_executor_block_on(failing.export(vec![span_data(), span_data()])).is_err());
        assert!(stats.failing());
        assert!(futures_executor_block_on(failing.export(vec![span_data()])).is_err());
        assert_eq!(stats.counts().failed, 3);
        let working = CountingExporter::new(InMemorySpanExporter::default(), stats.clone());
        assert!(futures_executor_block_on(working.export(vec![span_data()])).is_ok());
        assert!(!stats.failing());
        assert_eq!(stats.counts().exported, 1);
        assert_eq!(stats.pending.load(Ordering::Relaxed), 0);
    }

    /// Polls a future that completes without waking (the exporters here
    /// never wait).
    fn futures_executor_block_on<F: std::future::Future>(future: F) -> F::Output {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(future)
    }
}
