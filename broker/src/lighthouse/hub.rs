//! The lighthouse's service side: each Quorum or Commit call hands its
//! request to the [`Lighthouse`] under one lock, then waits for its answer
//! (decided by its own call, a later call of another member, a stream's
//! end, or the clock), ticking the state while it waits. A vote's samples
//! are pinned in the queue before the state sees the vote; a decision's
//! settlement goes to the queue, and a commit is answered once the queue
//! made it durable. Lock order: this hub's lock, then the queue's; the
//! queue never calls back into the hub under its lock.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;

use crate::rpc_error::RpcError;

use super::{
    Admission, Answers, CommitRecord, Decision, Lighthouse, LighthouseSettings, QuorumAnswer,
    QuorumAsk, RoundKey, Settlement, Vote,
};

/// How often a waiting call ticks the state (idle answers, timeouts).
const TICK: Duration = Duration::from_millis(20);

/// What the lighthouse needs of the queue: the broker's service implements
/// it over its one queue (and its write-ahead log).
pub trait StepLedger: Send + Sync {
    /// Pins the deliveries `drafter_id` holds to `round`, all or none; the
    /// error says which it does not hold.
    fn pin(
        &self,
        drafter_id: &str,
        samples: &[StepSample],
        round: RoundKey,
        charge_on_abort: bool,
    ) -> Result<(), String>;
    /// A vote that reached no open round: the deliveries it names that the
    /// drafter still holds go back to the queue, uncharged.
    fn release(&self, drafter_id: &str, delivery_ids: &[u64]);
    /// Applies a decision to the pinned samples; the receiver resolves once
    /// what it changed is durable (at once without a state dir).
    fn settle(&self, settlement: &Settlement) -> Settled;
}

/// What the queue did with a decision.
pub struct Settled {
    /// Resolves once the change is durable; never, if the log failed.
    pub durable: oneshot::Receiver<()>,
    /// With a commit: the (target, seq) it acked.
    pub acked: Vec<(Arc<str>, u64)>,
}

/// The lighthouse's state and the calls waiting on it.
pub struct LighthouseHub {
    inner: Mutex<HubInner>,
    ledger: OnceLock<Weak<dyn StepLedger>>,
    runtime: tokio::runtime::Handle,
    /// Tasks that wait for a commit to be durable.
    tasks: TaskTracker,
}

struct HubInner {
    state: Lighthouse,
    /// The waiting Quorum call of each drafter, with its call number.
    asks: HashMap<String, (u64, oneshot::Sender<QuorumAnswer>)>,
    /// The waiting Commit call of each drafter, with its call number.
    votes: HashMap<String, (u64, oneshot::Sender<Decision>)>,
    next_call: u64,
}

/// Withdraws a call's request when the call ends before its answer.
struct Withdraw<'a> {
    hub: &'a LighthouseHub,
    drafter_id: String,
    call: u64,
    vote: bool,
}

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        let mut inner = self.hub.inner.lock();
        let ours = |call: &u64| *call == self.call;
        if self.vote {
            if inner
                .votes
                .get(&self.drafter_id)
                .is_some_and(|(call, _)| ours(call))
            {
                inner.votes.remove(&self.drafter_id);
            }
        } else if inner
            .asks
            .get(&self.drafter_id)
            .is_some_and(|(call, _)| ours(call))
        {
            inner.asks.remove(&self.drafter_id);
            inner.state.withdraw(&self.drafter_id);
        }
    }
}

impl LighthouseHub {
    /// Must be made inside the broker's runtime (commit waits run on it).
    pub fn new(settings: LighthouseSettings) -> Self {
        LighthouseHub {
            inner: Mutex::new(HubInner {
                state: Lighthouse::new(settings, instance(), None),
                asks: HashMap::new(),
                votes: HashMap::new(),
                next_call: 0,
            }),
            ledger: OnceLock::new(),
            runtime: tokio::runtime::Handle::current(),
            tasks: TaskTracker::new(),
        }
    }

