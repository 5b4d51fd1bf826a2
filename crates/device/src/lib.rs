//! # dflash-device
//!
//! What the two servers that own a device (target-server, drafter-server)
//! and the CLI's model commands share about running on it.
//!
//! # Layout
//! - [`worker`]: [`DeviceWorker`], the one dedicated device thread of a
//!   service (start handshake, bounded command and event channels, a join
//!   within a bound that reports a timeout as [`WorkerError::TimedOut`]);
//!   generic over its messages, so no libtorch here.
//! - [`alloc`]: [`configure_allocator`], glibc malloc settings that keep
//!   large tensor buffers across steps (and optional huge pages), which the
//!   libtorch binaries apply first thing in `main`.
//! - [`cuda_memory`]: on a GPU, which CUDA allocator libtorch uses
//!   ([`CudaAllocatorSettings`]: caching on or off, from the environment)
//!   and the device memory's peak ([`DeviceMemoryProbe`], NVML loaded at run
//!   time; nothing on a host without the driver).
//!
//! Must not depend on libtorch, tonic or any other crate of ours. The broker
//! and the operator binary (`dflash-ops`) never link it.

pub mod alloc;
pub mod cuda_memory;
pub mod worker;

pub use alloc::{configure_allocator, AllocatorMode, AllocatorReport};
pub use cuda_memory::{
    CudaAllocatorSettings, DeviceMemory, DeviceMemoryProbe, GpuMemoryMonitor, GpuMemoryReading,
    PeakTracker,
};
pub use worker::{join_within, DeviceWorker, WorkerChannels, WorkerError, WorkerSide};
