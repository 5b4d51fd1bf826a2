//! The broker's Prometheus metrics, computed from a queue [`Snapshot`] at
//! scrape time.
//!
//! The queue already counts everything status needs, so metrics are a
//! second view of the same snapshot rather than instruments updated on the
//! hot path: nothing is added under the queue lock, and the numbers in
//! `/metrics` and `GetStatus` always agree. Per-target and per-drafter
//! series carry the ids (and the device the peer reported) as labels; the
//! queue forgets old disconnected drafters, which bounds their number.

use dflash_telemetry::{Exposition, MetricKind};

use crate::payload::ReceivedCounts;
use crate::queue::{BrokerState, DrafterSnapshot, Snapshot, TargetSnapshot, TargetState};
use crate::run_model::evaluation::TauGauges;
use crate::wal::writer::WriterCounts;

/// Every metric name starts with this.
pub const PREFIX: &str = "dflash_broker_";

/// The text exposition (format 0.0.4) of `snapshot`.
pub fn render(snapshot: &Snapshot) -> String {
    render_with(snapshot, ReceivedCounts::default(), None, None)
}

/// [`render`] with how large payloads arrived (counted outside the queue).
pub fn render_with(
    snapshot: &Snapshot,
    received: ReceivedCounts,
    log: Option<WriterCounts>,
    tau: Option<TauGauges>,
) -> String {
    let mut out = Exposition::new();
    write_run(&mut out, snapshot);
    write_queue(&mut out, snapshot);
    write_targets(&mut out, &snapshot.targets);
    write_drafters(&mut out, &snapshot.drafters);
    write_received(&mut out, received);
    if let Some(log) = log {
        write_log(&mut out, log);
    }
    if let Some(tau) = tau {
        write_tau(&mut out, tau);
    }
    out.finish()
}

/// Online evaluation: τ of the model as the evaluator last reported it,
/// the best so far, and the versions they are of (absent before the first
/// report: no τ is not τ 0).
fn write_tau(out: &mut Exposition, tau: TauGauges) {
    out.counter(
        &name("model_tau_reports_total"),
        "Evaluations of the model reported (ModelSync.ReportTau)",
        tau.reports as f64,
    );
    let series = [
        (
            tau.latest,
            "model_tau",
            "model_tau_version",
            "tau (mean acceptance length, bonus token counted) of the model version last evaluated",
            "The model version the last tau is of",
        ),
        (
            tau.best,
            "model_best_tau",
            "model_best_tau_version",
            "The best tau reported so far (that version is written to model-best/)",
            "The model version of the best tau",
        ),
    ];
    for (point, tau_suffix, version_suffix, tau_help, version_help) in series {
        if let Some((version, value)) = point {
            out.gauge(&name(tau_suffix), tau_help, value);
            out.gauge(&name(version_suffix), version_help, version as f64);
        }
    }
}

/// The write-ahead log's writer (only with `--state-dir`).
fn write_log(out: &mut Exposition, log: WriterCounts) {
    out.gauge(
        &name("log_stalled"),
        "1 while a write-ahead log write waits for space (no space, quota, EIO): answers are held back and health is NOT_SERVING until it goes through.",
        f64::from(u8::from(log.stalled)),
    );
    out.gauge(
        &name("log_failed"),
        "1 once the write-ahead log failed for good (a sync or another write error): the run is aborted.",
        f64::from(u8::from(log.failed)),
    );
    out.counter(
        &name("log_groups_total"),
        "Groups of submissions the write-ahead log's writer wrote together.",
        log.groups as f64,
    );
    out.counter(
        &name("log_syncs_total"),
        "fdatasync calls on the write-ahead log.",
        log.syncs as f64,
    );
    out.gauge(
        &name("log_segment_bytes"),
        "Bytes in the write-ahead log's newest segment.",
        log.log_bytes as f64,
    );
}

