//! The accepted connections the gRPC server serves: each with
//! `TCP_NODELAY`, at most `--max-connections` open at once, and (when set)
//! at most `--max-connections-per-peer` from one IP address.
//!
//! tonic applies `tcp_nodelay` only to sockets it binds itself; without it
//! Nagle's algorithm holds small messages (end-of-stream, acks) for a
//! delayed-ACK period. A connection over the cap is closed as soon as it is
//! accepted, before any TLS or HTTP/2 work is spent on it, so a flood of
//! connections cannot take memory or file descriptors from the run's peers;
//! a slot frees when a served connection closes. The per-address cap keeps
//! one misbehaving host (every pod has its own address) from taking all the
//! slots from the rest.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::warn;

/// An accepted connection holding one of the cap's slots (and one of its
/// address's) until it closes.
pub struct CappedConnection {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    _peer_slot: PeerSlot,
}

/// Open connections per peer address.
#[derive(Default)]
struct PeerCounts(parking_lot::Mutex<HashMap<IpAddr, usize>>);

/// One of a peer address's slots, given back on drop.
struct PeerSlot {
    counts: Arc<PeerCounts>,
    peer: Option<IpAddr>,
}

impl PeerCounts {
    /// A slot for `peer`, unless it holds `max` already (0: no cap). A
    /// connection whose address cannot be read counts against the global
    /// cap only.
    fn take(self: &Arc<Self>, peer: Option<IpAddr>, max: usize) -> Option<PeerSlot> {
        let peer = peer.filter(|_| max > 0);
        if let Some(address) = peer {
            let mut counts = self.0.lock();
            let open = counts.entry(address).or_default();
            if *open >= max {
                return None;
            }
            *open += 1;
        }
        Some(PeerSlot {
            counts: self.clone(),
            peer,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        if let Some(address) = self.peer {
            let mut counts = self.counts.0.lock();
            if let Some(open) = counts.get_mut(&address) {
                *open -= 1;
                if *open == 0 {
                    counts.remove(&address);
                }
            }
        }
    }
}

/// The accepted connections of `listener`: at most `max_connections` open
/// at once, and at most `max_per_peer` from one address (0: no such cap).
pub fn capped_incoming(
    listener: TcpListener,
    max_connections: usize,
    max_per_peer: usize,
) -> impl futures::Stream<Item = std::io::Result<CappedConnection>> {
    let slots = Arc::new(Semaphore::new(max_connections));
    let peers = Arc::new(PeerCounts::default());
    let refused = Arc::new(AtomicU64::new(0));
    futures::StreamExt::filter_map(TcpListenerStream::new(listener), move |accepted| {
        let slots = slots.clone();
        let peers = peers.clone();
        let refused = refused.clone();
        async move {
            let stream = match accepted {
                Ok(stream) => stream,
                Err(error) => return Some(Err(error)),
            };
            let peer = stream.peer_addr().ok().map(|address| address.ip());
            let Some(peer_slot) = peers.take(peer, max_per_peer) else {
                refuse(
                    &refused,
                    peer,
                    "--max-connections-per-peer are open from this address",
                );
                return None;
            };
            let Ok(slot) = slots.try_acquire_owned() else {
                refuse(&refused, peer, "--max-connections are open");
                return None;
            };
            let _ = stream.set_nodelay(true);
            Some(Ok(CappedConnection {
                stream,
                _slot: slot,
                _peer_slot: peer_slot,
            }))
        }
    })
}

/// Logs a refused connection (which the caller drops, closing it): the
/// first and then every 1000th, so a flood cannot flood the log too.
fn refuse(refused: &AtomicU64, peer: Option<IpAddr>, why: &str) {
    let count = refused.fetch_add(1, Ordering::Relaxed) + 1;
    if count == 1 || count.is_multiple_of(1000) {
        warn!(?peer, refused_so_far = count, "connection refused: {why}");
    }
}

impl Connected for CappedConnection {
    type ConnectInfo = TcpConnectInfo;
    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for CappedConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(context, buffer)
    }
}

impl AsyncWrite for CappedConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(context, buffer)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffers: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(context, buffers)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(context)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(context)
    }
}
