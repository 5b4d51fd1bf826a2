//! [`ClientOptions`]: the transport settings of a client, and their
//! defaults with the security a server's flags give.

use std::time::Duration;

use dflash_proto::transport;

use crate::security::{ClientSecurity, ClientSecurityArgs, SecurityError};

/// Transport settings. The defaults suit hidden-state payloads of up to 256 MiB.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub connect_timeout: Duration,
    pub max_message_bytes: usize,
    pub stream_window_bytes: u32,
    pub connection_window_bytes: u32,
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// Items a producer may have sent and not yet had answered.
    pub producer_window_items: usize,
    /// TLS and the bearer token (none by default).
    pub security: ClientSecurity,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(10),
            max_message_bytes: transport::message_limit_bytes(transport::DEFAULT_MAX_ITEM_BYTES),
            stream_window_bytes: transport::STREAM_WINDOW_BYTES,
            connection_window_bytes: transport::CONNECTION_WINDOW_BYTES,
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(20),
            producer_window_items: 16,
            security: ClientSecurity::default(),
        }
    }
}

impl ClientSecurityArgs {
    /// [`ClientOptions`] defaults with this security.
    pub fn client_options(&self) -> Result<ClientOptions, SecurityError> {
        Ok(ClientOptions {
            security: self.load()?,
            ..ClientOptions::default()
        })
    }
}
