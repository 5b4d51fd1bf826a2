//! The gRPC adapter: converts `dflash.v1` messages to queue operations and
//! queue effects back to stream messages. All rules live in `queue`.
//!
//! Concurrency: one mutex around the queue and the per-stream outboxes.
//! Every operation runs under it and dispatches its effects before it is
//! released, so a stream's messages leave in the order the queue decided
//! them; only end-of-stream messages are sent just after it is released
//! (their outboxes have left the map under it, so nothing can follow them),
//! which keeps the fan-out to every drafter out of the lock. Nothing under
//! the lock blocks or copies payload bytes.

use crate::roles::{Principal, Role};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;
use dflash_proto::v1::broker_server::Broker;
use dflash_telemetry::TRACE_TARGET;
use futures::Stream;
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn, Instrument};

use crate::config::BrokerConfig;
use crate::convert::{self, WirePayload};
use crate::payload::{ProduceIn, WireItem};
use crate::queue::{
    ConnectionId, Delivery, Effect, ItemAccepted, Queue, QueueError, RejectReason, RunStatus,
};
use crate::wal::{Wal, WalError};

/// How long a new stream may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest accepted target or drafter id.
const MAX_ID_LENGTH: usize = 256;
/// Floor on the ticker's sleep, so a deadline that `tick` leaves in place
/// cannot make it spin.
const MIN_TICK_SPACING: Duration = Duration::from_millis(1);

type Outbox<T> = mpsc::UnboundedSender<Result<T, Status>>;

/// A Produce stream's messages, however they were decoded (from the
/// received frames by the `zero_copy` route, or by tonic).
pub type InboundProduce = Pin<Box<dyn Stream<Item = Result<ProduceIn, Status>> + Send>>;

/// What a Consume stream sends: a delivery (encoded by the route with its
/// payload passed through) or any other message.
#[derive(Debug)]
pub enum ConsumeOut {
    Delivery(Delivery<WirePayload>),
    Message(proto::ConsumeResponse),
}

impl ConsumeOut {
    /// prost's message (the payload joined into one buffer per tensor: a
    /// copy when it arrived in several frames). For the generated route;
    /// the broker serves Consume through `zero_copy`.
    pub fn into_proto(self) -> proto::ConsumeResponse {
        match self {
            ConsumeOut::Message(message) => message,
            ConsumeOut::Delivery(delivery) => {
                let item = delivery.payload.item.to_proto();
                proto::ConsumeResponse {
                    kind: Some(proto::consume_response::Kind::Delivery(proto::Delivery {
                        delivery_id: delivery.delivery_id,
                        target_id: delivery.target_id.to_string(),
                        seq: delivery.seq,
                        sample: item.sample,
                        delivery_count: delivery.delivery_count,
                        trace_context: item.trace_context,
                    })),
                }
            }
        }
    }
}

/// What is guarded by the one lock.
struct Locked {
    queue: Queue<WirePayload>,
    consumer_outboxes: HashMap<ConnectionId, Outbox<ConsumeOut>>,
    producer_outboxes: HashMap<ConnectionId, Outbox<proto::ProduceResponse>>,
    /// Set when a Produce stream's outbox is removed (the stream ended, was
    /// fenced or closed); `with_queue` takes it to wake readers waiting for
    /// room, so a gone stream's reader drops its decoded item at once.
    producer_stream_ended: bool,
    /// When the ticker will next wake on its own; an operation that creates
    /// an earlier deadline wakes it sooner.
    ticker_wakes_at: Option<Instant>,
    /// The write-ahead log, with `--state-dir`.
    wal: Option<Wal<WirePayload>>,
}

impl Locked {
    /// Appends the queue's new journal entries to the write-ahead log (a
    /// no-op without `--state-dir`), starting a background compaction when
    /// it outgrew its bound.
    /// Called before any answer that depends on them leaves. A failed write
    /// aborts the run: a broker that cannot keep what it accepted must not
    /// say "accepted".
    fn persist(&mut self) {
        let Some(wal) = &mut self.wal else {
            return;
        };
        let entries = self.queue.take_journal();
        if entries.is_empty() {
            return;
        }
        let mut result = wal.append(&entries);
        // The checkpoint is written on the log's own thread: under this lock
        // only the entry list is built (payloads are shared, not copied).
        if result.is_ok() && wal.needs_compaction() && !wal.is_compacting() {
            result = wal.compact_in_background(self.queue.checkpoint_entries());
        }
        if let Err(error) = result {
            tracing::error!(%error, "write-ahead log failed; aborting the run");
            self.wal = None;
            self.queue.disable_journal();
            self.queue
                .abort(format!("the write-ahead log failed: {error}"));
        }
    }

