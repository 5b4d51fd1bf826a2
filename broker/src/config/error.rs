//! [`ConfigError`]: a broker flag value that cannot work.

use std::time::Duration;

/// A configuration value that cannot work, named with the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("--expected-targets must be at least 1 (or give --target-ids), got {0}")]
    NoTargets(u32),
    #[error("--target-ids names {ids} targets but --expected-targets is {expected}")]
    TargetCountMismatch { ids: usize, expected: u32 },
    #[error("--target-ids: {0:?} is empty or repeated")]
    BadTargetId(String),
    #[error("--max-item-bytes {item} exceeds --max-queue-bytes {queue}: such an item could never be queued")]
    ItemLargerThanQueue { item: u64, queue: u64 },
    #[error("--max-deliveries must be at least 1, got 0")]
    NoDeliveries,
    #[error("{flag} must be positive, got {value:?}")]
    NonPositiveDuration { flag: &'static str, value: Duration },
    #[error("{0}")]
    Parse(String),
}
