//! # dflash-client
//!
//! The Rust client of the dflash broker, used by target-servers, drafter-
//! servers, the `dflash` CLI and the system tests.
//!
//! # Layout
//! - [`BrokerClient`]: connects (HTTP/2 windows, keepalive and message limits
//!   set for large payloads), status calls, ReportDone, and opens streams.
//! - `producer`: [`Producer`], a target's pipelined Produce stream with a
//!   bounded window of unanswered items.
//! - `consumer`: [`Consumer`] and its cloneable [`ConsumerHandle`] for acks,
//!   nacks, credit and stats from any thread.
//! - `security`: TLS, mutual TLS and the bearer token of every connection
//!   ([`ClientSecurityArgs`], the flags every client role shares).
//!
//! Depends only on `dflash-proto` and tonic; no model code.

mod consumer;
mod producer;
pub mod security;

use std::time::Duration;

use dflash_proto::transport;
use dflash_proto::v1 as proto;
use dflash_proto::v1::broker_client::BrokerClient as GeneratedClient;
use tonic::transport::Endpoint;

pub use consumer::{Consumer, ConsumerEvent, ConsumerHandle};
pub use producer::{ProduceReport, Producer};
pub use security::{AuthChannel, ClientSecurity, ClientSecurityArgs};

/// Errors of the client, each naming what failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid broker address {address:?}: {source}")]
    InvalidAddress {
        address: String,
        source: tonic::transport::Error,
    },
    #[error("cannot connect to the broker at {address}: {source}")]
    Connect {
        address: String,
        source: tonic::transport::Error,
    },
    #[error(transparent)]
    Security(#[from] security::SecurityError),
    #[error("broker call {call} failed: {status}")]
    Call {
        call: &'static str,
        status: tonic::Status,
    },
    #[error("broker stream {stream} ended unexpectedly{}", if .detail.is_empty() { String::new() } else { format!(": {}", .detail) })]
    StreamEnded {
        stream: &'static str,
        detail: String,
    },
    #[error("broker sent an unexpected message on {stream}: {detail}")]
    Protocol {
        stream: &'static str,
        detail: String,
    },
    #[error("the broker closed this Produce stream ({status:?}): {reason}")]
    ProducerClosed {
        status: proto::RunStatus,
        reason: String,
    },
}

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

/// A connection to the broker. Cheap to clone; each Produce or Consume
/// stream opens its own HTTP/2 connection so one large stream never shares
/// a connection window with another.
#[derive(Clone)]
pub struct BrokerClient {
    address: String,
    options: ClientOptions,
    client: GeneratedClient<AuthChannel>,
}

impl BrokerClient {
    /// Connects to `address` (e.g. `http://127.0.0.1:50051`).
    pub async fn connect(
        address: impl Into<String>,
        options: ClientOptions,
    ) -> Result<Self, ClientError> {
        let address = address.into();
        let client = Self::open_channel(&address, &options).await?;
        Ok(BrokerClient {
            address,
            options,
            client,
        })
    }

    /// The address this client connects to.
    pub fn address(&self) -> &str {
        &self.address
    }

    async fn open_channel(
        address: &str,
        options: &ClientOptions,
    ) -> Result<GeneratedClient<AuthChannel>, ClientError> {
        let channel = connect_channel(address, options).await?;
        Ok(GeneratedClient::new(channel)
            .max_decoding_message_size(options.max_message_bytes)
            .max_encoding_message_size(options.max_message_bytes))
    }

    pub async fn status(&self) -> Result<proto::StatusSnapshot, ClientError> {
        self.client
            .clone()
            .get_status(proto::GetStatusRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| ClientError::Call {
                call: "GetStatus",
                status,
            })
    }

    /// A stream of snapshots every `interval`.
    pub async fn watch_status(
        &self,
        interval: Duration,
    ) -> Result<tonic::Streaming<proto::StatusSnapshot>, ClientError> {
        let interval_ms = u32::try_from(interval.as_millis()).unwrap_or(u32::MAX);
        self.client
            .clone()
            .watch_status(proto::WatchStatusRequest { interval_ms })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| ClientError::Call {
                call: "WatchStatus",
                status,
            })
    }

    /// Reports a target finished with `total_items` accepted items in all.
    pub async fn report_done(
        &self,
        target_id: &str,
        total_items: u64,
    ) -> Result<proto::ReportDoneResponse, ClientError> {
        self.client
            .clone()
            .report_done(proto::ReportDoneRequest {
                target_id: target_id.to_string(),
                total_items,
                ..Default::default()
            })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| ClientError::Call {
                call: "ReportDone",
                status,
            })
    }

    /// Opens a target's Produce stream on its own connection and waits for
    /// the welcome (which says where to resume).
    pub async fn produce(&self, target_id: &str) -> Result<Producer, ClientError> {
        let client = Self::open_channel(&self.address, &self.options).await?;
        Producer::open(client, target_id, self.options.producer_window_items).await
    }

    /// Opens a drafter's Consume stream on its own connection with an initial
    /// credit window, and waits for the welcome.
    pub async fn consume(
        &self,
        drafter_id: &str,
        credit: proto::Credit,
    ) -> Result<Consumer, ClientError> {
        let client = Self::open_channel(&self.address, &self.options).await?;
        Consumer::open(client, drafter_id, credit).await
    }
}

/// A channel to `address` with `options`' transport settings, TLS and token:
/// for other services on the broker's port (health, model sync).
pub async fn connect_channel(
    address: &str,
    options: &ClientOptions,
) -> Result<AuthChannel, ClientError> {
    let endpoint = Endpoint::from_shared(address.to_string())
        .map_err(|source| ClientError::InvalidAddress {
            address: address.to_string(),
            source,
        })?
        .connect_timeout(options.connect_timeout)
        .initial_stream_window_size(Some(options.stream_window_bytes))
        .initial_connection_window_size(Some(options.connection_window_bytes))
        // The broker's deliveries arrive in 1 MiB DATA frames instead of
        // HTTP/2's default 16 KiB.
        .max_frame_size(transport::MAX_FRAME_BYTES)
        .http2_keep_alive_interval(options.keepalive_interval)
        .keep_alive_timeout(options.keepalive_timeout)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true);
    let endpoint = options.security.apply(endpoint, address)?;
    let channel = endpoint
        .connect()
        .await
        .map_err(|source| ClientError::Connect {
            address: address.to_string(),
            source,
        })?;
    Ok(options.security.wrap(channel))
}
