//! Which records of the data file belong to this target.
//!
//! Records (non-blank lines) are dealt round-robin: record `r` belongs to
//! shard `r % num_shards`. Round-robin keeps shards equal in size and mix
//! (a data file sorted by source or length would give contiguous shards very
//! different costs), and it is a pure function of the record index, so a
//! restarted target picks exactly the same records.

/// One shard of the data: this target processes records `r` with
/// `r % count == index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    pub index: u32,
    pub count: u32,
}

/// The shard flags and the broker disagree or are incomplete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    #[error("--num-shards must be at least 1")]
    ZeroShards,
    #[error("--shard-index {index} is out of range for {count} shards (0..{count})")]
    IndexOutOfRange { index: u32, count: u32 },
    #[error("cannot tell this target's shard index: pass --shard-index or end --target-id {target_id:?} with a number (like target-3)")]
    NoIndex { target_id: String },
    #[error("cannot tell the number of shards: pass --num-shards or start the broker with --expected-targets")]
    NoCount,
}

impl ShardSpec {
    pub fn new(index: u32, count: u32) -> Result<Self, ShardError> {
        if count == 0 {
            return Err(ShardError::ZeroShards);
        }
        if index >= count {
            return Err(ShardError::IndexOutOfRange { index, count });
        }
        Ok(ShardSpec { index, count })
    }

    /// Whether record `record_index` (0-based, counting non-blank lines)
    /// belongs to this shard.
    pub fn contains(&self, record_index: u64) -> bool {
        record_index % u64::from(self.count) == u64::from(self.index)
    }

    /// How many of `record_count` records this shard holds.
    pub fn records_in_shard(&self, record_count: u64) -> u64 {
        let count = u64::from(self.count);
        let index = u64::from(self.index);
        record_count / count + u64::from(record_count % count > index)
    }
}

/// The number a target id ends with: `target-3` → 3, the pod ordinal of a
/// Kubernetes StatefulSet.
pub fn trailing_number(target_id: &str) -> Option<u32> {
    let digits_start = target_id
        .char_indices()
        .rev()
        .take_while(|(_, character)| character.is_ascii_digit())
        .last()
        .map(|(position, _)| position)?;
    target_id[digits_start..].parse().ok()
}

/// The shard from explicit flags, falling back to the target id's trailing
/// number and the broker's expected target count.
pub fn resolve_shard(
    explicit_index: Option<u32>,
    explicit_count: Option<u32>,
    target_id: &str,
    broker_expected_targets: Option<u32>,
) -> Result<ShardSpec, ShardError> {
    let count = explicit_count
        .or(broker_expected_targets.filter(|&count| count > 0))
        .ok_or(ShardError::NoCount)?;
    let index = match explicit_index {
        Some(index) => index,
        None => trailing_number(target_id).ok_or_else(|| ShardError::NoIndex {
            target_id: target_id.to_string(),
        })?,
    };
    ShardSpec::new(index, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_and_cover_every_record() {
        for count in 1..=7u32 {
            for record_count in [0u64, 1, 5, 13, 100] {
                let shards: Vec<ShardSpec> =
                    (0..count).map(|index| ShardSpec { index, count }).collect();
                for record in 0..record_count {
                    let owners = shards.iter().filter(|shard| shard.contains(record)).count();
                    assert_eq!(
                        owners, 1,
                        "record {record} of {record_count} with {count} shards"
                    );
                }
                let total: u64 = shards
                    .iter()
                    .map(|shard| shard.records_in_shard(record_count))
                    .sum();
                assert_eq!(total, record_count);
                for shard in &shards {
                    let counted = (0..record_count)
                        .filter(|&record| shard.contains(record))
                        .count() as u64;
                    assert_eq!(shard.records_in_shard(record_count), counted);
                }
            }
        }
    }

    #[test]
    fn trailing_numbers_of_pod_names() {
        assert_eq!(trailing_number("target-3"), Some(3));
        assert_eq!(trailing_number("dflash-target-12"), Some(12));
        assert_eq!(trailing_number("target7"), Some(7));
        assert_eq!(trailing_number("target"), None);
        assert_eq!(trailing_number(""), None);
        assert_eq!(trailing_number("target-99999999999"), None, "overflows u32");
    }

    #[test]
    fn resolution_prefers_flags_then_id_and_broker() {
        assert_eq!(
            resolve_shard(None, None, "target-2", Some(5)),
            Ok(ShardSpec { index: 2, count: 5 })
        );
        assert_eq!(
            resolve_shard(Some(1), Some(3), "target-2", Some(5)),
            Ok(ShardSpec { index: 1, count: 3 })
        );
        assert_eq!(
            resolve_shard(None, None, "target-5", Some(5)),
            Err(ShardError::IndexOutOfRange { index: 5, count: 5 })
        );
        assert_eq!(
            resolve_shard(None, None, "target-0", Some(0)),
            Err(ShardError::NoCount)
        );
        assert!(matches!(
            resolve_shard(None, Some(2), "main", None),
            Err(ShardError::NoIndex { .. })
        ));
        assert_eq!(
            resolve_shard(Some(0), Some(0), "t", None),
            Err(ShardError::ZeroShards)
        );
    }
}
