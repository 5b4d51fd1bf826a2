//! Conversions between the queue's domain types and the `dflash.v1` messages
//! (queue errors become statuses in [`crate::rpc_error`]).

use std::sync::Arc;

use dflash_proto::v1 as proto;

use crate::payload::WireItem;

use crate::queue::{
    BrokerState, ConsumerStats, Credit, DeadLetter, DrafterSnapshot, NackDisposition, Payload,
    ProducerStats, RunStatus, RunSummary, Snapshot, TargetSnapshot, TargetState, TraceExport,
};

/// The queue's payload on the wire side is the producer's item itself,
/// shared (`Arc<WireItem>`) so that a delivery and a redelivery never copy
/// tensor bytes (each tensor's data is the slices of the frames it arrived
/// in, see `payload`). Its size is [`WireItem::held_bytes`].
impl crate::wal::DurablePayload for Arc<WireItem> {
    /// prost's encoding of the `Item` (the log's format is unchanged), as
    /// the pieces the delivery route sends: tensor data are the received
    /// frames' slices, shared rather than copied.
    fn encode_payload(&self) -> Vec<bytes::Bytes> {
        self.encode_pieces().unwrap_or_else(|_| {
            // Only an item over 4 GiB fails to encode as pieces; prost's
            // own encoding of the joined item is the (slower) same bytes.
            vec![prost::Message::encode_to_vec(&self.to_proto()).into()]
        })
    }

    fn decode_payload(bytes: &[u8]) -> Result<Self, String> {
        let item: proto::Item =
            prost::Message::decode(bytes).map_err(|error| format!("item: {error}"))?;
        Ok(Arc::new(WireItem::from_proto(item)))
    }
}

impl Payload for Arc<WireItem> {
    fn size_bytes(&self) -> u64 {
        self.held_bytes()
    }
}

pub fn credit_from_proto(credit: Option<proto::Credit>) -> Credit {
    credit.map_or(Credit { items: 1, bytes: 0 }, |credit| Credit {
        items: credit.items,
        bytes: credit.bytes,
    })
}

pub fn nack_disposition_from_proto(value: i32) -> NackDisposition {
    match proto::NackDisposition::try_from(value) {
        Ok(proto::NackDisposition::DeadLetter) => NackDisposition::DeadLetter,
        _ => NackDisposition::Requeue,
    }
}

pub fn producer_stats_from_proto(stats: proto::ProducerStats) -> ProducerStats {
    ProducerStats {
        tokens_per_second: stats.tokens_per_second,
        busy_fraction: stats.busy_fraction,
        device: dflash_proto::transport::bounded_control_string(&stats.device).into_owned(),
        samples_done: stats.samples_done,
        samples_total: stats.samples_total,
        tokens_done: stats.tokens_done,
        trace_export: stats.trace_export.map(trace_export_from_proto),
    }
}

fn trace_export_from_proto(stats: proto::TraceExportStats) -> TraceExport {
    TraceExport {
        exported_spans: stats.exported_spans,
        dropped_spans: stats.dropped_spans,
        failed_spans: stats.failed_spans,
        failing: stats.failing,
    }
}

fn trace_export_to_proto(stats: &TraceExport) -> proto::TraceExportStats {
    proto::TraceExportStats {
        exported_spans: stats.exported_spans,
        dropped_spans: stats.dropped_spans,
        failed_spans: stats.failed_spans,
        failing: stats.failing,
    }
}

fn producer_stats_to_proto(stats: &ProducerStats) -> proto::ProducerStats {
    proto::ProducerStats {
        tokens_per_second: stats.tokens_per_second,
        busy_fraction: stats.busy_fraction,
        device: stats.device.clone(),
        samples_done: stats.samples_done,
        samples_total: stats.samples_total,
        tokens_done: stats.tokens_done,
        trace_export: stats.trace_export.as_ref().map(trace_export_to_proto),
    }
}

pub fn consumer_stats_from_proto(stats: proto::ConsumerStats) -> ConsumerStats {
    ConsumerStats {
        tokens_per_second: stats.tokens_per_second,
        loss: stats.loss,
        busy_fraction: stats.busy_fraction,
        device: dflash_proto::transport::bounded_control_string(&stats.device).into_owned(),
        steps: stats.steps,
        samples_trained: stats.samples_trained,
        accuracy: stats.accuracy,
        skipped_steps: stats.skipped_steps,
        non_finite_samples: stats.non_finite_samples,
        trace_export: stats.trace_export.map(trace_export_from_proto),
    }
}

fn consumer_stats_to_proto(stats: &ConsumerStats) -> proto::ConsumerStats {
    proto::ConsumerStats {
        tokens_per_second: stats.tokens_per_second,
        loss: stats.loss,
        busy_fraction: stats.busy_fraction,
        device: stats.device.clone(),
        steps: stats.steps,
        samples_trained: stats.samples_trained,
        accuracy: stats.accuracy,
        skipped_steps: stats.skipped_steps,
        non_finite_samples: stats.non_finite_samples,
        trace_export: stats.trace_export.as_ref().map(trace_export_to_proto),
    }
}

