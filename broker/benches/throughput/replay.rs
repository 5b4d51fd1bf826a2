//! Section 6: how long a broker takes to read its write-ahead log back at
//! start (what a Kubernetes startupProbe must allow for). Writes a log of
//! items of one size with the broker's own log code (`Wal`), then times
//! `Wal::open` (replay, the CRC of every frame, the queue's books) twice:
//! with the segment in the page cache, and after dropping the page cache
//! (`/proc/sys/vm/drop_caches`, root only; said so when not allowed).

use std::time::Instant;

use dflash_broker::queue::{JournalEntry, Payload};
use dflash_broker::wal::{DurablePayload, LogConfig, RunShape, Wal};

#[derive(Debug, Clone)]
struct Blob(bytes::Bytes);

impl Payload for Blob {
    fn size_bytes(&self) -> u64 {
        self.0.len() as u64
    }
}

impl DurablePayload for Blob {
    fn encode_payload(&self) -> Vec<bytes::Bytes> {
        vec![self.0.clone()]
    }
    fn decode_payload(bytes: &[u8]) -> Result<Self, String> {
        Ok(Blob(bytes::Bytes::copy_from_slice(bytes)))
    }
}

fn config(total_bytes: u64) -> LogConfig {
    // No compaction while the log is written.
    LogConfig::new(total_bytes, RunShape::new(vec!["target-0".to_string()]))
}

/// Seconds to open (replay) the log in `dir`, and the records read.
fn time_open(dir: &std::path::Path, total_bytes: u64) -> (f64, u64) {
    let started = Instant::now();
    let opened = Wal::<Blob>::open(dir, &config(total_bytes), || unreachable!("a log exists"))
        .expect("replay");
    let seconds = started.elapsed().as_secs_f64();
    (seconds, opened.records)
}

fn drop_page_cache() -> bool {
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

pub fn print_replay(quick: bool) {
    let total_bytes: u64 = if quick { 256 << 20 } else { 2 << 30 };
    println!();
    println!(
        "6. Write-ahead log replay at start ({} MiB of accepted items, then Wal::open)",
        total_bytes >> 20
    );
    println!("   item size | records |  page cache: s   GB/s |  cold: s   GB/s");
    for item_bytes in [16usize << 20, 64 << 10] {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).expect("temp dir");
        let items = total_bytes / item_bytes as u64;
        {
            let mut opened = Wal::<Blob>::open(dir.path(), &config(total_bytes), || {
                "bench-replay".to_string()
            })
            .expect("open");
            let payload = bytes::Bytes::from(vec![7u8; item_bytes]);
            for seq in 0..items {
                opened
                    .wal
                    .append(&[JournalEntry::Accepted {
                        target_id: std::sync::Arc::from("target-0"),
                        seq,
                        payload: Blob(payload.clone()),
                    }])
                    .expect("append");
            }
            opened.wal.sync().expect("sync");
        }
        let (warm, records) = time_open(dir.path(), total_bytes);
        let cold = if drop_page_cache() {
            let (seconds, _) = time_open(dir.path(), total_bytes);
            format!("{seconds:>7.2} {:>6.2}", total_bytes as f64 / seconds / 1e9)
        } else {
            "  (cannot drop the page cache here)".to_string()
        };
        println!(
            "   {:>9} | {records:>7} | {warm:>14.2} {:>6.2} | {cold}",
            if item_bytes >= 1 << 20 {
                format!("{} MiB", item_bytes >> 20)
            } else {
                format!("{} KiB", item_bytes >> 10)
            },
            total_bytes as f64 / warm / 1e9,
        );
    }
}
