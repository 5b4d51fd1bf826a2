//! Gives the `dflash` binary and the test binaries an rpath to the
//! libtorch library folder, so they run without LD_LIBRARY_PATH.

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libtorch}/lib");
    }
}