    /// Connects the queue (before serving), with the commit record its log
    /// restored: H survives a broker restart with `--state-dir`.
    pub fn connect(&self, ledger: Weak<dyn StepLedger>, restored: Option<CommitRecord>) {
        let _ = self.ledger.set(ledger);
        let mut inner = self.inner.lock();
        let settings = inner.state.settings();
        let instance = inner.state.instance();
        if let Some(record) = restored {
            tracing::info!(%record, "data parallelism: commit record restored from the state dir");
        }
        inner.state = Lighthouse::new(settings, instance, restored);
    }

    /// Tasks waiting for durable commits, awaited (bounded) on shutdown.
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// A drafter's Consume stream ended and it has no other: not live.
    pub fn member_gone(self: &Arc<Self>, drafter_id: &str) {
        let mut inner = self.inner.lock();
        let answers = inner.state.member_gone(Instant::now(), drafter_id);
        self.deliver(&mut inner, answers);
    }

    /// A drafter opened a Consume stream: live again.
    pub fn member_back(&self, drafter_id: &str) {
        self.inner.lock().state.member_back(drafter_id);
    }

    /// The commit record, the last quorum and the counters, for status.
    pub fn status(&self) -> proto::LighthouseStatus {
        let inner = self.inner.lock();
        let counters = &inner.state.counters;
        let record = inner.state.record();
        let mut status = proto::LighthouseStatus {
            quorums_formed: counters.quorums_formed,
            steps_committed: counters.steps_committed,
            steps_failed: counters.steps_failed,
            heals: counters.heals,
            checksum_mismatches: counters.checksum_mismatches,
            members_dropped: counters.members_dropped,
            committed_step: record.step,
            committed_by_quorum: record.quorum_id,
            splits: counters.splits,
            unknown_decisions: counters.unknown_decisions,
            rollbacks: counters.rollbacks,
            steps_rolled_back: counters.steps_rolled_back,
            waiting_for_holder: inner.state.waiting_for_holder(),
            ..Default::default()
        };
        if let Some(formed) = inner.state.last() {
            status.quorum_id = formed.quorum_id;
            status.step = formed.step;
            status.members = formed.members.clone();
        }
        status
    }

    /// Sends each decided answer to its waiting call and each settlement to
    /// the queue; a commit's voters hear it once it is durable.
    fn deliver(self: &Arc<Self>, inner: &mut HubInner, answers: Answers) {
        for (drafter_id, answer) in answers.quorums {
            if let Some((_, sender)) = inner.asks.remove(&drafter_id) {
                let _ = sender.send(answer);
            }
        }
        for (drafter_id, decision) in answers.decisions {
            if let Some((_, sender)) = inner.votes.remove(&drafter_id) {
                let _ = sender.send(decision);
            }
        }
        for settlement in answers.settlements {
            let ledger = self.ledger.get().and_then(Weak::upgrade);
            let settled = ledger.as_ref().map(|ledger| ledger.settle(&settlement));
            let Settlement::Commit { round, record } = settlement else {
                continue;
            };
            match settled {
                None => {
                    log_commit(record, &[]);
                    let answers = inner.state.durable(round);
                    self.deliver(inner, answers);
                }
                Some(Settled { durable, acked }) => {
                    let hub = Arc::downgrade(self);
                    self.tasks.spawn_on(
                        async move {
                            // A log that failed never resolves it: the run
                            // is aborted and nobody hears COMMIT.
                            if durable.await.is_ok() {
                                log_commit(record, &acked);
                                if let Some(hub) = hub.upgrade() {
                                    hub.made_durable(round);
                                }
                            }
                        },
                        &self.runtime,
                    );
                }
            }
        }
    }

    fn made_durable(self: &Arc<Self>, round: RoundKey) {
        let mut inner = self.inner.lock();
        let answers = inner.state.durable(round);
        self.deliver(&mut inner, answers);
    }

    async fn wait<T>(
        self: &Arc<Self>,
        mut receiver: oneshot::Receiver<T>,
        shutdown: &CancellationToken,
    ) -> Result<T, Status> {
        loop {
            tokio::select! {
                answer = &mut receiver => {
                    return answer.map_err(|_| RpcError::ReplacedByNewerCall.into());
                }
                _ = shutdown.cancelled() => return Err(RpcError::ShuttingDown.into()),
                _ = tokio::time::sleep(TICK) => {
                    let mut inner = self.inner.lock();
                    let answers = inner.state.tick(Instant::now());
                    self.deliver(&mut inner, answers);
                }
            }
        }
    }

