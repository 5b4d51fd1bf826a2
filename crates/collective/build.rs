//! Compiles the C++ shim (`shim/c10d_shim.cpp`) against the libtorch that
//! tch links (torch-sys's `links = "tch"` metadata gives its lib folder) and
//! gloo's headers (fetched once by `scripts/setup-gloo-headers.sh`), and links
//! `torch_cpu` and `c10` (c10d and gloo live inside libtorch_cpu.so) with an
//! rpath to that folder.
//!
//! With the `nccl` feature it also defines `USE_C10D_NCCL` and `USE_CUDA`
//! and links `torch_cuda` (whole, `--no-as-needed`) and `c10_cuda`: tch must
//! then link the CUDA wheel's libtorch (`LIBTORCH_USE_PYTORCH=1`). The CUDA
//! headers come from `CUDA_HOME/include` (default `/usr/local/cuda/include`),
//! nccl.h and any further folders from `DFLASH_NCCL_INCLUDE` (`:`-separated).
//! With pip's wheels: `CUDA_HOME=<site-packages>/nvidia/cu13` (cuda-runtime,
//! -crt, -cccl, cublas, cusparse, cusolver put their headers there) and
//! `DFLASH_NCCL_INCLUDE=<site-packages>/nvidia/nccl/include`.

use std::env;
use std::path::{Path, PathBuf};

const SHIM_SOURCE: &str = "shim/c10d_shim.cpp";
const GLOO_SETUP_SCRIPT: &str = "scripts/setup-gloo-headers.sh";

fn main() {
    if let Err(message) = build() {
        eprintln!("error: dflash-collective build script: {message}");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    println!("cargo:rerun-if-changed={SHIM_SOURCE}");
    println!("cargo:rerun-if-changed=build.rs");
    for variable in [
        "DFLASH_GLOO_INCLUDE",
        "DFLASH_CACHE_DIR",
        "XDG_CACHE_HOME",
        "HOME",
        "CUDA_HOME",
        "DFLASH_NCCL_INCLUDE",
    ] {
        println!("cargo:rerun-if-env-changed={variable}");
    }

    let libtorch_lib = PathBuf::from(env::var("DEP_TCH_LIBTORCH_LIB").map_err(|_| {
        "DEP_TCH_LIBTORCH_LIB is not set: torch-sys must be a direct dependency \
         (it declares links = \"tch\" and reports libtorch's lib folder)"
            .to_string()
    })?);
    let libtorch_root = libtorch_lib.join("..");
    let libtorch_include = libtorch_root.join("include");
    if !libtorch_include
        .join("torch/csrc/distributed/c10d/ProcessGroupGloo.hpp")
        .is_file()
    {
        return Err(format!(
            "{} has no torch/csrc/distributed/c10d/ProcessGroupGloo.hpp: \
             this libtorch ships no c10d headers",
            libtorch_include.display()
        ));
    }
    let gloo_include = gloo_include_dir()?;
    println!("cargo:rerun-if-changed={}", gloo_include.display());

    let nccl = env::var_os("CARGO_FEATURE_NCCL").is_some();

    let mut shim = cc::Build::new();
    shim.cpp(true)
        .file(SHIM_SOURCE)
        .include(&libtorch_include)
        .include(libtorch_include.join("torch/csrc/api/include"))
        .include(&gloo_include)
        .flag("-std=c++17")
        .define("USE_C10D_GLOO", None)
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("GLOG_USE_GLOG_EXPORT", None)
        // libtorch's headers are noisy under -Wall, and use C++20 bit-field
        // initialisers that g++ accepts in C++17 with a warning each.
        .warnings(false)
        .flag_if_supported("-Wno-c++20-extensions");
    if nccl {
        shim.define("USE_C10D_NCCL", None).define("USE_CUDA", None);
        let cuda_home = env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".to_string());
        shim.include(Path::new(&cuda_home).join("include"));
        if let Ok(folders) = env::var("DFLASH_NCCL_INCLUDE") {
            for folder in folders.split(':').filter(|folder| !folder.is_empty()) {
                shim.include(folder);
            }
        }
    }
    shim.try_compile("dflash_c10d_shim")
        .map_err(|error| format!("compiling {SHIM_SOURCE}: {error}"))?;

    println!("cargo:rustc-link-search=native={}", libtorch_lib.display());
    if nccl {
        // Without --no-as-needed the linker drops libtorch_cuda (nothing names
        // its symbols directly) and CUDA is not initialised: a known tch pitfall.
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        // c10::cuda::getCurrentCUDAStream and CUDAStream::synchronize.
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", libtorch_lib.display());
    Ok(())
}

/// `DFLASH_GLOO_INCLUDE`, else the cache folder the setup script fills (the
/// same rule as scripts/setup-libtorch.sh: `DFLASH_CACHE_DIR`, else
/// `XDG_CACHE_HOME/dflash`, else `HOME/.cache/dflash`).
fn gloo_include_dir() -> Result<PathBuf, String> {
    let include = match env::var_os("DFLASH_GLOO_INCLUDE") {
        Some(folder) => PathBuf::from(folder),
        None => {
            let cache_root = if let Some(folder) = env::var_os("DFLASH_CACHE_DIR") {
                PathBuf::from(folder)
            } else if let Some(folder) = env::var_os("XDG_CACHE_HOME") {
                PathBuf::from(folder).join("dflash")
            } else if let Some(home) = env::var_os("HOME") {
                PathBuf::from(home).join(".cache").join("dflash")
            } else {
                return Err(format!(
                    "none of DFLASH_GLOO_INCLUDE, DFLASH_CACHE_DIR, XDG_CACHE_HOME, HOME is set: \
                     run {GLOO_SETUP_SCRIPT} (or `make setup`) and set DFLASH_GLOO_INCLUDE"
                ));
            };
            cache_root.join("gloo-headers").join("include")
        }
    };
    if include.join("gloo").join("context.h").is_file() {
        Ok(include)
    } else {
        Err(format!(
            "gloo's headers are missing: no gloo/context.h under {}; run `bash {GLOO_SETUP_SCRIPT}` \
             (or `make setup`) once, or point DFLASH_GLOO_INCLUDE at a folder holding gloo/",
            include.display()
        ))
    }
}
