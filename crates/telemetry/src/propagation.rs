//! W3C trace context inside items.
//!
//! gRPC metadata belongs to a whole stream, and one Produce or Consume stream
//! carries thousands of samples from many batches, so the trace context of
//! each sample travels in the item itself (`Item.trace_context`, relayed as
//! `Delivery.trace_context`). The producer injects the context of the span
//! that made the sample; the broker and the consumer parent their spans to
//! it. Everything here is a no-op when no span exporter is installed.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C `traceparent`/`tracestate` of the current `tracing` span, for
/// `Item.trace_context`. Empty when the span is not exported.
pub fn inject_current_context() -> HashMap<String, String> {
    inject_context_of(&tracing::Span::current())
}

/// The W3C trace context of `span`, as [`inject_current_context`] for a span
/// that is not the current one (e.g. a batch span held by a producer task).
pub fn inject_context_of(span: &tracing::Span) -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    if span.is_disabled() {
        return carrier;
    }
    let context = span.context();
    if context.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&context, &mut carrier);
    }
    carrier
}

/// Makes `span` a child of the producer's span whose context is in
/// `carrier` (an item's or a delivery's `trace_context`), so the consumer's
/// work joins the producer's trace. Call it before the span is first
/// entered. Returns whether the span was linked: false when the carrier
/// holds no valid context (a peer's input: malformed values are ignored),
/// the span is disabled, or no exporter is installed.
pub fn set_parent_from(span: &tracing::Span, carrier: &HashMap<String, String>) -> bool {
    if span.is_disabled() || carrier.is_empty() {
        return false;
    }
    let context = TraceContextPropagator::new().extract(carrier);
    if !context.span().span_context().is_valid() {
        return false;
    }
    span.set_parent(context).is_ok()
}

/// Links `span` to the producer's span whose context is in `carrier`,
/// without making it the parent: for work that consumes many samples at once
/// (a drafter's step over a batch of deliveries from different targets),
/// which can have one parent but a link to each sample's trace. Returns
/// whether a link was added (false for an invalid carrier or a disabled span).
pub fn add_link_from(span: &tracing::Span, carrier: &HashMap<String, String>) -> bool {
    if span.is_disabled() || carrier.is_empty() {
        return false;
    }
    let context = TraceContextPropagator::new().extract(carrier);
    let span_context = context.span().span_context().clone();
    if !span_context.is_valid() {
        return false;
    }
    span.add_link(span_context);
    true
}

/// The trace id (32 lowercase hex digits) in a carrier, when it holds a
/// valid context: for log lines that name the trace of a sample.
pub fn trace_id_of(carrier: &HashMap<String, String>) -> Option<String> {
    let context = TraceContextPropagator::new().extract(carrier);
    let span_context = context.span().span_context().clone();
    span_context
        .is_valid()
        .then(|| span_context.trace_id().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{build_subscriber, LogFormat};
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
    use tracing_subscriber::EnvFilter;

    fn with_exporter<R>(body: impl FnOnce() -> R) -> (R, Vec<SpanData>) {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = build_subscriber(
            EnvFilter::new("off"),
            EnvFilter::new("info,dflash::trace=debug"),
            LogFormat::Text,
            Some(provider.tracer("test")),
            true,
        );
        let result = tracing::subscriber::with_default(subscriber, body);
        // Shutting the provider down (on drop) clears the in-memory
        // exporter: read the spans first.
        let spans = exporter.get_finished_spans().expect("finished spans");
        drop(provider);
        (result, spans)
    }

    #[test]
    fn round_trip_keeps_the_trace_id_and_parents_the_consumer_span() {
        let (carrier, spans) = with_exporter(|| {
            let producer = tracing::info_span!("batch");
            let carrier = producer.in_scope(inject_current_context);
            drop(producer);
            let consumer =
                tracing::debug_span!(target: crate::TRACE_TARGET, "step", delivery_id = 7);
            assert!(
                set_parent_from(&consumer, &carrier),
                "consumer span not linked"
            );
            consumer.in_scope(|| {});
            carrier
        });
        let traceparent = carrier.get("traceparent").expect("traceparent injected");
        assert_eq!(traceparent.len(), 55, "traceparent {traceparent:?}");
        let batch = spans
            .iter()
            .find(|span| span.name == "batch")
            .expect("batch");
        let step = spans.iter().find(|span| span.name == "step").expect("step");
        assert_eq!(
            step.span_context.trace_id(),
            batch.span_context.trace_id(),
            "consumer span is in another trace"
        );
        assert_eq!(step.parent_span_id, batch.span_context.span_id());
        assert_eq!(
            trace_id_of(&carrier),
            Some(batch.span_context.trace_id().to_string())
        );
    }

    #[test]
    fn a_step_over_many_samples_links_every_other_trace() {
        let (links, spans) = with_exporter(|| {
            let carriers: Vec<_> = (0..3)
                .map(|batch| tracing::info_span!("batch", batch).in_scope(inject_current_context))
                .collect();
            let step = tracing::info_span!("step");
            assert!(set_parent_from(&step, &carriers[0]));
            let linked = carriers[1..]
                .iter()
                .filter(|carrier| add_link_from(&step, carrier))
                .count();
            assert!(!add_link_from(&step, &HashMap::new()));
            step.in_scope(|| {});
            linked
        });
        assert_eq!(links, 2);
        let batches: Vec<_> = spans.iter().filter(|span| span.name == "batch").collect();
        let step = spans.iter().find(|span| span.name == "step").expect("step");
        assert_eq!(step.parent_span_id, batches[0].span_context.span_id());
        let linked: Vec<_> = step
            .links
            .iter()
            .map(|link| link.span_context.span_id())
            .collect();
        assert_eq!(
            linked,
            vec![
                batches[1].span_context.span_id(),
                batches[2].span_context.span_id()
            ]
        );
    }

    #[test]
    fn bad_carriers_are_ignored() {
        let ((), spans) = with_exporter(|| {
            let span = tracing::info_span!("step");
            let garbage = HashMap::from([("traceparent".to_string(), "00-zz-yy-01".to_string())]);
            assert!(!set_parent_from(&span, &garbage));
            assert!(!set_parent_from(&span, &HashMap::new()));
            let all_zero = HashMap::from([(
                "traceparent".to_string(),
                format!("00-{}-{}-01", "0".repeat(32), "0".repeat(16)),
            )]);
            assert!(!set_parent_from(&span, &all_zero));
            span.in_scope(|| {});
        });
        assert_eq!(spans.len(), 1);
        assert_eq!(trace_id_of(&HashMap::new()), None);
    }

    #[test]
    fn without_an_exporter_nothing_is_injected() {
        // The default log filter, no exporter: what a binary runs with
        // when OTEL_EXPORTER_OTLP_ENDPOINT is unset.
        let subscriber = build_subscriber(
            EnvFilter::new("info"),
            EnvFilter::new("info,dflash::trace=debug"),
            LogFormat::Text,
            None,
            true,
        );
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("batch");
            assert!(span.in_scope(inject_current_context).is_empty());
            // Whether the callsite itself is disabled depends on tracing's
            // process-wide interest cache, which other tests' subscribers
            // (running in parallel) also feed; what matters is that nothing
            // is propagated without an exporter.
            let trace_only = tracing::debug_span!(target: crate::TRACE_TARGET, "enqueue");
            assert!(trace_only.in_scope(inject_current_context).is_empty());
        });
    }
}