    /// Registers one call (`submit` files its sender and its request),
    /// sends what that decided, and waits for the call's own answer; the
    /// request is withdrawn if the call ends first.
    async fn call<T>(
        self: &Arc<Self>,
        drafter_id: String,
        vote: bool,
        submit: impl FnOnce(&mut HubInner, u64, oneshot::Sender<T>) -> Answers,
        shutdown: &CancellationToken,
    ) -> Result<T, Status> {
        let (sender, receiver) = oneshot::channel();
        let call = {
            let mut inner = self.inner.lock();
            let call = inner.next_call;
            inner.next_call += 1;
            let answers = submit(&mut inner, call, sender);
            self.deliver(&mut inner, answers);
            call
        };
        let _withdraw = Withdraw {
            hub: self,
            drafter_id,
            call,
            vote,
        };
        self.wait(receiver, shutdown).await
    }

    pub async fn ask(
        self: &Arc<Self>,
        ask: QuorumAsk,
        shutdown: &CancellationToken,
    ) -> Result<QuorumAnswer, Status> {
        let drafter_id = ask.drafter_id.clone();
        let key = drafter_id.clone();
        let submit = move |inner: &mut HubInner, call, sender| {
            inner.asks.insert(key, (call, sender));
            inner.state.ask(Instant::now(), ask)
        };
        self.call(drafter_id, false, submit, shutdown).await
    }

    /// A vote: a member's first vote on an open round pins its samples
    /// first (a pin refused turns it into a no naming the deliveries).
    pub async fn vote(
        self: &Arc<Self>,
        mut vote: Vote,
        samples: StepSamples,
        shutdown: &CancellationToken,
    ) -> Result<Decision, Status> {
        let drafter_id = vote.drafter_id.clone();
        let key = drafter_id.clone();
        let ledger = self.ledger.get().and_then(Weak::upgrade);
        let submit = move |inner: &mut HubInner, call, sender| {
            inner.votes.insert(key, (call, sender));
            match (inner.state.admits(&vote), ledger) {
                (Admission::Open(round), Some(ledger)) => {
                    if let Err(error) = ledger.pin(
                        &vote.drafter_id,
                        &samples.samples,
                        round,
                        samples.charge_on_abort,
                    ) {
                        if vote.ok {
                            vote.ok = false;
                            vote.reason = format!("its samples cannot join the step: {error}");
                        }
                    }
                }
                (Admission::Answered, Some(ledger)) if !samples.samples.is_empty() => {
                    let ids: Vec<u64> = samples
                        .samples
                        .iter()
                        .map(|sample| sample.delivery_id)
                        .collect();
                    ledger.release(&vote.drafter_id, &ids);
                }
                _ => {}
            }
            inner.state.vote(Instant::now(), vote)
        };
        self.call(drafter_id, true, submit, shutdown).await
    }
}

/// The per-step record of which samples each committed step trained,
/// logged once the commit is durable (the fault tests read it).
fn log_commit(record: CommitRecord, acked: &[(Arc<str>, u64)]) {
    let mut keys = String::with_capacity(acked.len() * 12);
    for (index, (target_id, seq)) in acked.iter().enumerate() {
        if index > 0 {
            keys.push(',');
        }
        keys.push_str(target_id);
        keys.push(':');
        keys.push_str(&seq.to_string());
    }
    tracing::info!(
        step = record.step,
        quorum_id = record.quorum_id,
        samples = acked.len(),
        keys = %keys,
        "data parallelism: step committed"
    );
}

/// One sample of a vote's share: its delivery and what it delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSample {
    pub delivery_id: u64,
    pub target_id: String,
    pub seq: u64,
}

/// The samples a vote brings to its step.
#[derive(Debug, Clone, Default)]
pub struct StepSamples {
    pub samples: Vec<StepSample>,
    /// The member blames its own share for a no: an abort charges them.
    pub charge_on_abort: bool,
}

/// This broker process's lighthouse instance: the clock and the process
/// id, mixed (quorum ids start again at 1 after a restart).
fn instance() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos() as u64);
    (nanos.rotate_left(17) ^ u64::from(std::process::id())).max(1)
}
