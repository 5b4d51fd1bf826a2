//! The state behind the broker's one lock and how an operation runs
//! under it: the queue, every stream's outbox, the write-ahead log's
//! writer; messages decided under the lock go out in order, through the
//! log when it holds records they depend on (see the parent module).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;
use dflash_telemetry::TRACE_TARGET;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;
use tracing::info;

use crate::config::BrokerConfig;
use crate::convert;
use crate::payload::WireItem;
use crate::queue::{ConnectionId, Delivery, Effect, ItemAccepted, Queue, QueueError, RunStatus};
use crate::rpc_error::RpcError;
use crate::wal::writer::{LogWriter, Release};
use crate::wal::{Wal, WalError};

use super::consume_out::ConsumeOut;
use super::outbox::Outbox;

/// Floor on the ticker's sleep, so a deadline that `tick` leaves in place
/// cannot make it spin.
const MIN_TICK_SPACING: Duration = Duration::from_millis(1);

/// A message decided under the lock, sent once what it reports is durable.
pub(super) enum Outgoing {
    Consumer(Outbox<ConsumeOut>, Result<ConsumeOut, Status>),
    Producer(
        Outbox<proto::ProduceResponse>,
        Result<proto::ProduceResponse, Status>,
    ),
    /// A unary answer's go-ahead (ReportDone answers once `done` is logged).
    Durable(tokio::sync::oneshot::Sender<()>),
}

impl Outgoing {
    /// A receiver that is gone means its stream is going away (its guard
    /// returns the leases); nothing to do.
    pub(super) fn send(self) {
        match self {
            Outgoing::Consumer(outbox, message) => {
                outbox.send(message);
            }
            Outgoing::Producer(outbox, message) => {
                outbox.send(message);
            }
            Outgoing::Durable(answer) => {
                let _ = answer.send(());
            }
        }
    }

    pub(super) fn send_all(messages: Vec<Outgoing>) {
        for message in messages {
            message.send();
        }
    }
}

/// What is guarded by the one lock.
pub(super) struct Locked {
    pub(super) queue: Queue<Arc<WireItem>>,
    pub(super) consumer_outboxes: HashMap<ConnectionId, Outbox<ConsumeOut>>,
    pub(super) producer_outboxes: HashMap<ConnectionId, Outbox<proto::ProduceResponse>>,
    /// Set when a Produce stream's outbox is removed (the stream ended, was
    /// fenced or closed); `with_queue` takes it to wake readers waiting for
    /// room, so a gone stream's reader drops its decoded item at once.
    pub(super) producer_stream_ended: bool,
    /// When the ticker will next wake on its own; an operation that creates
    /// an earlier deadline wakes it sooner.
    pub(super) ticker_wakes_at: Option<Instant>,
    /// The write-ahead log's writer thread, with `--state-dir`.
    pub(super) log: Option<LogWriter<Arc<WireItem>>>,
    /// Messages the current operation decided, in order.
    pub(super) outgoing: Vec<Outgoing>,
}

impl Locked {
    /// Ends the current operation: its journal entries and messages go to
    /// the log's writer thread, which sends the messages once the entries
    /// are durable; with nothing to log and nothing in flight (or without a
    /// log) the messages are sent now, still under the lock, so no later
    /// operation's message can overtake them. When the log asked for a
    /// compaction, the queue's image follows the entries (it is their
    /// state; only the entry list is built here, payloads are shared).
    pub(super) fn finish_operation(&mut self) {
        let entries = self.queue.take_journal();
        let outgoing = std::mem::take(&mut self.outgoing);
        let Some(log) = self.log.as_ref().filter(|log| !log.has_failed()) else {
            Outgoing::send_all(outgoing);
            return;
        };
        let compaction = log
            .take_compaction_request()
            .then(|| self.queue.snapshot_entries());
        if entries.is_empty() && compaction.is_none() && log.is_idle() {
            Outgoing::send_all(outgoing);
            return;
        }
        let release = (!outgoing.is_empty())
            .then(|| Box::new(move || Outgoing::send_all(outgoing)) as Release);
        log.submit(entries, release);
        if let Some(image) = compaction {
            log.compact(image);
        }
    }

    /// The writer thread failed to write or sync: a broker that cannot
    /// keep what it accepted must not say "accepted", so the run is
    /// aborted (every stream hears why, sent directly from now on).
    pub(super) fn log_failed(&mut self, error: &WalError) {
        tracing::error!(%error, "write-ahead log failed; aborting the run");
        self.queue.disable_journal();
        self.queue
            .abort(format!("the write-ahead log failed: {error}"));
    }

