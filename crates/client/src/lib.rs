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
//! - `backoff`: [`Backoff`], the doubling wait between reconnect attempts
//!   that every client role uses.
//! - `wire`: the Produce and Consume streams' bodies without tonic's
//!   copies: an item's tensors go out as their own chunks (no copy), a
//!   delivery's tensors are views on the received HTTP/2 frames (joined
//!   once only when one spans frames; [`Consumer::copies`] counts).
//! - `fuzzing` (hidden): the fuzz body of the client's decoder of what the
//!   broker sends (deliveries and Produce answers) and its seeds; run by
//!   `tests/fuzz` and, over the committed corpus, by `tests/fuzz_corpus.rs`.
//!
//! A client remembers the broker's run id from its first welcome and each
//! target's latest epoch, and sends them in later hellos and ReportDone: a
//! broker that lost the run (a new run id) or a fenced stream is refused with
//! a status [`ClientError::is_retryable`] says not to retry.
//!
//! Depends only on `dflash-proto` and tonic; no model code.

mod backoff;
mod consumer;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod options;
mod producer;
pub mod security;
mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dflash_proto::transport;
use dflash_proto::v1 as proto;
use dflash_proto::v1::broker_client::BrokerClient as GeneratedClient;
use tonic::transport::Endpoint;

pub use backoff::Backoff;
pub use consumer::{Consumer, ConsumerEvent, ConsumerHandle};
pub use error::{ClientError, RETRYABLE_CODES};
pub use options::ClientOptions;
pub use producer::{ProduceReport, Producer};
pub use security::{AuthChannel, ClientSecurity, ClientSecurityArgs};

/// What a client learned from the broker's welcomes, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct Session {
    /// The run id from the first welcome; sent in every later hello.
    run_id: Option<String>,
    /// Each target's epoch from its latest Produce welcome.
    epochs: HashMap<String, u64>,
}

impl Session {
    /// Records a welcome's run id; an error when it differs from the one
    /// this client already worked in.
    pub(crate) fn observe_run(&mut self, run_id: &str) -> Result<(), ClientError> {
        if run_id.is_empty() {
            return Ok(());
        }
        match &self.run_id {
            Some(remembered) if remembered != run_id => Err(ClientError::RunChanged {
                remembered: remembered.clone(),
                current: run_id.to_string(),
            }),
            Some(_) => Ok(()),
            None => {
                self.run_id = Some(run_id.to_string());
                Ok(())
            }
        }
    }

    pub(crate) fn run_id(&self) -> String {
        self.run_id.clone().unwrap_or_default()
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
    session: Arc<Mutex<Session>>,
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
            session: Arc::new(Mutex::new(Session::default())),
        })
    }

    /// Seeds the run id a previous client of this process worked in, so a
    /// reconnect through a fresh client still refuses a broker that lost
    /// that run.
    pub fn remembering_run(self, run_id: Option<String>) -> Self {
        if run_id.is_some() {
            self.session().run_id = run_id;
        }
        self
    }

    /// The run id this client works in (from its first welcome), if any.
    pub fn run_id(&self) -> Option<String> {
        self.session().run_id.clone()
    }

    fn session(&self) -> std::sync::MutexGuard<'_, Session> {
        // A panic while holding this lock leaves plain data behind: go on.
        self.session
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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

    /// Reports a target finished with `total_items` accepted items in all,
    /// with the epoch of this client's latest Produce stream for the target
    /// and the run id: the broker refuses a report from a fenced stream or
    /// an earlier run.
    pub async fn report_done(
        &self,
        target_id: &str,
        total_items: u64,
    ) -> Result<proto::ReportDoneResponse, ClientError> {
        let (epoch, run_id) = {
            let session = self.session();
            (
                session.epochs.get(target_id).copied().unwrap_or(0),
                session.run_id(),
            )
        };
        self.client
            .clone()
            .report_done(proto::ReportDoneRequest {
                target_id: target_id.to_string(),
                total_items,
                epoch,
                run_id,
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
        let channel = connect_channel(&self.address, &self.options).await?;
        let run_id = self.session().run_id();
        let producer = Producer::open(
            channel,
            target_id,
            &run_id,
            self.options.producer_window_items,
            self.options.max_message_bytes,
        )
        .await?;
        let mut session = self.session();
        session.observe_run(producer.run_id())?;
        session
            .epochs
            .insert(target_id.to_string(), producer.epoch());
        drop(session);
        Ok(producer)
    }

    /// Opens a drafter's Consume stream on its own connection with an initial
    /// credit window, and waits for the welcome.
    pub async fn consume(
        &self,
        drafter_id: &str,
        credit: proto::Credit,
    ) -> Result<Consumer, ClientError> {
        let channel = connect_channel(&self.address, &self.options).await?;
        let run_id = self.session().run_id();
        let consumer = Consumer::open(
            channel,
            drafter_id,
            credit,
            &run_id,
            self.options.max_message_bytes,
        )
        .await?;
        self.session().observe_run(&consumer.welcome().run_id)?;
        Ok(consumer)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `DeadlineExceeded` → `DEADLINE_EXCEEDED`, as grpc's Python names it.
    fn python_name(code: tonic::Code) -> String {
        let mut name = String::new();
        for (index, letter) in format!("{code:?}").chars().enumerate() {
            if letter.is_ascii_uppercase() && index > 0 {
                name.push('_');
            }
            name.push(letter.to_ascii_uppercase());
        }
        name
    }

    #[test]
    fn the_python_client_retries_the_same_statuses() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../clients/python/dflash_client/aio.py"
        );
        let source = std::fs::read_to_string(path).unwrap();
        let start = source.find("RETRYABLE_CODES = frozenset(").unwrap();
        let end = start + source[start..].find("\n)").unwrap();
        let mut python: Vec<String> = source[start..end]
            .split("grpc.StatusCode.")
            .skip(1)
            .map(|rest| {
                rest.chars()
                    .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                    .collect()
            })
            .collect();
        let mut rust: Vec<String> = RETRYABLE_CODES.iter().map(|&c| python_name(c)).collect();
        python.sort();
        rust.sort();
        assert_eq!(python, rust);
        assert_eq!(
            python_name(tonic::Code::DeadlineExceeded),
            "DEADLINE_EXCEEDED"
        );
    }

    #[test]
    fn refusals_are_not_retried_and_transport_failures_are() {
        let call = |code| ClientError::Call {
            call: "Produce",
            status: tonic::Status::new(code, "x"),
        };
        for code in [
            tonic::Code::FailedPrecondition,
            tonic::Code::Unauthenticated,
            tonic::Code::PermissionDenied,
            tonic::Code::InvalidArgument,
            tonic::Code::NotFound,
            tonic::Code::Aborted,
            tonic::Code::ResourceExhausted,
            tonic::Code::OutOfRange,
            tonic::Code::Unimplemented,
        ] {
            assert!(!call(code).is_retryable(), "{code:?}");
        }
        for code in RETRYABLE_CODES {
            assert!(call(code).is_retryable(), "{code:?}");
        }
    }
}
