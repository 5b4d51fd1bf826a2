//! The lighthouse's two RPCs, `ModelSync.Quorum` and `ModelSync.Commit`:
//! each call hands its request to [`QuorumState`] under one lock, then waits
//! for its answer (decided by its own call, a later call of another member,
//! or the clock), ticking the state while it waits. A call that ends early
//! (the drafter died or gave up) withdraws its request.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dflash_proto::v1 as proto;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::model_sync::quorum::{
    Answers, Decision, QuorumAnswer, QuorumAsk, QuorumSettings, QuorumState, Vote,
};

/// How often a waiting call ticks the state (idle answers, timeouts).
const TICK: Duration = Duration::from_millis(20);

/// The lighthouse's state and the calls waiting on it.
pub struct QuorumHub {
    inner: Mutex<HubInner>,
}

struct HubInner {
    state: QuorumState,
    /// The waiting Quorum call of each drafter, with its call number.
    asks: HashMap<String, (u64, oneshot::Sender<QuorumAnswer>)>,
    /// The waiting Commit call of each drafter, with its call number.
    votes: HashMap<String, (u64, oneshot::Sender<Decision>)>,
    next_call: u64,
}

impl HubInner {
    /// Sends each decided answer to its waiting call.
    fn deliver(&mut self, answers: Answers) {
        for (drafter_id, answer) in answers.quorums {
            if let Some((_, sender)) = self.asks.remove(&drafter_id) {
                let _ = sender.send(answer);
            }
        }
        for (drafter_id, decision) in answers.decisions {
            if let Some((_, sender)) = self.votes.remove(&drafter_id) {
                let _ = sender.send(decision);
            }
        }
    }
}

/// Withdraws a call's request when the call ends before its answer.
struct Withdraw<'a> {
    hub: &'a QuorumHub,
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

impl QuorumHub {
    pub fn new(settings: QuorumSettings) -> Self {
        QuorumHub {
            inner: Mutex::new(HubInner {
                state: QuorumState::new(settings, instance()),
                asks: HashMap::new(),
                votes: HashMap::new(),
                next_call: 0,
            }),
        }
    }

    /// The last quorum and the counters, for status.
    pub fn status(&self) -> proto::DataParallelStatus {
        let inner = self.inner.lock();
        let counters = &inner.state.counters;
        let mut status = proto::DataParallelStatus {
            quorums_formed: counters.quorums_formed,
            steps_committed: counters.steps_committed,
            steps_failed: counters.steps_failed,
            heals: counters.heals,
            checksum_mismatches: counters.checksum_mismatches,
            members_dropped: counters.members_dropped,
            ..Default::default()
        };
        if let Some(formed) = inner.state.last() {
            status.quorum_id = formed.quorum_id;
            status.step = formed.step;
            status.members = formed.members.clone();
        }
        status
    }

