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
//! `error` ([`CollectiveError`], [`Operation`]), `ffi` (the only `unsafe`: the
//! C functions of `shim/c10d_shim.cpp` and the owning handles over its
//! objects; the shim catches every C++ exception and returns its text).
//! `build.rs` compiles the shim against the libtorch tch links and gloo's
//! headers (`scripts/setup-gloo-headers.sh`).
//!
//! Must not depend on tonic, tokio or our other crates: membership (who is in
//! which group, under which prefix) is decided elsewhere and handed in as
//! [`GroupOptions`]. Calls block the calling thread; run them on a dedicated
//! thread, never on an async runtime's.

mod error;
mod ffi;
mod group;
mod store;

use std::time::Duration;

pub use error::{CollectiveError, Operation};
pub use group::{GroupOptions, ProcessGroup};
pub use store::Store;

/// Which c10d backend moves a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// ProcessGroupGloo: CPU tensors, TCP.
    #[default]
    Gloo,
    /// ProcessGroupNCCL: CUDA tensors; only in builds with the `nccl` feature.
    Nccl,
}

/// The backend for tensors on `device`: NCCL for CUDA tensors when this
/// build has the `nccl` feature, Gloo otherwise.
pub fn backend_for(device: tch::Device) -> Backend {
    match device {
        tch::Device::Cuda(_) if cfg!(feature = "nccl") => Backend::Nccl,
        _ => Backend::Gloo,
    }
}

/// Dropped groups whose C++ objects are still being destroyed on their
/// detached threads (a group stuck on a stopped peer until its timeout).
/// Tests and shutdown paths may wait for zero before the process exits.
pub fn groups_being_destroyed() -> usize {
    ffi::groups_being_destroyed()
}

/// A positive timeout in whole milliseconds, as c10d takes it.
pub(crate) fn timeout_millis(timeout: Duration) -> Result<i64, String> {
    let millis = timeout.as_millis();
    if millis == 0 {
        return Err(format!("timeout {timeout:?} is under 1 ms"));
    }
    Ok(i64::try_from(millis).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_tensors_use_gloo() {
        assert_eq!(backend_for(tch::Device::Cpu), Backend::Gloo);
    }

    #[test]
    fn cuda_tensors_use_nccl_only_with_the_feature() {
        let expected = if cfg!(feature = "nccl") {
            Backend::Nccl
        } else {
            Backend::Gloo
        };
        assert_eq!(backend_for(tch::Device::Cuda(0)), expected);
    }

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

    #[test]
    fn timeouts_under_a_millisecond_are_refused() {
        assert!(timeout_millis(Duration::from_micros(999)).is_err());
        assert_eq!(timeout_millis(Duration::from_secs(3)), Ok(3000));
        assert_eq!(timeout_millis(Duration::MAX), Ok(i64::MAX));
    }
}
