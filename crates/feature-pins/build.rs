//! Empty: the crate's build-dependencies only pin the features the
//! workspace turns on for build scripts (Cargo.toml).
fn main() {}
