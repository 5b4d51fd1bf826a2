//! What the drafter's (and the target's) non-finite check costs: scans a
//! sample of Qwen3-8B's size (550 tokens x 5 layers x 4096, bf16: 22.5 MB)
//! with `dflash_proto::sample::non_finite_values` and prints GB/s and the
//! time per sample, to set beside a step's time.
//!
//!     cargo run --release -p dflash-proto --example non_finite_scan

use std::time::Instant;

use dflash_proto::sample::non_finite_values;
use dflash_proto::v1::Dtype;

fn main() {
    const TOKENS: usize = 550;
    const WIDTH: usize = 5 * 4096;
    const ROUNDS: usize = 40;
    // Finite bf16 values of varied bit patterns (no NaN: the scan's common case).
    let data: Vec<u8> = (0..TOKENS * WIDTH)
        .flat_map(|index| {
            let value = ((index % 1013) as f32 - 506.0) / 97.0;
            ((value.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect();
    let mut found = 0u64;
    let started = Instant::now();
    for _ in 0..ROUNDS {
        found += non_finite_values(std::hint::black_box(&data), Dtype::Bf16)
            .map_or(0, |values| values.count);
    }
    let seconds = started.elapsed().as_secs_f64();
    let bytes = (data.len() * ROUNDS) as f64;
    println!(
        "non_finite_values over {:.1} MB bf16 samples: {:.2} GB/s, {:.2} ms per sample ({} non-finite found)",
        data.len() as f64 / 1e6,
        bytes / seconds / 1e9,
        seconds * 1e3 / ROUNDS as f64,
        found
    );
}
