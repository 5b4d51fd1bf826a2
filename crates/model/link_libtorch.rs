// Link settings for every binary that uses libtorch through `dflash-model`
// (target-server, drafter-server, dflash, and the test and example
// binaries), shared by their build scripts with `include!`: cargo passes a
// `rustc-link-arg` only to the binaries of the package whose build script
// printed it, so each binary package prints these itself.
//
// - An rpath to the libtorch library folder, so the binaries run without
//   LD_LIBRARY_PATH.
// - With a CUDA libtorch, `libtorch_cuda.so` is linked with
//   `--no-as-needed`: nothing references its symbols directly, so the
//   default `--as-needed` drops it and `tch::Cuda::is_available()` would
//   report false on a GPU machine (`make check-cuda-build` checks every
//   binary's NEEDED entries).

fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Ok(libtorch) = std::env::var("LIBTORCH") else {
        return;
    };
    let library_folder = std::path::Path::new(&libtorch).join("lib");
    println!(
        "cargo:rustc-link-arg=-Wl,-rpath,{}",
        library_folder.display()
    );
    if library_folder.join("libtorch_cuda.so").is_file() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
