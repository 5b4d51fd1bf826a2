//! The gRPC adapter: converts `dflash.v1` messages to queue operations and
//! queue effects back to stream messages. All rules live in `queue`.
//!
//! Concurrency: one mutex around the queue and the per-stream outboxes.
//! Every operation runs under it and collects the messages it decided (its
//! effects, welcomes, answers) as [`Outgoing`]s. With `--state-dir`, the
//! operation's journal entries and those messages go to the write-ahead
//! log's writer thread in one channel send, and the thread sends the
//! messages once the entries are as durable as `--fsync` promises
//! (`wal::writer`); without a log, or with nothing logged and nothing
//! still in flight, they are sent before the lock is released. Either way a
//! stream's messages leave in the order the queue decided them, and no
//! message tells a peer about state a crash could take back. Nothing under
//! the lock blocks, writes to disk or copies payload bytes (channel sends
//! only; payloads are reference-counted).
//!
//! # Layout
//! - `mod.rs`: the RPC entry points (`impl Broker`), stream guards, the
//!   checks every hello goes through (ids, run id, first message).
//! - `shared`: [`Shared`], the state behind the one lock (queue, outboxes,
//!   the write-ahead log's writer), `with_queue` (run an operation, route
//!   its messages through the log), the ticker, shutdown of streams.
//! - `produce`: a Produce stream: hello and welcome, the reader task,
//!   item checks, waiting for room, accepting, refusing.
//! - `consume`: a Consume stream: hello and welcome, the reader task
//!   (acks, nacks, credit, lease extension, stats).

use crate::roles::{validate_id, Principal, Role};
use crate::rpc_error::RpcError;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use dflash_proto::v1 as proto;
use dflash_proto::v1::broker_server::Broker;
use futures::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use crate::payload::ProduceIn;
use crate::queue::ConnectionId;

mod consume;
mod consume_out;
mod outbox;
mod produce;
mod shared;
mod steps;

pub use consume_out::ConsumeOut;
use shared::Outgoing;
pub(crate) use shared::Shared;

use outbox::OutboxStream;

/// A Produce stream's messages, however they were decoded (from the
/// received frames by the `zero_copy` route, or by tonic).
pub type InboundProduce = Pin<Box<dyn Stream<Item = Result<ProduceIn, Status>> + Send>>;

#[derive(Clone, Copy)]
enum StreamKind {
    Producer,
    Consumer,
}

/// Closes the stream's queue connection when the response stream is dropped
/// (the client went away), whatever the reader task is doing.
struct ConnectionGuard {
    shared: Arc<Shared>,
    connection: ConnectionId,
    kind: StreamKind,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        let connection = self.connection;
        let gone = self.shared.with_queue(|locked, now| match self.kind {
            StreamKind::Producer => {
                locked.remove_producer_outbox(connection);
                locked.queue.close_producer(connection, now);
                None
            }
            StreamKind::Consumer => {
                locked.consumer_outboxes.remove(&connection);
                locked.queue.close_consumer_of(connection, now)
            }
        });
        self.shared.drafter_gone(gone);
    }
}

/// A response stream that closes its queue connection when dropped.
pub struct GuardedStream<T> {
    inner: OutboxStream<T>,
    _guard: ConnectionGuard,
}

impl<T> Stream for GuardedStream<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.inner).poll_next(context)
    }
}

/// The `dflash.v1.Broker` service.
#[derive(Clone)]
pub struct BrokerService {
    shared: Arc<Shared>,
}

impl BrokerService {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        BrokerService { shared }
    }
}

/// Waits for the stream's first message, which must be its hello, at most
/// `--hello-timeout`.
async fn first_message<T, S>(inbound: &mut S, timeout: Duration) -> Result<T, Status>
where
    S: Stream<Item = Result<T, Status>> + Unpin,
{
    match tokio::time::timeout(timeout, futures::StreamExt::next(inbound)).await {
        Err(_) => Err(RpcError::NoHello(timeout).into()),
        Ok(Some(Err(status))) => Err(status),
        Ok(None) => Err(RpcError::StreamEndedBeforeHello.into()),
        Ok(Some(Ok(message))) => Ok(message),
    }
}

/// The stream's next message; `Ok(None)` when it ended or the broker is
/// shutting down, `Err` when it broke (each reader then closes its queue
/// connection).
async fn next_request<T, S>(
    shutdown: &CancellationToken,
    inbound: &mut S,
    connection: ConnectionId,
    role: &'static str,
) -> Result<Option<T>, Status>
where
    S: Stream<Item = Result<T, Status>> + Unpin,
{
    let message = tokio::select! {
        _ = shutdown.cancelled() => return Ok(None),
        message = futures::StreamExt::next(inbound) => message,
    };
    message
        .transpose()
        .inspect_err(|status| debug!(connection, %status, role, "stream broke"))
}

