//! The crate's one error type. Each variant names what was being done and
//! by whom, and carries the C++ exception text where c10d raised one.

use std::fmt;

/// The collective operation an error comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    AllReduce,
    Broadcast,
    Barrier,
}

impl fmt::Display for Operation {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            Operation::AllReduce => "all_reduce",
            Operation::Broadcast => "broadcast",
            Operation::Barrier => "barrier",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// Hosting the TCPStore failed: the address did not bind, or c10d
    /// refused the socket.
    #[error("hosting a tcp store on {bind_host}:{port}: {message}")]
    StoreHost {
        bind_host: String,
        port: u16,
        message: String,
    },

    /// The group options cannot form a group; nothing was attempted.
    #[error("group options for rank {rank} of {world_size} (prefix {prefix}): {reason}")]
    InvalidOptions {
        prefix: String,
        rank: usize,
        world_size: usize,
        reason: String,
    },

    /// `Backend::Nccl` asked of a build without the `nccl` feature.
    #[error("backend nccl for rank {rank} of {world_size} (prefix {prefix}): built without feature nccl")]
    NcclUnavailable {
        prefix: String,
        rank: usize,
        world_size: usize,
    },

    /// Connecting to the store or the rendezvous failed (unreachable store,
    /// peers that never came within the timeout, a transport error).
    #[error(
        "joining rank {rank} of {world_size} (prefix {prefix}) at store {store_host}:{store_port}: {message}"
    )]
    Join {
        prefix: String,
        rank: usize,
        world_size: usize,
        store_host: String,
        store_port: u16,
        message: String,
    },

    /// The tensor or root handed to a collective is unusable; nothing was sent.
    #[error("{operation} over rank {rank} of {world_size} (prefix {prefix}): {reason}")]
    InvalidArgument {
        operation: Operation,
        prefix: String,
        rank: usize,
        world_size: usize,
        reason: String,
    },

    /// c10d raised during the collective (a peer died, the timeout passed).
    /// The group is then unusable: form a new one under a new prefix.
    #[error("{operation} over rank {rank} of {world_size} (prefix {prefix}): {message}")]
    Collective {
        operation: Operation,
        prefix: String,
        rank: usize,
        world_size: usize,
        message: String,
    },
}
