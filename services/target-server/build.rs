//! Link settings for the `target-server` binary and the tests.
//!
//! - An rpath to the libtorch library folder, so the binary runs without
//!   LD_LIBRARY_PATH.
//! - With a CUDA libtorch, `libtorch_cuda.so` is linked with
//!   `--no-as-needed`: nothing references its symbols directly, so the
//!   default `--as-needed` drops it and `tch::Cuda::is_available()` would
//!   report false on a GPU machine.

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Ok(libtorch) = std::env::var("LIBTORCH") else {
        return;
    };
    let library_folder = Path::new(&libtorch).join("lib");
    println!(
        "cargo:rustc-link-arg=-Wl,-rpath,{}",
        library_folder.display()
    );
    if library_folder.join("libtorch_cuda.so").is_file() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