fn write_received(out: &mut Exposition, received: ReceivedCounts) {
    let mut payloads = out.family(
        &name("received_payloads_total"),
        "Tensors of at least 16 KiB in valid items received, by how their data arrived: within one HTTP/2 frame, or across several (kept as the frames' slices; neither is copied).",
        MetricKind::Counter,
    );
    payloads.sample(&[("frames", "one")], received.one_frame as f64);
    payloads.sample(&[("frames", "several")], received.several_frames as f64);
    out.counter(
        &name("received_payload_slices_total"),
        "Frame slices the tensors that arrived across several frames are held as.",
        received.slices as f64,
    );
    out.gauge(
        &name("waiting_for_room_items"),
        "Decoded items whose producer waits for room in the full queue (at most one per open Produce stream; not counted in queued bytes).",
        received.waiting_items as f64,
    );
    out.gauge(
        &name("waiting_for_room_bytes"),
        "Payload bytes of the items waiting for room.",
        received.waiting_bytes as f64,
    );
}

fn name(suffix: &str) -> String {
    format!("{PREFIX}{suffix}")
}

fn broker_state_label(state: BrokerState) -> &'static str {
    match state {
        BrokerState::Running => "running",
        BrokerState::Draining => "draining",
        BrokerState::Complete => "complete",
        BrokerState::Aborted => "aborted",
    }
}

fn write_run(out: &mut Exposition, snapshot: &Snapshot) {
    let mut state = out.family(
        &name("state"),
        "Run state: 1 for the current state, 0 for the others.",
        MetricKind::Gauge,
    );
    for candidate in [
        BrokerState::Running,
        BrokerState::Draining,
        BrokerState::Complete,
        BrokerState::Aborted,
    ] {
        let current = if candidate == snapshot.state {
            1.0
        } else {
            0.0
        };
        state.sample(&[("state", broker_state_label(candidate))], current);
    }
    out.gauge(
        &name("uptime_seconds"),
        "Seconds since the broker started.",
        snapshot.uptime.as_secs_f64(),
    );
    out.gauge(
        &name("targets_expected"),
        "Targets that must finish before the run can complete.",
        f64::from(snapshot.expected_targets),
    );
    out.gauge(
        &name("targets_done"),
        "Targets finished (done, or failed under the continue policy).",
        f64::from(snapshot.done_targets),
    );
}

/// Writes the queue's series: its gauges (what it holds now), its counters
/// (what passed through it), rejections by reason, and the ack rates.
fn write_queue(out: &mut Exposition, snapshot: &Snapshot) {
    write_queue_gauges(out, snapshot);
    write_queue_counters(out, snapshot);
    write_queue_rejections_and_rates(out, snapshot);
}

/// Writes what the queue holds now: queued and leased items and bytes, and
/// its bound.
fn write_queue_gauges(out: &mut Exposition, snapshot: &Snapshot) {
    let gauges = [
        (
            "queued_items",
            "Items waiting for a drafter.",
            snapshot.queued_items,
        ),
        (
            "queued_bytes",
            "Payload bytes of the items waiting for a drafter.",
            snapshot.queued_bytes,
        ),
        (
            "leased_items",
            "Items delivered and not yet acked.",
            snapshot.leased_items,
        ),
        (
            "leased_bytes",
            "Payload bytes of the items delivered and not yet acked.",
            snapshot.leased_bytes,
        ),
        (
            "max_queue_bytes",
            "Bound on queued plus leased bytes; producers wait when it is reached.",
            snapshot.max_queue_bytes,
        ),
    ];
    for (suffix, help, value) in gauges {
        out.gauge(&name(suffix), help, value as f64);
    }
}

/// Writes the queue's counters: items and bytes accepted, deliveries,
/// redeliveries, acks and dead letters.
fn write_queue_counters(out: &mut Exposition, snapshot: &Snapshot) {
    let counters = [
        (
            "accepted_items_total",
            "Items accepted from targets (duplicates not counted).",
            snapshot.accepted_items,
        ),
        (
            "accepted_bytes_total",
            "Payload bytes accepted from targets.",
            snapshot.accepted_bytes,
        ),
        (
            "delivered_items_total",
            "Deliveries to drafters, redeliveries included.",
            snapshot.delivered_items,
        ),
        (
            "redelivered_items_total",
            "Deliveries of items that had been delivered before.",
            snapshot.redelivered_items,
        ),
        (
            "acked_items_total",
            "Items acked by drafters (trained on).",
            snapshot.acked_items,
        ),
        (
            "dead_letters_total",
            "Items given up on after too many deliveries or a poison nack.",
            snapshot.summary.dead_letter_count,
        ),
    ];
    for (suffix, help, value) in counters {
        out.counter(&name(suffix), help, value as f64);
    }
}

