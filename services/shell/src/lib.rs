//! # dflash-service
//!
//! The shell the broker, the target-server, the drafter-server and the
//! `dflash` CLI share, so flags, signals and exit codes mean the same thing in
//! every binary.
//!
//! # Layout
//! - [`units`]: flag values with units: [`parse_duration`] (`500ms`, `5s`,
//!   `2m`) and [`parse_bytes`] (`64MiB`).
//! - [`device`]: [`DeviceChoice`] (`auto`, `cpu`, `cuda:N`) and
//!   [`DtypeChoice`] (`bf16`, `f16`, `f32`) as flags; `dflash-model` turns
//!   them into libtorch devices and kinds.
//! - [`signal`]: [`shutdown_signal`], one `CancellationToken` cancelled on
//!   SIGINT or SIGTERM.
//! - [`exit`]: [`Exit`], the exit-code table of every binary.
//! - [`worker`]: [`DeviceWorker`], the one dedicated device thread of a
//!   service (start handshake, bounded command and event channels, a join
//!   within a bound that reports a timeout as [`WorkerError::TimedOut`]);
//!   generic over its messages, so no libtorch here.
//! - [`alloc`]: [`configure_allocator`], glibc malloc settings that keep
//!   large tensor buffers across steps (and optional huge pages), which the
//!   libtorch binaries apply first thing in `main`.
//! - [`durable`]: files that survive a crash: [`write_synced`],
//!   [`sync_directory`], and [`replace_directory`], a checkpoint directory
//!   replaced as a whole (the draft model's and the broker's center).
//! - [`cuda_memory`]: on a GPU, which CUDA allocator libtorch uses
//!   ([`CudaAllocatorSettings`]: caching on or off, from the environment)
//!   and the device memory's peak ([`DeviceMemoryProbe`], NVML loaded at run
//!   time; nothing on a host without the driver).
//!
//! Must not depend on libtorch, tonic or any other crate of ours: the broker
//! and the operator CLI link it without libtorch.

pub mod alloc;
pub mod cuda_memory;
pub mod device;
pub mod durable;
pub mod exit;
pub mod signal;
pub mod units;
pub mod worker;

pub use alloc::{configure_allocator, AllocatorMode, AllocatorReport};
pub use cuda_memory::{
    CudaAllocatorSettings, DeviceMemory, DeviceMemoryProbe, GpuMemoryMonitor, GpuMemoryReading,
    PeakTracker,
};
pub use device::{DeviceChoice, DtypeChoice};
pub use durable::{replace_directory, sync_directory, write_synced, DurableError};
pub use exit::Exit;
pub use signal::shutdown_signal;
pub use units::{parse_bytes, parse_duration};
pub use worker::{join_within, DeviceWorker, WorkerChannels, WorkerError, WorkerSide};