    /// Routes effects to their streams. End-of-stream messages are returned
    /// instead of sent: their outboxes have left the map, so nothing can
    /// follow them, and the caller sends them once the lock is released
    /// (the fan-out to every drafter then neither holds the lock nor wakes
    /// streams whose closing would wait for it).
    fn dispatch(&mut self, effects: Vec<Effect<WirePayload>>) -> Vec<Ending> {
        let mut endings = Vec::new();
        for effect in effects {
            match effect {
                Effect::Deliver {
                    connection,
                    delivery,
                } => self.deliver(connection, delivery),
                Effect::EndConsumer {
                    connection,
                    outcome,
                    reason,
                    summary,
                } => {
                    if let Some(outbox) = self.consumer_outboxes.remove(&connection) {
                        endings.push(Ending {
                            outbox,
                            outcome,
                            reason,
                            summary,
                        });
                    }
                }
                Effect::CloseProducer {
                    connection,
                    outcome,
                    reason,
                } => self.close_producer(connection, outcome, reason),
            }
        }
        endings
    }

    /// Hands one delivery to its consumer's stream (nothing when that stream
    /// is gone), inside a `deliver` span that joins the producer's trace.
    fn deliver(&self, connection: ConnectionId, delivery: Delivery<WirePayload>) {
        let Some(outbox) = self.consumer_outboxes.get(&connection) else {
            return;
        };
        // Joins the producer's trace; disabled (and nearly free)
        // unless spans are exported.
        let span = tracing::debug_span!(
            target: TRACE_TARGET,
            "deliver",
            target_id = %delivery.target_id,
            seq = delivery.seq,
            delivery_id = delivery.delivery_id,
            delivery_count = delivery.delivery_count,
            drafter_id = tracing::field::Empty,
        );
        if !span.is_disabled() {
            if let Some(drafter_id) = self.queue.drafter_id_of(connection) {
                span.record("drafter_id", drafter_id);
            }
            dflash_telemetry::set_parent_from(&span, &delivery.payload.item.trace_context);
        }
        let _entered = span.enter();
        // Encoded by the stream's body, outside the lock. A
        // closed receiver means the stream is going away; its
        // guard returns the lease.
        let _ = outbox.send(Ok(ConsumeOut::Delivery(delivery)));
    }

    /// Sends a producer its `Closed` message and drops its outbox, which
    /// ends its stream.
    fn close_producer(&mut self, connection: ConnectionId, outcome: RunStatus, reason: String) {
        if let Some(outbox) = self.remove_producer_outbox(connection) {
            let message = proto::ProduceResponse {
                kind: Some(proto::produce_response::Kind::Closed(proto::StreamClosed {
                    status: convert::run_status(outcome) as i32,
                    reason,
                })),
            };
            let _ = outbox.send(Ok(message));
        }
    }

    /// Offers one item to the queue, logs the queue's change to the
    /// write-ahead log, and then answers the producer: accepted (or a
    /// duplicate), or rejected. A full queue or a stale connection gets no
    /// answer; the caller waits for room or ends the stream.
    fn accept_and_answer(
        &mut self,
        connection: ConnectionId,
        seq: u64,
        payload: WirePayload,
        now: Instant,
    ) -> Result<ItemAccepted, QueueError> {
        let outcome = self.queue.accept_item(connection, seq, payload, now);
        // Logged before the target hears "accepted".
        self.persist();
        match &outcome {
            Ok(accepted) => self.send_to_producer(
                connection,
                proto::produce_response::Kind::Accepted(proto::ItemAccepted {
                    seq,
                    duplicate: accepted.duplicate,
                }),
            ),
            Err(QueueError::QueueFull { .. } | QueueError::StaleConnection { .. }) => {}
            Err(error) => self.send_to_producer(
                connection,
                proto::produce_response::Kind::Rejected(proto::ItemRejected {
                    seq,
                    reason: error.to_string(),
                }),
            ),
        }
        outcome
    }

    /// When the write-ahead log's batched sync is due: `None` without a log
    /// or with nothing to sync.
    fn wal_sync_due(&self) -> Option<Instant> {
        self.wal.as_ref()?.sync_due()
    }

