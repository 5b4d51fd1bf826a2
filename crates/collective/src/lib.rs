//! # Layout
//!
//! `dflash-collective` is a thin safe wrapper over PyTorch's own c10d
//! collectives, the ones libtorch ships: a TCPStore server to rendezvous at
//! ([`Store`]), and process groups ([`ProcessGroup`]: ProcessGroupGloo over a
//! PrefixStore; ProcessGroupNCCL for CUDA tensors behind the `nccl` feature)
//! with in-place `all_reduce_sum`, `broadcast` and `barrier`. It owns no
//! collective algorithm of its own: every reduction and broadcast is c10d's.
//!
//! Modules: `store` ([`Store`]), `group` ([`ProcessGroup`], [`GroupOptions`]),
//! `error` ([`CollectiveError`], [`Operation`]), `backend` ([`Backend`]), `ffi` (the only `unsafe`: the
//! C functions of `shim/c10d_shim.cpp` and the owning handles over its
//! objects; the shim catches every C++ exception and returns its text).
//! `build.rs` compiles the shim against the libtorch tch links and gloo's
//! headers (`scripts/setup-gloo-headers.sh`).
//!
//! Must not depend on tonic, tokio or our other crates: membership (who is in
//! which group, under which prefix) is decided elsewhere and handed in as
//! [`GroupOptions`]. Calls block the calling thread; run them on a dedicated
//! thread, never on an async runtime's.

mod backend;
mod error;
mod ffi;
mod group;
mod store;

pub use backend::{backend_for, Backend};
pub use error::{CollectiveError, Operation};
pub use group::{GroupOptions, ProcessGroup};
pub use store::Store;

/// Dropped groups whose C++ objects are still being destroyed on their
/// detached threads (a group stuck on a stopped peer until its timeout).
/// Tests and shutdown paths may wait for zero before the process exits.
pub fn groups_being_destroyed() -> usize {
    ffi::groups_being_destroyed()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threading contract callers build on: a group moves to its own
    /// thread; a store is shared (behind an Arc) between threads.
    #[test]
    fn groups_are_send_and_stores_send_and_sync() {
        fn send<T: Send>() {}
        fn send_and_sync<T: Send + Sync>() {}
        send::<ProcessGroup>();
        send_and_sync::<Store>();
        send_and_sync::<CollectiveError>();
    }
}
