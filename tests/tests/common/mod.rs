//! Finding the workspace's binaries from a test.

#![allow(dead_code, clippy::expect_used)]

use std::path::PathBuf;

/// A binary of this workspace in the same target folder as the running test.
pub fn workspace_binary(name: &str) -> PathBuf {
    let test_binary = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let profile_dir = test_binary
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target profile folder");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins)",
        path.display()
    );
    path
}