/// Writes the rejected items by reason and the acked items and bytes per
/// second.
fn write_queue_rejections_and_rates(out: &mut Exposition, snapshot: &Snapshot) {
    let mut rejected = out.family(
        &name("rejected_items_total"),
        "Items rejected, by reason.",
        MetricKind::Counter,
    );
    for (reason, count) in &snapshot.rejected_by_reason {
        rejected.sample(&[("reason", reason.as_str())], *count as f64);
    }
    out.gauge(
        &name("acked_items_per_second"),
        "Acked items per second over the last seconds.",
        snapshot.acked_items_per_second,
    );
    out.gauge(
        &name("acked_bytes_per_second"),
        "Acked payload bytes per second over the last seconds.",
        snapshot.acked_bytes_per_second,
    );
}

fn target_state_label(state: &TargetState) -> &'static str {
    match state {
        TargetState::Connected { .. } => "connected",
        TargetState::Disconnected { .. } => "disconnected",
        TargetState::Done => "done",
        TargetState::Failed { .. } => "failed",
    }
}

/// Writes the per-target series: each target's state, what the broker
/// counted for it, then what it reported about itself.
fn write_targets(out: &mut Exposition, targets: &[TargetSnapshot]) {
    write_target_states(out, targets);
    write_target_series(out, targets);
    write_target_reported(out, targets);
}

/// Writes one `target_state` series per target, the one for its state.
fn write_target_states(out: &mut Exposition, targets: &[TargetSnapshot]) {
    let mut state = out.family(
        &name("target_state"),
        "Each target's state (the series with value 1).",
        MetricKind::Gauge,
    );
    for target in targets {
        state.sample(
            &[
                ("target_id", &target.target_id),
                ("state", target_state_label(&target.state)),
            ],
            1.0,
        );
    }
}

/// Writes what the broker counted for each target (accepted, rejected, last
/// seen), labelled with the target's id.
fn write_target_series(out: &mut Exposition, targets: &[TargetSnapshot]) {
    let per_target: [Series<TargetSnapshot>; 3] = [
        (
            "target_accepted_items_total",
            "Items accepted from this target.",
            MetricKind::Counter,
            |target| target.accepted_items as f64,
        ),
        (
            "target_rejected_items_total",
            "Items rejected from this target.",
            MetricKind::Counter,
            |target| target.rejected_items as f64,
        ),
        (
            "target_last_seen_seconds",
            "Seconds since this target was last heard from.",
            MetricKind::Gauge,
            |target| target.last_seen_ago.as_secs_f64(),
        ),
    ];
    write_per_peer(out, targets, &per_target, |target| {
        Some((target, vec![("target_id", target.target_id.as_str())]))
    });
}

/// Writes what each target reported about itself, labelled with its id and
/// device; a target that reported nothing yet has no series.
fn write_target_reported(out: &mut Exposition, targets: &[TargetSnapshot]) {
    let reported: [Series<crate::queue::ProducerStats>; 4] = [
        (
            "target_tokens_per_second",
            "Tokens per second the target reports producing.",
            MetricKind::Gauge,
            |stats| stats.tokens_per_second,
        ),
        (
            "target_busy_fraction",
            "Fraction of wall time the target's device computes (0..1).",
            MetricKind::Gauge,
            |stats| stats.busy_fraction,
        ),
        (
            "target_samples_done_total",
            "Samples the target reports done.",
            MetricKind::Counter,
            |stats| stats.samples_done as f64,
        ),
        (
            "target_samples_expected",
            "Samples in the target's shard (0 when not known).",
            MetricKind::Gauge,
            |stats| stats.samples_total as f64,
        ),
    ];
    write_per_peer(out, targets, &reported, |target| {
        let stats = target.stats.as_ref()?;
        let labels = vec![
            ("target_id", target.target_id.as_str()),
            ("device", stats.device.as_str()),
        ];
        Some((stats, labels))
    });
}

