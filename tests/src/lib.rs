//! # dflash-system-tests
//!
//! Whole-system tests live in `tests/tests/`: they run the real binaries
//! (`broker`, `target-server`, `drafter-server`, `dflash`) as processes on
//! loopback, found next to the test binary in cargo's target folder (build
//! them first: `cargo build --workspace --bins`, which `make test` does).
//!
//! # Layout
//! - `tests/local_pipeline.rs`: `dflash local` on the embedded tiny default.
//! - `tests/cli_status.rs`: `dflash status --json` against a live broker.
//! - `tests/common/`: finding the workspace binaries from a test.
//!
//! This crate has no library code of its own.