    async fn wait<T>(
        &self,
        mut receiver: oneshot::Receiver<T>,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<T, Status> {
        loop {
            tokio::select! {
                answer = &mut receiver => {
                    return answer.map_err(|_| Status::aborted("a newer call of the same drafter replaced this one"));
                }
                _ = shutdown.cancelled() => return Err(Status::unavailable("broker is shutting down")),
                _ = tokio::time::sleep(TICK) => {
                    let mut inner = self.inner.lock();
                    let answers = inner.state.tick(Instant::now());
                    inner.deliver(answers);
                }
            }
        }
    }

    /// Registers one call (`submit` files its sender and its request),
    /// sends what that decided, and waits for the call's own answer; the
    /// request is withdrawn if the call ends first.
    async fn call<T>(
        &self,
        drafter_id: String,
        vote: bool,
        submit: impl FnOnce(&mut HubInner, u64, oneshot::Sender<T>) -> Answers,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<T, Status> {
        let (sender, receiver) = oneshot::channel();
        let call = {
            let mut inner = self.inner.lock();
            let call = inner.next_call;
            inner.next_call += 1;
            let answers = submit(&mut inner, call, sender);
            inner.deliver(answers);
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

    async fn ask(
        &self,
        ask: QuorumAsk,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<QuorumAnswer, Status> {
        let drafter_id = ask.drafter_id.clone();
        let key = drafter_id.clone();
        let submit = move |inner: &mut HubInner, call, sender| {
            inner.asks.insert(key, (call, sender));
            inner.state.ask(Instant::now(), ask)
        };
        self.call(drafter_id, false, submit, shutdown).await
    }

    async fn vote(
        &self,
        vote: Vote,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<Decision, Status> {
        let drafter_id = vote.drafter_id.clone();
        let key = drafter_id.clone();
        let submit = move |inner: &mut HubInner, call, sender| {
            inner.votes.insert(key, (call, sender));
            inner.state.vote(Instant::now(), vote)
        };
        self.call(drafter_id, true, submit, shutdown).await
    }
}

/// This broker process's lighthouse instance: the clock and the process
/// id, mixed (quorum ids start again at 1 after a restart).
fn instance() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos() as u64);
    nanos.rotate_left(17) ^ u64::from(std::process::id())
}

fn checked_drafter(
    principal: &crate::roles::Principal,
    drafter_id: &str,
    action: &str,
) -> Result<(), Status> {
    if drafter_id.is_empty() {
        return Err(Status::invalid_argument("drafter_id is empty"));
    }
    crate::roles::validate_id("drafter_id", drafter_id)?;
    principal.authorize(crate::roles::Role::Drafter, drafter_id, action)
}

/// `ModelSync.Quorum`.
pub async fn quorum(
    hub: &QuorumHub,
    shutdown: &CancellationToken,
    request: Request<proto::QuorumRequest>,
) -> Result<Response<proto::QuorumResponse>, Status> {
    let principal = crate::roles::Principal::of(request.extensions());
    let request = request.into_inner();
    checked_drafter(&principal, &request.drafter_id, "ModelSync.Quorum")?;
    if !request.leaving {
        check_store_address(&request.store_address)?;
    }
    let ask = QuorumAsk {
        drafter_id: request.drafter_id.clone(),
        store_address: request.store_address,
        step: request.step,
        state_checksum: request.state_checksum,
        samples_ready: request.samples_ready,
        leaving: request.leaving,
    };
    let answer = hub.ask(ask, shutdown).await?;
    let response = match answer {
        QuorumAnswer::Formed(formed) => {
            let rank = formed.rank_of(&request.drafter_id).ok_or_else(|| {
                Status::internal(format!(
                    "quorum {} answered to {} which is not one of its members",
                    formed.quorum_id, request.drafter_id
                ))
            })?;
            proto::QuorumResponse {
                quorum_id: formed.quorum_id,
                rank: rank as u32,
                world_size: formed.members.len() as u32,
                members: formed.members.clone(),
                store_address: formed.store_address.clone(),
                store_prefix: formed.store_prefix(),
                step: formed.step,
                heal: formed.heal,
                heal_reason: formed.heal_reason.clone(),
            }
        }
        QuorumAnswer::Idle | QuorumAnswer::Left => proto::QuorumResponse::default(),
    };
    Ok(Response::new(response))
}

/// `ModelSync.Commit`.
pub async fn commit(
    hub: &QuorumHub,
    shutdown: &CancellationToken,
    request: Request<proto::CommitVote>,
) -> Result<Response<proto::CommitDecision>, Status> {
    let principal = crate::roles::Principal::of(request.extensions());
    let request = request.into_inner();
    checked_drafter(&principal, &request.drafter_id, "ModelSync.Commit")?;
    let vote = Vote {
        drafter_id: request.drafter_id,
        quorum_id: request.quorum_id,
        step: request.step,
        ok: request.ok,
        reason: request.reason,
    };
    let decision = hub.vote(vote, shutdown).await?;
    Ok(Response::new(proto::CommitDecision {
        commit: decision.commit,
        reason: decision.reason,
    }))
}

/// A store address is `host:port` with a port in 1..=65535.
fn check_store_address(address: &str) -> Result<(), Status> {
    let bad = || {
        Status::invalid_argument(format!(
            "store_address {address:?} is not host:port with a port in 1..=65535"
        ))
    };
    let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || host.len() > 253 {
        return Err(bad());
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(()),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::check_store_address;

    #[test]
    fn store_addresses_are_host_and_port() {
        assert!(check_store_address("10.0.0.7:29500").is_ok());
        assert!(check_store_address("drafter-3.dflash:1").is_ok());
        for bad in ["", "host", ":80", "host:0", "host:65536", "host:x"] {
            let status = check_store_address(bad).unwrap_err();
            assert!(status.message().contains(&format!("{bad:?}")), "{status:?}");
        }
    }
}