    pub(super) fn post(&mut self, message: Outgoing) {
        self.outgoing.push(message);
    }

    /// Routes effects to their streams (as [`Outgoing`]s). An
    /// end-of-stream removes its outbox from the map, so nothing can follow
    /// it.
    pub(super) fn dispatch(&mut self, effects: Vec<Effect<Arc<WireItem>>>) {
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
                        let message = end_of_stream(outcome, reason, &summary);
                        self.post(Outgoing::Consumer(outbox, Ok(message)));
                    }
                }
                Effect::CloseProducer {
                    connection,
                    outcome,
                    reason,
                } => self.close_producer(connection, outcome, reason),
            }
        }
    }

    /// Hands one delivery to its consumer's stream (nothing when that stream
    /// is gone), inside a `deliver` span that joins the producer's trace.
    pub(super) fn deliver(&mut self, connection: ConnectionId, delivery: Delivery<Arc<WireItem>>) {
        let Some(outbox) = self.consumer_outboxes.get(&connection).cloned() else {
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
            dflash_telemetry::set_parent_from(&span, &delivery.payload.trace_context);
        }
        let _entered = span.enter();
        // Encoded by the stream's body, outside the lock.
        self.post(Outgoing::Consumer(
            outbox,
            Ok(ConsumeOut::Delivery(delivery)),
        ));
    }

    /// Sends a producer its `Closed` message and drops its outbox, which
    /// ends its stream.
    pub(super) fn close_producer(
        &mut self,
        connection: ConnectionId,
        outcome: RunStatus,
        reason: String,
    ) {
        if let Some(outbox) = self.remove_producer_outbox(connection) {
            let message = proto::ProduceResponse {
                kind: Some(proto::produce_response::Kind::Closed(proto::StreamClosed {
                    status: convert::run_status(outcome) as i32,
                    reason,
                })),
            };
            self.post(Outgoing::Producer(outbox, Ok(message)));
        }
    }

    /// Offers one item to the queue, logs the queue's change to the
    /// write-ahead log, and then answers the producer: accepted (or a
    /// duplicate), or rejected. A full queue or a stale connection gets no
    /// answer; the caller waits for room or ends the stream.
    pub(super) fn accept_and_answer(
        &mut self,
        connection: ConnectionId,
        seq: u64,
        payload: Arc<WireItem>,
        now: Instant,
    ) -> Result<ItemAccepted, QueueError> {
        let outcome = self.queue.accept_item(connection, seq, payload, now);
        // Sent once the item's record is durable (`finish_operation`).
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

    /// Drops a Produce stream's outbox (ending its response stream) and
    /// marks that a producer's reader may have to stop waiting for room.
    pub(super) fn remove_producer_outbox(
        &mut self,
        connection: ConnectionId,
    ) -> Option<Outbox<proto::ProduceResponse>> {
        let outbox = self.producer_outboxes.remove(&connection);
        self.producer_stream_ended |= outbox.is_some();
        outbox
    }

    pub(super) fn send_to_producer(
        &mut self,
        connection: ConnectionId,
        message: proto::produce_response::Kind,
    ) {
        if let Some(outbox) = self.producer_outboxes.get(&connection).cloned() {
            let message = proto::ProduceResponse {
                kind: Some(message),
            };
            self.post(Outgoing::Producer(outbox, Ok(message)));
        }
    }
}

/// A Consume stream's end-of-stream message.
pub(super) fn end_of_stream(
    outcome: RunStatus,
    reason: String,
    summary: &crate::queue::RunSummary,
) -> ConsumeOut {
    ConsumeOut::Message(proto::ConsumeResponse {
        kind: Some(proto::consume_response::Kind::EndOfStream(
            proto::EndOfStream {
                status: convert::run_status(outcome) as i32,
                reason,
                summary: Some(convert::summary_to_proto(summary)),
            },
        )),
    })
}

