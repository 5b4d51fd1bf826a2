//! Links libtorch into this crate's test and example binaries: an rpath to its library folder, and
//! `libtorch_cuda.so` kept when libtorch has CUDA (see the included file).

include!("link_libtorch.rs");

fn main() {
    link_libtorch();
}