/// Writes the per-drafter series: what the broker knows of each drafter,
/// then what each drafter reported about itself.
fn write_drafters(out: &mut Exposition, drafters: &[DrafterSnapshot]) {
    write_drafter_series(out, drafters);
    write_drafter_reported(out, drafters);
}

/// Writes what the broker itself knows of each drafter (its stream, leases,
/// deliveries and acks), labelled with the drafter's id.
fn write_drafter_series(out: &mut Exposition, drafters: &[DrafterSnapshot]) {
    let per_drafter: [Series<DrafterSnapshot>; 8] = [
        (
            "drafter_connected",
            "1 while the drafter's stream is open.",
            MetricKind::Gauge,
            |drafter| if drafter.connected { 1.0 } else { 0.0 },
        ),
        (
            "drafter_leased_items",
            "Items delivered to this drafter and not yet acked.",
            MetricKind::Gauge,
            |drafter| drafter.leased_items as f64,
        ),
        (
            "drafter_leased_bytes",
            "Payload bytes delivered to this drafter and not yet acked.",
            MetricKind::Gauge,
            |drafter| drafter.leased_bytes as f64,
        ),
        (
            "drafter_delivered_items_total",
            "Deliveries to this drafter.",
            MetricKind::Counter,
            |drafter| drafter.delivered_items as f64,
        ),
        (
            "drafter_acked_items_total",
            "Items this drafter acked.",
            MetricKind::Counter,
            |drafter| drafter.acked_items as f64,
        ),
        (
            "drafter_nacked_items_total",
            "Items this drafter nacked.",
            MetricKind::Counter,
            |drafter| drafter.nacked_items as f64,
        ),
        (
            "drafter_expired_leases_total",
            "Leases of this drafter taken back after the lease timeout.",
            MetricKind::Counter,
            |drafter| drafter.expired_leases as f64,
        ),
        (
            "drafter_last_seen_seconds",
            "Seconds since this drafter was last heard from.",
            MetricKind::Gauge,
            |drafter| drafter.last_seen_ago.as_secs_f64(),
        ),
    ];
    write_per_peer(out, drafters, &per_drafter, |drafter| {
        Some((drafter, vec![("drafter_id", drafter.drafter_id.as_str())]))
    });
}

/// Writes what each drafter reported about itself (rate, loss, steps),
/// labelled with its id and device; a drafter that reported nothing yet has
/// no series.
fn write_drafter_reported(out: &mut Exposition, drafters: &[DrafterSnapshot]) {
    let reported: [Series<crate::queue::ConsumerStats>; 6] = [
        (
            "drafter_tokens_per_second",
            "Tokens per second the drafter reports training on.",
            MetricKind::Gauge,
            |stats| stats.tokens_per_second,
        ),
        (
            "drafter_busy_fraction",
            "Fraction of wall time the drafter's device computes (0..1).",
            MetricKind::Gauge,
            |stats| stats.busy_fraction,
        ),
        (
            "drafter_loss",
            "The drafter's last reported training loss.",
            MetricKind::Gauge,
            |stats| stats.loss,
        ),
        (
            "drafter_accuracy",
            "The drafter's last reported draft-token accuracy.",
            MetricKind::Gauge,
            |stats| stats.accuracy,
        ),
        (
            "drafter_steps_total",
            "Optimizer steps the drafter reports.",
            MetricKind::Counter,
            |stats| stats.steps as f64,
        ),
        (
            "drafter_samples_trained_total",
            "Samples the drafter reports trained on.",
            MetricKind::Counter,
            |stats| stats.samples_trained as f64,
        ),
    ];
    write_per_peer(out, drafters, &reported, |drafter| {
        let stats = drafter.stats.as_ref()?;
        let labels = vec![
            ("drafter_id", drafter.drafter_id.as_str()),
            ("device", stats.device.as_str()),
        ];
        Some((stats, labels))
    });
}

/// One per-peer metric: its name suffix, help, kind and how to read its
/// value from what `write_per_peer`'s view gives.
type Series<V> = (&'static str, &'static str, MetricKind, fn(&V) -> f64);

