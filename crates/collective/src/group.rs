//! [`ProcessGroup`]: one c10d process group (Gloo, or NCCL with the `nccl`
//! feature) formed at a store under a prefix, and its three collectives.

use std::ffi::{c_int, CString};
use std::time::Duration;

use crate::backend::Backend;
use crate::error::CollectiveError;
use crate::error::Operation;
use crate::ffi::timeout_millis;
use crate::ffi::{self, GroupHandle, RawGroupOptions};
use crate::store::Store;

/// Where and as whom to join a group.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// Host of the TCPStore every rank rendezvouses at.
    pub store_host: String,
    pub store_port: u16,
    /// The PrefixStore prefix: one per group incarnation (a new group after a
    /// member leaves needs a new prefix on the same store).
    pub prefix: String,
    pub rank: usize,
    pub world_size: usize,
    /// address of this process's interface for Gloo's transport (e.g. "127.0.0.1")
    pub interface_host: String,
    /// Bounds connecting to the store, the rendezvous and every collective.
    pub timeout: Duration,
    /// Gloo (CPU tensors) or NCCL (CUDA tensors, `nccl` feature only).
    pub backend: Backend,
}

impl Default for GroupOptions {
    /// A world of one on a loopback store at port 0 (fill in the port),
    /// Gloo, a 60 s timeout.
    fn default() -> Self {
        GroupOptions {
            store_host: "127.0.0.1".to_string(),
            store_port: 0,
            prefix: String::new(),
            rank: 0,
            world_size: 1,
            interface_host: "127.0.0.1".to_string(),
            timeout: Duration::from_secs(60),
            backend: Backend::Gloo,
        }
    }
}

/// One member of a c10d process group. `Send`, not `Sync`: one thread at a
/// time. After a collective fails (a peer died, the timeout passed) the group
/// is unusable: drop it and form a new one under a new prefix.
///
/// Dropping never blocks: the C++ group is destroyed on a detached thread,
/// because ProcessGroupGloo (libtorch 2.13) has no working abort and its
/// destructor waits for a collective stuck on a stopped peer until the
/// timeout. [`groups_being_destroyed`](crate::groups_being_destroyed) counts
/// those still in progress.
pub struct ProcessGroup {
    handle: GroupHandle,
    rank: usize,
    world_size: usize,
    prefix: String,
    backend: Backend,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("prefix", &self.prefix)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl ProcessGroup {
    /// Rendezvous at the store (if `local_store` is Some and is the store at store_host:store_port, use it rather than a client connection), under PrefixStore(prefix).
    ///
    /// Blocks until all `world_size` ranks have joined, or fails at the
    /// timeout. A `local_store` that is not the store at
    /// `store_host:store_port` is ignored (a client connection is made).
    pub fn new(
        options: &GroupOptions,
        local_store: Option<&Store>,
    ) -> Result<ProcessGroup, CollectiveError> {
        let invalid = |reason: String| CollectiveError::InvalidOptions {
            prefix: options.prefix.clone(),
            rank: options.rank,
            world_size: options.world_size,
            reason,
        };
        if options.world_size == 0 {
            return Err(invalid(
                "world size 0: a group needs at least one rank".to_string(),
            ));
        }
        let world_size = c_int::try_from(options.world_size)
            .map_err(|_| invalid(format!("world size {} is too large", options.world_size)))?;
        if options.rank >= options.world_size {
            return Err(invalid(format!(
                "rank {} is not below world size {}",
                options.rank, options.world_size
            )));
        }
        let rank = c_int::try_from(options.rank)
            .map_err(|_| invalid(format!("rank {} is too large", options.rank)))?;
        let timeout_ms = timeout_millis(options.timeout).map_err(invalid)?;
        let c_string = |what: &str, value: &str| {
            CString::new(value).map_err(|_| invalid(format!("{what} {value:?} holds a nul byte")))
        };
        let store_host = c_string("store host", &options.store_host)?;
        let prefix = c_string("prefix", &options.prefix)?;
        let interface_host = c_string("interface host", &options.interface_host)?;
        let backend = match options.backend {
            Backend::Gloo => ffi::BACKEND_GLOO,
            Backend::Nccl if cfg!(feature = "nccl") => ffi::BACKEND_NCCL,
            Backend::Nccl => {
                return Err(CollectiveError::NcclUnavailable {
                    prefix: options.prefix.clone(),
                    rank: options.rank,
                    world_size: options.world_size,
                })
            }
        };
        let local_store = local_store
            .filter(|store| store.is_at(&options.store_host, options.store_port))
            .map(|store| &store.handle);
        let handle = GroupHandle::new(&RawGroupOptions {
            store_host: &store_host,
            store_port: options.store_port,
            local_store,
            prefix: &prefix,
            rank,
            world_size,
            interface_host: &interface_host,
            timeout_ms,
            backend,
        })
        .map_err(|message| CollectiveError::Join {
            prefix: options.prefix.clone(),
            rank: options.rank,
            world_size: options.world_size,
            store_host: options.store_host.clone(),
            store_port: options.store_port,
            message,
        })?;
        Ok(ProcessGroup {
            handle,
            rank: options.rank,
            world_size: options.world_size,
            prefix: options.prefix.clone(),
            backend: options.backend,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// In place, sum over ranks, one contiguous tensor (f32 on CPU for Gloo; any dtype c10d allows). Blocks until done or the group timeout.
    pub fn all_reduce_sum(&self, tensor: &mut tch::Tensor) -> Result<(), CollectiveError> {
        self.check_tensor(Operation::AllReduce, tensor)?;
        self.handle
            .all_reduce_sum(tensor)
            .map_err(|message| self.collective_error(Operation::AllReduce, message))
    }

    /// In place, every rank ends with `root`'s values.
    pub fn broadcast(&self, tensor: &mut tch::Tensor, root: usize) -> Result<(), CollectiveError> {
        self.check_tensor(Operation::Broadcast, tensor)?;
        if root >= self.world_size {
            return Err(self.invalid_argument(
                Operation::Broadcast,
                format!("root {root} is not below world size {}", self.world_size),
            ));
        }
        let root = c_int::try_from(root).map_err(|_| {
            self.invalid_argument(Operation::Broadcast, format!("root {root} is too large"))
        })?;
        self.handle
            .broadcast(tensor, root)
            .map_err(|message| self.collective_error(Operation::Broadcast, message))
    }

    pub fn barrier(&self) -> Result<(), CollectiveError> {
        self.handle
            .barrier()
            .map_err(|message| self.collective_error(Operation::Barrier, message))
    }

    /// c10d checks these too, but with messages that do not say which call.
    fn check_tensor(
        &self,
        operation: Operation,
        tensor: &tch::Tensor,
    ) -> Result<(), CollectiveError> {
        if !tensor.defined() {
            return Err(self.invalid_argument(operation, "tensor is undefined".to_string()));
        }
        if !tensor.is_contiguous() {
            return Err(self.invalid_argument(
                operation,
                format!("tensor of shape {:?} is not contiguous", tensor.size()),
            ));
        }
        Ok(())
    }

    fn invalid_argument(&self, operation: Operation, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            operation,
            prefix: self.prefix.clone(),
            rank: self.rank,
            world_size: self.world_size,
            reason,
        }
    }

    fn collective_error(&self, operation: Operation, message: String) -> CollectiveError {
        CollectiveError::Collective {
            operation,
            prefix: self.prefix.clone(),
            rank: self.rank,
            world_size: self.world_size,
            message,
        }
    }
}
