//! [`TargetReport`]: what a target-server run did, filled in by the pump
//! and the run's end.

use crate::reader::ReaderSummary;
use crate::shard::ShardSpec;
use std::time::Duration;

/// What a run did.
#[derive(Debug, Clone)]
pub struct TargetReport {
    pub target_id: String,
    pub shard: ShardSpec,
    /// False when shut down before the shard was done (no ReportDone sent).
    pub completed: bool,
    pub layer_ids: Vec<usize>,
    pub device: String,
    /// Where the broker said this target stood when the run began.
    pub resume_after_seq: Option<u64>,
    /// Items sent by this run.
    pub samples_sent: u64,
    /// Real tokens sent by this run.
    pub tokens_sent: u64,
    /// Newly accepted / already present / rejected items of the final stream.
    pub accepted: u64,
    pub duplicates: u64,
    pub rejected: Vec<(u64, String)>,
    /// Items the broker holds from this target over all runs (its own count).
    pub total_accepted: u64,
    /// What ReportDone said: the valid samples this target read from its
    /// shard (every seq it numbered, resumed ones included), counted by the
    /// target itself so the broker's check catches an item it never stored.
    /// None when no ReportDone was sent.
    pub reported_total: Option<u64>,
    pub reader: ReaderSummary,
    pub reconnects: u32,
    /// Wall time from the first forward to the last computed batch.
    pub compute_wall: Duration,
    pub tokens_per_second: f64,
    /// Fraction of `compute_wall` the device was busy.
    pub busy_fraction: f64,
    /// The GPU's peak memory in use after a batch (NVML), on CUDA only.
    pub device_memory_peak_bytes: Option<u64>,
    /// Captures with a NaN or an infinity that were not sent
    /// (`--on-non-finite skip`); ReportDone's total leaves them out.
    pub non_finite_skipped: u64,
}