    /// Drops a Produce stream's outbox (ending its response stream) and
    /// marks that a producer's reader may have to stop waiting for room.
    fn remove_producer_outbox(
        &mut self,
        connection: ConnectionId,
    ) -> Option<Outbox<proto::ProduceResponse>> {
        let outbox = self.producer_outboxes.remove(&connection);
        self.producer_stream_ended |= outbox.is_some();
        outbox
    }

    fn send_to_producer(&self, connection: ConnectionId, message: proto::produce_response::Kind) {
        if let Some(outbox) = self.producer_outboxes.get(&connection) {
            let _ = outbox.send(Ok(proto::ProduceResponse {
                kind: Some(message),
            }));
        }
    }
}

/// A Consume stream's end-of-stream, to be sent after the lock is released.
struct Ending {
    outbox: Outbox<ConsumeOut>,
    outcome: crate::queue::RunStatus,
    reason: String,
    summary: crate::queue::RunSummary,
}

impl Ending {
    fn send(self) {
        let message = proto::ConsumeResponse {
            kind: Some(proto::consume_response::Kind::EndOfStream(
                proto::EndOfStream {
                    status: convert::run_status(self.outcome) as i32,
                    reason: self.reason,
                    summary: Some(convert::summary_to_proto(&self.summary)),
                },
            )),
        };
        let _ = self.outbox.send(Ok(ConsumeOut::Message(message)));
    }
}

/// State shared by every handler and background task.
pub(crate) struct Shared {
    locked: Mutex<Locked>,
    /// Woken whenever bytes may have been freed, so producers waiting for
    /// room re-check.
    room: Notify,
    /// Woken when an operation created a deadline earlier than the ticker's
    /// planned wake.
    deadline_changed: Notify,
    /// The run state, published on every change (the center writer waits
    /// on it instead of polling).
    run_state: tokio::sync::watch::Sender<crate::queue::BrokerState>,
    config: BrokerConfig,
    /// Cancelled on shutdown: readers stop, streams end with UNAVAILABLE.
    shutdown: CancellationToken,
    tasks: TaskTracker,
    /// This run's identity, in every welcome and snapshot. New on every start
    /// (a broker without durable state cannot continue an earlier run).
    pub(crate) run_id: String,
    /// How the large payloads of accepted items arrived (in `/metrics`).
    pub(crate) received: crate::payload::ReceivedPayloads,
    /// The model-sync service, whose status joins every snapshot.
    model_sync: std::sync::OnceLock<Arc<crate::model_sync::ModelSyncShared>>,
}

impl Shared {
    /// The shared state; with `--state-dir`, the queue is rebuilt from its
    /// write-ahead log (same run id, every unacked item queued again).
    pub(crate) fn new(
        config: BrokerConfig,
        shutdown: CancellationToken,
    ) -> Result<Arc<Self>, WalError> {
        let now = Instant::now();
        let (queue, wal, run_id) = match &config.state_dir {
            None => (Queue::new(config.queue_config(), now), None, new_run_id()),
            Some(state_dir) => {
                let opened =
                    Wal::open(state_dir, config.fsync, config.max_queue_bytes, new_run_id)?;
                let queue = Queue::recover(config.queue_config(), opened.recovered, now);
                let snapshot = queue.snapshot(now);
                info!(
                    state_dir = %state_dir.display(),
                    run_id = %opened.run_id,
                    records = opened.records,
                    truncated_tail = opened.truncated_tail,
                    accepted = snapshot.accepted_items,
                    acked = snapshot.acked_items,
                    queued = snapshot.queued_items,
                    done_targets = snapshot.done_targets,
                    "state loaded from the write-ahead log"
                );
                (queue, Some(opened.wal), opened.run_id)
            }
        };
        let run_state = tokio::sync::watch::Sender::new(queue.state());
        Ok(Arc::new(Shared {
            run_state,
            locked: Mutex::new(Locked {
                queue,
                consumer_outboxes: HashMap::new(),
                producer_outboxes: HashMap::new(),
                producer_stream_ended: false,
                ticker_wakes_at: None,
                wal,
            }),
            room: Notify::new(),
            deadline_changed: Notify::new(),
            config,
            shutdown,
            run_id,
            tasks: TaskTracker::new(),
            received: crate::payload::ReceivedPayloads::default(),
            model_sync: std::sync::OnceLock::new(),
        }))
    }

    pub(crate) fn set_model_sync(&self, model_sync: Arc<crate::model_sync::ModelSyncShared>) {
        let _ = self.model_sync.set(model_sync);
    }