pub fn run_status(outcome: RunStatus) -> proto::RunStatus {
    match outcome {
        RunStatus::Complete => proto::RunStatus::Complete,
        RunStatus::Aborted => proto::RunStatus::Aborted,
    }
}

pub fn summary_to_proto(summary: &RunSummary) -> proto::RunSummary {
    proto::RunSummary {
        expected_targets: summary.expected_targets,
        done_targets: summary.done_targets,
        failed_targets: summary.failed_targets.clone(),
        accepted_items: summary.accepted_items,
        accepted_bytes: summary.accepted_bytes,
        acked_items: summary.acked_items,
        dead_letters: summary.dead_letter_count,
        expected_items: summary.expected_items,
    }
}

fn dead_letter_to_proto(dead: &DeadLetter) -> proto::DeadLetter {
    proto::DeadLetter {
        target_id: dead.target_id.to_string(),
        seq: dead.seq,
        deliveries: dead.deliveries,
        reason: dead.reason.clone(),
        bytes: dead.bytes,
    }
}

fn millis(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The status snapshot on the wire. `run_id`, `model_sync` and `lighthouse` are left empty
/// for the service to fill in.
pub fn snapshot_to_proto(snapshot: &Snapshot) -> proto::StatusSnapshot {
    proto::StatusSnapshot {
        state: broker_state_to_proto(snapshot.state) as i32,
        expected_targets: snapshot.expected_targets,
        done_targets: snapshot.done_targets,
        queued_items: snapshot.queued_items,
        queued_bytes: snapshot.queued_bytes,
        leased_items: snapshot.leased_items,
        dead_letters: snapshot.summary.dead_letter_count,
        targets: snapshot.targets.iter().map(target_to_proto).collect(),
        drafters: snapshot.drafters.iter().map(drafter_to_proto).collect(),
        accepted_items: snapshot.accepted_items,
        accepted_bytes: snapshot.accepted_bytes,
        delivered_items: snapshot.delivered_items,
        acked_items: snapshot.acked_items,
        redelivered_items: snapshot.redelivered_items,
        rejected_items: snapshot.rejected_items,
        items_per_second: snapshot.acked_items_per_second,
        bytes_per_second: snapshot.acked_bytes_per_second,
        leased_bytes: snapshot.leased_bytes,
        max_queue_bytes: snapshot.max_queue_bytes,
        abort_reason: snapshot.abort_reason.clone(),
        dead_letter_items: snapshot
            .dead_letters
            .iter()
            .map(dead_letter_to_proto)
            .collect(),
        uptime_ms: millis(snapshot.uptime),
        summary: Some(summary_to_proto(&snapshot.summary)),
        accepted_items_per_second: snapshot.accepted_items_per_second,
        accepted_bytes_per_second: snapshot.accepted_bytes_per_second,
        run_id: String::new(),
        // Filled in by the service from the model-sync state.
        model_sync: None,
        trace_export: None,
        lighthouse: None,
    }
}

/// The run's state on the wire.
fn broker_state_to_proto(state: BrokerState) -> proto::BrokerState {
    match state {
        BrokerState::Running => proto::BrokerState::Running,
        BrokerState::Draining => proto::BrokerState::Draining,
        BrokerState::Complete => proto::BrokerState::Complete,
        BrokerState::Aborted => proto::BrokerState::Aborted,
    }
}

/// One target's status on the wire; the failure reason is empty unless it
/// failed.
fn target_to_proto(target: &TargetSnapshot) -> proto::TargetStatus {
    let (state, failure_reason) = match &target.state {
        TargetState::Connected { .. } => (proto::TargetState::Connected, String::new()),
        TargetState::Disconnected { .. } => (proto::TargetState::Disconnected, String::new()),
        TargetState::Done => (proto::TargetState::Done, String::new()),
        TargetState::Failed { reason } => (proto::TargetState::Failed, reason.clone()),
    };
    proto::TargetStatus {
        target_id: target.target_id.clone(),
        state: state as i32,
        accepted_items: target.accepted_items,
        accepted_bytes: target.accepted_bytes,
        rejected_items: target.rejected_items,
        duplicate_items: target.duplicate_items,
        last_seen_ms_ago: millis(target.last_seen_ago),
        stats: target.stats.as_ref().map(producer_stats_to_proto),
        failure_reason,
        highest_seq: target.highest_seq,
    }
}

/// One drafter's status on the wire.
fn drafter_to_proto(drafter: &DrafterSnapshot) -> proto::DrafterStatus {
    proto::DrafterStatus {
        drafter_id: drafter.drafter_id.clone(),
        connected: drafter.connected,
        leased_items: drafter.leased_items,
        delivered_items: drafter.delivered_items,
        acked_items: drafter.acked_items,
        nacked_items: drafter.nacked_items,
        expired_leases: drafter.expired_leases,
        last_seen_ms_ago: millis(drafter.last_seen_ago),
        stats: drafter.stats.as_ref().map(consumer_stats_to_proto),
        credit: Some(proto::Credit {
            items: drafter.credit.items,
            bytes: drafter.credit.bytes,
        }),
        leased_bytes: drafter.leased_bytes,
    }
}