/// State shared by every handler and background task.
pub(crate) struct Shared {
    pub(super) locked: Mutex<Locked>,
    /// Woken whenever bytes may have been freed, so producers waiting for
    /// room re-check.
    pub(super) room: Notify,
    /// Woken when an operation created a deadline earlier than the ticker's
    /// planned wake.
    pub(super) deadline_changed: Notify,
    /// The run state, published on every change (the model writer waits
    /// on it instead of polling).
    pub(super) run_state: tokio::sync::watch::Sender<crate::queue::BrokerState>,
    /// Why the write-ahead log cannot write right now (no space, EIO), or
    /// `None`: the health service follows it (NOT_SERVING while stalled).
    log_stalled: tokio::sync::watch::Sender<Option<String>>,
    pub(super) config: BrokerConfig,
    /// Cancelled on shutdown: readers stop, streams end with UNAVAILABLE.
    pub(super) shutdown: CancellationToken,
    pub(super) tasks: TaskTracker,
    /// This run's identity, in every welcome and snapshot. New on every start
    /// (a broker without durable state cannot continue an earlier run).
    pub(crate) run_id: String,
    /// How the large payloads of accepted items arrived (in `/metrics`).
    pub(crate) received: crate::payload::ReceivedPayloads,
    /// The model-sync service, whose status joins every snapshot.
    pub(super) model_sync: std::sync::OnceLock<Arc<crate::run_model::service::ModelSyncShared>>,
    /// The data-parallel drafters' lighthouse: told when a drafter's
    /// Consume stream ends or comes back; its status joins every snapshot.
    pub(super) lighthouse: std::sync::OnceLock<Arc<crate::lighthouse::hub::LighthouseHub>>,
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
                let opened = Wal::open(state_dir, &config.log_config(), new_run_id)?;
                let queue = Queue::recover(config.queue_config(), opened.recovered, now);
                // Every record has its CRC, but whole records can still be
                // missing or altered: a queue whose books do not add up
                // would never complete, so it is refused here.
                queue
                    .check_invariants()
                    .map_err(|detail| WalError::Inconsistent {
                        path: state_dir.clone(),
                        detail,
                    })?;
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
        let log_stalled = tokio::sync::watch::Sender::new(None);
        let fsync = config.fsync;
        let state_dir = config.state_dir.clone().unwrap_or_default();
        let mut spawn_failure = None;
        let shared = Arc::new_cyclic(|weak: &std::sync::Weak<Shared>| {
            let weak = weak.clone();
            let log = wal.and_then(|wal| {
                let on_failure = move |error: WalError| {
                    if let Some(shared) = weak.upgrade() {
                        shared.with_queue(|locked, _now| locked.log_failed(&error));
                    }
                };
                let stalled = log_stalled.clone();
                let on_stall = Box::new(move |error: Option<&WalError>| {
                    stalled.send_replace(error.map(ToString::to_string));
                });
                LogWriter::spawn(wal, fsync, on_failure, on_stall)
                    .map_err(|source| spawn_failure = Some(source))
                    .ok()
            });
            Shared {
                run_state,
                log_stalled,
                locked: Mutex::new(Locked {
                    queue,
                    consumer_outboxes: HashMap::new(),
                    producer_outboxes: HashMap::new(),
                    producer_stream_ended: false,
                    ticker_wakes_at: None,
                    log,
                    outgoing: Vec::new(),
                }),
                room: Notify::new(),
                deadline_changed: Notify::new(),
                config,
                shutdown,
                run_id,
                tasks: TaskTracker::new(),
                received: crate::payload::ReceivedPayloads::default(),
                model_sync: std::sync::OnceLock::new(),
                lighthouse: std::sync::OnceLock::new(),
            }
        });
        match spawn_failure {
            Some(source) => Err(WalError::Io {
                path: state_dir,
                source,
            }),
            None => Ok(shared),
        }
    }

    /// A drafter's last Consume stream ended: the lighthouse stops waiting
    /// for it (called outside the queue's lock: the lighthouse's lock
    /// comes first).
    pub(super) fn drafter_gone(&self, drafter_id: Option<String>) {
        if let (Some(drafter_id), Some(lighthouse)) = (drafter_id, self.lighthouse.get()) {
            lighthouse.member_gone(&drafter_id);
        }
    }

    /// A drafter opened a Consume stream: live again for the lighthouse.
    pub(super) fn drafter_back(&self, drafter_id: &str) {
        if let Some(lighthouse) = self.lighthouse.get() {
            lighthouse.member_back(drafter_id);
        }
    }

    /// The data-parallel commit record the write-ahead log restored.
    pub(crate) fn commit_record(&self) -> Option<crate::queue::CommitRecord> {
        self.locked.lock().queue.commit_record()
    }

    pub(crate) fn set_model_sync(
        &self,
        model_sync: Arc<crate::run_model::service::ModelSyncShared>,
    ) {
        let _ = self.model_sync.set(model_sync);
    }

    pub(crate) fn set_lighthouse(&self, lighthouse: Arc<crate::lighthouse::hub::LighthouseHub>) {
        let _ = self.lighthouse.set(lighthouse);
    }

    pub(crate) fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Runs one queue operation and dispatches its effects under the lock.
    pub(super) fn with_queue<R>(&self, operation: impl FnOnce(&mut Locked, Instant) -> R) -> R {
        let (result, room_freed, wake_ticker) = {
            let mut locked = self.locked.lock();
            let held_before = locked.queue.held_bytes();
            let state_before = locked.queue.state();
            let now = Instant::now();
            let result = operation(&mut locked, now);
            let effects = locked.queue.take_effects();
            locked.dispatch(effects);
            locked.finish_operation();
            // A Produce stream that ended or was fenced also wakes the
            // waiters: its reader may hold a decoded item waiting for room,
            // and must let it go now rather than when room is freed.
            let producer_stream_ended = std::mem::take(&mut locked.producer_stream_ended);
            let room_freed = locked.queue.held_bytes() < held_before
                || locked.queue.state() != state_before
                || producer_stream_ended;
            let planned_wake = locked.ticker_wakes_at;
            let wake_ticker = locked
                .queue
                .take_new_deadline()
                .is_some_and(|deadline| planned_wake.is_none_or(|planned| deadline < planned));
            let state_after = locked.queue.state();
            if state_after != state_before {
                self.run_state.send_replace(state_after);
            }
            (result, room_freed, wake_ticker)
        };
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
        snapshot.lighthouse = self.lighthouse.get().map(|lighthouse| lighthouse.status());
        snapshot.run_id = self.run_id.clone();
        snapshot.trace_export = dflash_telemetry::trace_export_stats();
        snapshot
    }

    /// The Prometheus text exposition of the current state. The snapshot is
    /// taken under the lock; the text is formatted after it is released.
    pub(crate) fn metrics_text(&self) -> String {
        let (snapshot, log) = {
            let locked = self.locked.lock();
            let log = locked.log.as_ref().map(|log| log.counts());
            (locked.queue.snapshot(Instant::now()), log)
        };
        let tau = self
            .model_sync
            .get()
            .map(|model_sync| model_sync.tau_gauges());
        crate::metrics::render_with(&snapshot, self.received.counts(), log, tau)
    }

    /// Lease expiry and target liveness: sleeps until the queue's next
    /// deadline (with none, until woken), and is woken early when an
    /// operation creates an earlier one. An idle broker does not wake (the
    /// write-ahead log's batched sync is its writer thread's, which waits
    /// only while it has unsynced records).
    pub(crate) async fn run_ticker(self: Arc<Self>) {
        loop {
            let wake_at = self.with_queue(|locked, now| {
                locked.queue.tick(now);
                let wake_at = locked
                    .queue
                    .next_deadline()
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

    /// Ends every open stream with UNAVAILABLE so clients reconnect
    /// elsewhere (after the messages still waiting for the log).
    pub(crate) fn end_all_streams(&self) {
        self.with_queue(|locked, _now| {
            let shutting_down = || Status::from(RpcError::ShuttingDown);
            let consumers: Vec<_> = locked.consumer_outboxes.drain().collect();
            for (_, outbox) in consumers {
                locked.post(Outgoing::Consumer(outbox, Err(shutting_down())));
            }
            let producers: Vec<_> = locked.producer_outboxes.drain().collect();
            for (_, outbox) in producers {
                locked.post(Outgoing::Producer(outbox, Err(shutting_down())));
            }
        });
    }

    /// Closes the write-ahead log: its writer thread writes and releases
    /// what it holds, syncs and exits (bounded by what was submitted, at
    /// most about the queue's cap). Called once the server has stopped.
    pub(crate) fn close_log(&self) {
        let log = self.locked.lock().log.take();
        // Joined outside the lock: the thread may need it to report a
        // failure.
        drop(log);
    }

    /// Follows why the write-ahead log cannot write (`None`: it can).
    pub(crate) fn log_stalled(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.log_stalled.subscribe()
    }

    pub(crate) fn broker_state(&self) -> crate::queue::BrokerState {
        self.locked.lock().queue.state()
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
pub(super) fn new_run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    hasher.write_u128(since_epoch.as_nanos());
    hasher.write_u32(std::process::id());
    format!("run-{:016x}", hasher.finish())
}