    pub(crate) fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Runs one queue operation and dispatches its effects under the lock.
    fn with_queue<R>(&self, operation: impl FnOnce(&mut Locked, Instant) -> R) -> R {
        let (result, room_freed, wake_ticker, endings) = {
            let mut locked = self.locked.lock();
            let held_before = locked.queue.held_bytes();
            let state_before = locked.queue.state();
            let now = Instant::now();
            let result = operation(&mut locked, now);
            locked.persist();
            let effects = locked.queue.take_effects();
            let endings = locked.dispatch(effects);
            // A Produce stream that ended or was fenced also wakes the
            // waiters: its reader may hold a decoded item waiting for room,
            // and must let it go now rather than when room is freed.
            let producer_stream_ended = std::mem::take(&mut locked.producer_stream_ended);
            let room_freed = locked.queue.held_bytes() < held_before
                || locked.queue.state() != state_before
                || producer_stream_ended;
            let planned_wake = locked.ticker_wakes_at;
            let wake_ticker = [locked.queue.take_new_deadline(), locked.wal_sync_due()]
                .into_iter()
                .flatten()
                .min()
                .is_some_and(|deadline| planned_wake.is_none_or(|planned| deadline < planned));
            let state_after = locked.queue.state();
            if state_after != state_before {
                self.run_state.send_replace(state_after);
            }
            (result, room_freed, wake_ticker, endings)
        };
        for ending in endings {
            ending.send();
        }
        if wake_ticker {
            // Stores a permit when the ticker is busy, so no wake is lost.
            self.deadline_changed.notify_one();
        }
        // Only real changes wake producers waiting for room: a waiter's own
        // failed attempt must not wake itself into a spin.
        if room_freed {
            self.room.notify_waiters();
        }
        result
    }

    pub(crate) fn snapshot(&self) -> proto::StatusSnapshot {
        let snapshot = self.locked.lock().queue.snapshot(Instant::now());
        let mut snapshot = convert::snapshot_to_proto(&snapshot);
        snapshot.model_sync = self.model_sync.get().map(|model_sync| model_sync.status());
        snapshot.run_id = self.run_id.clone();
        snapshot
    }

    /// The Prometheus text exposition of the current state. The snapshot is
    /// taken under the lock; the text is formatted after it is released.
    pub(crate) fn metrics_text(&self) -> String {
        let snapshot = self.locked.lock().queue.snapshot(Instant::now());
        crate::metrics::render_with(&snapshot, self.received.counts())
    }

    /// Lease expiry, target liveness and the write-ahead log's batched sync:
    /// sleeps until the queue's next deadline or the log's next sync,
    /// whichever is first (with neither, until woken), and is woken early
    /// when an operation creates an earlier one. An idle broker does not wake.
    pub(crate) async fn run_ticker(self: Arc<Self>) {
        loop {
            let wake_at = self.with_queue(|locked, now| {
                locked.queue.tick(now);
                if let Some(wal) = &mut locked.wal {
                    if let Err(error) = wal.sync_if_due(now) {
                        warn!(%error, "write-ahead log sync failed");
                    }
                }
                let wake_at = [locked.queue.next_deadline(), locked.wal_sync_due()]
                    .into_iter()
                    .flatten()
                    .min()
                    .map(|wake_at| wake_at.max(now + MIN_TICK_SPACING));
                locked.ticker_wakes_at = wake_at;
                wake_at
            });
            let sleep = async {
                match wake_at {
                    Some(wake_at) => tokio::time::sleep_until(wake_at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.shutdown.cancelled() => break,
                _ = sleep => {}
                _ = self.deadline_changed.notified() => {}
            }
        }
    }

    /// Ends every open stream with UNAVAILABLE so clients reconnect elsewhere.
    pub(crate) fn end_all_streams(&self) {
        let mut locked = self.locked.lock();
        if let Some(wal) = &mut locked.wal {
            if let Err(error) = wal.sync() {
                warn!(%error, "write-ahead log sync at shutdown failed");
            }
        }
        for (_, outbox) in locked.consumer_outboxes.drain() {
            let _ = outbox.send(Err(Status::unavailable("broker is shutting down")));
        }
        for (_, outbox) in locked.producer_outboxes.drain() {
            let _ = outbox.send(Err(Status::unavailable("broker is shutting down")));
        }
    }

    pub(crate) fn broker_state(&self) -> crate::queue::BrokerState {
        self.locked.lock().queue.state()
    }

    /// Items `drafter_id` has acked or holds leased (see the queue's).
    pub(crate) fn acked_or_leased_by(&self, drafter_id: &str) -> Option<u64> {
        self.locked.lock().queue.acked_or_leased_by(drafter_id)
    }

    /// The run state as it changes.
    pub(crate) fn watch_run_state(
        &self,
    ) -> tokio::sync::watch::Receiver<crate::queue::BrokerState> {
        self.run_state.subscribe()
    }
}

/// A fresh run id: 64 random bits (std's per-process random hasher keys,
/// mixed with the clock and pid), in hex.
fn new_run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    hasher.write_u128(since_epoch.as_nanos());
    hasher.write_u32(std::process::id());
    format!("run-{:016x}", hasher.finish())
}

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
        self.shared.with_queue(|locked, now| match self.kind {
            StreamKind::Producer => {
                locked.remove_producer_outbox(connection);
                locked.queue.close_producer(connection, now);
            }
            StreamKind::Consumer => {
                locked.consumer_outboxes.remove(&connection);
                locked.queue.close_consumer(connection, now);
            }
        });
    }
}

