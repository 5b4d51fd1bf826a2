//! # dflash-feature-pins
//!
//! No code. Cargo resolves a dependency's features for the packages a
//! command names: `cargo test -p dflash-broker` turns on fewer features in
//! `libc`, `cc`, `rand`, ... than the workspace's one test build, and so
//! compiles about 40 dependencies a second time (jemalloc's C among them;
//! the mutants' first build took 2 min 9 s on an idle 2-core machine).
//! This crate's manifest asks for the workspace's features, and the broker
//! depends on it for its tests, so that build reuses the workspace's.
//!
//! # Layout
//! - `Cargo.toml`: the pinned features, in the program (`[dependencies]`)
//!   and in build scripts (`[build-dependencies]`);
//! - `scripts/check-feature-pins.py` (in `make lint`) compares cargo's unit
//!   graphs of the two builds, without building, and names the package
//!   where they part, with both feature sets.
//!
//! A pin asks only for features the workspace's build already turns on, on
//! the same side (the program, or build scripts): one beyond that would
//! change the workspace's own build.
