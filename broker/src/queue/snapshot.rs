//! The read-only views' types: the run summary, the status snapshot and
//! the dead letters it lists. `status` computes them from the queue.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::types::*;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    pub expected_targets: u32,
    pub done_targets: u32,
    pub failed_targets: Vec<String>,
    pub accepted_items: u64,
    pub accepted_bytes: u64,
    pub acked_items: u64,
    /// Items dead-lettered over the run (the snapshot lists the first
    /// 100 of them).
    pub dead_letter_count: u64,
    pub expected_items: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    pub target_id: Arc<str>,
    pub seq: u64,
    pub deliveries: u32,
    pub reason: String,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TargetSnapshot {
    pub target_id: String,
    pub state: TargetState,
    pub accepted_items: u64,
    pub accepted_bytes: u64,
    pub rejected_items: u64,
    pub duplicate_items: u64,
    pub last_seen_ago: Duration,
    pub stats: Option<ProducerStats>,
    pub highest_seq: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DrafterSnapshot {
    pub drafter_id: String,
    pub connected: bool,
    pub leased_items: u64,
    pub leased_bytes: u64,
    pub delivered_items: u64,
    pub acked_items: u64,
    pub nacked_items: u64,
    pub expired_leases: u64,
    pub last_seen_ago: Duration,
    pub stats: Option<ConsumerStats>,
    pub credit: Credit,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub state: BrokerState,
    pub expected_targets: u32,
    pub done_targets: u32,
    pub queued_items: u64,
    pub queued_bytes: u64,
    pub leased_items: u64,
    pub leased_bytes: u64,
    pub max_queue_bytes: u64,
    pub dead_letters: Vec<DeadLetter>,
    pub targets: Vec<TargetSnapshot>,
    pub drafters: Vec<DrafterSnapshot>,
    pub accepted_items: u64,
    pub accepted_bytes: u64,
    pub delivered_items: u64,
    pub acked_items: u64,
    pub redelivered_items: u64,
    pub rejected_items: u64,
    /// `rejected_items` by reason; every reason is present, 0 when none.
    pub rejected_by_reason: BTreeMap<RejectReason, u64>,
    pub acked_items_per_second: f64,
    pub acked_bytes_per_second: f64,
    pub accepted_items_per_second: f64,
    pub accepted_bytes_per_second: f64,
    pub abort_reason: String,
    pub uptime: Duration,
    pub summary: RunSummary,
}
