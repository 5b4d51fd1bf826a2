//! [`Store`]: a c10d TCPStore server hosted by this process, where groups
//! rendezvous (each under its own PrefixStore prefix).

use std::ffi::CString;
use std::net::{IpAddr, TcpListener};
use std::os::fd::IntoRawFd;
use std::time::Duration;

use crate::error::CollectiveError;
use crate::ffi::timeout_millis;
use crate::ffi::StoreHandle;

/// A c10d TCPStore *server* hosted by this process. It lives as long as this
/// value or any [`crate::ProcessGroup`] built over it, whichever is last.
/// Like c10d's, it has no authentication: keep it on a private network.
pub struct Store {
    pub(crate) handle: StoreHandle,
    /// The address the listening socket is bound to, as the caller gave it.
    bind_host: String,
    port: u16,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Store")
            .field("bind_host", &self.bind_host)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Listen on `bind_host:port` (port 0 = any free port, then `port()` tells which).
    ///
    /// The socket is bound here (so `bind_host` is honoured; c10d alone would
    /// listen on every interface) and handed to TCPStore, which owns it from
    /// then on. `timeout` bounds the store's own client operations.
    pub fn host(bind_host: &str, port: u16, timeout: Duration) -> Result<Store, CollectiveError> {
        let store_error = |message: String| CollectiveError::StoreHost {
            bind_host: bind_host.to_string(),
            port,
            message,
        };
        let timeout_ms = timeout_millis(timeout).map_err(store_error)?;
        let listener = TcpListener::bind((bind_host, port))
            .map_err(|error| store_error(format!("binding: {error}")))?;
        let bound_address = listener
            .local_addr()
            .map_err(|error| store_error(format!("reading the bound address: {error}")))?;
        // TCPStore's server also connects a client to itself: an unspecified
        // bind address is reached through loopback.
        let self_client_host = match bound_address.ip() {
            IpAddr::V4(address) if address.is_unspecified() => "127.0.0.1".to_string(),
            IpAddr::V6(address) if address.is_unspecified() => "::1".to_string(),
            address => address.to_string(),
        };
        let self_client_host = CString::new(self_client_host)
            .map_err(|_| store_error("the bound address holds a nul byte".to_string()))?;
        let (handle, reported_port) = StoreHandle::host(
            &self_client_host,
            listener.into_raw_fd(),
            bound_address.port(),
            timeout_ms,
        )
        .map_err(store_error)?;
        Ok(Store {
            handle,
            bind_host: bind_host.to_string(),
            port: reported_port,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The host this store was asked to bind to.
    pub fn bind_host(&self) -> &str {
        &self.bind_host
    }

    /// Whether `store_host:store_port` names this store, as far as can be
    /// told without resolving names: the same port, and the same host or a
    /// loopback name on both sides (an unspecified bind address listens on
    /// loopback too). When unsure, false: a client connection to oneself
    /// works, a wrong store would not.
    pub(crate) fn is_at(&self, store_host: &str, store_port: u16) -> bool {
        if store_port != self.port {
            return false;
        }
        if store_host == self.bind_host {
            return true;
        }
        let bind_reaches_loopback = is_loopback(&self.bind_host)
            || self
                .bind_host
                .parse::<IpAddr>()
                .is_ok_and(|address| address.is_unspecified());
        bind_reaches_loopback && is_loopback(store_host)
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<IpAddr>()
            .is_ok_and(|address| address.is_loopback())
}