/// Whether a broken inbound stream broke on a message over the decoding
/// limit (both decoders answer OUT_OF_RANGE, "too large", before reading
/// its body).
fn is_oversized_message(status: &Status) -> bool {
    status.code() == tonic::Code::OutOfRange && status.message().contains("too large")
}

/// Why a hello or ReportDone from an earlier run is refused: this broker
/// does not have that run's state, so resuming into it would hide loss.
fn check_run_id(caller: &str, remembered: &str, current: &str) -> Result<(), RpcError> {
    if remembered.is_empty() || remembered == current {
        return Ok(());
    }
    Err(RpcError::OtherRun {
        caller: caller.to_string(),
        remembered: remembered.to_string(),
        current: current.to_string(),
    })
}

#[tonic::async_trait]
impl Broker for BrokerService {
    type ProduceStream = GuardedStream<proto::ProduceResponse>;
    type ConsumeStream = Pin<Box<dyn Stream<Item = Result<proto::ConsumeResponse, Status>> + Send>>;
    type WatchStatusStream =
        Pin<Box<dyn Stream<Item = Result<proto::StatusSnapshot, Status>> + Send>>;

    /// tonic's decoding; the broker serves Produce through `zero_copy`,
    /// which decodes from the received frames and calls [`Self::open_produce`].
    async fn produce(
        &self,
        request: Request<Streaming<proto::ProduceRequest>>,
    ) -> Result<Response<Self::ProduceStream>, Status> {
        let principal = Principal::of(request.extensions());
        let inbound = futures::StreamExt::map(request.into_inner(), |request| {
            request.map(ProduceIn::from_proto)
        });
        self.open_produce(Box::pin(inbound), principal)
            .await
            .map(Response::new)
    }

    async fn report_done(
        &self,
        request: Request<proto::ReportDoneRequest>,
    ) -> Result<Response<proto::ReportDoneResponse>, Status> {
        let principal = Principal::of(request.extensions());
        let request = request.into_inner();
        validate_id("target_id", &request.target_id)?;
        // Only the target's own credential may end its shard, and nobody
        // else learns its epoch or counts from the refusal.
        principal.authorize(Role::Target, &request.target_id, "ReportDone")?;
        check_run_id(
            &format!("ReportDone for target {:?}", request.target_id),
            &request.run_id,
            &self.shared.run_id,
        )?;
        let (durable, logged) = tokio::sync::oneshot::channel();
        let done = self
            .shared
            .with_queue(|locked, now| {
                let done = locked.queue.report_done(
                    &request.target_id,
                    request.total_items,
                    request.epoch,
                    now,
                );
                locked.post(Outgoing::Durable(durable));
                done
            })
            .inspect_err(|error| {
                warn!(target_id = %request.target_id, epoch = request.epoch, %error, "ReportDone refused")
            })?;
        // Answered once `done` is as durable as `--fsync` promises: a
        // target that hears it never reports again.
        logged.await.map_err(|_| RpcError::DoneNotLogged {
            target_id: request.target_id.clone(),
        })?;
        info!(
            target_id = %request.target_id,
            total_items = request.total_items,
            done_targets = done.done_targets,
            expected_targets = done.expected_targets,
            already_done = done.already_done,
            "target reported done"
        );
        Ok(Response::new(proto::ReportDoneResponse {
            done_targets: done.done_targets,
            expected_targets: done.expected_targets,
            already_done: done.already_done,
        }))
    }

    /// Deliveries as prost messages; the broker serves Consume through
    /// `zero_copy`, which passes each payload through.
    async fn consume(
        &self,
        request: Request<Streaming<proto::ConsumeRequest>>,
    ) -> Result<Response<Self::ConsumeStream>, Status> {
        let principal = Principal::of(request.extensions());
        let outgoing = self.open_consume(request.into_inner(), principal).await?;
        let messages =
            futures::StreamExt::map(outgoing, |message| message.map(ConsumeOut::into_proto));
        Ok(Response::new(Box::pin(messages)))
    }

    async fn get_status(
        &self,
        _request: Request<proto::GetStatusRequest>,
    ) -> Result<Response<proto::StatusSnapshot>, Status> {
        Ok(Response::new(self.shared.snapshot()))
    }

    async fn watch_status(
        &self,
        request: Request<proto::WatchStatusRequest>,
    ) -> Result<Response<Self::WatchStatusStream>, Status> {
        let interval_ms = match request.into_inner().interval_ms {
            0 => 1000,
            interval_ms => interval_ms.max(50),
        };
        let shared = self.shared.clone();
        let shutdown = self.shared.shutdown.clone();
        let ticks = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(
            Duration::from_millis(u64::from(interval_ms)),
        ));
        let stream = futures::StreamExt::map(ticks, move |_| Ok(shared.snapshot()));
        let stream = futures::StreamExt::take_until(stream, shutdown.cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }
}
