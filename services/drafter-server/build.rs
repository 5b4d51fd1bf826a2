//! Links libtorch into the drafter-server binary and the tests: an rpath to its library folder, and
//! `libtorch_cuda.so` kept when libtorch has CUDA (see the included file).

include!("../../crates/model/link_libtorch.rs");

fn main() {
    link_libtorch();
}