/// Writes one family per row of `table`, with a sample for each peer that
/// `view` gives a value and labels for (a peer that reported nothing yet
/// has no series).
fn write_per_peer<'peer, P, V: 'peer>(
    out: &mut Exposition,
    peers: &'peer [P],
    table: &[Series<V>],
    view: impl Fn(&'peer P) -> Option<(&'peer V, Vec<(&'static str, &'peer str)>)>,
) {
    for (suffix, help, kind, value) in table {
        let mut family = out.family(&name(suffix), help, *kind);
        for peer in peers {
            if let Some((subject, labels)) = view(peer) {
                family.sample(&labels, value(subject));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use super::*;
    use crate::queue::tests::{config, TestPayload};
    use crate::queue::{ConsumerStats, Credit, ProducerStats, Queue, RejectReason};

    /// Checks the text is well formed (every sample belongs to the family
    /// whose HELP and TYPE precede it, values parse) and returns
    /// `name{labels}` → value.
    fn parse(text: &str) -> BTreeMap<String, f64> {
        let mut samples = BTreeMap::new();
        let mut family: Option<String> = None;
        let mut helped: Option<String> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                helped = Some(rest.split(' ').next().unwrap().to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split(' ');
                let name = parts.next().unwrap().to_string();
                assert_eq!(helped.as_deref(), Some(name.as_str()), "TYPE without HELP");
                assert!(matches!(parts.next(), Some("counter" | "gauge")), "{line}");
                if name.ends_with("_total") {
                    assert!(rest.ends_with(" counter"), "{line}");
                }
                family = Some(name);
            } else {
                let (series, value) = line.rsplit_once(' ').unwrap();
                let sample_name = series.split('{').next().unwrap();
                assert_eq!(Some(sample_name), family.as_deref(), "{line}");
                assert!(sample_name.starts_with(PREFIX), "{line}");
                let value: f64 = value.parse().unwrap();
                assert!(
                    samples.insert(series.to_string(), value).is_none(),
                    "{line}"
                );
            }
        }
        samples
    }

    #[test]
    fn the_model_tau_series_appear_once_reported() {
        let queue: Queue<TestPayload> = Queue::new(config(1), Instant::now());
        let snapshot = queue.snapshot(Instant::now());
        let none = parse(&render_with(
            &snapshot,
            ReceivedCounts::default(),
            None,
            Some(TauGauges::default()),
        ));
        assert_eq!(
            none.get("dflash_broker_model_tau_reports_total"),
            Some(&0.0)
        );
        assert!(!none.contains_key("dflash_broker_model_tau"), "{none:?}");
        let tau = TauGauges {
            latest: Some((12, 2.25)),
            best: Some((9, 2.5)),
            reports: 3,
        };
        let text = render_with(&snapshot, ReceivedCounts::default(), None, Some(tau));
        let values = parse(&text);
        assert_eq!(values["dflash_broker_model_tau"], 2.25);
        assert_eq!(values["dflash_broker_model_tau_version"], 12.0);
        assert_eq!(values["dflash_broker_model_best_tau"], 2.5);
        assert_eq!(values["dflash_broker_model_best_tau_version"], 9.0);
        assert_eq!(values["dflash_broker_model_tau_reports_total"], 3.0);
    }

    #[test]
    fn snapshot_metrics_are_rendered_with_their_values() {
        let now = Instant::now();
        let mut queue: Queue<TestPayload> = Queue::new(config(2), now);
        let producer = queue.open_producer("target-0", now).unwrap().connection;
        queue.producer_stats(
            producer,
            ProducerStats {
                tokens_per_second: 27000.0,
                busy_fraction: 0.75,
                device: "cuda:0".to_string(),
                samples_done: 3,
                samples_total: 10,
                tokens_done: 1650,
                trace_export: None,
            },
            now,
        );
        let drafter = queue
            .open_consumer("drafter \"a\"", Credit { items: 1, bytes: 0 }, now)
            .unwrap();
        queue.consumer_stats(
            drafter,
            ConsumerStats {
                tokens_per_second: 5000.0,
                loss: 2.5,
                busy_fraction: 0.5,
                device: "cuda:1".to_string(),
                steps: 4,
                samples_trained: 8,
                accuracy: 0.25,
                skipped_steps: 0,
                non_finite_samples: 0,
                trace_export: None,
            },
            now,
        );
        for seq in 0..3 {
            queue
                .accept_item(producer, seq, TestPayload(10), now)
                .unwrap();
        }
        queue.count_rejected(producer, RejectReason::Malformed, now);
        let delivery_id = 1;
        queue.ack(drafter, &[delivery_id], now);

        let samples = parse(&render(&queue.snapshot(now)));
        let value = |series: &str| {
            *samples
                .get(series)
                .unwrap_or_else(|| panic!("no {series} in {samples:#?}"))
        };
        assert_eq!(value("dflash_broker_state{state=\"running\"}"), 1.0);
        assert_eq!(value("dflash_broker_state{state=\"complete\"}"), 0.0);
        assert_eq!(value("dflash_broker_targets_expected"), 2.0);
        assert_eq!(value("dflash_broker_targets_done"), 0.0);
        assert_eq!(value("dflash_broker_accepted_items_total"), 3.0);
        assert_eq!(value("dflash_broker_accepted_bytes_total"), 30.0);
        assert_eq!(value("dflash_broker_delivered_items_total"), 2.0);
        assert_eq!(value("dflash_broker_acked_items_total"), 1.0);
        assert_eq!(value("dflash_broker_queued_items"), 1.0);
        assert_eq!(value("dflash_broker_queued_bytes"), 10.0);
        assert_eq!(value("dflash_broker_leased_items"), 1.0);
        assert_eq!(value("dflash_broker_leased_bytes"), 10.0);
        assert_eq!(value("dflash_broker_redelivered_items_total"), 0.0);
        assert_eq!(value("dflash_broker_dead_letters_total"), 0.0);
        assert_eq!(
            value("dflash_broker_rejected_items_total{reason=\"malformed\"}"),
            1.0
        );
        assert_eq!(
            value("dflash_broker_rejected_items_total{reason=\"too_large\"}"),
            0.0
        );
        assert_eq!(
            value("dflash_broker_target_state{target_id=\"target-0\",state=\"connected\"}"),
            1.0
        );
        assert_eq!(
            value(
                "dflash_broker_target_tokens_per_second{target_id=\"target-0\",device=\"cuda:0\"}"
            ),
            27000.0
        );
        assert_eq!(
            value("dflash_broker_target_busy_fraction{target_id=\"target-0\",device=\"cuda:0\"}"),
            0.75
        );
        // The drafter's id is escaped in its label.
        let drafter_labels = "drafter_id=\"drafter \\\"a\\\"\",device=\"cuda:1\"";
        assert_eq!(
            value(&format!("dflash_broker_drafter_loss{{{drafter_labels}}}")),
            2.5
        );
        assert_eq!(
            value(&format!(
                "dflash_broker_drafter_tokens_per_second{{{drafter_labels}}}"
            )),
            5000.0
        );
        assert_eq!(
            value(&format!(
                "dflash_broker_drafter_busy_fraction{{{drafter_labels}}}"
            )),
            0.5
        );
        assert_eq!(
            value("dflash_broker_drafter_leased_items{drafter_id=\"drafter \\\"a\\\"\"}"),
            1.0
        );
    }

    #[test]
    fn a_fresh_broker_renders_every_family() {
        let queue: Queue<TestPayload> = Queue::new(config(1), Instant::now());
        let text = render(&queue.snapshot(Instant::now()));
        let samples = parse(&text);
        for reason in RejectReason::ALL {
            let series = format!(
                "dflash_broker_rejected_items_total{{reason=\"{}\"}}",
                reason.as_str()
            );
            assert_eq!(samples.get(&series), Some(&0.0), "{series}");
        }
        // Per-peer families are declared even with no peers yet.
        assert!(text.contains("# TYPE dflash_broker_drafter_loss gauge\n"));
        assert!(text.contains("# TYPE dflash_broker_target_tokens_per_second gauge\n"));
    }
}
