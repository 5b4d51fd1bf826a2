//! Writes a tiny model directory: `write_tiny DIR [qwen3|llama] [SEED]`.
//!
//! Used by `scripts/golden/target_golden.py` to make the parity fixtures
//! from exactly the bytes the Rust side writes.

use dflash_model::tiny::{write_tiny_model, TinyModelSpec};
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let mut arguments = std::env::args().skip(1);
    let directory: PathBuf = arguments
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: write_tiny DIR [qwen3|llama] [SEED]"))?
        .into();
    let mut spec = match arguments.next().as_deref() {
        None | Some("qwen3") => TinyModelSpec::default(),
        Some("llama") => TinyModelSpec::llama(),
        Some(other) => anyhow::bail!("unknown architecture {other:?} (qwen3 or llama)"),
    };
    if let Some(seed) = arguments.next() {
        spec.seed = seed.parse()?;
    }
    write_tiny_model(&directory, &spec)?;
    println!("wrote {spec:?} to {}", directory.display());
    Ok(())
}
