//! The samples one span worked on, for work over many samples at once (a
//! drafter's step over deliveries from several targets' batches).
//!
//! A trace is one target batch (its `target.batch` span, the broker's
//! `enqueue` and `deliver` span of each of its samples); a step trains on
//! samples of several batches. So the step span joins the trace of its
//! first sample (its parent), links each other batch once (not once per
//! sample: a step of 512 samples from 3 batches has 2 links, far below the
//! SDK's 128 per span), and names every sample it trained in the
//! `dflash.sample_keys` attribute (`"<target id>:<seq>"`), so one sample's
//! whole path is found from its (target, seq).

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanContext, TraceContextExt};
use opentelemetry::{KeyValue, StringValue, Value};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The attribute with the keys of the samples a span worked on.
pub const SAMPLE_KEYS_ATTRIBUTE: &str = "dflash.sample_keys";
/// The attribute, on each link, with how many of the span's samples came
/// from the linked span.
pub const LINK_SAMPLES_ATTRIBUTE: &str = "dflash.samples";

/// A sample's key in [`SAMPLE_KEYS_ATTRIBUTE`]: `"<target id>:<seq>"` (split
/// at the last colon: a target id may hold one, a seq cannot).
pub fn sample_key(target_id: &str, seq: u64) -> String {
    format!("{target_id}:{seq}")
}

/// Collects the samples of one span (a step) as they come, a micro-batch
/// at a time: [`SampleTraces::add`] for each sample, [`SampleTraces::apply`]
/// once before the span closes. Does nothing when the span is disabled (no
/// exporter): the drafter's hot path pays for a branch.
#[derive(Debug, Default)]
pub struct SampleTraces {
    /// The parent's context, once a sample with a valid context came.
    parent: Option<SpanContext>,
    /// Whether the span was given a parent (or refused one) already.
    parent_tried: bool,
    /// The other distinct producer spans, in order of arrival, with how
    /// many samples each gave.
    linked: Vec<(SpanContext, u64)>,
    /// Every sample's key, in order.
    keys: Vec<StringValue>,
}

impl SampleTraces {
    pub fn new() -> Self {
        SampleTraces::default()
    }

    /// Records that `span` works on the sample (`target_id`, `seq`) whose
    /// producer's trace context is in `carrier` (peer input: an invalid one
    /// only loses the link). The first valid context becomes the span's
    /// parent here, so call this before the span is first entered.
    pub fn add(
        &mut self,
        span: &tracing::Span,
        target_id: &str,
        seq: u64,
        carrier: &HashMap<String, String>,
    ) {
        if span.is_disabled() {
            return;
        }
        self.keys.push(sample_key(target_id, seq).into());
        let Some(context) = extract(carrier) else {
            return;
        };
        if let Some(parent) = &self.parent {
            if same_span(parent, &context) {
                return;
            }
        } else if !self.parent_tried {
            // Once: a span already entered cannot take a parent, and the
            // context then becomes a link like the others.
            self.parent_tried = true;
            let remote = opentelemetry::Context::new().with_remote_span_context(context.clone());
            if span.set_parent(remote).is_ok() {
                self.parent = Some(context);
                return;
            }
        }
        match self
            .linked
            .iter_mut()
            .find(|(linked, _)| same_span(linked, &context))
        {
            Some((_, samples)) => *samples += 1,
            None => self.linked.push((context, 1)),
        }
    }

    /// Samples recorded so far.
    pub fn samples(&self) -> usize {
        self.keys.len()
    }

    /// Distinct producer spans other than the parent.
    pub fn links(&self) -> usize {
        self.linked.len()
    }

    /// Puts the links and the keys on `span` and empties `self` for the
    /// next span. Call once, before `span` closes.
    pub fn apply(&mut self, span: &tracing::Span) {
        let traces = std::mem::take(self);
        if span.is_disabled() {
            return;
        }
        for (context, samples) in traces.linked {
            span.add_link_with_attributes(
                context,
                vec![KeyValue::new(LINK_SAMPLES_ATTRIBUTE, samples as i64)],
            );
        }
        if !traces.keys.is_empty() {
            span.set_attribute(
                SAMPLE_KEYS_ATTRIBUTE,
                Value::Array(opentelemetry::Array::String(traces.keys)),
            );
        }
    }
}

fn extract(carrier: &HashMap<String, String>) -> Option<SpanContext> {
    if carrier.is_empty() {
        return None;
    }
    let context = TraceContextPropagator::new().extract(carrier);
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

fn same_span(left: &SpanContext, right: &SpanContext) -> bool {
    left.trace_id() == right.trace_id() && left.span_id() == right.span_id()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{build_subscriber, LogFormat};
    use crate::propagation::inject_current_context;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::EnvFilter;

    #[test]
    fn a_step_links_each_batch_once_and_names_every_sample() {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = build_subscriber(
            EnvFilter::new("off"),
            EnvFilter::new("info"),
            LogFormat::Text,
            Some(provider.tracer("test")),
            true,
        );
        let (links, samples) = tracing::subscriber::with_default(subscriber, || {
            let batches: Vec<_> = (0..3)
                .map(|batch| tracing::info_span!("batch", batch).in_scope(inject_current_context))
                .collect();
            let step = tracing::info_span!("step");
            let mut traces = SampleTraces::new();
            // 300 samples over three batches, two micro-batches.
            for seq in 0..150u64 {
                traces.add(&step, "target-0", seq, &batches[(seq % 2) as usize]);
            }
            step.in_scope(|| {});
            for seq in 150..300u64 {
                let carrier = if seq == 299 {
                    HashMap::new()
                } else {
                    batches[(seq % 3) as usize].clone()
                };
                traces.add(&step, "target:1", seq, &carrier);
            }
            let counts = (traces.links(), traces.samples());
            traces.apply(&step);
            assert_eq!(traces.samples(), 0, "apply empties it");
            counts
        });
        assert_eq!((links, samples), (2, 300));
        let spans = exporter.get_finished_spans().unwrap();
        drop(provider);
        let batch_ids: Vec<_> = spans
            .iter()
            .filter(|span| span.name == "batch")
            .map(|span| span.span_context.span_id())
            .collect();
        let step = spans.iter().find(|span| span.name == "step").unwrap();
        assert_eq!(step.parent_span_id, batch_ids[0]);
        let linked: Vec<_> = step
            .links
            .iter()
            .map(|link| link.span_context.span_id())
            .collect();
        assert_eq!(linked, vec![batch_ids[1], batch_ids[2]]);
        let keys = step
            .attributes
            .iter()
            .find(|attribute| attribute.key.as_str() == SAMPLE_KEYS_ATTRIBUTE)
            .map(|attribute| attribute.value.clone())
            .unwrap();
        let Value::Array(opentelemetry::Array::String(keys)) = keys else {
            panic!("{keys:?}")
        };
        assert_eq!(keys.len(), 300);
        assert_eq!(keys[0].as_str(), "target-0:0");
        assert_eq!(keys[299].as_str(), "target:1:299");
    }

    #[test]
    fn without_an_exporter_nothing_is_collected() {
        let mut traces = SampleTraces::new();
        traces.add(&tracing::Span::none(), "target-0", 1, &HashMap::new());
        assert_eq!(traces.samples(), 0);
        traces.apply(&tracing::Span::none());
    }
}
