//! A data-parallel member's one connection to the broker for everything
//! but its samples: the lighthouse (`Lighthouse.Quorum`, `Commit`) and the
//! run's model (`ModelSync.ReadModel` at the start, `ModelSync.Session`
//! snapshots). Connected on first use and then shared: one HTTP/2
//! connection, which tonic re-establishes when the broker comes back. The
//! samples come on the Consume stream, the pump's own.
//!
//! The training thread makes these calls one at a time, so a snapshot's
//! upload never holds up a quorum call on the shared connection.

use std::sync::Arc;

use dflash_client::{AuthChannel, ClientOptions, ClientSecurityArgs};

/// Why the broker could not be reached: its address and what failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkError {
    pub address: String,
    pub detail: String,
}

/// The shared connection (see the module doc).
pub struct BrokerLink {
    broker: String,
    security: ClientSecurityArgs,
    channel: tokio::sync::OnceCell<AuthChannel>,
}

impl BrokerLink {
    /// A link to `broker` with the drafter's TLS and token (as its Consume
    /// stream's); nothing is connected yet.
    pub fn new(broker: &str, security: ClientSecurityArgs) -> Arc<Self> {
        Arc::new(BrokerLink {
            broker: broker.to_string(),
            security,
            channel: tokio::sync::OnceCell::new(),
        })
    }

    /// The broker's address, for errors.
    pub fn address(&self) -> &str {
        &self.broker
    }

    /// The connection, made by the first caller (with the transport
    /// settings of every other stream: `dflash_proto::transport`); a failed
    /// first connect is tried again by the next caller.
    pub async fn channel(&self) -> Result<AuthChannel, LinkError> {
        self.channel
            .get_or_try_init(|| async {
                let error = |detail: String| LinkError {
                    address: self.broker.clone(),
                    detail,
                };
                let security = self
                    .security
                    .load()
                    .map_err(|load| error(load.to_string()))?;
                let options = ClientOptions {
                    security,
                    ..ClientOptions::default()
                };
                dflash_client::connect_channel(&self.broker, &options)
                    .await
                    .map_err(|connect| error(connect.to_string()))
            })
            .await
            .cloned()
    }
}
