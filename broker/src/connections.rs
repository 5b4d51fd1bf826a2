//! The accepted connections the gRPC server serves: each with
//! `TCP_NODELAY`, and at most `--max-connections` open at once.
//!
//! tonic applies `tcp_nodelay` only to sockets it binds itself; without it
//! Nagle's algorithm holds small messages (end-of-stream, acks) for a
//! delayed-ACK period. A connection over the cap is closed as soon as it is
//! accepted, before any TLS or HTTP/2 work is spent on it, so a flood of
//! connections cannot take memory or file descriptors from the run's peers;
//! a slot frees when a served connection closes.

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

/// An accepted connection holding one of the cap's slots until it closes.
pub struct CappedConnection {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

/// The accepted connections of `listener`, at most `max_connections` open
/// at once.
pub fn capped_incoming(
    listener: TcpListener,
    max_connections: usize,
) -> impl futures::Stream<Item = std::io::Result<CappedConnection>> {
    let slots = Arc::new(Semaphore::new(max_connections));
    let refused = Arc::new(AtomicU64::new(0));
    futures::StreamExt::filter_map(TcpListenerStream::new(listener), move |accepted| {
        let slots = slots.clone();
        let refused = refused.clone();
        async move {
            let stream = match accepted {
                Ok(stream) => stream,
                Err(error) => return Some(Err(error)),
            };
            match slots.try_acquire_owned() {
                Ok(slot) => {
                    let _ = stream.set_nodelay(true);
                    Some(Ok(CappedConnection {
                        stream,
                        _slot: slot,
                    }))
                }
                Err(_) => {
                    let count = refused.fetch_add(1, Ordering::Relaxed) + 1;
                    // The first and then every 1000th, so a flood cannot
                    // flood the log too.
                    if count == 1 || count.is_multiple_of(1000) {
                        warn!(
                            peer = ?stream.peer_addr().ok(),
                            max_connections,
                            refused_so_far = count,
                            "connection refused: --max-connections are open"
                        );
                    }
                    drop(stream);
                    None
                }
            }
        }
    })
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