/// A response stream that closes its queue connection when dropped.
pub struct GuardedStream<T> {
    inner: UnboundedReceiverStream<Result<T, Status>>,
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

fn validate_id(kind: &str, id: &str) -> Result<(), Status> {
    if id.len() > MAX_ID_LENGTH {
        return Err(Status::invalid_argument(format!(
            "{kind} is {} bytes long, the limit is {MAX_ID_LENGTH}",
            id.len()
        )));
    }
    if id.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "{kind} {id:?} contains control characters"
        )));
    }
    Ok(())
}

/// Waits for the stream's first message, which must be its hello.
async fn first_message<T, S>(inbound: &mut S) -> Result<T, Status>
where
    S: Stream<Item = Result<T, Status>> + Unpin,
{
    match tokio::time::timeout(HELLO_TIMEOUT, futures::StreamExt::next(inbound)).await {
        Err(_) => Err(Status::deadline_exceeded(format!(
            "no hello within {}s",
            HELLO_TIMEOUT.as_secs()
        ))),
        Ok(Some(Err(status))) => Err(status),
        Ok(None) => Err(Status::invalid_argument("stream ended before its hello")),
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
fn check_run_id(caller: &str, remembered: &str, current: &str) -> Result<(), Status> {
    if remembered.is_empty() || remembered == current {
        return Ok(());
    }
    Err(Status::failed_precondition(format!(
        "{caller} was in run {remembered:?}, this broker serves run {current:?}: \
         the broker lost that run's state (restarted without --state-dir?); \
         what was accepted there cannot be accounted for"
    )))
}

impl BrokerService {
    /// Validates a producer's item; the message names the bad value.
    fn check_item(&self, item: &WireItem) -> Result<u64, (RejectReason, String)> {
        let Some(sample) = &item.sample else {
            return Err((
                RejectReason::Malformed,
                format!("item seq {} has no sample", item.seq),
            ));
        };
        sample.validate().map_err(|error| {
            (
                RejectReason::Malformed,
                format!("item seq {}: {error}", item.seq),
            )
        })?;
        item.check_trace_context().map_err(|error| {
            (
                RejectReason::Malformed,
                format!("item seq {}: {error}", item.seq),
            )
        })?;
        // Every byte the broker keeps for the item, not only its tensors'
        // data: an item of empty tensors with a large trace context counts.
        let bytes = item.held_bytes();
        if bytes > self.shared.config.max_item_bytes {
            return Err((
                RejectReason::TooLarge,
                format!(
                    "item seq {}: {bytes} bytes exceeds the limit of {} bytes",
                    item.seq, self.shared.config.max_item_bytes
                ),
            ));
        }
        Ok(bytes)
    }

    /// Reads a producer stream until it ends: accepts items (waiting for room
    /// without reading further while the queue is full), records stats.
    async fn read_producer(
        self,
        target_id: Arc<str>,
        connection: ConnectionId,
        mut inbound: InboundProduce,
    ) {
        let shared = self.shared.clone();
        loop {
            let request =
                match next_request(&shared.shutdown, &mut inbound, connection, "producer").await {
                    Ok(Some(request)) => request,
                    Ok(None) => break,
                    Err(status) => {
                        if is_oversized_message(&status) {
                            self.refuse_oversized(&target_id, connection, &status);
                        } else {
                            self.end_broken_producer(&target_id, connection, status);
                        }
                        break;
                    }
                };
            match request {
                ProduceIn::Item(item) => {
                    if !self.accept_item(&target_id, connection, item).await {
                        break;
                    }
                }
                ProduceIn::Stats(stats) => shared.with_queue(|locked, now| {
                    locked.queue.producer_stats(
                        connection,
                        convert::producer_stats_from_proto(stats),
                        now,
                    )
                }),
                ProduceIn::Hello(_) | ProduceIn::Empty => {
                    shared.with_queue(|locked, now| {
                        locked.queue.count_rejected(
                            connection,
                            RejectReason::UnexpectedMessage,
                            now,
                        );
                        locked.send_to_producer(
                            connection,
                            proto::produce_response::Kind::Rejected(proto::ItemRejected {
                                seq: 0,
                                reason: "unexpected message: hello was already sent, expected an item or stats"
                                    .to_string(),
                            }),
                        );
                    });
                }
            }
        }
        shared.with_queue(|locked, now| {
            locked.remove_producer_outbox(connection);
            locked.queue.close_producer(connection, now);
        });
    }

    /// An item over the gRPC message limit broke the stream before its body
    /// was read: the target gets RESOURCE_EXHAUSTED with the limit (its
    /// stream cannot continue), and the rejection is counted and logged.
    fn refuse_oversized(&self, target_id: &str, connection: ConnectionId, status: &Status) {
        let reason = format!(
            "item over the broker's message limit (--max-item-bytes {} plus framing): {}",
            self.shared.config.max_item_bytes,
            status.message()
        );
        warn!(target_id, connection, %reason, "item rejected; Produce stream ended");
        self.shared.with_queue(|locked, now| {
            locked
                .queue
                .count_rejected(connection, RejectReason::TooLarge, now);
            if let Some(outbox) = locked.remove_producer_outbox(connection) {
                let _ = outbox.send(Err(Status::resource_exhausted(reason)));
            }
        });
    }

    /// A Consume message over the control limit broke the stream: the
    /// drafter gets RESOURCE_EXHAUSTED with the limit (its leases go back
    /// when the stream closes).
    fn refuse_oversized_control(&self, connection: ConnectionId, status: &Status) {
        let reason = format!(
            "Consume message over the control limit of {} bytes (acks, nacks, credit and stats only): {}",
            dflash_proto::transport::CONTROL_MESSAGE_BYTES,
            status.message()
        );
        warn!(connection, %reason, "Consume stream ended");
        self.shared.with_queue(|locked, _now| {
            if let Some(outbox) = locked.consumer_outboxes.remove(&connection) {
                let _ = outbox.send(Err(Status::resource_exhausted(reason)));
            }
        });
    }

    /// A Produce stream that broke on something other than an oversized
    /// message (a malformed message, a reset): the target gets that status
    /// as the stream's end, so it learns what was wrong. A stream the
    /// target reset itself is gone, and the status goes nowhere.
    fn end_broken_producer(&self, target_id: &str, connection: ConnectionId, status: Status) {
        if matches!(
            status.code(),
            tonic::Code::InvalidArgument | tonic::Code::Internal
        ) {
            warn!(target_id, connection, %status, "malformed Produce stream; ended");
        }
        self.shared.with_queue(|locked, _now| {
            if let Some(outbox) = locked.remove_producer_outbox(connection) {
                let _ = outbox.send(Err(status));
            }
        });
    }

    /// Accepts one item; false when the stream must end (replaced, run over).
    /// The `enqueue` span joins the trace of the span that made the sample
    /// and lasts until the item is queued, so time spent waiting for room
    /// (backpressure) shows in the trace.
    async fn accept_item(&self, target_id: &str, connection: ConnectionId, item: WireItem) -> bool {
        let span = tracing::debug_span!(
            target: TRACE_TARGET,
            "enqueue",
            target_id,
            seq = item.seq,
            connection,
            outcome = tracing::field::Empty,
        );
        if !span.is_disabled() {
            dflash_telemetry::set_parent_from(&span, &item.trace_context);
        }
        self.enqueue(connection, item).instrument(span).await
    }

    /// Queues one item of a producer's stream, waiting for room while the
    /// queue is full; answers the producer (accepted, duplicate or rejected)
    /// and records the outcome on the `enqueue` span. False when the stream
    /// must end.
    async fn enqueue(&self, connection: ConnectionId, item: WireItem) -> bool {
        let shared = &self.shared;
        let seq = item.seq;
        let bytes = match self.check_item(&item) {
            Ok(bytes) => bytes,
            Err((reject_reason, reason)) => {
                self.reject_item(connection, seq, reject_reason, reason);
                return true;
            }
        };
        shared.received.record(&item);
        let payload = WirePayload {
            item: Arc::new(item),
            bytes,
        };
        // Counted while this stream's reader holds the decoded item waiting
        // for room; a fenced or closed stream wakes it (see `with_queue`).
        let mut waiting = None;
        loop {
            let room = shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            let outcome = shared.with_queue(|locked, now| {
                locked.accept_and_answer(connection, seq, payload.clone(), now)
            });
            match outcome {
                Ok(accepted) => {
                    let outcome = if accepted.duplicate {
                        "duplicate"
                    } else {
                        "accepted"
                    };
                    tracing::Span::current().record("outcome", outcome);
                    return true;
                }
                Err(QueueError::QueueFull { .. }) => {
                    // Stop reading this stream until room is freed: HTTP/2
                    // flow control then holds the target back.
                    waiting.get_or_insert_with(|| shared.received.wait_for_room(bytes));
                    tokio::select! {
                        _ = shared.shutdown.cancelled() => return false,
                        _ = &mut room => {}
                    }
                }
                Err(QueueError::StaleConnection { .. } | QueueError::RunEnded { .. }) => {
                    tracing::Span::current().record("outcome", "stream_ended");
                    return false;
                }
                Err(_) => {
                    tracing::Span::current().record("outcome", "rejected");
                    return true;
                }
            }
        }
    }

    /// Rejects an item that failed [`Self::check_item`]: logs it, counts it
    /// and tells the producer why (its stream goes on).
    fn reject_item(
        &self,
        connection: ConnectionId,
        seq: u64,
        reject_reason: RejectReason,
        reason: String,
    ) {
        warn!(connection, seq, %reason, "item rejected");
        tracing::Span::current().record("outcome", "rejected");
        self.shared.with_queue(|locked, now| {
            locked.queue.count_rejected(connection, reject_reason, now);
            locked.send_to_producer(
                connection,
                proto::produce_response::Kind::Rejected(proto::ItemRejected { seq, reason }),
            );
        });
    }

    async fn read_consumer(
        self,
        connection: ConnectionId,
        mut inbound: Streaming<proto::ConsumeRequest>,
    ) {
        let shared = self.shared.clone();
        loop {
            let request =
                match next_request(&shared.shutdown, &mut inbound, connection, "consumer").await {
                    Ok(Some(request)) => request,
                    Ok(None) => break,
                    Err(status) => {
                        if is_oversized_message(&status) {
                            self.refuse_oversized_control(connection, &status);
                        }
                        break;
                    }
                };
            use proto::consume_request::Kind;
            match request.kind {
                Some(Kind::Ack(ack)) => {
                    shared.with_queue(|locked, now| {
                        locked.queue.ack(connection, &ack.delivery_ids, now)
                    });
                }
                Some(Kind::Nack(nack)) => {
                    let disposition = convert::nack_disposition_from_proto(nack.disposition);
                    shared.with_queue(|locked, now| {
                        locked.queue.nack(
                            connection,
                            &nack.delivery_ids,
                            disposition,
                            &dflash_proto::transport::bounded_control_string(&nack.reason),
                            now,
                        )
                    });
                }
                Some(Kind::Credit(credit)) => shared.with_queue(|locked, now| {
                    locked.queue.set_credit(
                        connection,
                        convert::credit_from_proto(Some(credit)),
                        now,
                    )
                }),
                Some(Kind::Stats(stats)) => shared.with_queue(|locked, now| {
                    locked.queue.consumer_stats(
                        connection,
                        convert::consumer_stats_from_proto(stats),
                        now,
                    )
                }),
                Some(Kind::ExtendLeases(extend)) => shared.with_queue(|locked, now| {
                    locked
                        .queue
                        .extend_leases(connection, &extend.delivery_ids, now)
                }),
                Some(Kind::Hello(_)) | None => {
                    debug!(connection, "ignoring a repeated hello or empty message")
                }
            }
        }
        shared.with_queue(|locked, now| {
            locked.consumer_outboxes.remove(&connection);
            locked.queue.close_consumer(connection, now);
        });
    }
}

impl BrokerService {
    /// Opens a Produce stream on `inbound` (however it is decoded): the
    /// hello, the welcome, then a reader task accepting its items.
    pub(crate) async fn open_produce(
        &self,
        mut inbound: InboundProduce,
        principal: Principal,
    ) -> Result<GuardedStream<proto::ProduceResponse>, Status> {
        let hello = match first_message(&mut inbound).await? {
            ProduceIn::Hello(hello) => hello,
            _ => {
                return Err(Status::invalid_argument(
                    "the first Produce message must be a hello with target_id",
                ))
            }
        };
        validate_id("target_id", &hello.target_id)?;
        principal.authorize(Role::Target, &hello.target_id, "Produce")?;
        check_run_id(
            &format!("target {:?}", hello.target_id),
            &hello.run_id,
            &self.shared.run_id,
        )?;
        let (outbox, receiver) = mpsc::unbounded_channel();
        let (connection, epoch) = self.shared.with_queue(|locked, now| {
            let opened = locked.queue.open_producer(&hello.target_id, now)?;
            locked.persist();
            let welcome = proto::produce_response::Kind::Welcome(proto::ProducerWelcome {
                resume_after_seq: opened.resume_after_seq,
                accepted_items: opened.accepted_items,
                epoch: opened.epoch,
                run_id: self.shared.run_id.clone(),
            });
            let _ = outbox.send(Ok(proto::ProduceResponse {
                kind: Some(welcome),
            }));
            locked.producer_outboxes.insert(opened.connection, outbox);
            Ok::<_, QueueError>((opened.connection, opened.epoch))
        })?;
        info!(target_id = %hello.target_id, connection, epoch, "target connected");
        let guard = ConnectionGuard {
            shared: self.shared.clone(),
            connection,
            kind: StreamKind::Producer,
        };
        let target_id: Arc<str> = Arc::from(hello.target_id.as_str());
        self.shared
            .tasks
            .spawn(self.clone().read_producer(target_id, connection, inbound));
        Ok(GuardedStream {
            inner: UnboundedReceiverStream::new(receiver),
            _guard: guard,
        })
    }

    /// Opens a Consume stream: the hello, the welcome, then a reader task
    /// for acks and credit; deliveries leave through the returned stream.
    pub(crate) async fn open_consume(
        &self,
        mut inbound: Streaming<proto::ConsumeRequest>,
        principal: Principal,
    ) -> Result<GuardedStream<ConsumeOut>, Status> {
        let hello = match first_message(&mut inbound).await?.kind {
            Some(proto::consume_request::Kind::Hello(hello)) => hello,
            _ => {
                return Err(Status::invalid_argument(
                    "the first Consume message must be a hello with drafter_id",
                ))
            }
        };
        validate_id("drafter_id", &hello.drafter_id)?;
        principal.authorize(Role::Drafter, &hello.drafter_id, "Consume")?;
        check_run_id(
            &format!("drafter {:?}", hello.drafter_id),
            &hello.run_id,
            &self.shared.run_id,
        )?;
        let credit = convert::credit_from_proto(hello.credit);
        let (outbox, receiver) = mpsc::unbounded_channel();
        let lease_timeout_ms =
            u64::try_from(self.shared.config.lease_timeout.as_millis()).unwrap_or(u64::MAX);
        let connection = self
            .shared
            .with_queue(|locked, now| {
                let welcome = proto::consume_response::Kind::Welcome(proto::ConsumerWelcome {
                    summary: Some(convert::summary_to_proto(&locked.queue.summary())),
                    lease_timeout_ms,
                    run_id: self.shared.run_id.clone(),
                });
                let _ = outbox.send(Ok(ConsumeOut::Message(proto::ConsumeResponse {
                    kind: Some(welcome),
                })));
                let connection = locked.queue.open_consumer(&hello.drafter_id, credit, now)?;
                locked.consumer_outboxes.insert(connection, outbox);
                Ok::<_, QueueError>(connection)
            })
            .inspect_err(
                |error| warn!(drafter_id = %hello.drafter_id, %error, "Consume hello refused"),
            )?;
        info!(drafter_id = %hello.drafter_id, connection, credit_items = credit.items, "drafter connected");
        let guard = ConnectionGuard {
            shared: self.shared.clone(),
            connection,
            kind: StreamKind::Consumer,
        };
        self.shared
            .tasks
            .spawn(self.clone().read_consumer(connection, inbound));
        Ok(GuardedStream {
            inner: UnboundedReceiverStream::new(receiver),
            _guard: guard,
        })
    }
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
        let done = self
            .shared
            .with_queue(|locked, now| {
                locked.queue.report_done(
                    &request.target_id,
                    request.total_items,
                    request.epoch,
                    now,
                )
            })
            .inspect_err(|error| {
                warn!(target_id = %request.target_id, epoch = request.epoch, %error, "ReportDone refused")
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
